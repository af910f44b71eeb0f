"""``otelkv tune`` over a window of hand-built spans (in memory, native and stored forms).

The scenario, with every number chosen so the answer can be worked out by hand:

* four conversations, two turns each, played three times over (12 conversations 200 s
  apart: enough samples for the evidence gate); decode TTL 30 s, threshold 64, and a router
  that records a 28 s handle TTL (inside vLLM's 5 s margin: flagged);
* prefill compute is 10 ms + 1 ms per token (turn 0 computes 100..400 tokens, conv d's
  turn 1 recomputes 400); pulls wait 20 ms + 10 ns per byte, at 10 kB per token;
* turn 1 comes 5, 10, 8 s after turn 0's decode ended and pulls 200, 400, 100 tokens;
  conv d's comes after 40 s, the router calls the handle stale, 339 tokens are recomputed.
"""

from __future__ import annotations

from typing import Any

import pytest

from otelkv import names
from otelkv.analysis.sources import InMemorySource
from otelkv.analysis.tune.window import TuneOptions, options_from_dict, quantile, tune
from otelkv.spans import SpanRecord
from tests.unit.test_diagnose import T0, S, stored, turn_trace

CONFIG = {names.DECODER_KV_BLOCKS_TTL: 30.0}
ROUTER_TTL = {names.ROUTER_HANDLE_TTL_SECONDS: 28.0}
RETENTION = {names.RETENTION_BLOCKS: 10, names.RETENTION_BYTES: 1_000_000}
# (conversation, turn-0 computed tokens, gap s, turn-1 pulled tokens or None for the stale handle)
ROUND = [("a", 100, 5.0, 200), ("b", 200, 10.0, 400), ("c", 300, 8.0, 100), ("d", 400, 40.0, None)]
ROUNDS = 3
PLAN = [(f"{conv}{r}", *rest) for r in range(ROUNDS) for conv, *rest in ROUND]
SPACING_S = 200.0
"""Conversations start this far apart: none overlaps another, even at a 60 s TTL."""


def scenario(base_s: float = 100.0) -> list[SpanRecord]:
    spans: list[SpanRecord] = []
    for k, (conv, computed, gap, pulled) in enumerate(PLAN):
        start = base_s + SPACING_S * k
        compute = 0.01 + 0.001 * computed
        t0 = turn_trace(
            conv,
            0,
            start_s=start,
            request_s=1.0,
            router={names.ROUTER_HANDLE: names.ROUTER_HANDLE_MISS, **ROUTER_TTL},
            prefill={names.TOKENS_COMPUTED: computed, names.GEN_AI_USAGE_INPUT_TOKENS: computed},
            prefill_span=(0.05, 0.05 + compute),
            decode_resource=CONFIG,
            retention={**RETENTION, names.RETENTION_HELD_SECONDS: min(gap, 30.0)},
        )
        # turn 0's decode ends at start + 0.98 s; turn 1's prefill starts 0.05 s into turn 1
        start1 = start + 0.98 + gap - 0.05
        if pulled is not None:
            wait = 0.02 + 1e-8 * pulled * 10_000
            t1 = turn_trace(
                conv,
                1,
                start_s=start1,
                gap_s=gap,
                prev_trace=t0[0].trace_id,
                router=ROUTER_TTL,
                prefill={
                    names.GEN_AI_USAGE_INPUT_TOKENS: pulled + 50,
                    names.TOKENS_PULLED: pulled,
                    names.TOKENS_COMPUTED: 50,
                    names.TOKENS_REMOTE_REUSABLE: pulled,
                    names.PULL_DECISION: names.DECISION_PULL,
                    names.PULL_REASON: names.REASON_PULLED,
                },
                prefill_transfer={
                    names.TRANSFER_BYTES: pulled * 10_000,
                    names.TRANSFER_TOKENS: pulled,
                    names.TRANSFER_WAIT_SECONDS: wait,
                },
                prefill_span=(0.05, 0.05 + 0.06 + wait),
                decode_resource=CONFIG,
                retention={**RETENTION, names.RETENTION_HELD_SECONDS: 30.0},
            )
        else:
            t1 = turn_trace(
                conv,
                1,
                start_s=start1,
                gap_s=gap,
                prev_trace=t0[0].trace_id,
                router={names.ROUTER_HANDLE: names.ROUTER_HANDLE_STALE, **ROUTER_TTL},
                prefill={
                    names.GEN_AI_USAGE_INPUT_TOKENS: 400,
                    names.TOKENS_COMPUTED: 400,
                    names.PULL_REASON: names.REASON_NO_DECODE_HANDLE,
                },
                prefill_span=(0.05, 0.05 + 0.41),
                decode_resource=CONFIG,
                retention={**RETENTION, names.RETENTION_HELD_SECONDS: 30.0},
            )
        spans += t0 + t1
    return spans


