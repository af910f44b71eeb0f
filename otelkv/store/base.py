"""What every trace store offers: insert spans, run parameterised SQL, say where it lives.

Queries use ClickHouse's own ``{name:Type}`` query parameters, which both chDB and the
HTTP interface bind server-side. Values are never formatted into SQL text, so a hostile
conversation id cannot change a query.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from otelkv.spans import SpanRecord


class StoreError(Exception):
    """The trace store cannot do what was asked; the message says why and what to do."""


@runtime_checkable
class TraceStore(Protocol):
    """An ``otel_traces`` store (schema of :mod:`otelkv.store.schema`).

    Optional attributes its users read with a default: ``span_index`` (True when the store
    has the span index; :mod:`otelkv.store.queries` reads without it otherwise) and
    ``largest_insert_spans`` (the most spans a :class:`~otelkv.store.writer.BatchWriter`
    puts in one insert of a backlog; None or absent: its ``batch_spans``)."""

    database: str

    def insert_spans(self, spans: Sequence[SpanRecord]) -> int:
        """Write ``spans``; return how many were written. Raises :class:`StoreError`.

        The same as ``insert_encoded(encode_spans(spans))``."""
        ...

    def encode_spans(self, spans: Sequence[SpanRecord]) -> Any:
        """``spans`` in the form the store inserts (pure CPU: no I/O, no lock on the store).

        Split from :meth:`insert_encoded` so that a writer can encode one batch while the
        previous one is being inserted: the insert waits on the database with the GIL
        released, the encoding needs the interpreter."""
        ...

    def insert_encoded(self, encoded: Any) -> int:
        """Write a batch made by :meth:`encode_spans`; return how many spans it held.
        Raises :class:`StoreError`."""
        ...

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run ``sql`` (``{name:Type}`` placeholders bound from ``params``); rows as dicts.

        ``FORMAT JSONEachRow`` is applied by the store: do not end ``sql`` with a FORMAT
        clause. 64-bit integers come back as Python ints.
        """
        ...

    def describe(self) -> str:
        """Where the data lives (for logs and error messages)."""
        ...

    def close(self) -> None:
        """Release the store; safe to call twice."""
        ...


def param_text(value: Any) -> str:
    """A query parameter value as ClickHouse's parameter text (escaped-TSV style).

    Strings are backslash-escaped (ClickHouse unescapes parameter text); arrays (lists,
    tuples) become ``['a','b']`` literals, as both chDB and the HTTP interface expect for
    ``Array(String)`` parameters.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_array_item(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return str(value)
    return _escape(str(value))


_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r", "\0": "\\0"})


def _escape(text: str) -> str:
    """ClickHouse parses parameter values as escaped text: a bare tab or ``\\n`` would be altered."""
    return text.translate(_ESCAPES)


def _array_item(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return "'" + _escape(str(value)).replace("'", "\\'") + "'"
