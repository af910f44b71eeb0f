"""A batch of :class:`SpanRecord` as an Arrow table in ``otel_traces`` column order.

This is the Python half of every embedded-store insert: the GIL is held throughout (chDB
then inserts the table with the GIL released), so it is built column-wise with as little
per-span Python as possible: one comprehension per field turns the records into columns, and attribute
values are rendered to strings by Arrow instead of one Python call per value. Attribute
maps of one shape (the same keys in the same order: spans made by one code path) are read
key by key, each key's values typed with one ``set(map(type, ...))`` and converted with
the other values of that type in one pyarrow call, and their keys converted once per
shape; maps of rare shapes are flattened into one value list per batch (one masked
conversion per value type). Only what Arrow cannot render the
exporter's way goes through :func:`otelkv.store.rows.attr_value`: floats Arrow would print
with an exponent or as ``nan``/``inf``, bytes, lists, maps, ``None``, subclasses, ints beyond
int64. Spans of one OTLP resource share one resource dict, so resources (and the service
name derived from them) are rendered once per distinct dict and gathered with ``take``.

The values are those of :func:`otelkv.store.rows.span_to_row` (the tests hold the two
together); the HTTP store renders rows that way, so both stores write identical rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate, chain
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from otelkv.spans import SpanRecord
from otelkv.spans.attrs import attr_value, format_float
from otelkv.store import schema

_MAP = pa.map_(pa.string(), pa.string())
_TS = pa.timestamp("ns", tz="UTC")

_COLUMN_TYPES: dict[str, pa.DataType] = {
    "Timestamp": _TS,
    "ResourceAttributes": _MAP,
    "SpanAttributes": _MAP,
    "Duration": pa.uint64(),
    "Events.Timestamp": pa.list_(_TS),
    "Events.Attributes": pa.list_(_MAP),
    "Links.Attributes": pa.list_(_MAP),
}


def _arrow_type(column: str) -> pa.DataType:
    """Arrow type of an ``otel_traces`` column: the exceptions above, else (lists of) strings."""
    if column in _COLUMN_TYPES:
        return _COLUMN_TYPES[column]
    return pa.list_(pa.string()) if "." in column else pa.string()


# Arrow field names: chDB's Python() reads the table positionally into the INSERT's column
# list; dots (Nested sub-columns) are kept out of the Arrow side.
ARROW_SCHEMA = pa.schema([(c.replace(".", "_"), _arrow_type(c)) for c in schema.COLUMNS])

# Attribute values by exact type: these four Arrow converts and casts to the exporter's text
# itself (str as is, int in decimal, bool as true/false, float by shortest round-trip
# digits); everything else (and subclasses such as IntEnum) goes through attr_value.
_STR, _INT, _FLOAT, _BOOL, _OTHER = range(5)


class _TypeCodes(dict[type, int]):
    """Type -> code, :data:`_OTHER` for any other type (a C-level lookup in ``map``)."""

    def __missing__(self, key: type) -> int:
        return _OTHER


_TYPE_CODE = _TypeCodes({str: _STR, int: _INT, float: _FLOAT, bool: _BOOL})
_ARROW_OF_CODE = {_STR: pa.string(), _INT: pa.int64(), _FLOAT: pa.float64(), _BOOL: pa.bool_()}
_SURROGATES = re.compile("[\ud800-\udfff]")

BuildError = (UnicodeEncodeError, pa.ArrowException, TypeError, ValueError, OverflowError)
"""What :func:`spans_to_arrow` raises on a batch its fast path cannot take; retry with clean."""


def _clean(value: Any) -> str:
    """Any value as a UTF-8-encodable string (slow path, used only when a batch failed)."""
    text = value if isinstance(value, str) else attr_value(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = _SURROGATES.sub("\ufffd", text)
    return text


def _strings(values: Sequence[Any], clean: bool) -> pa.Array:
    return pa.array([_clean(v) for v in values] if clean else values, pa.string())


def _attr_strings(values: list[Any], clean: bool) -> pa.Array:
    """Attribute values as the exporter's strings (``attr_value`` of each), mostly in Arrow."""
    if clean or not values:
        return _strings(values, clean)
    # One byte per value, straight into an Arrow buffer (pa.array from ints costs 30 ns each).
    code_bytes = bytes(map(_TYPE_CODE.__getitem__, map(type, values)))
    codes = pa.Array.from_buffers(pa.int8(), len(code_bytes), [None, pa.py_buffer(code_bytes)])
    present = set(pc.unique(codes).to_pylist())
    if present == {_STR}:
        return pa.array(values, pa.string())
    try:
        parts = []
        for code in sorted(present - {_OTHER}):
            # mask=True skips the value unread, so each pass converts only its own type.
            typed = pa.array(values, _ARROW_OF_CODE[code], mask=pc.not_equal(codes, code))
            text = typed if code == _STR else typed.cast(pa.string())
            if code == _FLOAT:
                text = _go_floats(values, text)
            parts.append(text)
    except (pa.ArrowException, OverflowError):  # an int beyond int64: render in Python
        return pa.array([v if type(v) is str else attr_value(v) for v in values], pa.string())
    if _OTHER in present:
        odd = pc.indices_nonzero(pc.equal(codes, _OTHER)).to_pylist()
        rendered: list[str | None] = [None] * len(values)
        for i in odd:
            rendered[i] = attr_value(values[i])
        parts.append(pa.array(rendered, pa.string()))
    return pc.coalesce(*parts) if len(parts) > 1 else parts[0]


