"""The embedded store: chDB (ClickHouse in-process) on a local directory.

Inserts go through Arrow: the batch is built as a ``pyarrow.Table`` and inserted with
``INSERT ... SELECT * FROM Python(batch)``, so ClickHouse reads typed columns and nothing
is SQL-quoted or text-escaped (quotes, backslashes, newlines, control characters are just
bytes). Measured on a 2-core machine, 5000-span batches of 15-attribute spans: Arrow ~3x
faster than ``FORMAT JSONCompactColumns`` and ``VALUES`` text, whose parsing dominated.
Lone UTF-16 surrogates (possible from JSON decoding) cannot be UTF-8 encoded; such strings
are stored with U+FFFD in their place.

chDB runs one embedded server per process and per directory: a second process opening the
same directory fails (ClickHouse locks ``<dir>/status``), and one process cannot open two
directories at once. Both become a :class:`StoreError` that says what to do.
"""

from __future__ import annotations

import fcntl
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from otelkv.spans import SpanRecord
from otelkv.store import schema
from otelkv.store.arrow_batch import ARROW_SCHEMA, BuildError, spans_to_arrow
from otelkv.store.base import StoreError, param_text

log = logging.getLogger(__name__)

_MERGE_SETTINGS = "vertical_merge_algorithm_min_rows_to_activate = 1"
"""Table setting for the embedded store only (the collector's DDL in schema.py stays as is).

Every merge that writes a Wide part merges column by column (vertical) instead of whole
rows (horizontal); ClickHouse's default waits for 131,072 rows. With 22 columns, four
of them maps with LowCardinality keys, merging 20 parts of 5000 spans took 9.1 us of
CPU per row vertically against 20.8 horizontally on the 2-core test machine, and a
store's merges run beside its inserts on the same cores. Merges into Compact parts
(under 10 MB) stay horizontal; ClickHouse has no vertical merge for them.
"""


_INSERT_SETTINGS = ("materialize_skip_indexes_on_insert = 0", "enable_analyzer = 0")
"""Settings of every embedded-store insert (and so of the views it runs).

* ``materialize_skip_indexes_on_insert = 0``: skip indexes are built when parts merge,
  not on insert: a 5000-span part then has 13 files instead of 27 (two per index) and
  its insert skips the bloom-filter work; merges build every index for the parts they
  write. Until its first merge a fresh part (a few thousand rows) is read without index
  pruning.
* ``enable_analyzer = 0``: an insert is analyzed again every time, the two materialized
  views' queries with it, and ClickHouse's default (new) analyzer made every insert cost
  more CPU: 45.8 against 35.2 ms for one span, 62.7 against 51.8 for 100, 178.2 against
  152.0 for 5,000 (``bench/store_insert_cost.py``, merges included). Taken apart once, most
  of it was the span index's view (14 ms under the new analyzer, 8 under the old). The
  views' rows are the same (``tests/unit/test_store_chdb.py``). Reads keep the default.
  A chDB that no longer knows a setting inserts without it (checked when the store opens).
"""


def _holds_lock(path: Path) -> bool:
    """True when another process holds ClickHouse's ``status`` lock in ``path``."""
    status = path / "status"
    if not status.exists():
        return False
    try:
        with status.open("rb") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return True
            fcntl.flock(fh, fcntl.LOCK_UN)
    except OSError:
        return False
    return False


