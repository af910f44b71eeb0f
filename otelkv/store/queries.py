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
    one per trace (the sidecar's when an agent's own chat span shares its trace).

    Slowest first by ``otelkv.turn.total_s`` (the span's duration when that is absent or 0);
    with ``conversation_id``, that conversation's turns in time order instead. ``limit=None``
    returns all.
    """
    table, _ = _tables(store)
    where = [span_sql.TURN_SPANS]
    params: dict[str, Any] = {"sidecar_scope": names.SCOPE_SIDECAR}
    if since_ns is not None:
        where.append("Timestamp >= fromUnixTimestamp64Nano({since_ns:Int64})")
        params["since_ns"] = int(since_ns)
    if until_ns is not None:
        where.append("Timestamp < fromUnixTimestamp64Nano({until_ns:Int64})")
        params["until_ns"] = int(until_ns)
    if conversation_id is not None:
        where.append("SpanAttributes[{conv_key:String}] = {conversation_id:String}")
        params.update(conv_key=names.GEN_AI_CONVERSATION_ID, conversation_id=conversation_id)
        order = "StartNs ASC, SpanId"
    else:
        params["total_key"] = names.TURN_TOTAL_SECONDS
        total = "toFloat64OrZero(SpanAttributes[{total_key:String}])"
        latency = f"if({total} > 0, {total}, Duration / 1e9)"
        order = f"{latency} {'DESC' if slowest_first else 'ASC'}, StartNs ASC"
    one_per_trace = (
        f"SELECT {SPAN_SELECT}\nFROM {table}\nWHERE {' AND '.join(where)}\n"
        "ORDER BY ScopeName = {sidecar_scope:String} DESC, Timestamp ASC\nLIMIT 1 BY TraceId"
    )
    sql = f"SELECT *\nFROM (\n{one_per_trace}\n)\nORDER BY {order}"
    if limit is not None:
        sql += "\nLIMIT {limit:UInt64}"
        params["limit"] = max(0, int(limit))
    return _spans(store, sql, params)


def trace_spans(store: TraceStore, trace_ids: Sequence[str]) -> list[SpanRecord]:
    """Every span of ``trace_ids``, in start order.

    Like the Grafana ClickHouse plugin's trace query, the time range comes from
    ``otel_traces_trace_id_ts`` first, so the big table is read only in the partitions the
    traces live in. Traces missing from the lookup (rows inserted before the view existed)
    fall back to an unbounded scan rather than vanish.
    """
    ids = sorted({t for t in trace_ids if t})
    if not ids:
        return []
    table, lookup = _tables(store)
    sql = f"""\
WITH
    (SELECT minOrNull(Start) FROM {lookup} WHERE TraceId IN {{trace_ids:Array(String)}}) AS trace_start,
    (SELECT maxOrNull(End) + 1 FROM {lookup} WHERE TraceId IN {{trace_ids:Array(String)}}) AS trace_end,
    (SELECT uniqExact(TraceId) FROM {lookup} WHERE TraceId IN {{trace_ids:Array(String)}}) AS known
SELECT {SPAN_SELECT}
FROM {table}
WHERE TraceId IN {{trace_ids:Array(String)}}
  AND (known < {{n_ids:UInt64}} OR (Timestamp >= trace_start AND Timestamp <= trace_end))
ORDER BY Timestamp ASC, SpanId"""
    return _spans(store, sql, {"trace_ids": ids, "n_ids": len(ids)})


def tool_spans(
    store: TraceStore,
    *,
    since_ns: int,
    until_ns: int,
    conversation_id: str | None = None,
    conversation_ids: Sequence[str] | None = None,
) -> list[SpanRecord]:
    """``execute_tool {name}`` spans overlapping ``[since_ns, until_ns]``, in start order.

    Filter by one conversation or several (``otelkv slow`` asks for the tool spans of its
    turns' conversations only: a window spanning days holds far more).
    """
    table, _ = _tables(store)
    where = [
        span_sql.TOOL_SPANS,
        "Timestamp <= fromUnixTimestamp64Nano({until_ns:Int64})",
        "toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) >= {since_ns:Int64}",
    ]
    params: dict[str, Any] = {
        "since_ns": int(since_ns),
        "until_ns": int(until_ns),
    }
    if conversation_id is not None:
        where.append("SpanAttributes[{conv_key:String}] = {conversation_id:String}")
        params.update(conv_key=names.GEN_AI_CONVERSATION_ID, conversation_id=conversation_id)
    elif conversation_ids is not None:
        where.append("has({conversation_ids:Array(String)}, SpanAttributes[{conv_key:String}])")
        params.update(conv_key=names.GEN_AI_CONVERSATION_ID, conversation_ids=list(conversation_ids))
    sql = f"SELECT {SPAN_SELECT}\nFROM {table}\nWHERE {' AND '.join(where)}\nORDER BY Timestamp ASC, SpanId"
    return _spans(store, sql, params)


def engine_requests(
    store: TraceStore, *, since_ns: int, until_ns: int, roots_only: bool = False, limit: int | None = None
) -> list[SpanRecord]:
    """Engine request spans (:data:`otelkv.spans.sql.ENGINE_REQUEST_SPANS`) starting in
    ``[since_ns, until_ns)``, in start order; with ``roots_only``, only those without a
    parent (requests whose trace context never reached the engine)."""
    table, _ = _tables(store)
    where = [
        span_sql.ENGINE_REQUEST_SPANS,
        "Timestamp >= fromUnixTimestamp64Nano({since_ns:Int64})",
        "Timestamp < fromUnixTimestamp64Nano({until_ns:Int64})",
    ]
    if roots_only:
        where.append("ParentSpanId = ''")
    params: dict[str, Any] = {"since_ns": int(since_ns), "until_ns": int(until_ns)}
    sql = f"SELECT {SPAN_SELECT}\nFROM {table}\nWHERE {' AND '.join(where)}\nORDER BY Timestamp ASC, SpanId"
    if limit is not None:
        sql += "\nLIMIT {limit:UInt64}"
        params["limit"] = max(0, int(limit))
    return _spans(store, sql, params)


def find_turn(store: TraceStore, conversation_id: str, index: int) -> SpanRecord | None:
    """Turn ``index`` of a conversation; the sidecar's span (scope ``otelkv.sidecar``) wins."""
    table, _ = _tables(store)
    sql = f"""\
SELECT {SPAN_SELECT}
FROM {table}
WHERE {span_sql.TURN_SPANS}
  AND SpanAttributes[{{conv_key:String}}] = {{conversation_id:String}}
  AND SpanAttributes[{{turn_index_key:String}}] = toString({{index:Int64}})
ORDER BY ScopeName = {{sidecar_scope:String}} DESC, Timestamp ASC
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
