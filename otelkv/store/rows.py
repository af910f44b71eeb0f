"""Span records <-> ``otel_traces`` rows, with attribute values stored the exporter's way.

The contrib exporter stores every attribute as ``pcommon.Value.AsString()``: strings as-is,
booleans ``true``/``false``, integers in decimal, doubles as Go's
``strconv.FormatFloat(v, 'f', -1, 64)`` (shortest round-trip digits, never an exponent),
bytes base64, arrays and maps as JSON. We render the same way so a row written by otelkv
and one written by the collector read identically.

Reading back, attribute values therefore stay **strings** (``"12"``, ``"true"``): the
``Map(LowCardinality(String), String)`` columns have lost the type. The getters of
:mod:`otelkv.spans.attrs` accept both the native values of in-memory spans and the stored
strings, and never raise.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from otelkv.spans import SpanRecord
from otelkv.spans.attrs import attr_map, attr_value

SPAN_SELECT = """\
toUnixTimestamp64Nano(Timestamp) AS StartNs,
TraceId, SpanId, ParentSpanId, TraceState, SpanName, SpanKind, ServiceName,
ResourceAttributes, ScopeName, ScopeVersion, SpanAttributes, Duration, StatusCode, StatusMessage,
arrayMap(t -> toUnixTimestamp64Nano(t), Events.Timestamp) AS EventsNs,
Events.Name AS EventsName, Events.Attributes AS EventsAttributes,
Links.TraceId AS LinksTraceId, Links.SpanId AS LinksSpanId,
Links.TraceState AS LinksTraceState, Links.Attributes AS LinksAttributes"""
"""Select list whose rows :func:`row_to_span` reads (nanosecond integers, no time zones)."""


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
