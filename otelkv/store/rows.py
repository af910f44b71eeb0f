"""Span records <-> ``otel_traces`` rows, with attribute values stored the exporter's way.

The contrib exporter stores every attribute as ``pcommon.Value.AsString()``: strings as-is,
booleans ``true``/``false``, integers in decimal, doubles as Go's
``strconv.FormatFloat(v, 'f', -1, 64)`` (shortest round-trip digits, never an exponent),
bytes base64, arrays and maps as JSON. We render the same way so a row written by otelkv
and one written by the collector read identically.

Reading back, attribute values therefore stay **strings** (``"12"``, ``"true"``): the
``Map(LowCardinality(String), String)`` columns have lost the type. Use :func:`attr_int`,
:func:`attr_float`, :func:`attr_bool` and :func:`attr_str`, which accept both the native
values of in-memory spans and the stored strings, and never raise.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any, TypeVar

from otelkv.sidecar.otlp import SpanRecord

SPAN_SELECT = """\
toUnixTimestamp64Nano(Timestamp) AS StartNs,
TraceId, SpanId, ParentSpanId, TraceState, SpanName, SpanKind, ServiceName,
ResourceAttributes, ScopeName, ScopeVersion, SpanAttributes, Duration, StatusCode, StatusMessage,
arrayMap(t -> toUnixTimestamp64Nano(t), Events.Timestamp) AS EventsNs,
Events.Name AS EventsName, Events.Attributes AS EventsAttributes,
Links.TraceId AS LinksTraceId, Links.SpanId AS LinksSpanId,
Links.TraceState AS LinksTraceState, Links.Attributes AS LinksAttributes"""
"""Select list whose rows :func:`row_to_span` reads (nanosecond integers, no time zones)."""

_T = TypeVar("_T")


def format_float(value: float) -> str:
    """Go's ``strconv.FormatFloat(v, 'f', -1, 64)``: shortest digits, fixed notation."""
    text = repr(value)
    if "e" in text:
        return format(Decimal(text).normalize(), "f")
    if text[-2:] == ".0":
        return text[:-2]
    if text[-1] in "nf":  # nan, inf, -inf
        return "NaN" if text == "nan" else "+Inf" if text == "inf" else "-Inf"
    return text


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return str(value)


def attr_value(value: Any) -> str:
    """One attribute value as the exporter stores it (``pcommon.Value.AsString``)."""
    t = type(value)
    if t is str:
        return value
    if t is bool:
        return "true" if value else "false"
    if t is int:
        return str(value)
    if t is float:
        return format_float(value)
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=_json_default)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return format_float(float(value))
    return str(value)


def attr_map(attrs: Mapping[str, Any] | None) -> dict[str, str]:
    """An attribute dict as ``Map(String, String)`` content."""
    if not attrs:
        return {}
    out: dict[str, str] = {}
    for k, v in attrs.items():
        out[k if type(k) is str else str(k)] = v if type(v) is str else attr_value(v)
    return out


def span_to_row(span: SpanRecord) -> tuple[Any, ...]:
    """Values in :data:`otelkv.store.schema.COLUMNS` order (Timestamp as integer ns since epoch)."""
    events = span.events or ()
    links = span.links or ()
    return (
        int(span.start_ns),
        span.trace_id,
        span.span_id,
        span.parent_span_id,
        span.trace_state,
        span.name,
        span.kind,
        attr_value(span.resource.get("service.name", "")) if span.resource else "",
        attr_map(span.resource),
        span.scope_name,
        span.scope_version,
        attr_map(span.attributes),
        max(0, int(span.end_ns) - int(span.start_ns)),
        span.status_code,
        span.status_message,
        [int(e.get("time_ns", 0)) for e in events],
        [str(e.get("name", "")) for e in events],
        [attr_map(e.get("attributes")) for e in events],
        [str(link.get("trace_id", "")) for link in links],
        [str(link.get("span_id", "")) for link in links],
        [str(link.get("trace_state", "")) for link in links],
        [attr_map(link.get("attributes")) for link in links],
    )


def _int(value: Any) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            return _parse_datetime_ns(text)
    return int(value or 0)


def _parse_datetime_ns(text: str) -> int:
    """``2024-01-02 03:04:05.123456789`` (UTC, as ClickHouse prints DateTime64(9)) to ns."""
    whole, _, frac = text.partition(".")
    dt = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    return int(dt.timestamp()) * 1_000_000_000 + int((frac + "000000000")[:9] or 0)


def _smap(value: Any) -> dict[str, Any]:
    return dict(value) if value else {}


