"""The OpenTelemetry Collector contrib ClickHouse exporter's default trace schema, single node.

Rendered from ``open-telemetry/opentelemetry-collector-contrib``,
``exporter/clickhouseexporter/internal/sqltemplates/traces_table.sql`` (the non full-text-search
branch), ``traces_id_ts_lookup_table.sql`` and ``traces_id_ts_lookup_mv.sql``, with the
exporter's defaults: engine ``MergeTree()``, no ``ON CLUSTER``, table ``otel_traces``, TTL
``toDateTime(<column>) + toInterval<Unit>(N)``.

Why the exact schema and not our own: a fleet that already runs the collector with the
ClickHouse exporter has these tables, so every query in :mod:`otelkv.store.queries` runs
unchanged against the embedded chDB store and against that fleet's ClickHouse. Keep the
column names, types and order identical to the contrib file; :data:`COLUMNS` is the insert
order used by :mod:`otelkv.store.rows`.
"""

from __future__ import annotations

import re

TRACES_TABLE = "otel_traces"
TRACE_ID_TS_TABLE = "otel_traces_trace_id_ts"
TRACE_ID_TS_MV = "otel_traces_trace_id_ts_mv"

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
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1"""

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

_TRACE_ID_TS_MV_SQL = """\
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{mv}
TO {db}.{lookup}
AS SELECT
    TraceId,
    min(Timestamp) as Start,
    max(Timestamp) as End
FROM {db}.{table}
WHERE TraceId != ''
GROUP BY TraceId"""

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
    """DDL to run, in order: database, spans table, trace-id lookup table, its materialized view.

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
    }
    ttl = {"retention_days": retention_days, "retention_hours": retention_hours}
    return [
        f"CREATE DATABASE IF NOT EXISTS {names['db']}",
        _TRACES_TABLE_SQL.format(**names, ttl_timestamp=ttl_expr("Timestamp", **ttl)),
        _TRACE_ID_TS_TABLE_SQL.format(**names, ttl_start=ttl_expr("Start", **ttl)),
        _TRACE_ID_TS_MV_SQL.format(**names),
    ]