def _go_floats(values: list[Any], text: pa.Array) -> pa.Array:
    """Redo in Python the floats Arrow printed differently from Go.

    Arrow casts with the shortest round-trip digits, as Go's ``FormatFloat(v, 'f', -1, 64)``
    does, but switches to an exponent (``1e+16``, ``1.5e-7``) and writes ``nan``/``inf``
    where Go writes plain digits, ``NaN``, ``+Inf``: those few go through format_float.
    """
    # "e" catches exponents, "n" nan and inf (a regex costs 10x two substring scans).
    odd = pc.or_(pc.match_substring(text, "e"), pc.match_substring(text, "n"))
    redo = pc.indices_nonzero(pc.fill_null(odd, False))
    if not len(redo):
        return text
    fixed = text.to_pylist()
    for i in redo.to_pylist():
        fixed[i] = format_float(values[i])
    return pa.array(fixed, pa.string())


def _map_column(maps: Sequence[Mapping[str, Any] | None], clean: bool) -> pa.Array:
    """``map<string,string>``, one entry per item of ``maps`` (None and {} are empty maps).

    Maps with the same keys in the same order (spans made by one code path), at least
    :data:`MIN_SHAPE_ROWS` of them, are converted key by key (:func:`_by_shape`); the rest
    entry by entry, as one flat list.
    """
    if set(map(type, maps)) - {dict}:
        maps = [m if type(m) is dict else dict(m) if m else {} for m in maps]
    offsets = list(accumulate(map(len, maps), initial=0))
    if not clean and offsets[-1] >= len(maps) >= MIN_SHAPE_ROWS:  # maps of an entry or more
        shapes: dict[tuple[Any, ...], list[int]] = {}
        for i, shape in enumerate(map(tuple, maps)):
            shapes.setdefault(shape, []).append(i)
        if any(len(rows) >= MIN_SHAPE_ROWS and shape for shape, rows in shapes.items()):
            keys, values = _by_shape(maps, offsets, shapes)  # type: ignore[arg-type]
            return pa.MapArray.from_arrays(pa.array(offsets, pa.int32()), keys, values)
    keys = list(chain.from_iterable(maps))
    values = list(chain.from_iterable(map(dict.values, maps)))
    return pa.MapArray.from_arrays(
        pa.array(offsets, pa.int32()), _strings(keys, clean), _attr_strings(values, clean)
    )


MIN_SHAPE_ROWS = 32
"""Fewest maps of one shape that :func:`_map_column` converts key by key. Each key costs a few
pyarrow and numpy calls whatever its row count; for 15-key maps of four value types the key
by key path already ran fewer instructions than the flat one at 8 rows a shape (cachegrind:
144M against 206M for 5000 maps), so 32 leaves a margin."""

_EXACT = (str, int, float, bool)


