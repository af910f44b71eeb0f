"""The OpenTelemetry Collector contrib ClickHouse exporter's default trace schema, single node.

Rendered from ``open-telemetry/opentelemetry-collector-contrib``,
``exporter/clickhouseexporter/internal/sqltemplates/traces_table.sql`` (the non full-text-search
branch), ``traces_id_ts_lookup_table.sql`` and ``traces_id_ts_lookup_mv.sql``, with the
exporter's defaults: engine ``MergeTree()``, no ``ON CLUSTER``, table ``otel_traces``, TTL
``toDateTime(<column>) + toInterval<Unit>(N)``.

Beside them, one table of otelkv's own, filled by a materialized view on ``otel_traces``:
``otelkv_span_index``, a row per turn span, per tool span and per prefill request that
measured compute (kind, time, duration, ids, conversation, and a number: a turn's latency,
a tool's duration, a request's seconds per computed token). It is an index, not a copy:
ranking a million turns by latency, finding the tool spans in a few gaps, or the fastest
prefill rate of an hour reads its narrow columns instead of the attribute map of every
span; the traces of the turns found are then read from ``otel_traces`` (tool spans are
taken from the index rows alone: their times and conversation are all a turn's gap split
reads). A store opened without it (a reader of a fleet's ClickHouse where nobody
created it) is queried without it. One view fills all three kinds: each view on
``otel_traces`` writes a part of its own on every insert, which cost the embedded store
more CPU per insert than the rows did (``bench/store_views.py``).

One setting differs from the exporter's: ``otel_traces`` and ``otelkv_span_index`` keep
an index mark every :data:`INDEX_GRANULARITY` rows, not 8,192. Reading a few traces (``why``,
``conversation``, ``slow``) decompresses one granule per span name around each trace's
time (the table is ordered by service and span name before time), and a granule of
otelkv's spans is mostly attribute maps; the trace-id and conversation skip indexes skip
granules of that size. ``bench/store_ingest.py --spans 0`` on 1,000,000 turns, four runs
alternating 8,192 and 1,024 rows in both tables: ``otel_traces``' read for ``why`` 25.4 and
22.9 ms against 17.0 and 15.7, for ``slow`` over all turns 121.6 and 94.4 against 70.7 and
76.9; whole commands in docs/performance.md. Tables that exist keep the setting they were
created with: it changes speed, never results.

Why the exact schema and not our own: a fleet that already runs the collector with the
ClickHouse exporter has these tables, so every query in :mod:`otelkv.store.queries` runs
unchanged against the embedded chDB store and against that fleet's ClickHouse. Keep the
column names, types and order identical to the contrib file; :data:`COLUMNS` is the insert
order used by :mod:`otelkv.store.rows`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from otelkv import names
from otelkv.spans import sql as span_sql

INDEX_GRANULARITY = 1024
"""Rows per index mark of ``otel_traces`` and ``otelkv_span_index`` (the module docstring
says why it is not the exporter's 8,192)."""

TRACES_TABLE = "otel_traces"
TRACE_ID_TS_TABLE = "otel_traces_trace_id_ts"
TRACE_ID_TS_MV = "otel_traces_trace_id_ts_mv"
INDEX_TABLE = "otelkv_span_index"
INDEX_MV = "otelkv_span_index_mv"
KIND_TURN = "turn"
KIND_TOOL = "tool"
KIND_RATE = "rate"
"""``Kind`` of an index row: a turn span (:data:`otelkv.spans.sql.TURN_SPANS`), a tool span
(:data:`otelkv.spans.sql.TOOL_SPANS`) or a prefill request that measured compute
(:data:`otelkv.spans.sql.COMPUTE_MEASURING_SPANS`; its ``Latency`` is
:data:`otelkv.spans.sql.COMPUTE_RATE_S`)."""

COLUMNS: tuple[str, ...] = (
    "Timestamp",
    "TraceId",
    "SpanId",
    "ParentSpanId",
    "TraceState",
    "SpanName",
    "SpanKind",
    "ServiceName",
    "ResourceAttributes",
    "ScopeName",
    "ScopeVersion",
    "SpanAttributes",
    "Duration",
    "StatusCode",
    "StatusMessage",
    "Events.Timestamp",
    "Events.Name",
    "Events.Attributes",
    "Links.TraceId",
    "Links.SpanId",
    "Links.TraceState",
    "Links.Attributes",
)
"""Insert column order (the contrib ``traces_insert.sql`` order; Nested columns flattened)."""

_TRACES_TABLE_SQL = """\
CREATE TABLE IF NOT EXISTS {db}.{table} (
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(T64, ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    Links Nested (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    ResourceAttributeItems Array(String) ALIAS arrayMap(kv -> concat(kv.1, '=', kv.2), \
CAST(ResourceAttributes, 'Array(Tuple(String, String))')),
    SpanAttributeItems Array(String) ALIAS arrayMap(kv -> concat(kv.1, '=', kv.2), \
CAST(SpanAttributes, 'Array(Tuple(String, String))')),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1,
    INDEX idx_lower_span_name lower(SpanName) TYPE tokenbf_v1(32768, 3, 0) GRANULARITY 8
) ENGINE = MergeTree()
PARTITION BY toDate(Timestamp)
PRIMARY KEY (ServiceName, SpanName, toDateTime(Timestamp))
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp), Timestamp)
{ttl_timestamp}
SETTINGS index_granularity = {granularity}, ttl_only_drop_parts = 1"""

_TRACE_ID_TS_TABLE_SQL = """\
CREATE TABLE IF NOT EXISTS {db}.{lookup} (
    TraceId String CODEC(ZSTD(1)),
    Start SimpleAggregateFunction(min, DateTime) CODEC(ZSTD(1)),
    End SimpleAggregateFunction(max, DateTime) CODEC(ZSTD(1))
) ENGINE = MergeTree()
PARTITION BY toStartOfWeek(Start)
ORDER BY (TraceId)
{ttl_start}
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1"""

_TRACE_ID_TS_SELECT = """\
SELECT
    TraceId,
    min(Timestamp) as Start,
    max(Timestamp) as End
FROM {db}.{table}
WHERE TraceId != ''
GROUP BY TraceId"""
_TRACE_ID_TS_MV_SQL = f"""\
CREATE MATERIALIZED VIEW IF NOT EXISTS {{db}}.{{mv}}
TO {{db}}.{{lookup}}
AS {_TRACE_ID_TS_SELECT}"""

_INDEX_TABLE_SQL = """\
CREATE TABLE IF NOT EXISTS {db}.{index} (
    Kind LowCardinality(String) CODEC(ZSTD(1)),
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    Duration UInt64 CODEC(T64, ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ScopeName LowCardinality(String) CODEC(ZSTD(1)),
    ConversationId String CODEC(ZSTD(1)),
    Latency Float64 CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_conversation_id ConversationId TYPE bloom_filter(0.001) GRANULARITY 1
) ENGINE = MergeTree()
PARTITION BY toDate(Timestamp)
ORDER BY (Kind, Timestamp)
{ttl_timestamp}
SETTINGS index_granularity = {granularity}, ttl_only_drop_parts = 1"""

_INDEX_COLUMNS = f"""\
SELECT
    multiIf({span_sql.TURN_SPANS}, {span_sql.lit(KIND_TURN)},
            {span_sql.TOOL_SPANS}, {span_sql.lit(KIND_TOOL)},
            {span_sql.lit(KIND_RATE)}) AS Kind,
    Timestamp,
    Duration,
    TraceId,
    SpanId,
    ScopeName,
    {span_sql.attr(names.GEN_AI_CONVERSATION_ID)} AS ConversationId,
    if(Kind = {span_sql.lit(KIND_RATE)}, {span_sql.COMPUTE_RATE_S}, {span_sql.TURN_LATENCY_S}) AS Latency
FROM {{db}}.{{table}}"""
_INDEX_SELECT = f"""\
{_INDEX_COLUMNS}
WHERE {span_sql.TURN_SPANS} OR {span_sql.TOOL_SPANS} OR {span_sql.COMPUTE_MEASURING_SPANS}"""
_RATE_ROWS_SELECT = f"""\
{_INDEX_COLUMNS}
WHERE {span_sql.COMPUTE_MEASURING_SPANS} AND NOT ({span_sql.TURN_SPANS} OR {span_sql.TOOL_SPANS})"""

_INDEX_MV_SQL = f"""\
CREATE MATERIALIZED VIEW IF NOT EXISTS {{db}}.{{index_mv}}
TO {{db}}.{{index}}
AS {_INDEX_SELECT}"""

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def quote_ident(name: str) -> str:
    """Backquote an identifier; only plain names are accepted (they end up in DDL text)."""
    if not _IDENT.match(name):
        raise ValueError(f"invalid ClickHouse identifier {name!r} (letters, digits and _ only)")
    return f"`{name}`"


def ttl_expr(column: str, *, retention_days: int | None = None, retention_hours: int | None = None) -> str:
    """The exporter's TTL clause: whole days as ``toIntervalDay``, else hours; empty when unset/0."""
    if retention_hours:
        if retention_hours % 24 == 0:
            return f"TTL toDateTime({column}) + toIntervalDay({int(retention_hours) // 24})"
        return f"TTL toDateTime({column}) + toIntervalHour({int(retention_hours)})"
    if retention_days:
        return f"TTL toDateTime({column}) + toIntervalDay({int(retention_days)})"
    return ""


def create_statements(
    database: str = "otel", *, retention_days: int | None = 7, retention_hours: int | None = None
) -> list[str]:
    """DDL to run, in order: database, spans table, trace-id lookup table and its materialized
    view, span index table and its materialized view. A span index created by these
    statements on a store that already holds spans is filled by :func:`index_backfill`.

    ``retention_hours`` wins over ``retention_days`` when both are given; neither (or 0)
    means no TTL, as in the exporter.
    """
    if (retention_days or 0) < 0 or (retention_hours or 0) < 0:
        raise ValueError("retention must be >= 0")
    names = {
        "db": quote_ident(database),
        "table": quote_ident(TRACES_TABLE),
        "lookup": quote_ident(TRACE_ID_TS_TABLE),
        "mv": quote_ident(TRACE_ID_TS_MV),
        "index": quote_ident(INDEX_TABLE),
        "index_mv": quote_ident(INDEX_MV),
    }
    ttl = {"retention_days": retention_days, "retention_hours": retention_hours}
    return [
        f"CREATE DATABASE IF NOT EXISTS {names['db']}",
        _TRACES_TABLE_SQL.format(
            **names, ttl_timestamp=ttl_expr("Timestamp", **ttl), granularity=INDEX_GRANULARITY
        ),
        _TRACE_ID_TS_TABLE_SQL.format(**names, ttl_start=ttl_expr("Start", **ttl)),
        _TRACE_ID_TS_MV_SQL.format(**names),
        _INDEX_TABLE_SQL.format(
            **names, ttl_timestamp=ttl_expr("Timestamp", **ttl), granularity=INDEX_GRANULARITY
        ),
        _INDEX_MV_SQL.format(**names),
    ]


def index_exists_query(database: str = "otel") -> str:
    """``EXISTS TABLE`` of the span index (one row: 1 or 0)."""
    return f"EXISTS TABLE {quote_ident(database)}.{quote_ident(INDEX_TABLE)}"


def index_backfill(database: str = "otel") -> str:
    """Fill the span index from the spans already stored: run once, right after
    :func:`create_statements` created it on a store that had spans (its view sees only
    inserts made after it exists)."""
    return f"INSERT INTO {quote_ident(database)}.{quote_ident(INDEX_TABLE)}\n{index_select(database)}"


def index_select(database: str = "otel") -> str:
    """The span index's rows for the spans in ``otel_traces``: its view's query."""
    return _INDEX_SELECT.format(db=quote_ident(database), table=quote_ident(TRACES_TABLE))


def trace_id_lookup_select(database: str = "otel") -> str:
    """The trace-id lookup's rows for the spans in ``otel_traces``: its view's query."""
    return _TRACE_ID_TS_SELECT.format(db=quote_ident(database), table=quote_ident(TRACES_TABLE))


def index_view_without_rates_query(database: str = "otel") -> str:
    """One row, 1 when the span index's view is one that indexes no prefill rates (made
    before :data:`KIND_RATE` rows existed), else 0."""
    return (
        "SELECT count() AS n FROM system.tables "
        f"WHERE database = {span_sql.lit(database)} AND name = {span_sql.lit(INDEX_MV)} "
        f"AND position(create_table_query, {span_sql.lit(span_sql.lit(KIND_RATE))}) = 0"
    )


def index_rates_upgrade(database: str = "otel") -> list[str]:
    """Index the prefill rates already stored, then replace a span index view that indexes
    none (see :func:`index_view_without_rates_query`). In that order, an upgrade that stops
    part way is done again at the next open (rate rows indexed twice change no minimum).
    Spans inserted between the rates' read and the new view miss their rate rows, and those
    between the view's drop and its creation every row: run it while nothing writes (the
    embedded store does, at open)."""
    db, index, mv = quote_ident(database), quote_ident(INDEX_TABLE), quote_ident(INDEX_MV)
    select = _RATE_ROWS_SELECT.format(db=db, table=quote_ident(TRACES_TABLE))
    return [
        f"INSERT INTO {db}.{index}\n{select}",
        f"DROP VIEW IF EXISTS {db}.{mv}",
        _INDEX_MV_SQL.format(db=db, index=index, index_mv=mv, table=quote_ident(TRACES_TABLE)),
    ]


def ensure(
    run: Callable[[str], bytes],
    *,
    had_index: bool,
    database: str = "otel",
    retention_days: int | None = 7,
    retention_hours: int | None = None,
) -> None:
    """Create the schema through ``run`` (a statement in, its answer's text out), then bring
    the span index up to date: filled from the spans already stored when ``had_index`` says
    the store had none before, given its prefill rates when its view predates them. The one
    order both stores open by."""
    ttl = {"retention_days": retention_days, "retention_hours": retention_hours}
    for statement in create_statements(database, **ttl):
        run(statement)
    if not had_index:  # a store from before the span index: index what it holds
        run(index_backfill(database))
    elif run(index_view_without_rates_query(database)).strip() == b"1":
        for statement in index_rates_upgrade(database):
            run(statement)
