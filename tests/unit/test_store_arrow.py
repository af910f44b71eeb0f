"""The chDB store's column-wise Arrow batch holds the same values as ``span_to_row`` (pure
logic, no database): the HTTP store writes rows that way, so both stores must agree, and
the fast path renders most attribute values in Arrow rather than with ``attr_value``."""

from __future__ import annotations

import enum
import math
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otelkv.spans import SpanRecord
from otelkv.store import arrow_batch, schema
from otelkv.store.arrow_batch import ARROW_SCHEMA, spans_to_arrow
from otelkv.store.rows import span_to_row

# Text Arrow can encode (lone surrogates take the clean path, tested against chDB).
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
LEAF = st.one_of(
    TEXT,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e21, 1.5e-7, 1e16, 123456789012345678.0, 2.5e-5, -0.0, 1.0, 0.1 + 0.2]),
    st.booleans(),
    st.none(),
    st.binary(max_size=4),
)
VALUE = st.one_of(LEAF, st.lists(LEAF, max_size=3), st.dictionaries(TEXT, LEAF, max_size=2))
ATTRS = st.dictionaries(TEXT, VALUE, max_size=6)
NESTED_ATTRS = st.one_of(st.none(), ATTRS)
EVENT = st.fixed_dictionaries(
    {}, optional={"time_ns": st.integers(0, 2**62), "name": TEXT, "attributes": NESTED_ATTRS}
)
LINK = st.fixed_dictionaries(
    {},
    optional={"trace_id": TEXT, "span_id": TEXT, "trace_state": TEXT, "attributes": NESTED_ATTRS},
)


@st.composite
def batches(draw: st.DrawFn) -> list[SpanRecord]:
    """Spans that share some resource dicts (as OTLP resources are shared) and not others."""
    resources = draw(st.lists(ATTRS, min_size=1, max_size=3))
    out = []
    for _ in range(draw(st.integers(1, 8))):
        start = draw(st.integers(0, 2**62))
        out.append(
            SpanRecord(
                trace_id=draw(TEXT),
                span_id=draw(TEXT),
                parent_span_id=draw(TEXT),
                name=draw(TEXT),
                kind=draw(st.sampled_from(["Server", "Internal", "Client"])),
                start_ns=start,
                end_ns=start + draw(st.integers(-(10**9), 10**12)),  # negative: duration 0
                attributes=draw(ATTRS),
                resource=draw(st.sampled_from(resources)) if draw(st.booleans()) else draw(ATTRS),
                scope_name=draw(TEXT),
                scope_version=draw(TEXT),
                status_code=draw(st.sampled_from(["Unset", "Ok", "Error"])),
                status_message=draw(TEXT),
                trace_state=draw(TEXT),
                events=draw(st.lists(EVENT, max_size=2)),
                links=draw(st.lists(LINK, max_size=2)),
            )
        )
    return out


def as_rows(table: pa.Table) -> list[tuple[Any, ...]]:
    """The table in span_to_row's shape: timestamps as int ns, maps as dicts."""

    def plain(value: Any, arrow_type: pa.DataType) -> Any:
        if pa.types.is_map(arrow_type):
            return dict(value)
        if pa.types.is_list(arrow_type):
            return [plain(v, arrow_type.value_type) for v in value]
        return value

    columns = []
    for column in table.columns:
        arrow_type = column.type
        if arrow_type == pa.timestamp("ns", tz="UTC"):
            column = column.cast(pa.int64())
        elif pa.types.is_list(arrow_type) and pa.types.is_timestamp(arrow_type.value_type):
            column = column.cast(pa.list_(pa.int64()))
        columns.append([plain(v, arrow_type) for v in column.to_pylist()])
    return list(zip(*columns, strict=True))


