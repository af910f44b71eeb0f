"""The OTLP decoder must read what real OpenTelemetry exporters send, byte for byte, and
turn every kind of bad input into ``OtlpDecodeError`` (the receiver's only 400 path).

Spans are produced by the real SDK and encoded by the real OTLP encoder, so a drift in
the wire format (or in our reading of it) fails here rather than in the fleet tests.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from otelkv.sidecar.otlp import OtlpDecodeError, decode_traces
from otelkv.spans import SpanRecord

PROTO = "application/x-protobuf"


@pytest.fixture(scope="module")
def sdk_spans() -> tuple[ReadableSpan, ...]:
    """A server span with typed attributes and an erroring internal child."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": "prefill", "otelkv.process.kind": "scheduler"})
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("otelkv.engine", "9.9")
    with tracer.start_as_current_span("kv_request prefill", kind=SpanKind.SERVER) as parent:
        parent.set_attributes(
            {
                "otelkv.tokens.pulled": 192,
                "otelkv.transfer.xfer_s": 0.25,
                "otelkv.kv_transfer_params.returned": True,
                "otelkv.role": "prefill",
                "gen_ai.response.finish_reasons": ["stop", "length"],
                "ints": [1, 2],
            }
        )
        parent.add_event("alloc", {"blocks": 3})
        with tracer.start_as_current_span("kv_transfer D->P") as child:
            child.set_status(Status(StatusCode.ERROR, "NIXL read failed"))
    provider.shutdown()
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["kv_transfer D->P", "kv_request prefill"]
    return spans


def by_name(records: list[SpanRecord]) -> dict[str, SpanRecord]:
    return {r.name: r for r in records}


def check_decoded(records: list[SpanRecord], spans: tuple[ReadableSpan, ...]) -> None:
    child_sdk, parent_sdk = spans
    got = by_name(records)
    assert set(got) == {"kv_request prefill", "kv_transfer D->P"}
    parent, child = got["kv_request prefill"], got["kv_transfer D->P"]
    assert parent.trace_id == format(parent_sdk.context.trace_id, "032x")
    assert parent.span_id == format(parent_sdk.context.span_id, "016x")
    assert parent.parent_span_id == ""
    assert child.trace_id == parent.trace_id
    assert child.span_id == format(child_sdk.context.span_id, "016x")
    assert child.parent_span_id == parent.span_id
    assert (parent.kind, child.kind) == ("Server", "Internal")
    assert (parent.status_code, parent.status_message) == ("Unset", "")
    assert (child.status_code, child.status_message) == ("Error", "NIXL read failed")
    assert parent.attributes == {
        "otelkv.tokens.pulled": 192,
        "otelkv.transfer.xfer_s": 0.25,
        "otelkv.kv_transfer_params.returned": True,
        "otelkv.role": "prefill",
        "gen_ai.response.finish_reasons": ["stop", "length"],
        "ints": [1, 2],
    }
    assert type(parent.attributes["otelkv.tokens.pulled"]) is int
    assert type(parent.attributes["otelkv.kv_transfer_params.returned"]) is bool
    assert parent.resource["service.name"] == "prefill"
    assert parent.resource["otelkv.process.kind"] == "scheduler"
    assert parent.service_name == "prefill"
    assert (parent.scope_name, parent.scope_version) == ("otelkv.engine", "9.9")
    assert (parent.start_ns, parent.end_ns) == (parent_sdk.start_time, parent_sdk.end_time)
    assert [(e["name"], e["attributes"]) for e in parent.events] == [("alloc", {"blocks": 3})]


def test_protobuf_export_decodes(sdk_spans: tuple[ReadableSpan, ...]) -> None:
    body = encode_spans(sdk_spans).SerializeToString()
    check_decoded(decode_traces(body, PROTO, None), sdk_spans)


@pytest.mark.parametrize(
    ("ctype", "encoding"),
    [
        ("application/x-protobuf", "gzip"),
        ("application/protobuf; charset=binary", " GZIP "),
        (PROTO, "identity"),
    ],
)
def test_protobuf_variants_decode(sdk_spans: tuple[ReadableSpan, ...], ctype: str, encoding: str) -> None:
    body = encode_spans(sdk_spans).SerializeToString()
    if encoding.strip().lower() == "gzip":
        body = gzip.compress(body)
    check_decoded(decode_traces(body, ctype, encoding), sdk_spans)


def test_empty_protobuf_is_no_spans() -> None:
    assert decode_traces(b"", PROTO, None) == []


# ------------------------------------------------------------------ JSON

TRACE = "5b8efff798038103d269b633813fc60c"
SPAN = "eee19b7ec3c1b174"
PARENT = "eee19b7ec3c1b173"


def json_doc(**span_fields: Any) -> dict[str, Any]:
    span = {"traceId": TRACE, "spanId": SPAN, "name": "router chat", **span_fields}
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "router"}}]},
                "scopeSpans": [{"scope": {"name": "otelkv.fleet", "version": "1"}, "spans": [span]}],
            }
        ]
    }


