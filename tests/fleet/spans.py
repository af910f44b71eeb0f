"""Helpers to find the spans of one turn in what a fleet's engines exported."""

from __future__ import annotations

from collections.abc import Iterable

from otelkv import names
from otelkv.fleet.span_sink import SpanSink
from otelkv.spans import SpanRecord


def in_trace(spans: Iterable[SpanRecord], trace_id: str) -> list[SpanRecord]:
    return [s for s in spans if s.trace_id == trace_id]


def engine_request(spans: Iterable[SpanRecord], role: str) -> SpanRecord:
    found = [s for s in spans if s.name == names.engine_request_span_name(role)]
    assert len(found) == 1, f"expected one kv_request {role} span, found {[s.name for s in found]}"
    return found[0]


def children(spans: Iterable[SpanRecord], parent: SpanRecord, prefix: str) -> list[SpanRecord]:
    return [s for s in spans if s.parent_span_id == parent.span_id and s.name.startswith(prefix)]


def wait_for_turn(
    sink: SpanSink, trace_id: str, *, decode: bool = True, timeout: float = 60.0
) -> list[SpanRecord]:
    """Wait until the turn's engine request spans (and the agent span) have arrived. The
    timeout only bounds a failure: on a loaded 2-core machine a failed request's spans once
    took over 30 s to arrive."""
    wanted = {names.engine_request_span_name(names.ROLE_PREFILL)}
    if decode:
        wanted.add(names.engine_request_span_name(names.ROLE_DECODE))

    def ready(all_spans: list[SpanRecord]) -> bool:
        mine = {s.name for s in all_spans if s.trace_id == trace_id}
        return wanted <= mine and any(n.startswith("chat ") for n in mine)

    return in_trace(sink.wait_for(ready, timeout=timeout), trace_id)
