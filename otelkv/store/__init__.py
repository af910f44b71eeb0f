"""The trace store: spans in the OpenTelemetry Collector ClickHouse exporter's schema.

Design:

* **Same schema, same SQL.** Spans are stored in ``otel_traces`` exactly as the contrib
  ClickHouse exporter creates it (:mod:`otelkv.store.schema`), so the queries in
  :mod:`otelkv.store.queries` run unchanged on the embedded store and on a fleet's
  ClickHouse fed by the collector (:class:`ClickHouseHttpStore`).
* **Embedded = chDB.** ClickHouse in-process (:class:`ChdbStore`): no server to run, same
  SQL dialect and engine. chDB allows one process per directory (and one directory per
  process); the sidecar owns the directory and other tools query through it
  (``--sidecar URL``) or read a fleet ClickHouse (``--clickhouse URL``).
* **Never in the request path.** Receivers hand spans to :class:`BatchWriter`, whose
  ``submit`` is O(1) and drops (counted) rather than blocks.
"""

from __future__ import annotations

from pathlib import Path

from otelkv.store.base import StoreError, TraceStore
from otelkv.store.clickhouse_http import ClickHouseHttpStore
from otelkv.store.writer import BatchWriter

__all__ = ["BatchWriter", "ClickHouseHttpStore", "StoreError", "TraceStore", "open_store"]

DEFAULT_DATABASE = "otel"


def open_store(
    *,
    path: Path | str | None = None,
    clickhouse_url: str | None = None,
    retention_days: int = 7,
    database: str = DEFAULT_DATABASE,
    create_schema: bool = True,
) -> TraceStore:
    """A ClickHouse HTTP store when ``clickhouse_url`` is given, else chDB at ``path``.

    ``create_schema=False`` is for readers of a fleet's ClickHouse: the collector's exporter
    owns the tables there, and a read-only user may not run CREATE.
    """
    if clickhouse_url:
        return ClickHouseHttpStore(
            clickhouse_url, database=database, retention_days=retention_days, create_schema=create_schema
        )
    if path is None:
        raise StoreError("no trace store given: pass a directory (chDB) or a ClickHouse URL")
    try:
        import chdb  # noqa: F401
    except ImportError:
        raise StoreError(
            "the embedded trace store needs chDB, which is not installed: pip install 'otelkv[sidecar]'"
        ) from None
    from otelkv.store.chdb_store import ChdbStore

    return ChdbStore(Path(path), database=database, retention_days=retention_days)
