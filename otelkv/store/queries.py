"""The SQL the analysis needs, parameterised, for chDB and a fleet ClickHouse alike.

Every value is a ClickHouse ``{name:Type}`` parameter; only the database identifier (checked
by :func:`otelkv.store.schema.quote_ident`) is formatted into the text. Results come back
as :class:`SpanRecord` with string attribute values (see :mod:`otelkv.store.rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from otelkv import names
from otelkv.spans import SpanRecord
from otelkv.spans import sql as span_sql
from otelkv.store import schema
from otelkv.store.base import TraceStore
from otelkv.store.rows import SPAN_SELECT, row_to_span


def _tables(store: TraceStore) -> tuple[str, str]:
    db = schema.quote_ident(getattr(store, "database", "otel"))
    traces = f"{db}.{schema.quote_ident(schema.TRACES_TABLE)}"
    return traces, f"{db}.{schema.quote_ident(schema.TRACE_ID_TS_TABLE)}"


def _spans(store: TraceStore, sql: str, params: dict[str, Any]) -> list[SpanRecord]:
    return [row_to_span(row) for row in store.query(sql, params)]


def _window(where: list[str], params: dict[str, Any], since_ns: int | None, until_ns: int | None) -> None:
    """Add ``since_ns <= Timestamp < until_ns`` (either bound optional) to ``where``."""
    if since_ns is not None:
        where.append("Timestamp >= fromUnixTimestamp64Nano({since_ns:Int64})")
        params["since_ns"] = int(since_ns)
    if until_ns is not None:
        where.append("Timestamp < fromUnixTimestamp64Nano({until_ns:Int64})")
        params["until_ns"] = int(until_ns)


def turn_spans(
    store: TraceStore,
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    limit: int | None = 20,
    slowest_first: bool = True,
    conversation_id: str | None = None,
) -> list[SpanRecord]:
    """Turn spans (:data:`otelkv.spans.sql.TURN_SPANS`) starting in ``[since_ns, until_ns)``,
    one per trace: the sidecar's when an agent's own chat span shares its trace, else the
    earliest (the lowest span id breaks an exact tie).

    Slowest first by ``otelkv.turn.total_s`` (the span's duration when that is absent or 0);
    with ``conversation_id``, that conversation's turns in time order instead. ``limit=None``
    returns all.
    """
    if conversation_id is None and slowest_first and limit is not None:
        return _slowest_turn_spans(store, since_ns, until_ns, max(0, int(limit)))
    table, where = _tables(store)[0], [span_sql.TURN_SPANS]
    params: dict[str, Any] = {"sidecar_scope": names.SCOPE_SIDECAR}
    _window(where, params, since_ns, until_ns)
    if conversation_id is not None:
        where.append("SpanAttributes[{conv_key:String}] = {conversation_id:String}")
        params.update(conv_key=names.GEN_AI_CONVERSATION_ID, conversation_id=conversation_id)
        order = "StartNs ASC, SpanId"
    else:
        order = f"{span_sql.TURN_LATENCY_S} {'DESC' if slowest_first else 'ASC'}, StartNs ASC"
    one_per_trace = (
        f"SELECT {SPAN_SELECT}\nFROM {table}\nWHERE {' AND '.join(where)}\n"
        "ORDER BY ScopeName = {sidecar_scope:String} DESC, Timestamp ASC, SpanId ASC\nLIMIT 1 BY TraceId"
    )
    sql = f"SELECT *\nFROM (\n{one_per_trace}\n)\nORDER BY {order}"
    if limit is not None:
        sql += "\nLIMIT {limit:UInt64}"
        params["limit"] = max(0, int(limit))
    return _spans(store, sql, params)


def _slowest_turn_spans(
    store: TraceStore, since_ns: int | None, until_ns: int | None, limit: int
) -> list[SpanRecord]:
    """:func:`turn_spans` slowest first, ``limit`` of them, read in two steps.

    Picking one span per trace before ordering (``LIMIT 1 BY TraceId`` over every turn span
    of the window) sorts every turn span of the window as whole rows, attribute maps and
    all (seconds on a store of a million turns); instead, the ``ask`` slowest turn spans
    come first, as trace id and latency only, then every turn span of those traces, whole. Each trace's
    span is picked as :func:`otelkv.spans.kinds.turn_rank` picks it, and a picked span among
    the ``ask`` slowest outranks every span outside them: when ``limit`` picked spans are
    among them, they are the answer; otherwise ``ask`` grows. A window with fewer than
    ``ask`` turn spans was read whole.
    """
    if limit == 0:
        return []
    table, _ = _tables(store)
    where = [span_sql.TURN_SPANS]
    params: dict[str, Any] = {}
    _window(where, params, since_ns, until_ns)
    latency, cond = span_sql.TURN_LATENCY_S, " AND ".join(where)
    ask = 2 * limit + 8
    while True:
        params["ask"] = ask
        slowest = store.query(
            f"SELECT TraceId, SpanId, toUnixTimestamp64Nano(Timestamp) AS StartNs, {latency} AS Latency\n"
            f"FROM {table}\nWHERE {cond}\nORDER BY Latency DESC, StartNs ASC\nLIMIT {{ask:UInt64}}",
            params,
        )
        ranked = {(r["TraceId"], r["SpanId"], int(r["StartNs"])) for r in slowest}
        rows = store.query(
            f"SELECT {SPAN_SELECT}, {latency} AS Latency\nFROM {table}\n"
            f"WHERE {cond} AND TraceId IN {{trace_ids:Array(String)}}",
            {**params, "trace_ids": sorted({r["TraceId"] for r in slowest})},
        )
        picked: dict[str, dict[str, Any]] = {}
        for row in sorted(rows, key=_turn_row_rank):
            picked.setdefault(row["TraceId"], row)
        whole = len(slowest) < ask
        found = [
            r for r in picked.values() if whole or (r["TraceId"], r["SpanId"], int(r["StartNs"])) in ranked
        ]
        if whole or len(found) >= limit:
            found.sort(key=lambda r: (-float(r["Latency"]), int(r["StartNs"])))
            return [row_to_span(r) for r in found[:limit]]
        ask *= 4


def _turn_row_rank(row: dict[str, Any]) -> tuple[bool, int, str]:
    """:func:`otelkv.spans.kinds.turn_rank` of a selected row (span id breaks exact ties)."""
    return (row.get("ScopeName") != names.SCOPE_SIDECAR, int(row["StartNs"]), str(row.get("SpanId", "")))


MAX_TIME_RANGES = 32
"""Most time ranges one :func:`trace_spans` query ORs together (nearest ranges are merged)."""


def trace_spans(store: TraceStore, trace_ids: Sequence[str]) -> list[SpanRecord]:
    """Every span of ``trace_ids``, in start order.

    Like the Grafana ClickHouse plugin's trace query, the time range comes from
    ``otel_traces_trace_id_ts`` first, so the big table is read only where the traces
    live: each trace's own range (at most :data:`MAX_TIME_RANGES` ranges, the nearest
    merged), a few granules per trace wherever in the store the traces lie. Traces
    missing from the lookup (rows inserted before the view existed) are read without a
    time bound rather than vanish.
    """
    ids = sorted({t for t in trace_ids if t})
    if not ids:
        return []
    table, lookup = _tables(store)
    known = store.query(
        f"SELECT TraceId, toUnixTimestamp(min(Start)) AS Start, toUnixTimestamp(max(End)) AS End\n"
        f"FROM {lookup}\nWHERE TraceId IN {{trace_ids:Array(String)}}\nGROUP BY TraceId",
        {"trace_ids": ids},
    )
    params: dict[str, Any] = {"trace_ids": ids}
    # The lookup keeps whole seconds: a trace lies in [Start, End + 1 s).
    ranges = [(int(r["Start"]) * 10**9, (int(r["End"]) + 1) * 10**9) for r in known]
    where = [_in_ranges(ranges, params)] if ranges else []
    unknown = sorted(set(ids) - {str(r["TraceId"]) for r in known})
    if unknown:
        where.append("TraceId IN {unknown_ids:Array(String)}")
        params["unknown_ids"] = unknown
    sql = f"""\
