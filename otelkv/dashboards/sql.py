"""ClickHouse SQL for the trace-store panels, and the ClickHouse target the SDK lacks.

The panels query ``otel.otel_traces`` exactly as the OpenTelemetry Collector's ClickHouse
exporter creates it (:mod:`otelkv.store.schema`), so they run unchanged on a fleet's
ClickHouse and on the sidecar's embedded chDB store. Attribute keys, span names and
vocabulary values come from :mod:`otelkv.names` and are written into the SQL as quoted
literals (Grafana sends raw SQL; there are no bound parameters); which spans are turns,
requests, transfers and retentions comes from :mod:`otelkv.spans.sql`. Dashboard variables go
through the ClickHouse plugin's own mechanisms: ``${var:singlequote}`` for values and
``$__conditionalAll(...)`` for "All", as the plugin's documentation recommends.

grafana-foundation-sdk ships no ClickHouse query model: :class:`ClickHouseQuery` is a
``Dataquery`` whose JSON is the plugin's query model (``editorType: sql``, ``rawSql``,
numeric ``format``), registered with the SDK's runtime so ``Dashboard.from_json`` gives it
back unchanged.
"""

from __future__ import annotations

import typing

from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import runtime as cogruntime
from grafana_foundation_sdk.cog import variants as cogvariants

from otelkv.dashboards.sources import CLICKHOUSE, TRACES_DATABASE
from otelkv.spans import sql as span_sql
from otelkv.spans.sql import attr, lit
from otelkv.store import schema

FORMAT_TABLE = 1
"""The plugin's (sqlutil's) numeric format for a table result: 0 time series, 1 table."""

TABLE = f"{TRACES_DATABASE}.{schema.TRACES_TABLE}"
TIME_FILTER = "$__timeFilter(Timestamp)"
"""The plugin macro for the dashboard's time range on the span start."""


class ClickHouseQuery(cogvariants.Dataquery):
    """A grafana-clickhouse-datasource target, kept as the plugin's own JSON model."""

    def __init__(self, data: dict[str, typing.Any]) -> None:
        self.data = data

    def to_json(self) -> dict[str, object]:
        return dict(self.data)

    @classmethod
    def from_json(cls, data: dict[str, typing.Any]) -> ClickHouseQuery:
        return cls(dict(data))


cogruntime.Runtime().register_dataquery_variant(
    cogruntime.DataqueryConfig(identifier=CLICKHOUSE.type, from_json_hook=ClickHouseQuery.from_json)
)


class ClickHouseTarget(cogbuilder.Builder[ClickHouseQuery]):
    """A raw-SQL target in table format (what tables and bar charts need)."""

    def __init__(self, sql: str, ref_id: str = "A") -> None:
        self._data: dict[str, typing.Any] = {
            "refId": ref_id,
            "datasource": CLICKHOUSE.as_json(),
            "editorType": "sql",
            "queryType": "table",
            "format": FORMAT_TABLE,
            "rawSql": sql.strip(),
        }

    def build(self) -> ClickHouseQuery:
        return ClickHouseQuery(dict(self._data))


def resource(key: str) -> str:
    return f"ResourceAttributes[{lit(key)}]"


def num(key: str) -> str:
    """A numeric span attribute; 0 when absent or not a number."""
    return f"toFloat64OrZero({attr(key)})"


def num_or_null(key: str) -> str:
    """A numeric span attribute; NULL when absent (a table then shows an empty cell)."""
    return f"toFloat64OrNull({attr(key)})"


def integer(key: str) -> str:
    return f"toInt64OrZero({attr(key)})"


TURN_SPANS = span_sql.SIDECAR_TURN_SPANS
"""The sidecar's turn spans (an agent's own ``chat`` client spans have another scope)."""
PREFILL_SPANS = span_sql.PREFILL_SPANS
ENGINE_REQUEST_SPANS = span_sql.ENGINE_REQUEST_SPANS
TRANSFER_SPANS = span_sql.TRANSFER_SPANS
RETENTION_SPANS = span_sql.RETENTION_SPANS


def var_in(expr: str, variable: str) -> str:
    """``expr IN (selected values)``, or no filter at all when the variable is "All"."""
    return f"$__conditionalAll({expr} IN (${{{variable}:singlequote}}), ${variable})"


def var_eq(expr: str, variable: str) -> str:
    """``expr = 'selected value'`` (quoted and escaped by Grafana)."""
    return f"{expr} = ${{{variable}:singlequote}}"