def _by_shape(
    maps: Sequence[dict[Any, Any]], offsets: list[int], shapes: dict[tuple[Any, ...], list[int]]
) -> tuple[pa.Array, pa.Array]:
    """Keys and values of :func:`_map_column`, in entry order, for maps grouped by shape
    (key tuple -> row indexes, rows ascending).

    One key of a shape is a column: a strided slice of the shape's values, whose types one
    ``set(map(type, ...))`` tells. The columns of one exact type (str, int, float, bool:
    nearly all of them) are joined and rendered by one pyarrow conversion and cast per type,
    so no Python code runs per value; a column of mixed or other types goes through
    :func:`_attr_strings`, as do the maps of rare shapes (one flat list). Keys are each
    shape's tuple, converted once. Every entry's source is scattered into one index of
    entry positions (row start + key position), and a ``take`` gathers keys and values in
    entry order.
    """
    n_entries = offsets[-1]
    starts = np.asarray(offsets[:-1], np.int64)
    value_src = np.empty(n_entries, np.int64)
    key_src = np.empty(n_entries, np.int64)
    typed: dict[type, list[Any]] = {t: [] for t in _EXACT}
    typed_at: dict[type, list[np.ndarray]] = {t: [] for t in _EXACT}
    other: list[tuple[list[Any], np.ndarray]] = []
    key_parts: list[pa.Array] = []
    n_keys = 0
    rare: list[int] = []
    for shape, rows in shapes.items():
        if len(rows) < MIN_SHAPE_ROWS or not shape:
            rare.extend(rows)
            continue
        width = len(shape)
        row_starts = starts[rows]
        key_parts.append(pa.array(shape, pa.string()))
        key_src[(row_starts[:, None] + np.arange(width)).ravel()] = np.tile(
            np.arange(n_keys, n_keys + width), len(rows)
        )
        n_keys += width
        flat = list(chain.from_iterable(map(dict.values, map(maps.__getitem__, rows))))
        for j in range(width):
            column = flat[j::width]
            types = set(map(type, column))
            kind = types.pop() if len(types) == 1 else None
            if kind in typed:
                typed[kind].extend(column)  # type: ignore[index]
                typed_at[kind].append(row_starts + j)  # type: ignore[index]
            else:
                other.append((column, row_starts + j))
    parts: list[pa.Array] = []
    n_values = 0

    def place(text: pa.Array, at: np.ndarray) -> None:
        nonlocal n_values
        parts.append(text)
        value_src[at] = np.arange(n_values, n_values + len(text))
        n_values += len(text)

    for kind, values in typed.items():
        if values:
            place(_exact_strings(values, kind), np.concatenate(typed_at[kind]))
    for column, at in other:
        place(_attr_strings(column, False), at)
    if rare:
        rare.sort()
        rare_maps = [maps[i] for i in rare]
        lengths = np.diff(np.asarray(offsets, np.int64))[rare]
        # Entry e of a rare row lands at the row's start + e.
        at = np.repeat(starts[rare] - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
        place(_attr_strings(list(chain.from_iterable(map(dict.values, rare_maps))), False), at)
        key_parts.append(pa.array(list(chain.from_iterable(rare_maps)), pa.string()))
        key_src[at] = np.arange(n_keys, n_keys + len(at))
    keys = pa.concat_arrays(key_parts).take(key_src)
    return keys, pa.concat_arrays(parts).take(value_src)


_ARROW_OF_TYPE: dict[type, pa.DataType] = {int: pa.int64(), float: pa.float64(), bool: pa.bool_()}


def _exact_strings(values: list[Any], kind: type) -> pa.Array:
    """Values all of exactly type ``kind`` (str, int, float or bool) as the exporter's strings."""
    if kind is str:
        return pa.array(values, pa.string())
    try:
        text = pa.array(values, _ARROW_OF_TYPE[kind]).cast(pa.string())
    except (pa.ArrowException, OverflowError):  # an int beyond int64
        return _attr_strings(values, False)
    return _go_floats(values, text) if kind is float else text


def _service_name(resource: Mapping[str, Any] | None) -> str:
    return attr_value(resource.get("service.name", "")) if resource else ""


def _per_resource(resources: Sequence[Any], clean: bool) -> tuple[pa.Array, pa.Array]:
    """ServiceName and ResourceAttributes, rendered once per distinct resource object."""
    ids = list(map(id, resources))
    # The spans keep every resource alive while this runs, so ids are unique per object.
    distinct = dict(zip(ids, resources, strict=True))
    if len(distinct) == len(ids):
        uniq: Sequence[Any] = resources
        index = None
    else:
        uniq = list(distinct.values())
        position = {key: i for i, key in enumerate(distinct)}
        index = pa.array(list(map(position.__getitem__, ids)), pa.int32())
    services = _strings([_service_name(r) for r in uniq], clean)
    maps = _map_column(uniq, clean)
    if index is None:
        return services, maps
    return services.take(index), maps.take(index)


def _nested(
    per_span: Sequence[Iterable[Mapping[str, Any]] | None],
    fields: Sequence[tuple[str, Any, pa.DataType]],
    clean: bool,
) -> list[pa.Array]:
    """List columns of the events (or links) of each span: one per ``(key, default, type)``
    field (timestamps as int ns, the rest ``str()``), then the ``attributes`` maps.

    Most spans have neither events nor links, so the common case is all empty lists.
    """
    types = [t for _, _, t in fields] + [_MAP]
    if not any(per_span):
        offsets = pa.repeat(pa.scalar(0, pa.int32()), len(per_span) + 1)
        return [pa.ListArray.from_arrays(offsets, pa.array([], t)) for t in types]
    items = [list(x or ()) for x in per_span]
    offsets = pa.array(list(accumulate(map(len, items), initial=0)), pa.int32())
    flat = list(chain.from_iterable(items))
    columns = []
    for key, default, arrow_type in fields:
        raw = [item.get(key, default) for item in flat]
        if arrow_type == _TS:
            columns.append(pa.array([int(v) for v in raw], pa.int64()).cast(_TS))
        else:
            columns.append(_strings([str(v) for v in raw], clean))
    columns.append(_map_column([item.get("attributes") for item in flat], clean))
    return [pa.ListArray.from_arrays(offsets, c) for c in columns]


_EVENT_FIELDS = (("time_ns", 0, _TS), ("name", "", pa.string()))
_LINK_FIELDS = (("trace_id", "", pa.string()), ("span_id", "", pa.string()), ("trace_state", "", pa.string()))


def spans_to_arrow(spans: Sequence[SpanRecord], *, clean: bool = False) -> pa.Table:
    """The batch as an Arrow table in :data:`schema.COLUMNS` order (same values as ``span_to_row``).

    ``clean`` stringifies odd keys and replaces lone surrogates; it is the retry path after
    the fast path raised one of :data:`BuildError`, so the common case pays nothing for it.
    """
    if not spans:
        return ARROW_SCHEMA.empty_table()
    # One comprehension per field: the interpreter specializes ``s.field`` (about 25 ns a
    # span each); operator.attrgetter takes the generic lookup and is twice as slow.
    start = [s.start_ns for s in spans]
    end = [s.end_ns for s in spans]
    resource = [s.resource for s in spans]
    events = [s.events for s in spans]
    links = [s.links for s in spans]
    if clean:
        start, end = [int(x) for x in start], [int(x) for x in end]
    start_ns = pa.array(start, pa.int64())
    duration = pc.max_element_wise(pc.subtract_checked(pa.array(end, pa.int64()), start_ns), 0)
    service, resource_attributes = _per_resource(resource, clean)
    columns: dict[str, pa.Array] = {
        "Timestamp": start_ns.cast(_TS),
        "TraceId": _strings([s.trace_id for s in spans], clean),
        "SpanId": _strings([s.span_id for s in spans], clean),
        "ParentSpanId": _strings([s.parent_span_id for s in spans], clean),
        "TraceState": _strings([s.trace_state for s in spans], clean),
        "SpanName": _strings([s.name for s in spans], clean),
        "SpanKind": _strings([s.kind for s in spans], clean),
        "ServiceName": service,
        "ResourceAttributes": resource_attributes,
        "ScopeName": _strings([s.scope_name for s in spans], clean),
        "ScopeVersion": _strings([s.scope_version for s in spans], clean),
        "SpanAttributes": _map_column([s.attributes for s in spans], clean),
        "Duration": duration.cast(pa.uint64()),
        "StatusCode": _strings([s.status_code for s in spans], clean),
        "StatusMessage": _strings([s.status_message for s in spans], clean),
    }
    for prefix, per_span, fields in (("Events.", events, _EVENT_FIELDS), ("Links.", links, _LINK_FIELDS)):
        names = [c for c in schema.COLUMNS if c.startswith(prefix)]
        columns.update(zip(names, _nested(per_span, fields, clean), strict=True))
    return pa.Table.from_arrays([columns[c] for c in schema.COLUMNS], schema=ARROW_SCHEMA)
