"""Agent ``execute_tool`` spans are indexed by conversation and by tool call id, bounded, and
answer which tool time overlapped a gap.
"""

from __future__ import annotations

from typing import Any

from otelkv import names
from otelkv.sidecar.identity import IdPolicy, hashed_id
from otelkv.sidecar.tool_spans import ToolSpanIndex
from otelkv.spans import SpanRecord, is_tool_span


def _span(name: str, start: int, end: int, **attrs: Any) -> SpanRecord:
    return SpanRecord("0" * 32, "1" * 16, "", name, "Internal", start, end, attrs, {})


def test_is_tool_span_by_operation_or_name() -> None:
    """The GenAI operation name or a span name starting with execute_tool marks a tool span."""
    assert is_tool_span(_span("run grep", 0, 1, **{names.GEN_AI_OPERATION_NAME: "execute_tool"}))
    assert is_tool_span(_span("execute_tool grep", 0, 1))
    assert not is_tool_span(_span("chat m", 0, 1, **{names.GEN_AI_OPERATION_NAME: "chat"}))


def test_index_by_conversation_and_by_call_id() -> None:
    """A span is found through its conversation id or through a tool call id."""
    index = ToolSpanIndex()
    added = index.add(
        [
            _span("execute_tool a", 10, 20, **{names.GEN_AI_CONVERSATION_ID: "conv"}),
            _span("execute_tool b", 30, 40, **{names.GEN_AI_TOOL_CALL_ID: "call_b"}),
            _span("execute_tool c", 50, 60, **{names.GEN_AI_CONVERSATION_ID: "other"}),
            _span("execute_tool anon", 15, 25),  # no key: not indexed
            _span("chat m", 0, 100, **{names.GEN_AI_CONVERSATION_ID: "conv"}),  # not a tool span
        ]
    )
    assert added == 3
    assert index.intervals(0, 100, conversation_id="conv") == [(10, 20)]
    assert index.intervals(0, 100, conversation_id="conv", call_ids=["call_b"]) == [(10, 20), (30, 40)]
    assert index.intervals(0, 100, conversation_id="nobody", call_ids=["call_b"]) == [(30, 40)]


def test_span_with_both_keys_is_reported_once() -> None:
    """Found through both its conversation and its call id, a span still counts once."""
    index = ToolSpanIndex()
    index.add(
        [_span("execute_tool", 5, 9, **{names.GEN_AI_CONVERSATION_ID: "c", names.GEN_AI_TOOL_CALL_ID: "t"})]
    )
    assert index.intervals(0, 10, conversation_id="c", call_ids=["t"]) == [(5, 9)]


def test_overlap_query() -> None:
    """Only intervals overlapping [start, end) come back; touching the edges is no overlap."""
    index = ToolSpanIndex()
    key = {names.GEN_AI_CONVERSATION_ID: "c"}
    index.add(
        [_span("execute_tool", s, e, **key) for s, e in [(0, 10), (10, 20), (15, 25), (30, 40), (5, 50)]]
    )
    assert index.intervals(20, 30, conversation_id="c") == [(5, 50), (15, 25)]
    assert index.intervals(10, 11, conversation_id="c") == [(5, 50), (10, 20)]
    assert index.intervals(100, 200, conversation_id="c") == []


def test_capacity_evicts_oldest_key() -> None:
    """The index holds at most ``capacity`` keys; the least recently added key goes first."""
    index = ToolSpanIndex(capacity=2)
    for cid in ("a", "b", "c"):
        index.add([_span("execute_tool", 1, 2, **{names.GEN_AI_CONVERSATION_ID: cid})])
    assert index.intervals(0, 10, conversation_id="a") == []
    assert index.intervals(0, 10, conversation_id="c") == [(1, 2)]


def test_agent_ids_are_keyed_as_the_sidecar_keeps_them() -> None:
    """An agent sends the raw id; the turn is keyed by its hash (over the cap, or hash mode)."""
    long_id = "L" * 1000
    index = ToolSpanIndex()
    index.add([_span("execute_tool a", 10, 20, **{names.GEN_AI_CONVERSATION_ID: long_id})])
    assert index.intervals(0, 100, conversation_id=hashed_id(long_id)) == [(10, 20)]
    hashing = ToolSpanIndex(id_policy=IdPolicy(hash_all=True))
    hashing.add([_span("execute_tool a", 10, 20, **{names.GEN_AI_CONVERSATION_ID: "conv"})])
    assert hashing.intervals(0, 100, conversation_id=hashed_id("conv")) == [(10, 20)]
    assert hashing.intervals(0, 100, conversation_id="conv") == []