def test_json_export_decodes() -> None:
    doc = json_doc(
        parentSpanId=PARENT,
        kind="SPAN_KIND_SERVER",
        startTimeUnixNano="1700000000000000000",
        endTimeUnixNano="1700000000500000000",
        status={"code": "STATUS_CODE_ERROR", "message": "decode returned 500"},
        attributes=[
            {"key": "n", "value": {"intValue": "5"}},
            {"key": "f", "value": {"doubleValue": 1.5}},
            {"key": "b", "value": {"boolValue": True}},
            {"key": "s", "value": {"stringValue": "hit"}},
            {"key": "l", "value": {"arrayValue": {"values": [{"intValue": 1}, {"stringValue": "x"}]}}},
            {"key": "m", "value": {"kvlistValue": {"values": [{"key": "k", "value": {"intValue": 2}}]}}},
            {"key": "empty", "value": {}},
        ],
        links=[{"traceId": TRACE, "spanId": PARENT}],
    )
    (record,) = decode_traces(json.dumps(doc).encode(), "application/json; charset=utf-8", None)
    assert (record.trace_id, record.span_id, record.parent_span_id) == (TRACE, SPAN, PARENT)
    assert (record.name, record.kind) == ("router chat", "Server")
    assert (record.status_code, record.status_message) == ("Error", "decode returned 500")
    assert (record.start_ns, record.end_ns, record.duration_s) == (
        1700000000000000000,
        1700000000500000000,
        0.5,
    )
    assert record.attributes == {
        "n": 5,
        "f": 1.5,
        "b": True,
        "s": "hit",
        "l": [1, "x"],
        "m": {"k": 2},
        "empty": None,
    }
    assert record.resource == {"service.name": "router"}
    assert (record.scope_name, record.scope_version) == ("otelkv.fleet", "1")
    assert record.links == [{"trace_id": TRACE, "span_id": PARENT, "attributes": {}}]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (2, "Server"),
        (3, "Client"),
        ("SPAN_KIND_INTERNAL", "Internal"),
        ("SPAN_KIND_NOPE", "Unspecified"),
        (None, "Unspecified"),
    ],
)
def test_json_kind_as_int_or_name(kind: Any, expected: str) -> None:
    (record,) = decode_traces(json.dumps(json_doc(kind=kind)).encode(), "application/json", None)
    assert record.kind == expected


def test_json_uppercase_hex_ids_are_normalized() -> None:
    (record,) = decode_traces(json.dumps(json_doc(traceId=TRACE.upper())).encode(), "application/json", None)
    assert record.trace_id == TRACE


def test_json_gzip_decodes() -> None:
    body = gzip.compress(json.dumps(json_doc()).encode())
    assert [r.span_id for r in decode_traces(body, "application/json", "gzip")] == [SPAN]


# ------------------------------------------------------------------ errors

JSON = "application/json"


def doc(**span_fields: Any) -> bytes:
    return json.dumps(json_doc(**span_fields)).encode()


BAD_INPUTS = [
    (b"garbage", PROTO, None, "body is not an OTLP ExportTraceServiceRequest protobuf"),
    (b"{not json", JSON, None, "body is not valid JSON"),
    (b"\xff\xfe", JSON, None, "body is not valid JSON"),
    (b"[1, 2]", JSON, None, "expected an object with a resourceSpans list"),
    (b'{"resourceSpans": {}}', JSON, None, "expected an object with a resourceSpans list"),
    (doc(traceId="abcd"), JSON, None, "traceId must be 32 hex characters, got 4"),
    (doc(spanId="zz" * 8), JSON, None, "spanId must be 16 hex characters, got 'zzzz"),
    (doc(parentSpanId="00" * 9), JSON, None, "parentSpanId must be 16 hex characters, got 18"),
    (doc(attributes={"a": 1}), JSON, None, "attributes must be a list of {key, value}"),
    (doc(attributes=[{"value": {}}]), JSON, None, "each attribute needs a key"),
    (b'{"resourceSpans": [1]}', JSON, None, "malformed OTLP JSON"),
    (doc(startTimeUnixNano="soon"), JSON, None, "malformed OTLP JSON: invalid literal for int()"),
    # Regression: 1e400 parses to float('inf'); int() of it raised OverflowError.
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"endTimeUnixNano": 1e400}]}]}]}', JSON, None,
     "malformed OTLP JSON: cannot convert float infinity to integer"),
    # Regression: deep nesting raised RecursionError out of json.loads.
    (b"[" * 100_000, JSON, None, "body is not valid JSON: maximum recursion depth exceeded"),
    (b"{}", "text/plain", None, "unsupported Content-Type 'text/plain'"),
    (b"{}", None, None, "unsupported Content-Type None"),
    (b"{}", JSON, "br", "unsupported Content-Encoding 'br' (use gzip, deflate or none)"),
    (b"not gzip at all", PROTO, "gzip", "body is not valid gzip"),
    (gzip.compress(b"x" * 100)[:-6], PROTO, "gzip", "body is not valid gzip"),
    (b"not deflate", JSON, "deflate", "body is not valid deflate"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "ctype", "encoding", "message"), BAD_INPUTS)
def test_bad_input_raises_decode_error(
    body: bytes, ctype: str | None, encoding: str | None, message: str
) -> None:
    with pytest.raises(OtlpDecodeError) as info:
        decode_traces(body, ctype, encoding)
    assert type(info.value) is OtlpDecodeError
    assert str(info.value).startswith(message)


def test_infinite_kind_is_unspecified_not_a_crash() -> None:
    body = b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"kind": 1e400}]}]}]}'
    assert [r.kind for r in decode_traces(body, "application/json", None)] == ["Unspecified"]
