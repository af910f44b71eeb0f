"""A corpus of malformed and hostile OTLP exports against a real sidecar's receiver.

Per case: the exporter gets the status the OTLP/HTTP spec names (400 bad data, 413 too
large, 415 unsupported content type or encoding) with a text reason, the refusal is
counted (``otelkv_sidecar_otlp_rejected_total``), not one span of the export is accepted,
and the receiver then takes a valid export as before.
"""

from __future__ import annotations

import gzip
import http.client
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from otelkv import names
from otelkv.sidecar.app import Sidecar, SidecarConfig
from otelkv.sidecar.otlp import MAX_DECOMPRESSED_BYTES
from otelkv.sidecar.receiver import MAX_OTLP_BODY_BYTES
from otelkv.spans import SpanRecord

PROTO = "application/x-protobuf"
JSON = "application/json"
TRACE = "5b8efff798038103d269b633813fc60c"
SPAN = "eee19b7ec3c1b174"


def export(**span_fields: Any) -> ExportTraceServiceRequest:
    """A one-span protobuf export; ``span_fields`` override the span's fields."""
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id = bytes.fromhex(TRACE)
    span.span_id = bytes.fromhex(SPAN)
    span.name = "ok"
    span.start_time_unix_nano, span.end_time_unix_nano = 1, 2
    for key, value in span_fields.items():
        setattr(span, key, value)
    return request


VALID_PROTO = export().SerializeToString()


def json_export(**span_fields: Any) -> bytes:
    span = {"traceId": TRACE, "spanId": SPAN, "name": "ok", **span_fields}
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()


def with_attribute(value: AnyValue, key: str = "k") -> bytes:
    request = export()
    kv = request.resource_spans[0].scope_spans[0].spans[0].attributes.add()
    kv.key = key
    kv.value.CopyFrom(value)
    return request.SerializeToString()


def nested_any(depth: int) -> AnyValue:
    value = AnyValue(string_value="leaf")
    for _ in range(depth):
        outer = AnyValue()
        outer.array_value.values.add().CopyFrom(value)
        value = outer
    return value


def patched(data: bytes, old: bytes, new: bytes) -> bytes:
    """``data`` with one byte run replaced (to break a string's UTF-8 after encoding)."""
    assert data.count(old) == 1
    return data.replace(old, new)


def json_attr(value: Any) -> bytes:
    return json_export(attributes=[{"key": "k", "value": value}])


@dataclass(frozen=True)
class Case:
    id: str
    body: Callable[[], bytes]
    """Built lazily: some are large, and collection should stay cheap."""
    ctype: str | None
    status: int
    message: str
    encoding: str | None = None


def case(
    id_: str, body: bytes | Callable[[], bytes], ctype: str | None, status: int, message: str, **kw: Any
) -> Case:
    return Case(id_, body if callable(body) else (lambda: body), ctype, status, message, **kw)