def check_answer(data: dict[str, Any]) -> None:
    """The numbers worked out by hand (shared with the end-to-end store test): one round's, x 3."""
    assert data["window"]["turns"] == 24 and data["window"]["handoffs_with_next_turn"] == 12
    assert data["window"]["empty"] is None
    assert data["in_force"]["decoder_kv_blocks_ttl_s"] == 30.0
    assert data["in_force"]["kv_recompute_threshold"] == 64
    assert data["in_force"]["router_handle_ttl_s"] == 28.0
    rec, pull = data["costs"]["recompute"], data["costs"]["pull"]
    # 4 turn-0 prefills + conv d's recompute per round; 3 pulls per round; every sample on its line
    assert (rec["method"], rec["samples"], rec["evidence"]["accepted"]) == ("least_squares", 15, True)
    assert rec["seconds_per_token"] == pytest.approx(0.001, rel=1e-4)
    assert rec["fixed_s"] == pytest.approx(0.01, abs=1e-4)
    assert (pull["method"], pull["samples"], pull["evidence"]["accepted"]) == ("least_squares", 9, True)
    assert pull["seconds_per_byte"] == pytest.approx(1e-8, rel=1e-3)
    assert pull["fixed_s"] == pytest.approx(0.02, abs=1e-4)
    assert pull["evidence"]["size_ratio"] == 4.0  # 100 to 400 tokens
    assert data["costs"]["geometry"]["bytes_per_token"] == pytest.approx(10_000)
    assert data["costs"]["break_even_tokens"] == pytest.approx(22.2, abs=0.1)
    assert data["gaps"]["p50_s"] == pytest.approx(8.0, abs=1e-3)

    now = data["current"]
    assert (now["pulls"], now["failed_requests"], now["pulled_tokens"]) == (9, 0, 2100)
    assert now["fates"][names.REASON_NO_DECODE_HANDLE] == 3
    assert now["prefill_saved_s"] == pytest.approx(2.1, rel=1e-3)
    assert now["pull_wait_s"] == pytest.approx(0.39, rel=1e-3)
    assert now["ttft_delta_s"] == pytest.approx(-1.71, rel=1e-3)
    # held 5 + 10 + 8 s, 30 s (router dropped the handle), four last turns x 30 s; 10 blocks each
    assert now["block_seconds"] == pytest.approx(3 * 1730, abs=0.5)
    assert (now["peak_retained_bytes"], now["peak_retained_blocks"]) == (1_000_000, 10)
    assert data["model_check"]["compared"] == 12 and data["model_check"]["agree"] == 12

    best = data["recommended"]
    assert best["kv_recompute_threshold"] == 32  # break-even 22.2 tokens, up to a multiple of 16
    # TTL 20 s and 30 s catch 3 pulls a round (0.57 s saved); 60 s also catches conv d's 40 s gap:
    # + 0.339 s recompute avoided - 0.0539 s pull = 0.8551 s a round, so 60 s is the shortest >= 90%.
    assert best["decoder_kv_blocks_ttl_s"] == 60.0 and best["router_handle_ttl_s"] == 54.0
    details = best["details"]
    assert details["decoder_kv_blocks_ttl_s"]["recommendation"] == 60.0
    assert details["decoder_kv_blocks_ttl_s"]["evidence"]["hand-offs"]["handoffs"] == 12
    assert details["kv_recompute_threshold"]["need"] is None
    assert details["router_handle_ttl_s"]["recommendation"] == 54.0
    assert best["replay"]["ttft_delta_s"] == pytest.approx(-3 * 0.8551, rel=1e-3)
    assert best["replay"]["block_seconds"] == pytest.approx(3 * (50 + 100 + 80 + 400 + 4 * 10 * 60), abs=0.5)
    assert best["vs_current"]["pulls"] == 3
    assert best["vs_current"]["ttft_delta_s"] == pytest.approx(-3 * 0.2851, rel=1e-3)
    ttls = [r["decoder_kv_blocks_ttl_s"] for r in data["ttl_sweep"]]
    assert ttls[:3] == [20.0, 30.0, 60.0]  # 20 and 60 bridge the p50 and p90 gaps (+6 s, x1.25)
    assert [f["id"] for f in data["flags"]] == [names.TUNE_ROUTER_TTL_ABOVE_DECODE_TTL]
    assert data["flags"][0]["severity"] == "warning"  # 28 s: inside the 5 s margin, below the TTL


@pytest.mark.parametrize("form", [lambda s: s, stored], ids=["native", "stored"])
def test_tune_window_by_hand(form: Any) -> None:
    data = tune(InMemorySource(form(scenario())), since_ns=None, until_ns=None)
    check_answer(data)