SELECT {SPAN_SELECT}
FROM {table}
WHERE TraceId IN {{trace_ids:Array(String)}}
  AND ({" OR ".join(where)})
ORDER BY Timestamp ASC, SpanId"""
    return _spans(store, sql, params)


def _in_ranges(ranges: Sequence[tuple[int, int]], params: dict[str, Any]) -> str:
    """``Timestamp`` in one of the half-open ``ranges`` (ns; at most :data:`MAX_TIME_RANGES`,
    the nearest merged), its bounds added to ``params``; ``ranges`` must not be empty."""
    ors = []
    for i, (lo, hi) in enumerate(merge_ranges(ranges, MAX_TIME_RANGES)):
        ors.append(
            f"(Timestamp >= fromUnixTimestamp64Nano({{lo{i}:Int64}}) "
            f"AND Timestamp < fromUnixTimestamp64Nano({{hi{i}:Int64}}))"
        )
        params.update({f"lo{i}": lo, f"hi{i}": hi})
    return f"({' OR '.join(ors)})"


def merge_ranges(ranges: Sequence[tuple[int, int]], most: int) -> list[tuple[int, int]]:
    """Half-open ranges merged where they overlap or touch, then across the smallest gaps
    until at most ``most`` are left (every input point stays covered)."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    if len(merged) <= most:
        return merged
    # Keep the widest gaps as the breaks between ranges.
    gaps = sorted(range(1, len(merged)), key=lambda i: merged[i][0] - merged[i - 1][1], reverse=True)
    breaks = sorted(gaps[: max(most, 1) - 1])
    out, start = [], 0
    for b in [*breaks, len(merged)]:
        out.append((merged[start][0], max(hi for _, hi in merged[start:b])))
        start = b
    return out