def same(a: Any, b: Any) -> bool:
    """Equality where NaN == NaN (none reach here: floats are rendered to text)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_arrow_batch_equals_span_to_row(spans: list[SpanRecord]) -> None:
    table = spans_to_arrow(spans)
    assert table.schema == ARROW_SCHEMA
    assert as_rows(table) == [span_to_row(s) for s in spans]


def test_attribute_values_rendered_like_the_exporter() -> None:
    attrs = {
        "s": "x",
        "i": -12,
        "big": 2**64,
        "f": 0.25,
        "exp": 1e21,
        "tiny": 1.5e-7,
        "whole": 3.0,
        "nan": float("nan"),
        "inf": float("-inf"),
        "t": True,
        "none": None,
        "list": [1, "a"],
    }
    span = SpanRecord("t", "s", "", "n", "Internal", 5, 7, attrs, {"service.name": "svc"})
    (row,) = spans_to_arrow([span]).select(["SpanAttributes", "ServiceName", "Duration"]).to_pylist()
    assert dict(row["SpanAttributes"]) == {
        "s": "x",
        "i": "-12",
        "big": "18446744073709551616",
        "f": "0.25",
        "exp": "1000000000000000000000",
        "tiny": "0.00000015",
        "whole": "3",
        "nan": "NaN",
        "inf": "-Inf",
        "t": "true",
        "none": "",
        "list": '[1,"a"]',
    }
    assert (row["ServiceName"], row["Duration"]) == ("svc", 2)


def test_shared_resources_are_rendered_per_span_and_order_is_kept() -> None:
    shared = {"service.name": "a", "host.name": "h"}
    spans = [
        SpanRecord(
            f"t{i}", "s", "", "n", "Internal", 0, 1, {"i": i}, shared if i % 2 else {"service.name": "b"}
        )
        for i in range(5)
    ]
    table = spans_to_arrow(spans)
    assert table["ServiceName"].to_pylist() == ["b", "a", "b", "a", "b"]
    assert [dict(m) for m in table["ResourceAttributes"].to_pylist()] == [
        {"service.name": "b"},
        shared,
        {"service.name": "b"},
        shared,
        {"service.name": "b"},
    ]
    assert table["TraceId"].to_pylist() == [f"t{i}" for i in range(5)]


def test_empty_batch_and_column_order() -> None:
    assert spans_to_arrow([]).num_rows == 0
    assert [f.name for f in ARROW_SCHEMA] == [c.replace(".", "_") for c in schema.COLUMNS]


@pytest.mark.parametrize("bad", ["a\ud800b", 1.5])
def test_clean_path_takes_what_the_fast_path_refuses(bad: Any) -> None:
    """Lone surrogates (from JSON) and non-int timestamps are fixed by ``clean=True``."""
    span = SpanRecord("t", "s", "", "n", "Internal", 10, 20, {"k": bad}, {})
    if isinstance(bad, float):
        span.start_ns = 10.0  # type: ignore[assignment]
    table = spans_to_arrow([span], clean=True)
    (row,) = table.select(["SpanAttributes", "Duration"]).to_pylist()
    assert dict(row["SpanAttributes"]) == {"k": "a\ufffdb" if isinstance(bad, str) else "1.5"}
    assert row["Duration"] == 10


class Level(enum.IntEnum):
    LOW = 1


class Word(str, enum.Enum):
    A = "a"


# Values of one key vary in type between spans: the key-by-key path must fall back per key.
SHAPED_LEAF = st.one_of(
    st.sampled_from([0, -7, 2**63 - 1, 2**64, True, False, 0.5, 1e16, 1.5e-7, -0.0, float("nan"), None]),
    st.sampled_from([Level.LOW, Word.A, b"\x00\xff", [1, "a"], {"k": 1.5}]),
    TEXT,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
)


@st.composite
def shaped_batches(draw: st.DrawFn) -> list[SpanRecord]:
    """Many spans per key shape (as one code path makes them), a few of rare shapes, and keys
    whose values keep one type across spans or change it."""
    shapes = draw(st.lists(st.lists(TEXT, min_size=1, max_size=5, unique=True), min_size=1, max_size=3))
    # Per key: one fixed type for every span (the common case) or anything.
    fixed = [[draw(st.sampled_from([None, str, int, float, bool])) for _ in shape] for shape in shapes]
    typed = {str: TEXT, int: st.integers(-(2**63), 2**63 - 1), float: st.floats(), bool: st.booleans()}
    out = []
    for i in range(draw(st.integers(arrow_batch.MIN_SHAPE_ROWS, 3 * arrow_batch.MIN_SHAPE_ROWS))):
        if draw(st.integers(0, 9)) == 0:
            attrs = draw(ATTRS)  # a rare shape
        else:
            s = draw(st.integers(0, len(shapes) - 1))
            attrs = {
                k: draw(typed[t] if t is not None else SHAPED_LEAF)
                for k, t in zip(shapes[s], fixed[s], strict=True)
            }
        out.append(SpanRecord(f"t{i}", "s", "", "n", "Internal", i, i + 1, attrs, {"service.name": "svc"}))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shaped_batches())
def test_key_by_key_path_equals_span_to_row(spans: list[SpanRecord]) -> None:
    table = spans_to_arrow(spans)
    assert as_rows(table) == [span_to_row(s) for s in spans]


def test_key_by_key_path_is_taken_and_keeps_row_order() -> None:
    """Two interleaved shapes of typed values, plus rare and empty maps, back in row order."""
    n = 4 * arrow_batch.MIN_SHAPE_ROWS
    attrs = [
        {"a": i, "b": f"s{i}", "c": i / 4, "d": i % 2 == 0}
        if i % 3 == 0
        else ({"x": 1e16 * i, "y": Level.LOW, "z": None} if i % 3 == 1 else ({} if i % 2 else {"rare": [i]}))
        for i in range(n)
    ]
    spans = [SpanRecord(f"t{i}", "s", "", "n", "Internal", 0, 1, a, {}) for i, a in enumerate(attrs)]
    maps = [dict(m) for m in spans_to_arrow(spans)["SpanAttributes"].to_pylist()]
    assert maps == [span_to_row(s)[11] for s in spans]
    assert maps[0] == {"a": "0", "b": "s0", "c": "0", "d": "true"}
    assert maps[1] == {"x": "10000000000000000", "y": "1", "z": ""}