CORPUS = [
    # -- protobuf garbage
    case("protobuf-random-bytes", b"\xff\xff\xff garbage", PROTO, 400, "not an OTLP ExportTraceServiceRequest"),
    case("protobuf-truncated", VALID_PROTO[: len(VALID_PROTO) // 2], PROTO, 400, "not an OTLP"),
    case("protobuf-invalid-wire-type", b"\x0f\x00", PROTO, 400, "not an OTLP"),
    case("protobuf-length-beyond-body", b"\x0a\xff\xff\xff\x0f" + b"\x00" * 8, PROTO, 400, "not an OTLP"),
    case("protobuf-invalid-utf8-span-name", patched(export(name="n\x01me").SerializeToString(), b"n\x01me", b"n\xffme"),
         PROTO, 400, "not an OTLP"),
    case("protobuf-invalid-utf8-attribute-value", patched(with_attribute(AnyValue(string_value="v@lue")), b"v@lue", b"v\xc3lue"),
         PROTO, 400, "not an OTLP"),
    case("protobuf-invalid-utf8-attribute-key", patched(with_attribute(AnyValue(int_value=1), key="k@y"), b"k@y", b"k\x80y"),
         PROTO, 400, "not an OTLP"),
    case("protobuf-nesting-beyond-recursion-limit", lambda: with_attribute(nested_any(150)), PROTO, 400, "not an OTLP"),
    case("protobuf-trace-id-wrong-length", export(trace_id=b"\x01\x02\x03").SerializeToString(), PROTO, 400,
         "traceId must be 16 bytes, got 3"),
    case("protobuf-span-id-wrong-length", export(span_id=b"\x01" * 9).SerializeToString(), PROTO, 400,
         "spanId must be 8 bytes, got 9"),
    case("protobuf-parent-id-wrong-length", export(parent_span_id=b"\x01").SerializeToString(), PROTO, 400,
         "parentSpanId must be 8 bytes"),
    case("protobuf-start-time-past-int64", export(start_time_unix_nano=2**64 - 1).SerializeToString(), PROTO, 400,
         "startTimeUnixNano out of range"),
    case("protobuf-json-body", json_export(), PROTO, 400, "not an OTLP"),
    # -- JSON garbage and wrong types
    case("json-broken", b'{"resourceSpans": [', JSON, 400, "body is not valid JSON"),
    case("json-invalid-utf8", b'{"resourceSpans": [], "x": "\xff\xfe"}', JSON, 400, "body is not valid JSON"),
    case("json-empty-body", b"", JSON, 400, "body is not valid JSON"),
    case("json-top-level-array", b"[1, 2]", JSON, 400, "expected an object with a resourceSpans list"),
    case("json-resource-spans-object", b'{"resourceSpans": {}}', JSON, 400, "expected an object"),
    case("json-resource-spans-null-items", b'{"resourceSpans": [null]}', JSON, 400, "malformed OTLP JSON"),
    case("json-spans-a-string", b'{"resourceSpans": [{"scopeSpans": [{"spans": "abc"}]}]}', JSON, 400,
         "malformed OTLP JSON"),
    case("json-attributes-an-object", json_export(attributes={"k": 1}), JSON, 400, "attributes must be a list"),
    case("json-attribute-without-key", json_export(attributes=[{"value": {}}]), JSON, 400, "each attribute needs a key"),
    case("json-trace-id-not-hex", json_export(traceId="zz" * 16), JSON, 400, "traceId must be 32 hex characters"),
    case("json-trace-id-base64", json_export(traceId="W47/95gDgQPSabYzgT/GDA=="), JSON, 400, "traceId must be 32 hex"),
    case("json-span-id-wrong-length", json_export(spanId="ab"), JSON, 400, "spanId must be 16 hex characters, got 2"),
    case("json-int-value-not-a-number", json_attr({"intValue": "twelve"}), JSON, 400, "malformed OTLP JSON"),
    case("json-int-value-past-int64", json_attr({"intValue": str(2**63)}), JSON, 400, "intValue out of the int64 range"),
    case("json-int-value-4301-digits", json_attr({"intValue": "9" * 4301}), JSON, 400, "malformed OTLP JSON"),
    case("json-bytes-value-not-base64", json_attr({"bytesValue": "%%%"}), JSON, 400, "bytesValue must be base64"),
    case("json-array-value-not-a-list", json_attr({"arrayValue": {"values": 5}}), JSON, 400, "malformed OTLP JSON"),
    case("json-start-time-negative", json_export(startTimeUnixNano="-1"), JSON, 400, "startTimeUnixNano out of range"),
    case("json-end-time-infinite", json_export(endTimeUnixNano=float("inf")).replace(b"Infinity", b"1e400"), JSON, 400,
         "malformed OTLP JSON"),
    case("json-time-a-float-past-int64", json_export(startTimeUnixNano=1e30), JSON, 400, "startTimeUnixNano out of range"),
    case("json-event-not-an-object", json_export(events=[5]), JSON, 400, "malformed OTLP JSON"),
    case("json-link-trace-id-bad", json_export(links=[{"traceId": "x", "spanId": SPAN}]), JSON, 400,
         "link traceId must be 32 hex"),
    case("json-nesting-beyond-parser-depth", b'{"resourceSpans": ' + b"[" * 100_000, JSON, 400, "body is not valid JSON"),
    case("json-protobuf-body", VALID_PROTO, JSON, 400, "body is not valid JSON"),
    # -- media types and encodings
    case("content-type-text-plain", VALID_PROTO, "text/plain", 415, "unsupported Content-Type 'text/plain'"),
    case("content-type-missing", VALID_PROTO, None, 415, "unsupported Content-Type"),
    case("content-type-multipart", VALID_PROTO, "multipart/form-data; boundary=x", 415, "unsupported Content-Type"),
    case("content-type-lookalike", VALID_PROTO, "application/x-protobuf-ish", 415, "unsupported Content-Type"),
    case("content-encoding-brotli", VALID_PROTO, PROTO, 415, "unsupported Content-Encoding 'br'", encoding="br"),
    case("content-encoding-stacked", VALID_PROTO, PROTO, 415, "unsupported Content-Encoding", encoding="gzip, gzip"),
    case("gzip-not-gzip", b"plain bytes", PROTO, 400, "body is not valid gzip", encoding="gzip"),
    case("gzip-truncated", gzip.compress(VALID_PROTO)[:-6], PROTO, 400, "body is not valid gzip", encoding="gzip"),
    case("gzip-wrapping-garbage", gzip.compress(b"\xff\xff garbage"), PROTO, 400, "not an OTLP", encoding="gzip"),
    case("deflate-garbage", b"not deflate", JSON, 400, "body is not valid deflate", encoding="deflate"),
    # -- too large
    case("gzip-bomb", lambda: gzip.compress(b"\0" * (MAX_DECOMPRESSED_BYTES + 1024), 1), PROTO, 413,
         "decompressed body larger than", encoding="gzip"),
    case("deflate-bomb", lambda: zlib.compress(b"{" * (MAX_DECOMPRESSED_BYTES + 1024), 1), JSON, 413,
         "decompressed body larger than", encoding="deflate"),
    case("body-over-limit", lambda: b"\0" * (MAX_OTLP_BODY_BYTES + 1), PROTO, 413, "OTLP export over"),
]  # fmt: skip


class Taps:
    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []

    def __call__(self, spans: list[SpanRecord]) -> None:
        self.spans.extend(spans)


@pytest.fixture(scope="module")
def sidecar() -> Iterator[tuple[Sidecar, Taps]]:
    # Nothing listens upstream: only the admin listener is exercised here.
    sc = Sidecar(
        SidecarConfig(upstream="http://127.0.0.1:9", port=0, admin_port=0, store=False, token=None)
    ).start()
    taps = Taps()
    sc.pipeline.taps.append(taps)
    yield sc, taps
    sc.stop()


def post(sc: Sidecar, body: bytes, ctype: str | None, encoding: str | None = None) -> tuple[int, str, bytes]:
    host, port = sc.admin_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        headers = {"Content-Length": str(len(body))}
        if ctype is not None:
            headers["Content-Type"] = ctype
        if encoding is not None:
            headers["Content-Encoding"] = encoding
        conn.putrequest("POST", "/v1/traces", skip_accept_encoding=True)
        for key, value in headers.items():
            conn.putheader(key, value.encode("latin-1"))
        conn.endheaders()
        try:
            conn.send(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it was all read; the answer is still there to read
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


REJECTED_REASON = {400: "malformed", 413: "too_large", 415: "media_type"}
"""The ``reason`` label docs/telemetry.md gives each status an export is refused with."""


def rejected(sc: Sidecar) -> dict[str, float]:
    metric = names.METRIC_SIDECAR_OTLP_REJECTED + "_total"
    return {
        reason: sc.metrics.registry.get_sample_value(metric, {"reason": reason}) or 0.0
        for reason in REJECTED_REASON.values()
    }


def test_corpus_is_large_and_ids_are_unique() -> None:
    ids = [c.id for c in CORPUS]
    assert len(ids) == len(set(ids)) and len(ids) >= 45


@pytest.mark.parametrize("bad", CORPUS, ids=[c.id for c in CORPUS])
def test_bad_export_is_refused_counted_and_stores_nothing(bad: Case, sidecar: tuple[Sidecar, Taps]) -> None:
    sc, taps = sidecar
    before, accepted = rejected(sc), len(taps.spans)
    status, ctype, text = post(sc, bad.body(), bad.ctype, bad.encoding)
    assert status == bad.status, text[:300]
    assert ctype.startswith("text/plain") and bad.message in text.decode(), text[:300]
    reason = REJECTED_REASON[bad.status]
    after = {**before, reason: before[reason] + 1}
    assert rejected(sc) == after
    assert len(taps.spans) == accepted, "a refused export was (partly) accepted"
    # The receiver still takes a valid export, in both encodings.
    assert post(sc, VALID_PROTO, PROTO)[0] == 200
    assert post(sc, json_export(), JSON)[:3:2] == (200, b"{}")
    assert [s.span_id for s in taps.spans[accepted:]] == [SPAN, SPAN]
    assert rejected(sc) == after


def test_giant_attribute_value_within_the_body_cap_is_kept_whole(sidecar: tuple[Sidecar, Taps]) -> None:
    """Big but valid is not bad input: the export is accepted and nothing is truncated."""
    sc, taps = sidecar
    big = "v" * (4 * 1024 * 1024)
    accepted = len(taps.spans)
    assert post(sc, with_attribute(AnyValue(string_value=big)), PROTO)[0] == 200
    assert post(sc, json_attr({"stringValue": big}), JSON)[0] == 200
    assert [s.attributes["k"] == big for s in taps.spans[accepted:]] == [True, True]


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_exports_are_inflated_once_and_accepted(
    encoding: str, sidecar: tuple[Sidecar, Taps]
) -> None:
    """Regression: the admin listener inflated gzip itself, then the decoder again (400)."""
    sc, taps = sidecar
    accepted = len(taps.spans)
    pack = gzip.compress if encoding == "gzip" else zlib.compress
    assert post(sc, pack(VALID_PROTO), PROTO, encoding)[0] == 200
    assert post(sc, pack(json_export()), JSON, encoding)[0] == 200
    assert [s.span_id for s in taps.spans[accepted:]] == [SPAN, SPAN]
