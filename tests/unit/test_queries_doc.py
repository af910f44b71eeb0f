"""Every query of ``docs/queries.md``, run: SQL on chDB, TraceQL through Grafana's grammar.

The SQL runs on an ``otel_traces`` store holding constructed turn traces whose answers are
known by construction (a tool wait past the TTL, a slow pull, a below-threshold
conversation, a failed read, ...), so a query that stops running or starts answering
something else fails here in seconds. The same queries run on a real fleet's store in
``tests/fleet/test_gallery.py``. Every attribute key and span name the queries use must be
one otelkv emits (:mod:`otelkv.names`).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from otelkv import names
from otelkv.spans import SpanRecord
from otelkv.store.base import StoreError
from otelkv.store.chdb_store import ChdbStore
from tests import cookbook
from tests.unit.dashboards_tools import traceql_parse
from tests.unit.test_diagnose import T0, S, turn_trace

TTL_S = 12.0
DECODE = {names.REMOTE_ENGINE_ID: "decode-0"}
"""The decode engine a prefill request's handle names (``engine_resource`` calls it ``decode-0``)."""


def kept(outcome: str, held_s: float, blocks: int = 10) -> dict[str, Any]:
    return {
        names.RETENTION_OUTCOME: outcome,
        names.RETENTION_HELD_SECONDS: held_s,
        names.RETENTION_TTL_SECONDS: TTL_S,
        names.RETENTION_BLOCKS: blocks,
        names.RETENTION_BLOCK_SECONDS: blocks * held_s,
    }


def pulled(tokens: int) -> dict[str, Any]:
    return {
        **DECODE,
        names.PULL_DECISION: names.DECISION_PULL,
        names.PULL_REASON: names.REASON_PULLED,
        names.TOKENS_PULLED: tokens,
        names.TOKENS_REMOTE_REUSABLE: tokens,
        names.TOKENS_COMPUTED: 300 - tokens,
    }


def recomputed(reason: str, **extra: Any) -> dict[str, Any]:
    return {names.PULL_DECISION: names.DECISION_RECOMPUTE, names.PULL_REASON: reason, **extra}


def traces() -> list[SpanRecord]:
    """Five conversations, each turn a full trace (sidecar, router, prefill, decode).

    * conv-lapse: turn 1 after a 20 s tool call, past the 12 s TTL (KV expired, recomputed);
      turn 2 pulled 256 tokens in 0.02 s.
    * conv-slow: turn 1 pulled 256 tokens, but its read waited 2 s (recomputing 300 tokens
      takes 0.25 s on this prefill node).
    * conv-below: turn 1 had 40 reusable tokens, under the threshold of 64.
    * conv-failed: turn 1 came within vLLM's read margin; the read was declined, the request
      failed (HTTP 500).
    * conv-plain: a non-streamed first turn (TTFT from the engine spans).
    """
    lapse0 = turn_trace("conv-lapse", 0, start_s=100.0, retention=kept(names.RETENTION_EXPIRED, TTL_S))
    lapse1 = turn_trace(
        "conv-lapse",
        1,
        start_s=121.0,
        gap_s=20.0,
        prev_trace=lapse0[0].trace_id,
        prefill=recomputed(names.REASON_NO_DECODE_HANDLE),
        router={names.ROUTER_HANDLE: names.ROUTER_HANDLE_STALE},
        retention=kept(names.RETENTION_CONSUMED, 1.0),
    )
    lapse2 = turn_trace(
        "conv-lapse",
        2,
        start_s=123.0,
        gap_s=1.0,
        tool_wait_s=0.0,
        prev_trace=lapse1[0].trace_id,
        prefill=pulled(256),
        prefill_transfer={names.TRANSFER_BYTES: 1 << 20},
    )
    slow0 = turn_trace("conv-slow", 0, start_s=200.0, retention=kept(names.RETENTION_CONSUMED, 2.5))
    slow1 = turn_trace(
        "conv-slow",
        1,
        start_s=203.5,
        gap_s=2.5,
        tool_wait_s=0.0,
        request_s=3.0,
        prev_trace=slow0[0].trace_id,
        prefill=pulled(256),
        prefill_span=(0.05, 2.3),
        prefill_transfer={names.TRANSFER_WAIT_SECONDS: 2.0, names.TRANSFER_BYTES: 3 << 20},
        prefill_transfer_s=2.0,
    )
    below0 = turn_trace("conv-below", 0, start_s=300.0, retention=kept(names.RETENTION_CONSUMED, 0.5))
    below1 = turn_trace(
        "conv-below",
        1,
        start_s=301.5,
        gap_s=0.5,
        prev_trace=below0[0].trace_id,
        prefill=recomputed(names.REASON_BELOW_THRESHOLD, **{names.TOKENS_REMOTE_REUSABLE: 40}),
    )
    failed0 = turn_trace("conv-failed", 0, start_s=384.0, retention=kept(names.RETENTION_EXPIRED, TTL_S))
    failed1 = turn_trace(
        "conv-failed",
        1,
        start_s=394.0,
        gap_s=9.0,
        tool_wait_s=0.0,
        prev_trace=failed0[0].trace_id,
        status="Error",
        turn={names.HTTP_STATUS: 500},
        prefill={
            **DECODE,
            names.PULL_DECISION: names.DECISION_PULL,
            names.PULL_REASON: names.REASON_DECLINED_EXPIRED,
            names.REQUEST_OUTCOME: names.OUTCOME_FAILED_KV_LOAD,
        },
    )
    plain = turn_trace("conv-plain", 0, start_s=500.0, stream=False, request_s=1.0, prefill_span=(0.05, 0.6))
    spans = lapse0 + lapse1 + lapse2 + slow0 + slow1 + below0 + below1 + failed0 + failed1 + plain
    shift = time.time_ns() - T0 - 3600 * S  # an hour ago, inside the store's retention
    return [dataclasses.replace(s, start_ns=s.start_ns + shift, end_ns=s.end_ns + shift) for s in spans]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbStore]:
    st = ChdbStore(tmp_path_factory.mktemp("cookbook") / "store")
    try:
        st.insert_spans(traces())
        yield st
    finally:
        st.close()


