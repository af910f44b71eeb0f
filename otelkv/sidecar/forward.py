"""Also send the sidecar's turn spans to a collector when ``OTEL_EXPORTER_OTLP_*`` says so.

Fleets that already run an OpenTelemetry Collector want the turn span next to the engine
spans there too. The turn span is built from the proxy's record (not by an SDK tracer), so
it is re-wrapped as an SDK ``ReadableSpan`` and handed to the standard batch processor and
OTLP exporter, which bring their own queueing, retries and environment configuration.

A collector that is down or slow must cost neither requests nor memory nor restarts: the
spans waiting for it are bounded (``OTEL_BSP_MAX_QUEUE_SIZE``, default 2048), what does not
reach it is counted by reason (queue full, export failed, still queued at shutdown), and
shutting down waits at most :data:`SHUTDOWN_TIMEOUT_S` for it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from otelkv.spans import SpanRecord

logger = logging.getLogger("otelkv.sidecar")

SHUTDOWN_TIMEOUT_S = 2.0
"""At most this long for queued spans to reach the collector when the sidecar stops.

The SDK's own shutdown waits up to 30 s plus an export timeout per batch, and the proxy is
already closed by then: against a dead collector every restart meant ~17-30 s in which
agents' connections were refused.
"""
DEFAULT_MAX_QUEUE_SPANS = 2048
"""The SDK's default for ``OTEL_BSP_MAX_QUEUE_SIZE``."""
DROP_QUEUE_FULL = "queue_full"
DROP_EXPORT_FAILED = "export_failed"
DROP_SHUTDOWN = "shutdown"

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


class _CountingExporter(SpanExporter):
    """The OTLP exporter, reporting how each batch ended (the SDK only logs failures)."""

    def __init__(self, inner: SpanExporter, done: Callable[[int, bool], None]) -> None:
        self.inner = inner
        self.done = done

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        finally:
            self.done(len(spans), result == SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _max_queue_spans() -> int:
    try:
        return max(1, int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_MAX_QUEUE_SPANS)))
    except ValueError:
        return DEFAULT_MAX_QUEUE_SPANS


class CollectorForwarder:
    def __init__(
        self,
        exporter: SpanExporter,
        *,
        on_drop: Callable[[str, int], None] | None = None,
        max_queue_spans: int | None = None,
    ) -> None:
        self.on_drop = on_drop
        self.max_queue_spans = max_queue_spans or _max_queue_spans()
        # Spans handed to the processor and not yet exported or failed. Bounding this (rather
        # than letting the SDK's queue overflow) keeps the count exact and spares the log a
        # "Queue full" warning per span while the collector is away.
        self._pending = 0
        self._lock = threading.Lock()
        self._processor = BatchSpanProcessor(_CountingExporter(exporter, self._exported))

    @classmethod
    def from_env(cls, on_drop: Callable[[str, int], None] | None = None) -> CollectorForwarder | None:
        if not (
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        ):
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(), on_drop=on_drop)

    def forward(self, spans: Sequence[SpanRecord]) -> None:
        with self._lock:
            room = max(0, self.max_queue_spans - self._pending)
            self._pending += min(room, len(spans))
        if room < len(spans):
            self._drop(DROP_QUEUE_FULL, len(spans) - room)
        for record in spans[:room]:
            try:
                self._processor.on_end(readable_span(record))
            except Exception:
                self._exported(1, False)
                logger.exception("otelkv sidecar: could not forward a turn span")

    def _exported(self, count: int, ok: bool) -> None:
        with self._lock:
            self._pending -= count
        if not ok:
            self._drop(DROP_EXPORT_FAILED, count)

    def _drop(self, reason: str, count: int) -> None:
        if self.on_drop is None:
            return
        try:
            self.on_drop(reason, count)
        except Exception:  # a metrics callback must not break forwarding
            logger.debug("on_drop callback failed", exc_info=True)

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Give queued spans ``timeout_s`` to leave, then count the rest as dropped."""
        stopper = threading.Thread(target=self._shutdown, name="otelkv-forward-shutdown", daemon=True)
        stopper.start()
        stopper.join(timeout_s)
        left = self.pending
        if stopper.is_alive() and left > 0:
            logger.warning(
                "otelkv sidecar: the collector took more than %.0f s; %d turn spans not forwarded",
                timeout_s,
                left,
            )
            with self._lock:
                self._pending = 0
            self._drop(DROP_SHUTDOWN, left)

    def _shutdown(self) -> None:
        try:
            self._processor.shutdown()
        except Exception:
            logger.exception("otelkv sidecar: error while shutting the collector forwarder down")
