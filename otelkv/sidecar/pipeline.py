"""Where every span the sidecar sees goes: metrics, the tool-span index, the store.

Two inputs feed it - the sidecar's own turn spans (through an OpenTelemetry SDK span
processor, so context propagation is the standard one) and spans received over OTLP
from engines and agents. The store writer's queue is bounded; a full queue or a failing
store drops spans and counts them, and never slows a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from otelkv.sidecar.metrics import SidecarMetrics
from otelkv.sidecar.otlp import SpanRecord
from otelkv.sidecar.tool_spans import ToolSpanIndex

logger = logging.getLogger("otelkv.sidecar")

_KINDS = {
    "INTERNAL": "Internal",
    "SERVER": "Server",
    "CLIENT": "Client",
    "PRODUCER": "Producer",
    "CONSUMER": "Consumer",
}
_STATUS = {"UNSET": "Unset", "OK": "Ok", "ERROR": "Error"}


class SpanPipeline:
    def __init__(self, metrics: SidecarMetrics, tools: ToolSpanIndex, writer: Any | None) -> None:
        self.metrics = metrics
        self.tools = tools
        self.writer = writer
        """An ``otelkv.store.writer.BatchWriter`` or None (no store: metrics only)."""
        self.taps: list[Callable[[Sequence[SpanRecord]], Any]] = []
        """Extra consumers of every accepted batch (the reference fleet's in-memory sink)."""

    def accept(self, spans: Sequence[SpanRecord], source: str) -> None:
        if not spans:
            return
        try:
            self.metrics.observe_spans(spans)
            self.tools.add(spans)
            for tap in self.taps:
                tap(spans)
        except Exception:  # observation must not lose the spans
            logger.exception("otelkv sidecar: could not observe spans")
        if self.writer is None:
            return
        if self.writer.submit(spans):
            self.metrics.received.labels(source).inc(len(spans))
        else:
            self.metrics.dropped.labels("queue_full").inc(len(spans))


def record_from_sdk(span: ReadableSpan) -> SpanRecord:
    """An SDK span as the flat record the store and analysis use."""
    ctx = span.get_span_context()
    parent = span.parent
    scope = span.instrumentation_scope
    return SpanRecord(
        trace_id=format(ctx.trace_id, "032x"),
        span_id=format(ctx.span_id, "016x"),
        parent_span_id=format(parent.span_id, "016x") if parent is not None else "",
        name=span.name,
        kind=_KINDS.get(span.kind.name, "Unspecified"),
        start_ns=span.start_time or 0,
        end_ns=span.end_time or 0,
        attributes=dict(span.attributes or {}),
        resource=dict(span.resource.attributes),
        scope_name=scope.name if scope else "",
        scope_version=(scope.version or "") if scope else "",
        status_code=_STATUS.get(span.status.status_code.name, "Unset"),
        status_message=span.status.description or "",
        trace_state=ctx.trace_state.to_header() if ctx.trace_state else "",
        events=[
            {"time_ns": e.timestamp, "name": e.name, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        links=[
            {
                "trace_id": format(link.context.trace_id, "032x"),
                "span_id": format(link.context.span_id, "016x"),
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ],
    )


class PipelineSpanProcessor(SpanProcessor):
    """Hands the sidecar's own finished spans to the pipeline (synchronously: it only queues)."""

    def __init__(self, pipeline: SpanPipeline) -> None:
        self._pipeline = pipeline

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return

    def on_end(self, span: ReadableSpan) -> None:
        try:
            self._pipeline.accept([record_from_sdk(span)], "sidecar")
        except Exception:
            logger.exception("otelkv sidecar: could not record a turn span")

    def shutdown(self) -> None:
        return

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