class ChdbStore:
    """``otel_traces`` in a chDB directory; thread-safe (one lock around the session)."""

    largest_insert_spans = 20_000
    """The most spans a :class:`~otelkv.store.writer.BatchWriter` puts in one insert when it
    has a backlog: chDB's cost per span falls with the insert's size (an insert's cost is
    mostly per insert: parts written for the table and each view), and fewer parts are
    left to merge (``bench/store_ingest.py``, its raw_max arm)."""

    def __init__(
        self,
        path: Path | str,
        *,
        database: str = "otel",
        retention_days: int | None = 7,
        retention_hours: int | None = None,
    ) -> None:
        try:
            from chdb import session as chdb_session
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise StoreError("the embedded trace store needs chDB: pip install 'otelkv[sidecar]'") from exc
        self.path = Path(path).expanduser().resolve()
        self.database = database
        self._lock = threading.Lock()
        self.span_index = True
        """The store has the span index (:mod:`otelkv.store.schema`): always, it creates it."""
        self._table = f"{schema.quote_ident(database)}.{schema.quote_ident(schema.TRACES_TABLE)}"
        if _holds_lock(self.path):
            raise StoreError(self._busy_message())
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            self._session: Any = chdb_session.Session(str(self.path))
        except RuntimeError as exc:  # chDB raises RuntimeError with ClickHouse's text
            text = str(exc)
            if "Cannot lock file" in text or "Another server instance" in text or _holds_lock(self.path):
                raise StoreError(self._busy_message()) from None
            if "already initialized with path" in text:
                raise StoreError(
                    f"cannot open trace store {self.path}: this process already has another chDB "
                    f"directory open (chDB allows one per process): {text}"
                ) from None
            raise StoreError(f"cannot open trace store {self.path}: {text}") from None
        try:
            # Nothing else writes while the store opens (see schema.index_rates_upgrade).
            schema.ensure(
                self._answer,
                had_index=self._answer(schema.index_exists_query(database)) == b"1",
                database=database,
                retention_days=retention_days,
                retention_hours=retention_hours,
            )
            # Also on stores created before this setting (it is idempotent).
            self._session.query(f"ALTER TABLE {self._table} MODIFY SETTING {_MERGE_SETTINGS}")
            self.insert_settings = tuple(s for s in _INSERT_SETTINGS if self._knows(s))
            """The :data:`_INSERT_SETTINGS` this chDB knows, in every insert's ``SETTINGS``."""
        except RuntimeError as exc:
            self.close()
            raise StoreError(f"cannot create the otel_traces schema in {self.path}: {exc}") from None
        self._insert_sql = self.insert_sql(self.insert_settings)

    def insert_sql(self, settings: Sequence[str]) -> str:
        """The statement that inserts an :data:`ARROW_SCHEMA` table, with these settings."""
        clause = f"SETTINGS {', '.join(settings)} " if settings else ""
        return (
            f"INSERT INTO {self._table} ({', '.join(f'`{c}`' for c in schema.COLUMNS)}) "
            f"{clause}SELECT * FROM Python(_otelkv_arrow_batch)"
        )

    def _knows(self, setting: str) -> bool:
        """Whether this chDB knows ``setting``; any other failure of the probe is raised."""
        try:
            self._session.query(f"SELECT 1 SETTINGS {setting}")
        except RuntimeError as exc:
            if "UNKNOWN_SETTING" not in str(exc):
                raise
            log.info("otelkv store: this chDB does not know %r; inserts go without it", setting)
            return False
        return True

    def _answer(self, sql: str) -> bytes:
        """A statement's answer as text, stripped (the schema's statements and checks at open)."""
        return bytes(self._session.query(sql, "CSV").bytes()).strip()

    def _busy_message(self) -> str:
        return (
            f"trace store {self.path} is open in another process "
            "(is `otelkv sidecar` running? query it with --sidecar URL)"
        )

    def describe(self) -> str:
        return f"chDB {self.path} (database {self.database})"

    def insert_spans(self, spans: Sequence[SpanRecord]) -> int:
        return self.insert_encoded(self.encode_spans(spans))

    def encode_spans(self, spans: Sequence[SpanRecord]) -> pa.Table:
        """The batch as an Arrow table (:func:`spans_to_arrow`; its clean path when the fast
        one cannot take the batch)."""
        try:
            return spans_to_arrow(spans)
        except BuildError:
            return spans_to_arrow(spans, clean=True)

    def insert_encoded(self, encoded: pa.Table) -> int:
        """Insert a table in :data:`ARROW_SCHEMA` (:meth:`encode_spans`); return its row count.

        chDB reads the table through ``Python(...)`` and releases the GIL while it inserts, so
        other threads of the process run meanwhile."""
        if encoded.schema != ARROW_SCHEMA:
            raise StoreError("insert_encoded wants a table in ARROW_SCHEMA (encode_spans' output)")
        if encoded.num_rows:
            self._run_insert(encoded)
        return encoded.num_rows

    def _run_insert(self, _otelkv_arrow_batch: pa.Table) -> None:
        # chDB resolves ``Python(_otelkv_arrow_batch)`` by name in the calling frames.
        with self._lock:
            session = self._require_session()
            try:
                session.query(self._insert_sql)
            except RuntimeError as exc:
                raise StoreError(f"insert into {self.describe()} failed: {exc}") from None

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        bound = {k: param_text(v) for k, v in params.items()} if params else None
        with self._lock:
            session = self._require_session()
            try:
                result = session.query(sql, "JSONEachRow", params=bound)
            except RuntimeError as exc:
                raise StoreError(f"query on {self.describe()} failed: {exc}") from None
            data = result.bytes() if result is not None else b""
        # One JSON array for all rows: one parser call instead of one per row. JSONEachRow
        # writes one object per line and escapes newlines inside strings.
        rows = data.strip()
        return json.loads(b"[" + rows.replace(b"\n", b",") + b"]") if rows else []

    def _require_session(self) -> Any:
        if self._session is None:
            raise StoreError(f"trace store {self.path} is closed")
        return self._session

    def close(self) -> None:
        with self._lock:
            session, self._session = getattr(self, "_session", None), None
        if session is not None:
            session.close()

    def __enter__(self) -> ChdbStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