NOW = datetime.now(timezone.utc)
START, END = NOW - timedelta(hours=3), NOW + timedelta(minutes=5)


def run(store: ChdbStore, heading: str, **kw: Any) -> list[dict[str, Any]]:
    return store.query(cookbook.runnable(cookbook.sql(heading), START, END, **kw))


def test_the_page_has_the_queries() -> None:
    sql, traceql = cookbook.of("sql"), cookbook.of("traceql")
    assert len(sql) >= 11 and len(traceql) >= 12
    assert all(q.heading for q in sql + traceql)
    # One SQL block per question: the fleet test names them by heading.
    assert len({q.heading for q in sql}) == len(sql)


def test_every_sql_query_runs_and_answers(store: ChdbStore) -> None:
    empty = []
    for query in cookbook.of("sql"):
        wanted = "conv-lapse" if cookbook.CONVERSATION_LINE.search(query.text) else None
        if not store.query(cookbook.runnable(query.text, START, END, conversation=wanted)):
            empty.append(query.heading)
    assert not empty, empty


def test_a_broken_query_fails_on_chdb(store: ChdbStore) -> None:
    broken = cookbook.sql("Slow turns with their phases").replace("ORDER BY total_s", "ORDER BY totl_s")
    with pytest.raises(StoreError, match=r"UNKNOWN_IDENTIFIER|Missing columns|Unknown"):
        store.query(cookbook.runnable(broken, START, END))


def test_slow_turns(store: ChdbStore) -> None:
    rows = run(store, "Slow turns with their phases")
    top = rows[0]
    assert (top["conversation"], top["turn"], top["pull_reason"]) == (
        "conv-lapse",
        1,
        names.REASON_NO_DECODE_HANDLE,
    )
    assert top["total_s"] == pytest.approx(21.0) and top["tool_wait_s"] == pytest.approx(20.0)
    phases = ("tool_wait_s", "app_work_s", "input_processing_s", "generation_s")
    assert sum(top[p] for p in phases) == pytest.approx(top["total_s"])
    assert [r["total_s"] for r in rows] == sorted((r["total_s"] for r in rows), reverse=True)


def test_a_conversations_turns(store: ChdbStore) -> None:
    rows = run(store, "A conversation's turns", conversation="conv-lapse")
    assert [r["turn"] for r in rows] == [0, 1, 2]
    assert [r["retention"] for r in rows] == [names.RETENTION_EXPIRED, names.RETENTION_CONSUMED, ""]
    assert [r["pulled"] for r in rows] == [0, 0, 256]
    assert run(store, "A conversation's turns", conversation="it's not there") == []


