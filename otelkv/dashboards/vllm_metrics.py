"""The few vLLM metrics the dashboards read next to otelkv's (vLLM 0.32.0 names).

vLLM's own series sit beside otelkv's on every engine's ``/metrics`` with the same
``model_name`` and ``engine`` labels. They are vLLM's names, not otelkv's, so they live
here rather than in :mod:`otelkv.names`; one place still means one edit when vLLM renames.
The fleet test holds each one to a real engine's exposition.
"""

from __future__ import annotations

from typing import Final

NUM_REQUESTS_RUNNING: Final = "vllm:num_requests_running"
"""Gauge on every engine: the variables list models and engines from it."""
NUM_REQUESTS_WAITING: Final = "vllm:num_requests_waiting"
"""Gauge: requests queued (including those waiting for remote KV)."""
TIME_TO_FIRST_TOKEN: Final = "vllm:time_to_first_token_seconds"
"""Histogram: the engine's own TTFT (on a prefill node: the prefill itself)."""
PREFIX_CACHE_HITS: Final = "vllm:prefix_cache_hits"
"""Counter: prompt tokens found in the local prefix cache."""
PREFIX_CACHE_QUERIES: Final = "vllm:prefix_cache_queries"
"""Counter: prompt tokens looked up in the local prefix cache."""
KV_CACHE_USAGE: Final = "vllm:kv_cache_usage_perc"
"""Gauge, 0..1: how full the engine's KV cache is (retained blocks count against it)."""

ALL: Final = (
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    TIME_TO_FIRST_TOKEN,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    KV_CACHE_USAGE,
)
