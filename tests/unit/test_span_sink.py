"""The fleet's span sink must look like an OTLP collector to real exporters: accept their
exports (plain and gzip), refuse garbage with a 400 the client can read (never a dropped
connection, which exporters retry), and serve nothing but ``/v1/traces``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import requests
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from otelkv.fleet.span_sink import SpanSink

PROTO = "application/x-protobuf"


@pytest.fixture(scope="module")
def sdk_spans() -> tuple[ReadableSpan, ...]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "decode"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("otelkv.engine")
    with tracer.start_as_current_span("kv_request decode", kind=SpanKind.SERVER) as parent:
        parent.set_attribute("otelkv.tokens.pulled", 300)
        with tracer.start_as_current_span("kv_retention decode_ttl"):
            pass
    provider.shutdown()
    return exporter.get_finished_spans()


@pytest.fixture
def sink() -> Iterator[SpanSink]:
    with SpanSink(port=0) as running:
        yield running


def post(url: str, body: bytes, ctype: str) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": ctype}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers.get_content_type(), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get_content_type(), err.read()


def export(
    endpoint: str, spans: tuple[ReadableSpan, ...], compression: Compression = Compression.NoCompression
) -> SpanExportResult:
    session = requests.Session()
    session.trust_env = False  # never route 127.0.0.1 through an environment proxy
    exporter = OTLPSpanExporter(endpoint=endpoint, compression=compression, session=session, timeout=10)
    try:
        return exporter.export(spans)
    finally:
        exporter.shutdown()


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_accepts_a_real_otlp_http_exporter(
    sink: SpanSink, sdk_spans: tuple[ReadableSpan, ...], compression: Compression
) -> None:
    assert export(sink.endpoint, sdk_spans, compression) == SpanExportResult.SUCCESS
    got = {s.name: s for s in sink.spans()}
    assert sorted(got) == ["kv_request decode", "kv_retention decode_ttl"]
    parent, child = got["kv_request decode"], got["kv_retention decode_ttl"]
    assert parent.trace_id == format(sdk_spans[1].context.trace_id, "032x")
    assert child.parent_span_id == parent.span_id == format(sdk_spans[1].context.span_id, "016x")
    assert (parent.kind, parent.service_name, parent.attributes) == (
        "Server",
        "decode",
        {"otelkv.tokens.pulled": 300},
    )
    assert (sink.rejected, sink.dropped) == (0, 0)


def test_endpoint_is_the_traces_url(sink: SpanSink) -> None:
    assert sink.port > 0
    assert sink.endpoint == f"http://127.0.0.1:{sink.port}/v1/traces"


def test_garbage_gets_400_with_a_message(sink: SpanSink) -> None:
    status, ctype, body = post(sink.endpoint, b"garbage", PROTO)
    assert (status, ctype) == (400, "text/plain")
    assert body.decode().startswith("body is not an OTLP ExportTraceServiceRequest protobuf: ")
    assert body.endswith(b"\n")
    assert (sink.rejected, sink.spans()) == (1, [])


def test_overflowing_json_gets_400_not_a_dropped_connection(sink: SpanSink) -> None:
    body = b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": 1e400}]}]}]}'
    status, _, reply = post(sink.endpoint, body, "application/json")
    assert (status, reply) == (400, b"malformed OTLP JSON: cannot convert float infinity to integer\n")


def test_unsupported_content_type_gets_415(sink: SpanSink) -> None:
    status, _, body = post(sink.endpoint, b"{}", "text/plain")
    assert status == 415  # the OTLP/HTTP spec's "unsupported media type"
    assert body.startswith(b"unsupported Content-Type 'text/plain'")


def test_json_export_is_answered_with_json(sink: SpanSink) -> None:
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "ab" * 16, "spanId": "cd" * 8}]}]}]}
    assert post(sink.endpoint + "/", json.dumps(doc).encode(), "application/json") == (
        200,
        "application/json",
        b"{}",
    )
    assert [(s.trace_id, s.span_id) for s in sink.spans()] == [("ab" * 16, "cd" * 8)]


def test_other_paths_get_404(sink: SpanSink) -> None:
    status, _, body = post(f"http://127.0.0.1:{sink.port}/v1/metrics", b"", PROTO)
    assert (status, body) == (404, b"only /v1/traces is served here\n")
    assert sink.rejected == 0


def test_capacity_drops_oldest_and_counts(sdk_spans: tuple[ReadableSpan, ...]) -> None:
    small = SpanSink(capacity=1).start()
    try:
        assert export(small.endpoint, sdk_spans) == SpanExportResult.SUCCESS
        assert [s.name for s in small.spans()] == ["kv_request decode"]
        assert small.dropped == 1
    finally:
        small.close()