def test_why_a_turn_did_not_pull(store: ChdbStore) -> None:
    rows = {(r["conversation"], r["turn"]): r for r in run(store, "Why a turn did not pull")}
    assert set(rows) == {("conv-lapse", 1), ("conv-below", 1), ("conv-failed", 1)}
    lapse = rows["conv-lapse", 1]
    assert (lapse["pull_reason"], lapse["previous_retention"], lapse["router_handle"]) == (
        names.REASON_NO_DECODE_HANDLE,
        names.RETENTION_EXPIRED,
        names.ROUTER_HANDLE_STALE,
    )
    assert lapse["gap_s"] > lapse["ttl_s"] == TTL_S
    below = rows["conv-below", 1]
    assert (below["pull_reason"], below["remote_reusable"], below["threshold"]) == (
        names.REASON_BELOW_THRESHOLD,
        40,
        64,
    )


def test_ttl_lapsed_during_a_tool_call(store: ChdbStore) -> None:
    (row,) = run(store, "Turns whose TTL lapsed during a tool call, by agent")
    assert (row["agent"], row["lapsed_turns"], row["decode_ttl_s"]) == ("conv-lapse", 1, TTL_S)
    assert row["longest_tool_wait_s"] == pytest.approx(20.0)
    assert row["most_over_ttl_s"] == pytest.approx(20.0 - TTL_S)


def test_pulls_slower_than_recomputing(store: ChdbStore) -> None:
    (row,) = run(store, "Pulls slower than recomputing")
    assert (row["conversation"], row["turn"], row["pulled"], row["pull_s"]) == ("conv-slow", 1, 256, 2.0)
    # The fastest computing request: 300 tokens in its 0.25 s span.
    assert row["recompute_estimate_s"] == pytest.approx(256 * 0.25 / 300)


def test_conversations_whose_reuse_never_happened(store: ChdbStore) -> None:
    rows = {r["conversation"]: r for r in run(store, "Conversations whose reuse never happened")}
    assert set(rows) == {"conv-below", "conv-failed"}  # conv-plain has one turn only
    assert rows["conv-below"]["reasons"] == [names.REASON_BELOW_THRESHOLD]
    assert rows["conv-failed"]["reasons"] == [names.REASON_DECLINED_EXPIRED]


def test_tool_wait_against_app_work(store: ChdbStore) -> None:
    rows = {r["agent"]: r for r in run(store, "p95 tool wait against app work, per agent")}
    assert set(rows) == {"conv-lapse", "conv-slow", "conv-below", "conv-failed"}
    assert rows["conv-slow"]["p95_tool_wait_s"] == 0 and rows["conv-slow"]["p95_app_work_s"] == 2.5
    assert rows["conv-failed"]["p95_app_work_s"] == 9.0
    # conv-lapse: a 20 s tool wait and a 1 s gap of app work, over 21 + 1 + 2 s of turns.
    assert rows["conv-lapse"]["tool_wait_share"] == pytest.approx(20.0 / 23.0)


def test_block_seconds_per_saved_prefill_second(store: ChdbStore) -> None:
    (row,) = run(store, "Retained block-seconds per saved prefill second")
    held = [TTL_S, 1.0, 2.5, 0.5, TTL_S]
    assert row["decode_engine"] == "decode-0" and row["retentions"] == len(held) and row["expired"] == 2
    assert row["block_seconds"] == pytest.approx(10 * sum(held))
    assert row["pulled_tokens"] == 512
    saved = 512 * 0.25 / 300  # pulled tokens at the fastest seconds per computed token
    assert row["saved_prefill_s"] == pytest.approx(saved)
    assert row["block_seconds_per_saved_s"] == pytest.approx(10 * sum(held) / saved)


def test_ttft_by_turn_index(store: ChdbStore) -> None:
    rows = {r["turn"]: r for r in run(store, "TTFT by turn index")}
    # Turn 0: four streamed (0.4 s) and one non-streamed whose prefill ended 0.6 s in, its
    # decode node's read of the prompt 0.02 s later. The failed turn 1 is left out.
    assert rows[0]["turns"] == 5 and rows[1]["turns"] == 3 and rows[2]["turns"] == 1
    assert rows[0]["p50_ttft_s"] == pytest.approx(0.4)
    assert rows[0]["p95_ttft_s"] == pytest.approx(0.4 + 0.8 * (0.62 - 0.4))
    assert rows[2]["reused_share"] == pytest.approx(256 / 300)


