"""Also send the sidecar's turn spans to a collector when ``OTEL_EXPORTER_OTLP_*`` says so.

Fleets that already run an OpenTelemetry Collector want the turn span next to the engine
spans there too. The turn span is built from the proxy's record (not by an SDK tracer), so
it is re-wrapped as an SDK ``ReadableSpan`` and handed to the standard batch processor and
OTLP exporter, which bring their own queueing, retries and environment configuration.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from otelkv.sidecar.otlp import SpanRecord

logger = logging.getLogger("otelkv.sidecar")

_KINDS = {
    "Internal": SpanKind.INTERNAL,
    "Server": SpanKind.SERVER,
    "Client": SpanKind.CLIENT,
    "Producer": SpanKind.PRODUCER,
    "Consumer": SpanKind.CONSUMER,
}
_STATUS = {"Unset": StatusCode.UNSET, "Ok": StatusCode.OK, "Error": StatusCode.ERROR}


def readable_span(record: SpanRecord) -> ReadableSpan:
    """An SDK span carrying exactly the record's ids, times, attributes and status."""
    state = TraceState.from_header([record.trace_state]) if record.trace_state else TraceState()
    context = SpanContext(
        int(record.trace_id, 16), int(record.span_id, 16), False, TraceFlags(TraceFlags.SAMPLED), state
    )
    parent = (
        SpanContext(
            int(record.trace_id, 16), int(record.parent_span_id, 16), True, TraceFlags(TraceFlags.SAMPLED)
        )
        if record.parent_span_id
        else None
    )
    status_code = _STATUS.get(record.status_code, StatusCode.UNSET)
    description = record.status_message if status_code == StatusCode.ERROR and record.status_message else None
    return ReadableSpan(
        name=record.name,
        context=context,
        parent=parent,
        resource=Resource.create(record.resource),
        attributes=record.attributes,
        kind=_KINDS.get(record.kind, SpanKind.INTERNAL),
        status=Status(status_code, description),
        start_time=record.start_ns,
        end_time=record.end_ns,
        instrumentation_scope=InstrumentationScope(record.scope_name, record.scope_version or None),
    )


class CollectorForwarder:
    def __init__(self, exporter: SpanExporter) -> None:
        self._processor = BatchSpanProcessor(exporter)

    @classmethod
    def from_env(cls) -> CollectorForwarder | None:
        if not (
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        ):
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter())

    def forward(self, spans: Sequence[SpanRecord]) -> None:
        for record in spans:
            try:
                self._processor.on_end(readable_span(record))
            except Exception:
                logger.exception("otelkv sidecar: could not forward a turn span")

    def shutdown(self) -> None:
        try:
            self._processor.shutdown()
        except Exception:
            logger.exception("otelkv sidecar: error while shutting the collector forwarder down")