def tool_spans(
    store: TraceStore,
    *,
    since_ns: int,
    until_ns: int,
    conversation_id: str | None = None,
    conversation_ids: Sequence[str] | None = None,
    windows: Sequence[tuple[int, int]] | None = None,
) -> list[SpanRecord]:
    """``execute_tool {name}`` spans overlapping ``[since_ns, until_ns]``, in start order;
    with ``windows``, only those overlapping one of these ``[lo, hi]`` too (at most
    :data:`MAX_TIME_RANGES` are queried, the nearest merged: never fewer spans).

    Filter by one conversation or several (``otelkv slow`` asks for the tool spans of its
    turns' conversations only: a window spanning days holds far more).

    The overlap is a PREWHERE on the timestamp and duration columns: a span may have started
    any time before the window, so the primary key bounds only its start from above, and
    without PREWHERE ClickHouse reads the attribute maps of every span before the window's
    end. Conversations are matched with ``IN``, which the attribute-value bloom filter
    index of the exporter's schema prunes by (``has`` it does not).
    """
    table, _ = _tables(store)
    overlap = [
        "Timestamp <= fromUnixTimestamp64Nano({until_ns:Int64})",
        "toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) >= {since_ns:Int64}",
    ]
    where = [span_sql.TOOL_SPANS]
    params: dict[str, Any] = {
        "since_ns": int(since_ns),
        "until_ns": int(until_ns),
    }
    if windows is not None:
        ors = []
        for i, (lo, hi) in enumerate(merge_ranges([(int(a), int(b)) for a, b in windows], MAX_TIME_RANGES)):
            ors.append(
                f"(Timestamp <= fromUnixTimestamp64Nano({{whi{i}:Int64}}) "
                f"AND toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) >= {{wlo{i}:Int64}})"
            )
            params.update({f"wlo{i}": lo, f"whi{i}": hi})
        overlap.append(f"({' OR '.join(ors)})" if ors else "0")
    if conversation_id is not None:
        where.append("SpanAttributes[{conv_key:String}] = {conversation_id:String}")
        params.update(conv_key=names.GEN_AI_CONVERSATION_ID, conversation_id=conversation_id)
    elif conversation_ids is not None:
        where.append("SpanAttributes[{conv_key:String}] IN {conversation_ids:Array(String)}")
        params.update(conv_key=names.GEN_AI_CONVERSATION_ID, conversation_ids=list(conversation_ids))
    sql = (
        f"SELECT {SPAN_SELECT}\nFROM {table}\nPREWHERE {' AND '.join(overlap)}\n"
        f"WHERE {' AND '.join(where)}\nORDER BY Timestamp ASC, SpanId"
    )
    return _spans(store, sql, params)


NARROW_SELECT = """\
toUnixTimestamp64Nano(Timestamp) AS StartNs,
TraceId, SpanId, ParentSpanId, TraceState, SpanName, SpanKind, ServiceName, ScopeName, ScopeVersion,
Duration, StatusCode, StatusMessage, SpanAttributes"""
"""Select list of a narrow read: the span's own columns, without resource, events or links.
The attributes are narrowed in Python: filtering the map in SQL (``arrayFilter`` over its
keys; the trimmed chDB build has no ``mapFilter``) runs for every row before the LIMIT and
cost more than it saved."""


