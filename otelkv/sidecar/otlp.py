"""Decoding OTLP trace exports (HTTP, protobuf and JSON) into flat span records.

Used by the OTLP receivers of the sidecar and of the reference fleet. Bad input
raises :class:`OtlpDecodeError` with a message a client can act on; it never crashes the
receiving process.

The JSON mapping follows the OTLP/HTTP specification: trace and span ids are hex
strings (not base64 as generic protobuf JSON would have them), enum fields may be
integers or names, 64-bit integers may be strings.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from otelkv.spans import SpanRecord

MAX_DECOMPRESSED_BYTES = 64 * 1024 * 1024
"""Refuse exports that inflate beyond this (zip-bomb guard)."""

_SPAN_KINDS = {0: "Unspecified", 1: "Internal", 2: "Server", 3: "Client", 4: "Producer", 5: "Consumer"}
_STATUS_CODES = {0: "Unset", 1: "Ok", 2: "Error"}
_KIND_NAMES = {f"SPAN_KIND_{v.upper()}": k for k, v in _SPAN_KINDS.items()}
_STATUS_NAMES = {f"STATUS_CODE_{v.upper()}": k for k, v in _STATUS_CODES.items()}


MAX_TIME_NS = 2**63 - 1
"""Timestamps past this (year 2262) are refused: the store keeps signed 64-bit nanoseconds,
and one such span would fail the whole batch it is written with."""
_INT64 = (-(2**63), 2**63 - 1)


class OtlpDecodeError(ValueError):
    """The body is not a valid OTLP trace export; ``status`` is the HTTP answer the OTLP/HTTP
    spec asks for (400 bad data, 413 too large, 415 unsupported media type or encoding)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def decompress(body: bytes, encoding: str | None, limit: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    """Inflate a gzip/deflate body, refusing to produce more than ``limit`` bytes.

    Inflation stops at the limit, so a zip bomb costs at most ``limit`` bytes of memory.
    """
    encoding = (encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding == "gzip":
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        inflater = zlib.decompressobj()
    else:
        raise OtlpDecodeError(
            f"unsupported Content-Encoding {encoding!r} (use gzip, deflate or none)", status=415
        )
    try:
        out = inflater.decompress(body, limit + 1)
        if len(out) > limit:
            raise OtlpDecodeError(f"decompressed body larger than {limit} bytes", status=413)
        if not inflater.eof:
            raise OtlpDecodeError(f"body is not valid {encoding}: truncated stream")
    except zlib.error as exc:
        raise OtlpDecodeError(f"body is not valid {encoding}: {exc}") from None
    return out


# ------------------------------------------------------------------ protobuf


def _any_value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    if which == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, which)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in kvs}


def _time_ns(value: Any, what: str) -> int:
    """An OTLP timestamp the store can hold (JSON: number or decimal string)."""
    ns = int(value or 0)
    if not 0 <= ns <= MAX_TIME_NS:
        raise OtlpDecodeError(f"{what} out of range (0 to {MAX_TIME_NS} ns): {str(value)[:40]}")
    return ns


def _id_bytes(value: bytes, nbytes: int, what: str) -> str:
    """A protobuf trace/span id as hex: exactly ``nbytes`` long, or empty (no parent)."""
    if value and len(value) != nbytes:
        raise OtlpDecodeError(f"{what} must be {nbytes} bytes, got {len(value)}")
    return value.hex()