def test_kv_bytes_by_direction_and_backend(store: ChdbStore) -> None:
    rows = {r["direction"]: r for r in run(store, "KV bytes read, by direction and backend")}
    pull = rows[names.DIRECTION_D_TO_P]
    assert (pull["backend"], pull["reader"], pull["transfers"], pull["bytes"]) == (
        "UCX",
        "prefill-0",
        2,
        4 << 20,
    )
    assert rows[names.DIRECTION_P_TO_D]["transfers"] == 10  # one per request


def test_failed_kv_loads(store: ChdbStore) -> None:
    (row,) = run(store, "Failed KV loads")
    assert (row["conversation"], row["turn"], row["http_status"], row["outcome"], row["pull_reason"]) == (
        "conv-failed",
        1,
        "500",
        names.OUTCOME_FAILED_KV_LOAD,
        names.REASON_DECLINED_EXPIRED,
    )


# ------------------------------------------------------------------ names


def _emitted_keys() -> set[str]:
    return {
        v
        for k, v in vars(names).items()
        if k.isupper() and isinstance(v, str) and "." in v and not k.startswith(("METRIC_", "ENV_"))
    } | {"service.name"}


def _span_names() -> set[str]:
    templates = [
        (names.SPAN_ENGINE_REQUEST, names.ROLES),
        (names.SPAN_TRANSFER, names.DIRECTIONS),
        (names.SPAN_RETENTION, names.RETENTION_KINDS),
    ]
    return {t.split("{")[0] + v for t, values in templates for v in values}


SQL_KEY = re.compile(
    r"(?:SpanAttributes|ResourceAttributes)\['([^']+)'\]|mapContains\(SpanAttributes, '([^']+)'\)"
)
SQL_NAME = re.compile(
    r"SpanName (?:=|IN \() ?'([^']+)'|startsWith\(SpanName, '([^']+)'\)|SpanName IN \(([^)]*)\)"
)
TRACEQL_KEY = re.compile(r"\b(?:span|resource)\.([a-z_][\w.]*)")
TRACEQL_NAME = re.compile(r'\bname = "([^"]+)"')


def test_every_attribute_key_and_span_name_is_one_otelkv_emits() -> None:
    keys, span_names = _emitted_keys(), _span_names()
    prefixes = {"chat ", "kv_request ", "kv_transfer "}
    seen_keys: set[str] = set()
    for query in cookbook.queries():
        if query.language == "sql":
            found_keys = [a or b for a, b in SQL_KEY.findall(query.text)]
            found_names: list[str] = []
            for eq, prefix, listed in SQL_NAME.findall(query.text):
                found_names += [eq] if eq else [prefix] if prefix else re.findall(r"'([^']+)'", listed)
        else:
            found_keys = TRACEQL_KEY.findall(query.text)
            found_names = TRACEQL_NAME.findall(query.text)
        unknown = [k for k in found_keys if k not in keys]
        assert not unknown, (query.heading, unknown)
        odd = [n for n in found_names if n not in span_names and n not in prefixes]
        assert not odd, (query.heading, odd)
        seen_keys.update(found_keys)
    assert len(seen_keys) >= 30  # the patterns found the keys (a check over nothing must fail)


def test_the_key_check_catches_a_made_up_key() -> None:
    assert "otelkv.turn.made_up_s" not in _emitted_keys()
    assert TRACEQL_KEY.findall("{ span.otelkv.turn.made_up_s > 1 }") == ["otelkv.turn.made_up_s"]
    assert SQL_KEY.findall("SpanAttributes['otelkv.x']") == [("otelkv.x", "")]


# ------------------------------------------------------------------ TraceQL


def test_every_traceql_query_parses() -> None:
    texts = [q.text for q in cookbook.of("traceql")]
    code, results = traceql_parse([*texts, "{ span.otelkv.turn.total_s > }"])
    assert code == 1  # the parser rejects the broken one ...
    assert [r["query"] for r in results if r["errors"]] == ["{ span.otelkv.turn.total_s > }"]  # ... only
    assert all("\n" not in t for t in texts)  # one line each: Explore's query field