def engine_requests(
    store: TraceStore,
    *,
    since_ns: int,
    until_ns: int,
    roots_only: bool = False,
    limit: int | None = None,
    attributes: Sequence[str] | None = None,
) -> list[SpanRecord]:
    """Engine request spans (:data:`otelkv.spans.sql.ENGINE_REQUEST_SPANS`) starting in
    ``[since_ns, until_ns)``, in start order; with ``roots_only``, only those without a
    parent (requests whose trace context never reached the engine).

    ``attributes``: read only these span attributes, and no resource, events or links
    (:data:`NARROW_SELECT`): a sample of thousands of requests for a few facts each.
    """
    table, _ = _tables(store)
    where = [
        span_sql.ENGINE_REQUEST_SPANS,
        "Timestamp >= fromUnixTimestamp64Nano({since_ns:Int64})",
        "Timestamp < fromUnixTimestamp64Nano({until_ns:Int64})",
    ]
    if roots_only:
        where.append("ParentSpanId = ''")
    params: dict[str, Any] = {"since_ns": int(since_ns), "until_ns": int(until_ns)}
    select = SPAN_SELECT if attributes is None else NARROW_SELECT
    sql = f"SELECT {select}\nFROM {table}\nWHERE {' AND '.join(where)}\nORDER BY Timestamp ASC, SpanId"
    if limit is not None:
        sql += "\nLIMIT {limit:UInt64}"
        params["limit"] = max(0, int(limit))
    spans = _spans(store, sql, params)
    if attributes is not None:
        keys = set(attributes)
        for span in spans:
            span.attributes = {k: v for k, v in span.attributes.items() if k in keys}
    return spans


def find_turn(store: TraceStore, conversation_id: str, index: int) -> SpanRecord | None:
    """Turn ``index`` of a conversation; the sidecar's span (scope ``otelkv.sidecar``) wins."""
    table, _ = _tables(store)
    sql = f"""\
SELECT {SPAN_SELECT}
FROM {table}
WHERE {span_sql.TURN_SPANS}
  AND SpanAttributes[{{conv_key:String}}] = {{conversation_id:String}}
  AND SpanAttributes[{{turn_index_key:String}}] = toString({{index:Int64}})
ORDER BY ScopeName = {{sidecar_scope:String}} DESC, Timestamp ASC, SpanId ASC
LIMIT 1"""
    params = {
        "conv_key": names.GEN_AI_CONVERSATION_ID,
        "conversation_id": conversation_id,
        "turn_index_key": names.TURN_INDEX,
        "index": int(index),
        "sidecar_scope": names.SCOPE_SIDECAR,
    }
    spans = _spans(store, sql, params)
    return spans[0] if spans else None


def traces_with_prefix(store: TraceStore, prefix: str, *, limit: int = 100) -> list[str]:
    """Trace ids starting with ``prefix`` (lower-case hex) whose trace holds a turn span or an
    engine request (what ``otelkv why`` can explain), sorted, at most ``limit``.

    The lookup table ``otel_traces_trace_id_ts`` is ordered by trace id, so the prefix is a
    range of its primary key; its time bounds then keep the big table's read to the
    partitions those traces live in. With no match in the lookup (rows inserted before the
    view existed) the big table is scanned, as :func:`trace_spans` falls back.
    """
    table, lookup = _tables(store)
    sql = f"""\
WITH
    (SELECT minOrNull(Start) FROM {lookup} WHERE startsWith(TraceId, {{prefix:String}})) AS trace_start,
    (SELECT maxOrNull(End) + 1 FROM {lookup} WHERE startsWith(TraceId, {{prefix:String}})) AS trace_end
SELECT DISTINCT TraceId
FROM {table}
WHERE startsWith(TraceId, {{prefix:String}})
  AND ({span_sql.TURN_SPANS} OR {span_sql.ENGINE_REQUEST_SPANS})
  AND (trace_start IS NULL OR (Timestamp >= trace_start AND Timestamp <= trace_end))
ORDER BY TraceId
LIMIT {{limit:UInt64}}"""
    rows = store.query(sql, {"prefix": prefix, "limit": max(0, int(limit))})
    return [str(row["TraceId"]) for row in rows]


def count_spans(store: TraceStore) -> int:
    """Rows in ``otel_traces``."""
    table, _ = _tables(store)
    rows = store.query(f"SELECT count() AS n FROM {table}")
    return int(rows[0]["n"]) if rows else 0