def test_router_ttl_above_decode_ttl_is_an_error() -> None:
    spans = [
        s
        if names.ROUTER_HANDLE_TTL_SECONDS not in s.attributes
        else type(s)(**{**s.__dict__, "attributes": {**s.attributes, names.ROUTER_HANDLE_TTL_SECONDS: 45.0}})
        for s in scenario()
    ]
    data = tune(InMemorySource(spans), since_ns=None, until_ns=None)
    flag = data["flags"][0]
    assert (flag["id"], flag["severity"]) == (names.TUNE_ROUTER_TTL_ABOVE_DECODE_TTL, "error")
    # with a 45 s router TTL each conv d's 40 s-old handle is forwarded and its read declined: a failure
    assert (
        data["current"]["failed_requests"] == ROUNDS
        and flag["evidence"]["modelled_failed_requests"] == ROUNDS
    )


def test_window_bounds_and_given_candidates() -> None:
    """Conversations a0 and b0 only: 2 prefill samples, 2 pulls. The replay's counts are facts;
    every seconds figure and every recommendation waits for evidence."""
    source = InMemorySource(scenario())
    until = T0 + int(450 * S)  # conversations start at 100 s and 300 s
    data = tune(
        source, since_ns=None, until_ns=until, options=TuneOptions(ttls_s=(15.0, 45.0), thresholds=(128,))
    )
    assert data["window"]["turns"] == 4 and data["window"]["until_ns"] == until
    assert data["window"]["empty"] is None
    assert [r["decoder_kv_blocks_ttl_s"] for r in data["ttl_sweep"]] == [15.0, 30.0, 45.0]
    rec, pull = data["costs"]["recompute"], data["costs"]["pull"]
    assert rec["evidence"]["reason"] == "2 prefill requests (need 8)"
    assert pull["evidence"]["reason"] == "2 pulls (need 8)"
    assert data["costs"]["break_even_tokens"] is None
    now = data["current"]
    assert (now["pulls"], now["pulled_tokens"]) == (2, 600)  # a0 pulled 200, b0 400
    assert now["prefill_saved_s"] is None and now["pull_wait_s"] is None and now["ttft_delta_s"] is None
    best = data["recommended"]
    assert (best["decoder_kv_blocks_ttl_s"], best["kv_recompute_threshold"], best["router_handle_ttl_s"]) == (
        None,
        None,
        None,
    )
    threshold = best["details"]["kv_recompute_threshold"]
    assert threshold["reason"].startswith("not enough evidence: recompute fit: 2 prefill requests (need 8)")
    assert (
        "≥ 8 hand-offs that pulled" in threshold["need"] and "run longer or under load" in threshold["need"]
    )
    ttl = best["details"]["decoder_kv_blocks_ttl_s"]
    assert ttl["reason"].startswith("not enough evidence: hand-offs: 2 hand-offs to a next turn (need 10)")
    assert sorted({r["kv_recompute_threshold"] for r in data["grid"]}) == [64, 128]


def test_empty_window() -> None:
    data = tune(InMemorySource([]), since_ns=None, until_ns=None)
    assert data["window"]["turns"] == 0 and data["window"]["empty"] == "no turns in the window"
    assert data["current"] is None and data["flags"] == []
    assert data["ttl_sweep"] == [] and data["threshold_sweep"] == [] and data["grid"] == []
    ttl = data["recommended"]["details"]["decoder_kv_blocks_ttl_s"]
    assert ttl["recommendation"] is None and ttl["reason"] == "no turns in the window"


def test_turns_without_a_handoff() -> None:
    """Only conversation a0's first turn (its next turn starts about 6 s later): nothing to replay."""
    data = tune(InMemorySource(scenario()), since_ns=None, until_ns=T0 + int(103 * S))
    assert data["window"]["turns"] == 1 and data["window"]["handoffs_with_next_turn"] == 0
    assert data["window"]["empty"].startswith("1 turn but no hand-off to a next turn in the window")
    assert data["grid"] == [] and data["current"] is None
    assert data["recommended"]["kv_recompute_threshold"] is None


def test_options_from_dict() -> None:
    opts = options_from_dict({"ttls_s": "30,120", "thresholds": [16, "64"], "memory_budget_bytes": "1000"})
    assert (opts.ttls_s, opts.thresholds, opts.memory_budget_bytes) == ((30.0, 120.0), (16, 64), 1000)
    for bad in (
        {"ttls_s": "x"},
        {"thresholds": "-1"},
        {"target_share": "2"},
        {"ttls_s": ",".join(["1"] * 51)},
    ):
        with pytest.raises(ValueError, match="bad tune option"):
            options_from_dict(bad)
    assert quantile([5, 8, 10, 40], 0.5) == 8 and quantile([5, 8, 10, 40], 0.9) == 40
