"""A fleet ClickHouse (fed by the collector's ClickHouse exporter) over its HTTP interface.

Stdlib only (``urllib``), so querying a fleet's traces needs no ClickHouse driver. Queries
are POSTed as the body with ``param_<name>`` URL parameters (bound server-side by
ClickHouse's ``{name:Type}`` placeholders) and ``FORMAT JSONEachRow``; inserts POST
``INSERT INTO <db>.otel_traces FORMAT JSONEachRow`` rows, where JSON escaping takes care of
quotes, backslashes and control characters. 64-bit integers are requested unquoted
(``output_format_json_quote_64bit_integers=0``) so rows look the same as from chDB.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from otelkv.spans import SpanRecord
from otelkv.store import schema
from otelkv.store.base import StoreError, param_text
from otelkv.store.rows import span_to_row


def _row_json(span: SpanRecord) -> str:
    row = dict(zip(schema.COLUMNS, span_to_row(span), strict=True))
    # DateTime64(9) from JSON: a decimal string "seconds.nanoseconds" is exact; a bare
    # integer would be read as seconds.
    row["Timestamp"] = _ts_text(row["Timestamp"])
    row["Events.Timestamp"] = [_ts_text(t) for t in row["Events.Timestamp"]]
    return json.dumps(row, ensure_ascii=True, separators=(",", ":"))


def _ts_text(ns: int) -> str:
    seconds, frac = divmod(int(ns), 1_000_000_000)
    return f"{seconds}.{frac:09d}"


class ClickHouseHttpStore:
    """``otel_traces`` on a ClickHouse server, through ``http(s)://user:pass@host:8123``."""

    largest_insert_spans = None
    """No larger inserts for a backlog: a writer keeps its ``batch_spans`` (the inserts are
    JSON bodies sent under a timeout, and larger ones were not measured)."""

    def __init__(
        self,
        url: str,
        *,
        database: str = "otel",
        user: str | None = None,
        password: str | None = None,
        create_schema: bool = True,
        retention_days: int | None = 7,
        timeout: float = 30.0,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StoreError(f"ClickHouse URL must look like http://host:8123, got {url!r}")
        url_user = urllib.parse.unquote(parts.username or "")
        self.user = user or url_user or os.environ.get("CLICKHOUSE_USER", "")
        self.password = (
            password
            if password is not None
            else urllib.parse.unquote(parts.password or "") or os.environ.get("CLICKHOUSE_PASSWORD", "")
        )
        netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        if parts.port:
            netloc += f":{parts.port}"
        self.base_url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path or "/", "", ""))
        self.database = database
        self.timeout = timeout
        self._table = f"{schema.quote_ident(database)}.{schema.quote_ident(schema.TRACES_TABLE)}"
        self._closed = False
        self._span_index: bool | None = None
        if create_schema:
            # Spans the collectors insert while an old index's view is replaced go unindexed
            # (see schema.index_rates_upgrade); `why` prices from the rest.
            schema.ensure(
                lambda sql: self._post(sql.encode("utf-8"), {}),
                had_index=self._index_exists(),
                database=database,
                retention_days=retention_days,
            )
            self._span_index = True

    @property
    def span_index(self) -> bool:
        """The span index exists (:mod:`otelkv.store.schema`), so queries can use it; asked
        once, when a query first wants to know (a reader that never needs it never asks)."""
        if self._span_index is None:
            self._span_index = self._index_exists()
        return self._span_index

    def _index_exists(self) -> bool:
        try:
            return self._post(schema.index_exists_query(self.database).encode("utf-8"), {}).strip() == b"1"
        except StoreError:  # unreachable or not allowed: the first query says so
            return False

    def describe(self) -> str:
        return f"ClickHouse {self.base_url} (database {self.database})"

    def _post(self, body: bytes, query: Mapping[str, str]) -> bytes:
        if self._closed:
            raise StoreError(f"{self.describe()} is closed")
        url = self.base_url
        if query:
            url += "?" + urllib.parse.urlencode(query)
        request = urllib.request.Request(url, data=body, method="POST")
        request.add_header("Content-Type", "text/plain; charset=utf-8")
        if self.user or self.password:
            token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode("ascii")
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace").strip()
            raise StoreError(f"{self.describe()} answered HTTP {exc.code}: {detail[:2000]}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise StoreError(f"cannot reach {self.describe()}: {reason}") from None

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        query = {
            "database": self.database,
            "default_format": "JSONEachRow",
            "output_format_json_quote_64bit_integers": "0",
        }
        for name, value in (params or {}).items():
            query[f"param_{name}"] = param_text(value)
        data = self._post(sql.encode("utf-8"), query)
        try:
            return [json.loads(line) for line in data.splitlines() if line.strip()]
        except ValueError as exc:
            raise StoreError(f"{self.describe()} returned non-JSON rows: {exc}") from None

    def insert_spans(self, spans: Sequence[SpanRecord]) -> int:
        return self.insert_encoded(self.encode_spans(spans))

    def encode_spans(self, spans: Sequence[SpanRecord]) -> tuple[bytes, int]:
        """The batch as one ``INSERT ... FORMAT JSONEachRow`` request body, and its span count."""
        if not spans:
            return b"", 0
        columns = ", ".join(f"`{c}`" for c in schema.COLUMNS)
        head = f"INSERT INTO {self._table} ({columns}) FORMAT JSONEachRow\n"
        body = head + "\n".join(_row_json(s) for s in spans) + "\n"
        return body.encode("utf-8"), len(spans)

    def insert_encoded(self, encoded: tuple[bytes, int]) -> int:
        body, n = encoded
        if not n:
            return 0
        # Lone surrogates (from JSON-decoded input) are escaped as \udXXX by ensure_ascii;
        # let ClickHouse keep them instead of failing the whole batch.
        self._post(body, {"input_format_json_throw_on_bad_escape_sequence": "0"})
        return n

    def close(self) -> None:
        self._closed = True
