"""The sidecar's OTLP/HTTP trace receiver (protobuf and JSON, gzip or not).

Engines export with ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://<sidecar>:8801/v1/traces``;
agents may send their ``execute_tool`` spans here too. The reply is what an OTLP
collector answers, so exporters neither retry nor log errors; refused exports get the
status the OTLP/HTTP spec names (400 malformed, 413 too large, 415 unsupported content
type or encoding; none of them retried) with the reason, are counted, and store nothing.
"""

from __future__ import annotations

import logging

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from otelkv import names
from otelkv.sidecar.metrics import SidecarMetrics
from otelkv.sidecar.otlp import OtlpDecodeError, decode_traces
from otelkv.sidecar.pipeline import SpanPipeline

logger = logging.getLogger("otelkv.sidecar")

MAX_OTLP_BODY_BYTES = 32 * 1024 * 1024
_PROTOBUF_OK = ExportTraceServiceResponse().SerializeToString()
_REJECTED_REASONS = {
    400: names.REFUSED_MALFORMED,
    413: names.REFUSED_TOO_LARGE,
    415: names.REFUSED_MEDIA_TYPE,
}
"""The status of a refused export and its ``reason`` label."""


class OtlpReceiver:
    def __init__(self, pipeline: SpanPipeline, metrics: SidecarMetrics) -> None:
        self.pipeline = pipeline
        self.metrics = metrics

    async def handle(self, request: web.Request) -> web.Response:
        ctype = request.headers.get("Content-Type")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.metrics.otlp_rejected.labels(names.REFUSED_TOO_LARGE).inc()
            return web.Response(status=413, text=f"OTLP export over {MAX_OTLP_BODY_BYTES} bytes\n")
        try:
            spans = decode_traces(body, ctype, request.headers.get("Content-Encoding"))
        except OtlpDecodeError as exc:
            self.metrics.otlp_rejected.labels(
                _REJECTED_REASONS.get(exc.status, names.REFUSED_MALFORMED)
            ).inc()
            return web.Response(status=exc.status, text=f"{exc}\n")
        self.pipeline.accept(spans, "otlp")
        if (ctype or "").startswith("application/json"):
            return web.Response(body=b"{}", content_type="application/json")
        return web.Response(body=_PROTOBUF_OK, content_type="application/x-protobuf")