def decode_protobuf(body: bytes) -> list[SpanRecord]:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise OtlpDecodeError(f"body is not an OTLP ExportTraceServiceRequest protobuf: {exc}") from None
    out: list[SpanRecord] = []
    for resource_spans in request.resource_spans:
        resource = _attrs(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope
            for span in scope_spans.spans:
                out.append(
                    SpanRecord(
                        trace_id=_id_bytes(span.trace_id, 16, "traceId"),
                        span_id=_id_bytes(span.span_id, 8, "spanId"),
                        parent_span_id=_id_bytes(span.parent_span_id, 8, "parentSpanId"),
                        name=span.name,
                        kind=_SPAN_KINDS.get(span.kind, "Unspecified"),
                        start_ns=_time_ns(span.start_time_unix_nano, "startTimeUnixNano"),
                        end_ns=_time_ns(span.end_time_unix_nano, "endTimeUnixNano"),
                        attributes=_attrs(span.attributes),
                        resource=resource,
                        scope_name=scope.name,
                        scope_version=scope.version,
                        status_code=_STATUS_CODES.get(span.status.code, "Unset"),
                        status_message=span.status.message,
                        trace_state=span.trace_state,
                        events=[
                            {
                                "time_ns": _time_ns(e.time_unix_nano, "event timeUnixNano"),
                                "name": e.name,
                                "attributes": _attrs(e.attributes),
                            }
                            for e in span.events
                        ],
                        links=[
                            {
                                "trace_id": _id_bytes(link.trace_id, 16, "link traceId"),
                                "span_id": _id_bytes(link.span_id, 8, "link spanId"),
                                "attributes": _attrs(link.attributes),
                            }
                            for link in span.links
                        ],
                    )
                )
    return out


# ------------------------------------------------------------------ JSON


def _json_any(value: Any) -> Any:
    if not isinstance(value, dict) or not value:
        return None
    (key, inner), *_ = value.items()
    if key == "stringValue":
        return str(inner)
    if key == "boolValue":
        return bool(inner)
    if key == "intValue":
        number = int(inner)
        if not _INT64[0] <= number <= _INT64[1]:
            raise OtlpDecodeError(f"intValue out of the int64 range: {str(inner)[:40]}")
        return number
    if key == "doubleValue":
        return float(inner)
    if key == "bytesValue":
        # Protobuf JSON carries bytes as base64; report them as hex like the protobuf path.
        try:
            return base64.b64decode(str(inner), validate=True).hex()
        except (binascii.Error, ValueError):
            raise OtlpDecodeError("bytesValue must be base64") from None
    if key == "arrayValue":
        return [_json_any(v) for v in (inner or {}).get("values", [])]
    if key == "kvlistValue":
        return _json_attrs((inner or {}).get("values", []))
    return None


def _json_attrs(kvs: Any) -> dict[str, Any]:
    if not isinstance(kvs, list):
        raise OtlpDecodeError("attributes must be a list of {key, value}")
    out: dict[str, Any] = {}
    for kv in kvs:
        if not isinstance(kv, dict) or "key" not in kv:
            raise OtlpDecodeError("each attribute needs a key")
        out[str(kv["key"])] = _json_any(kv.get("value"))
    return out


def _hex_id(value: Any, nbytes: int, what: str) -> str:
    text = str(value or "")
    if not text:
        return ""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise OtlpDecodeError(f"{what} must be {nbytes * 2} hex characters, got {text[:40]!r}") from None
    if len(raw) != nbytes:
        raise OtlpDecodeError(f"{what} must be {nbytes * 2} hex characters, got {len(text)}")
    return raw.hex()


def _enum(value: Any, by_name: dict[str, int]) -> int:
    if isinstance(value, str):
        return by_name.get(value, 0)
    try:
        return int(value or 0)
    except (TypeError, ValueError, OverflowError):
        return 0


def decode_json(body: bytes) -> list[SpanRecord]:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise OtlpDecodeError(f"body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans", []), list):
        raise OtlpDecodeError("expected an object with a resourceSpans list")
    out: list[SpanRecord] = []
    try:
        for rs in doc.get("resourceSpans", []):
            resource = _json_attrs((rs.get("resource") or {}).get("attributes", []))
            for ss in rs.get("scopeSpans", []):
                scope = ss.get("scope") or {}
                for span in ss.get("spans", []):
                    status = span.get("status") or {}
                    out.append(
                        SpanRecord(
                            trace_id=_hex_id(span.get("traceId"), 16, "traceId"),
                            span_id=_hex_id(span.get("spanId"), 8, "spanId"),
                            parent_span_id=_hex_id(span.get("parentSpanId"), 8, "parentSpanId"),
                            name=str(span.get("name", "")),
                            kind=_SPAN_KINDS.get(_enum(span.get("kind"), _KIND_NAMES), "Unspecified"),
                            start_ns=_time_ns(span.get("startTimeUnixNano"), "startTimeUnixNano"),
                            end_ns=_time_ns(span.get("endTimeUnixNano"), "endTimeUnixNano"),
                            attributes=_json_attrs(span.get("attributes", [])),
                            resource=resource,
                            scope_name=str(scope.get("name", "")),
                            scope_version=str(scope.get("version", "")),
                            status_code=_STATUS_CODES.get(_enum(status.get("code"), _STATUS_NAMES), "Unset"),
                            status_message=str(status.get("message", "")),
                            trace_state=str(span.get("traceState", "")),
                            events=[
                                {
                                    "time_ns": _time_ns(e.get("timeUnixNano"), "event timeUnixNano"),
                                    "name": str(e.get("name", "")),
                                    "attributes": _json_attrs(e.get("attributes", [])),
                                }
                                for e in span.get("events", [])
                            ],
                            links=[
                                {
                                    "trace_id": _hex_id(link.get("traceId"), 16, "link traceId"),
                                    "span_id": _hex_id(link.get("spanId"), 8, "link spanId"),
                                    "attributes": _json_attrs(link.get("attributes", [])),
                                }
                                for link in span.get("links", [])
                            ],
                        )
                    )
    except (AttributeError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        if isinstance(exc, OtlpDecodeError):
            raise
        raise OtlpDecodeError(f"malformed OTLP JSON: {exc}") from None
    return out


def decode_traces(body: bytes, content_type: str | None, content_encoding: str | None) -> list[SpanRecord]:
    """Decode one OTLP/HTTP traces export by its content type."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype in ("application/x-protobuf", "application/protobuf"):
        return decode_protobuf(decompress(body, content_encoding))
    if ctype == "application/json":
        return decode_json(decompress(body, content_encoding))
    raise OtlpDecodeError(
        f"unsupported Content-Type {content_type!r}: use application/x-protobuf or application/json",
        status=415,
    )
