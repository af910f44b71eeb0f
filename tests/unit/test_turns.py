"""Per-turn summaries are what the demo prints and what a reader trusts to explain a
reverse pull, so every field is pinned against a hand-built trace of one turn.

Span shapes follow what the fleet emits: the agent's ``chat`` span (with the turn index),
the router's span (with the handle state), and per engine a ``kv_request`` span whose
``kv_transfer``/``kv_retention`` children carry the transfer and retention facts.
"""

from __future__ import annotations

from typing import Any

import pytest

from otelkv import names
from otelkv.analysis.turns import EngineLeg, TurnSummary, summarize_turns
from otelkv.sidecar.otlp import SpanRecord

T1 = "11" * 16
T2 = "22" * 16
S = 1_700_000_000_000_000_000  # a start time in ns


def span(
    trace_id: str, span_id: str, parent: str, name: str, start_s: float, end_s: float,
    attributes: dict[str, Any], status: str = "Unset", message: str = "",
) -> SpanRecord:  # fmt: skip
    return SpanRecord(
        trace_id=trace_id, span_id=span_id, parent_span_id=parent, name=name, kind="Internal",
        start_ns=S + int(start_s * 1e9), end_ns=S + int(end_s * 1e9), attributes=attributes,
        resource={}, status_code=status, status_message=message,
    )  # fmt: skip


def turn_trace(trace_id: str = T1, turn: int = 2, offset_s: float = 0.0) -> list[SpanRecord]:
    """One full turn: agent chat -> router -> prefill (pulled) and decode (retained)."""
    o = offset_s
    return [
        span(trace_id, "a1", "", "chat tiny", o + 0.0, o + 2.0, {
            names.GEN_AI_OPERATION_NAME: "chat", names.TURN_INDEX: turn,
            names.GEN_AI_CONVERSATION_ID: "conv-7",
        }),
        span(trace_id, "r1", "a1", "router chat", o + 0.1, o + 1.9, {names.ROUTER_HANDLE: "hit"}),
        span(trace_id, "p1", "r1", "kv_request prefill", o + 0.2, o + 0.7, {
            names.ROLE: "prefill", names.REQUEST_ID: "req-p", names.REQUEST_OUTCOME: "finished",
            names.GEN_AI_USAGE_INPUT_TOKENS: 300, names.TOKENS_LOCAL_CACHE_HIT: 16,
            names.TOKENS_PULLED: 240, names.TOKENS_COMPUTED: 44, names.PULL_DECISION: "pull",
            names.PULL_REASON: "pulled", names.TOKENS_REMOTE_REUSABLE: 240,
            names.KV_PARAMS_RETURNED: True,
        }),
        span(trace_id, "x1", "p1", "kv_transfer D->P", o + 0.3, o + 0.4, {
            names.TRANSFER_DIRECTION: "D->P", names.TRANSFER_BYTES: 1_000_000,
            names.TRANSFER_WAIT_SECONDS: 0.125, names.TRANSFER_OUTCOME: "ok",
        }),
        span(trace_id, "d1", "r1", "kv_request decode", o + 0.8, o + 1.8, {
            names.ROLE: "decode", names.REQUEST_ID: "req-d", names.REQUEST_OUTCOME: "finished",
            names.GEN_AI_USAGE_INPUT_TOKENS: 301, names.TOKENS_PULLED: 300, names.TOKENS_COMPUTED: 1,
            names.KV_PARAMS_RETURNED: True,
        }, status="Error", message="late"),
        span(trace_id, "k1", "d1", "kv_retention decode_ttl", o + 1.8, o + 9.8, {
            names.RETENTION_KIND: "decode_ttl", names.RETENTION_OUTCOME: "consumed",
            names.RETENTION_HELD_SECONDS: 8.0, names.RETENTION_BLOCKS: 19,
        }),
        # A vLLM-native span in the same trace: counted, otherwise ignored.
        span(trace_id, "v1", "p1", "llm_request", o + 0.2, o + 0.7, {names.GEN_AI_REQUEST_ID: "chatcmpl-1"}),
    ]  # fmt: skip


def test_full_turn_summary() -> None:
    (turn,) = summarize_turns(turn_trace())
    prefill = EngineLeg(
        role="prefill", request_id="req-p", outcome="finished", status="Unset", status_message="",
        prompt_tokens=300, local_hit=16, pulled=240, computed=44, decision="pull", reason="pulled",
        remote_reusable=240, params_returned=True, duration_s=0.5, transfer_bytes=1_000_000,
        transfer_wait_s=0.125, transfer_outcome="ok",
    )  # fmt: skip
    decode = EngineLeg(
        role="decode", request_id="req-d", outcome="finished", status="Error", status_message="late",
        prompt_tokens=301, pulled=300, computed=1, params_returned=True, duration_s=1.0,
        retention_outcome="consumed", retention_held_s=8.0, retention_blocks=19,
    )  # fmt: skip
    assert turn == TurnSummary(
        trace_id=T1, conversation_id="conv-7", turn_index=2, start_ns=S, latency_s=2.0, status="Unset",
        router_handle="hit", prefill=prefill, decode=decode, spans=7,
    )  # fmt: skip


