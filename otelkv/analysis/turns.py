"""Assemble per-turn summaries from the spans of a fleet (pure logic).

A turn is one trace: the agent's ``chat`` span, the router's span and legs, and on each
engine a ``kv_request`` span with its ``kv_transfer`` and ``kv_retention`` children. The
retention of a turn's decode request ends later (when the next turn reads it or the TTL
lapses) but stays in the same trace, so summaries built after the fact see it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from otelkv import names
from otelkv.sidecar.otlp import SpanRecord


@dataclass
class EngineLeg:
    """What one engine recorded for the turn's request."""

    role: str
    request_id: str = ""
    outcome: str = ""
    status: str = "Unset"
    status_message: str = ""
    prompt_tokens: int = 0
    local_hit: int = 0
    pulled: int = 0
    computed: int = 0
    decision: str | None = None
    reason: str | None = None
    remote_reusable: int = 0
    params_returned: bool | None = None
    duration_s: float = 0.0
    transfer_bytes: int = 0
    transfer_wait_s: float | None = None
    transfer_outcome: str | None = None
    retention_outcome: str | None = None
    retention_held_s: float | None = None
    retention_blocks: int = 0


@dataclass
class TurnSummary:
    trace_id: str
    conversation_id: str = ""
    turn_index: int | None = None
    start_ns: int = 0
    latency_s: float | None = None
    status: str = "Unset"
    router_handle: str | None = None
    prefill: EngineLeg | None = None
    decode: EngineLeg | None = None
    spans: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _leg(request: SpanRecord, children: list[SpanRecord]) -> EngineLeg:
    a = request.attributes
    leg = EngineLeg(
        role=str(a.get(names.ROLE, "")),
        request_id=str(a.get(names.REQUEST_ID, "")),
        outcome=str(a.get(names.REQUEST_OUTCOME, "")),
        status=request.status_code,
        status_message=request.status_message,
        prompt_tokens=int(a.get(names.GEN_AI_USAGE_INPUT_TOKENS, 0) or 0),
        local_hit=int(a.get(names.TOKENS_LOCAL_CACHE_HIT, 0) or 0),
        pulled=int(a.get(names.TOKENS_PULLED, 0) or 0),
        computed=int(a.get(names.TOKENS_COMPUTED, 0) or 0),
        decision=a.get(names.PULL_DECISION),
        reason=a.get(names.PULL_REASON),
        remote_reusable=int(a.get(names.TOKENS_REMOTE_REUSABLE, 0) or 0),
        params_returned=a.get(names.KV_PARAMS_RETURNED),
        duration_s=request.duration_s,
    )
    for child in children:
        c = child.attributes
        if names.TRANSFER_DIRECTION in c:
            leg.transfer_bytes += int(c.get(names.TRANSFER_BYTES, 0) or 0)
            leg.transfer_wait_s = float(c.get(names.TRANSFER_WAIT_SECONDS, 0.0) or 0.0)
            leg.transfer_outcome = c.get(names.TRANSFER_OUTCOME)
        elif names.RETENTION_KIND in c:
            leg.retention_outcome = c.get(names.RETENTION_OUTCOME)
            leg.retention_held_s = c.get(names.RETENTION_HELD_SECONDS)
            leg.retention_blocks = int(c.get(names.RETENTION_BLOCKS, 0) or 0)
    return leg


def summarize_turns(spans: Iterable[SpanRecord]) -> list[TurnSummary]:
    """One summary per trace that contains an agent turn or an engine request, by start time."""
    by_trace: dict[str, list[SpanRecord]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace_id].append(span)
    out: list[TurnSummary] = []
    for trace_id, group in by_trace.items():
        children: dict[str, list[SpanRecord]] = defaultdict(list)
        for span in group:
            children[span.parent_span_id].append(span)
        turn = TurnSummary(trace_id=trace_id, spans=len(group))
        relevant = False
        for span in group:
            a = span.attributes
            if a.get(names.GEN_AI_OPERATION_NAME) == "chat" and names.TURN_INDEX in a:
                relevant = True
                turn.conversation_id = str(a.get(names.GEN_AI_CONVERSATION_ID, ""))
                turn.turn_index = int(a[names.TURN_INDEX])
                turn.start_ns = span.start_ns
                turn.latency_s = span.duration_s
                turn.status = span.status_code
            elif names.ROUTER_HANDLE in a:
                turn.router_handle = str(a[names.ROUTER_HANDLE])
            elif span.name.startswith("kv_request") and names.ROLE in a:
                relevant = True
                leg = _leg(span, children.get(span.span_id, []))
                if leg.role == names.ROLE_PREFILL:
                    turn.prefill = leg
                elif leg.role == names.ROLE_DECODE:
                    turn.decode = leg
                if not turn.conversation_id:
                    turn.conversation_id = str(a.get(names.GEN_AI_CONVERSATION_ID, ""))
                # The agent's chat span fixes the start; without one, the earliest request.
                if turn.turn_index is None and (not turn.start_ns or span.start_ns < turn.start_ns):
                    turn.start_ns = span.start_ns
        if relevant:
            out.append(turn)
    out.sort(key=lambda t: (t.start_ns, t.turn_index or 0))
    return out
