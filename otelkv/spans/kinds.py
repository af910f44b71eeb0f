"""What a span is: the one definition of each kind of span the analysis reads.

A **turn span** is named ``chat {model}`` (the GenAI name of a chat span) and is either the
sidecar's (scope ``otelkv.sidecar``, operation ``chat`` or ``text_completion``: the sidecar
names both ``chat``) or, from another scope, an agent's own ``chat`` span that carries a
turn index (the reference fleet's driver). A trace holding both is one turn: the sidecar's
span speaks for it. :mod:`otelkv.spans.sql` writes the
same predicates as ClickHouse SQL; a unit test holds the two to the same answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from otelkv import names
from otelkv.spans.attrs import attr_str
from otelkv.spans.record import SpanRecord

ENGINE_REQUEST_PREFIX = names.span_name_prefix(names.SPAN_ENGINE_REQUEST)
TRANSFER_PREFIX = names.span_name_prefix(names.SPAN_TRANSFER)
RETENTION_PREFIX = names.span_name_prefix(names.SPAN_RETENTION)
ROUTER_PREFIX = names.span_name_prefix(names.SPAN_ROUTER_TURN)
TOOL_PREFIX = names.span_name_prefix(names.SPAN_TOOL)
TURN_PREFIX = names.span_name_prefix(names.SPAN_AGENT_TURN)


def named(span: SpanRecord, prefix: str) -> bool:
    """The span's name is the template's fixed word alone or followed by its variable part
    (``execute_tool`` and ``execute_tool grep``, not ``execute_toolbox``)."""
    return span.name == prefix.rstrip() or span.name.startswith(prefix)


def operation(span: SpanRecord) -> str:
    """The span's ``gen_ai.operation.name`` ("" when absent)."""
    return attr_str(span.attributes, names.GEN_AI_OPERATION_NAME)


def is_sidecar_turn_span(span: SpanRecord) -> bool:
    """The sidecar's turn span: the authoritative record of one agent turn."""
    return (
        span.scope_name == names.SCOPE_SIDECAR
        and operation(span) in names.TURN_OPERATIONS
        and named(span, TURN_PREFIX)
    )


def is_agent_turn_span(span: SpanRecord) -> bool:
    """Another scope's ``chat`` span with a turn index (e.g. the reference agent driver)."""
    return (
        span.scope_name != names.SCOPE_SIDECAR
        and operation(span) == names.OPERATION_CHAT
        and named(span, TURN_PREFIX)
        and attr_str(span.attributes, names.TURN_INDEX) != ""
    )


def is_turn_span(span: SpanRecord) -> bool:
    """A span that defines a turn (sidecar's, or an agent's with a turn index)."""
    return is_sidecar_turn_span(span) or is_agent_turn_span(span)


def turn_rank(span: SpanRecord) -> tuple[bool, int]:
    """Which turn span speaks for a trace or a turn: the sidecar's first, then the earliest."""
    return (span.scope_name != names.SCOPE_SIDECAR, span.start_ns)


def one_per_trace(turn_spans: Sequence[SpanRecord]) -> list[SpanRecord]:
    """The turn span that speaks for each trace (:func:`turn_rank`), in the given order.
    :data:`otelkv.spans.sql.TURN_SPANS` queries pick the same with ``LIMIT 1 BY TraceId``."""
    best: dict[str, SpanRecord] = {}
    for span in sorted(turn_spans, key=turn_rank):
        best.setdefault(span.trace_id, span)
    return [s for s in turn_spans if best[s.trace_id] is s]


def is_tool_span(span: SpanRecord) -> bool:
    """An agent's tool execution (``execute_tool {name}``, by operation or by name)."""
    return operation(span) == names.OPERATION_EXECUTE_TOOL or named(span, TOOL_PREFIX)


def is_router_span(span: SpanRecord) -> bool:
    """A router's handling of one request (``router {operation}``, or any span with a handle state)."""
    return names.ROUTER_HANDLE in span.attributes or named(span, ROUTER_PREFIX)


def is_engine_request(span: SpanRecord) -> bool:
    """One request's life on one engine (``kv_request {role}`` with its role)."""
    return named(span, ENGINE_REQUEST_PREFIX) and names.ROLE in span.attributes


def is_prefill_request(span: SpanRecord) -> bool:
    return is_engine_request(span) and attr_str(span.attributes, names.ROLE) == names.ROLE_PREFILL


MIN_COMPUTED_TOKENS = 16
"""Prefill requests that computed fewer tokens do not measure compute: fixed per-request
overhead dominates their time."""


def is_transfer(span: SpanRecord) -> bool:
    """One KV read by an engine (``kv_transfer {direction}``)."""
    return names.TRANSFER_DIRECTION in span.attributes or named(span, TRANSFER_PREFIX)


def is_retention(span: SpanRecord) -> bool:
    """Blocks an engine kept for another to read (``kv_retention {kind}``)."""
    return names.RETENTION_KIND in span.attributes or named(span, RETENTION_PREFIX)