def test_span_order_does_not_matter() -> None:
    assert summarize_turns(reversed(turn_trace())) == summarize_turns(turn_trace())


def test_unrelated_traces_produce_no_summary() -> None:
    startup = [
        span(T2, "s1", "", "vllm startup", 0.0, 5.0, {"vllm.phase": "load"}),
        span(T2, "s2", "s1", "llm_request", 1.0, 2.0, {names.GEN_AI_REQUEST_ID: "warmup"}),
        # A chat span without a turn index is somebody else's chat, not an agent turn.
        span(T2, "s3", "", "chat tiny", 1.0, 2.0, {names.GEN_AI_OPERATION_NAME: "chat"}),
        # A kv_request name without the role attribute is not otelkv's.
        span(T2, "s4", "", "kv_request prefill", 1.0, 2.0, {}),
    ]
    assert summarize_turns(startup) == []
    assert [t.trace_id for t in summarize_turns(startup + turn_trace())] == [T1]


def test_router_span_alone_is_not_a_turn() -> None:
    assert summarize_turns([span(T2, "r", "", "router chat", 0, 1, {names.ROUTER_HANDLE: "miss"})]) == []


def test_engine_only_trace_takes_conversation_and_earliest_start() -> None:
    spans = [s for s in turn_trace() if s.span_id in {"d1", "p1"}]
    spans[1].attributes[names.GEN_AI_CONVERSATION_ID] = "conv-from-engine"
    for order in (spans, spans[::-1]):
        (turn,) = summarize_turns(order)
        assert (turn.turn_index, turn.latency_s, turn.router_handle) == (None, None, None)
        assert turn.conversation_id == "conv-from-engine"
        assert turn.start_ns == S + 200_000_000  # the prefill request began first
        assert (turn.prefill is not None, turn.decode is not None, turn.spans) == (True, True, 2)


def test_chat_start_wins_over_engine_spans() -> None:
    spans = turn_trace(offset_s=0.0)
    spans[2].start_ns = S - 5  # an engine clock a little behind the agent's
    for order in (spans, spans[::-1]):
        assert summarize_turns(order)[0].start_ns == S


def test_turns_sorted_by_start_time() -> None:
    later = turn_trace(T1, turn=1, offset_s=10.0)
    earlier = turn_trace(T2, turn=0, offset_s=0.0)
    turns = summarize_turns(later + earlier)
    assert [(t.trace_id, t.turn_index) for t in turns] == [(T2, 0), (T1, 1)]


def test_unified_legs_are_neither_prefill_nor_decode() -> None:
    bare = span(T1, "u", "", "kv_request unified", 0.0, 0.25, {names.ROLE: "unified"})
    (turn,) = summarize_turns([bare])
    assert (turn.prefill, turn.decode, turn.start_ns) == (None, None, S)


def test_missing_or_null_numbers_default_to_zero() -> None:
    attrs = {names.ROLE: "prefill", names.TOKENS_PULLED: None, names.GEN_AI_USAGE_INPUT_TOKENS: "12"}
    (turn,) = summarize_turns([span(T1, "p", "", "kv_request prefill", 0.0, 0.25, attrs)])
    assert turn.prefill == EngineLeg(role="prefill", prompt_tokens=12, duration_s=0.25)


@pytest.mark.parametrize(
    ("children", "bytes_", "outcome"),
    [
        ([], 0, None),
        (
            [{names.TRANSFER_DIRECTION: "D->P", names.TRANSFER_BYTES: 10, names.TRANSFER_OUTCOME: "failed"}],
            10,
            "failed",
        ),
        (
            [
                {names.TRANSFER_DIRECTION: "D->P", names.TRANSFER_BYTES: 10, names.TRANSFER_OUTCOME: "ok"},
                {names.TRANSFER_DIRECTION: "D->P", names.TRANSFER_BYTES: 5, names.TRANSFER_OUTCOME: "stuck"},
            ],
            15,
            "stuck",
        ),
    ],
)
def test_transfer_bytes_add_up(children: list[dict[str, Any]], bytes_: int, outcome: str | None) -> None:
    request = span(T1, "p", "", "kv_request prefill", 0.0, 1.0, {names.ROLE: "prefill"})
    kids = [span(T1, f"c{i}", "p", "kv_transfer D->P", 0.1, 0.2, a) for i, a in enumerate(children)]
    (turn,) = summarize_turns([request, *kids])
    assert turn.prefill is not None
    assert (turn.prefill.transfer_bytes, turn.prefill.transfer_outcome) == (bytes_, outcome)
    assert turn.prefill.transfer_wait_s == (0.0 if children else None)