def row_to_span(row: Mapping[str, Any]) -> SpanRecord:
    """A row selected with :data:`SPAN_SELECT` back to a :class:`SpanRecord`.

    Attribute values (span, resource, event, link) come back as strings; see the module doc.
    Rows from ``SELECT *`` (``Timestamp`` text, ``Events.Timestamp``...) are accepted too.
    """
    start = _int(row["StartNs"] if "StartNs" in row else row.get("Timestamp", 0))
    duration = _int(row.get("Duration", 0))
    ev_ts = row.get("EventsNs", row.get("Events.Timestamp")) or []
    ev_names = row.get("EventsName", row.get("Events.Name")) or []
    ev_attrs = row.get("EventsAttributes", row.get("Events.Attributes")) or []
    l_trace = row.get("LinksTraceId", row.get("Links.TraceId")) or []
    l_span = row.get("LinksSpanId", row.get("Links.SpanId")) or []
    l_state = row.get("LinksTraceState", row.get("Links.TraceState")) or []
    l_attrs = row.get("LinksAttributes", row.get("Links.Attributes")) or []
    events = [
        {
            "time_ns": _int(t),
            "name": ev_names[i] if i < len(ev_names) else "",
            "attributes": _smap(ev_attrs[i] if i < len(ev_attrs) else None),
        }
        for i, t in enumerate(ev_ts)
    ]
    links = [
        {
            "trace_id": tid,
            "span_id": l_span[i] if i < len(l_span) else "",
            "trace_state": l_state[i] if i < len(l_state) else "",
            "attributes": _smap(l_attrs[i] if i < len(l_attrs) else None),
        }
        for i, tid in enumerate(l_trace)
    ]
    return SpanRecord(
        trace_id=row.get("TraceId", ""),
        span_id=row.get("SpanId", ""),
        parent_span_id=row.get("ParentSpanId", ""),
        name=row.get("SpanName", ""),
        kind=row.get("SpanKind", ""),
        start_ns=start,
        end_ns=start + duration,
        attributes=_smap(row.get("SpanAttributes")),
        resource=_smap(row.get("ResourceAttributes")),
        scope_name=row.get("ScopeName", ""),
        scope_version=row.get("ScopeVersion", ""),
        status_code=row.get("StatusCode", "Unset"),
        status_message=row.get("StatusMessage", ""),
        trace_state=row.get("TraceState", ""),
        events=events,
        links=links,
    )


# ------------------------------------------------------------------ typed getters

_TRUE = {"true", "1", "yes", "on", "t"}
_FALSE = {"false", "0", "no", "off", "f", ""}


def attr_str(attrs: Mapping[str, Any] | None, key: str, default: str = "") -> str:
    """A string attribute; non-strings rendered like the exporter (``True`` -> ``"true"``)."""
    if not attrs:
        return default
    value = attrs.get(key)
    if value is None:
        return default
    try:
        return value if isinstance(value, str) else attr_value(value)
    except Exception:  # noqa: BLE001 - a getter must never raise
        return default


def _coerce(attrs: Mapping[str, Any] | None, key: str, default: _T, convert: Callable[[Any], _T]) -> _T:
    """``convert(attrs[key])``, or ``default`` when the key is missing, None or not convertible.

    The one shape of the numeric getters: stored rows hold text, live spans native values,
    and a bad attribute must never raise out of an analysis.
    """
    value = attrs.get(key) if attrs else None
    if value is None:
        return default
    try:
        return convert(value)
    except (ValueError, TypeError, OverflowError):  # NaN/inf -> int raise too
        return default


def _to_int(value: Any) -> int:
    if isinstance(value, (int, float)):  # bool included: True -> 1
        return int(value)
    text = str(value).strip()
    try:
        return int(text)  # exact for big ints, which a float would round
    except ValueError:
        return int(float(text))


def _to_float(value: Any) -> float:
    return float(value if isinstance(value, (int, float)) else str(value).strip())


def attr_int(attrs: Mapping[str, Any] | None, key: str, default: int = 0) -> int:
    """An integer attribute from ``12``, ``"12"``, ``12.0`` or ``"12.0"``; bad/missing -> default."""
    return _coerce(attrs, key, default, _to_int)


def attr_float(attrs: Mapping[str, Any] | None, key: str, default: float = 0.0) -> float:
    """A float attribute from ``1.5`` or ``"1.5"`` (also ``"NaN"``/``"+Inf"``); bad/missing -> default."""
    return _coerce(attrs, key, default, _to_float)


def attr_bool(attrs: Mapping[str, Any] | None, key: str, default: bool = False) -> bool:
    """A boolean attribute from ``True`` or ``"true"``/``"false"`` (also 1/0); else default."""
    value = attrs.get(key) if attrs else None
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE and text != "":
            return False
    return default
