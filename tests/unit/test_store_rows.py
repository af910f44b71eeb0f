"""Rows and attribute rendering (pure logic): values stored the way the contrib exporter's
``pcommon.Value.AsString`` renders them, and getters that read both forms without raising."""

from __future__ import annotations

import pytest

from otelkv.spans import SpanRecord
from otelkv.spans.attrs import attr_bool, attr_float, attr_int, attr_str, attr_value, format_float
from otelkv.store import schema
from otelkv.store.base import param_text
from otelkv.store.rows import row_to_span, span_to_row


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1.0, "1"),
        (-3.0, "-3"),
        (0.25, "0.25"),
        (0.1 + 0.2, "0.30000000000000004"),
        (1e21, "1000000000000000000000"),
        (1.5e-7, "0.00000015"),
        (float("nan"), "NaN"),
        (float("inf"), "+Inf"),
        (float("-inf"), "-Inf"),
        (-0.0, "-0"),
    ],
)
def test_format_float_matches_go(value: float, text: str) -> None:
    assert format_float(value) == text


def test_attr_value_like_as_string() -> None:
    assert attr_value("x") == "x"
    assert attr_value(True) == "true" and attr_value(False) == "false"
    assert attr_value(123) == "123"
    assert attr_value(None) == ""
    assert attr_value(b"\x00\x01") == "AAE="
    assert attr_value([1, "a", True]) == '[1,"a",true]'
    assert attr_value({"k": [1.5]}) == '{"k":[1.5]}'


def test_span_to_row_order_and_values() -> None:
    s = SpanRecord(
        trace_id="t",
        span_id="s",
        parent_span_id="",
        name="chat m",
        kind="Server",
        start_ns=10,
        end_ns=25,
        attributes={"a": 1},
        resource={"service.name": "svc"},
        events=[{"time_ns": 11, "name": "e", "attributes": {"b": False}}],
        links=[{"trace_id": "lt", "span_id": "ls", "attributes": {}}],
    )
    row = dict(zip(schema.COLUMNS, span_to_row(s), strict=True))
    assert row["Timestamp"] == 10 and row["Duration"] == 15 and row["ServiceName"] == "svc"
    assert row["SpanAttributes"] == {"a": "1"}
    assert row["Events.Attributes"] == [{"b": "false"}] and row["Links.TraceState"] == [""]
    back = row_to_span({"StartNs": 10, "Duration": "15", "SpanAttributes": {"a": "1"}, "EventsNs": ["11"]})
    assert (back.start_ns, back.end_ns, back.events[0]["time_ns"]) == (10, 25, 11)


def test_row_to_span_accepts_select_star_timestamps() -> None:
    back = row_to_span({"Timestamp": "1970-01-01 00:00:01.000000002", "Duration": 3})
    assert (back.start_ns, back.end_ns) == (1_000_000_002, 1_000_000_005)


def test_typed_getters_read_native_and_stored_forms() -> None:
    a = {
        "i": 12,
        "si": "12",
        "sf": "1.5",
        "f": 1.5,
        "t": True,
        "st": "true",
        "sF": "false",
        "bad": "x",
        "nan": "NaN",
    }
    assert attr_int(a, "i") == 12 and attr_int(a, "si") == 12 and attr_int(a, "sf") == 1
    assert attr_int(a, "bad", -1) == -1 and attr_int(a, "missing", 7) == 7 and attr_int(a, "nan", 5) == 5
    assert attr_float(a, "sf") == 1.5 and attr_float(a, "f") == 1.5 and attr_float(a, "i") == 12.0
    assert attr_float(a, "bad", 2.0) == 2.0 and attr_float(None, "x", 3.0) == 3.0
    assert attr_bool(a, "t") is True and attr_bool(a, "st") is True and attr_bool(a, "sF") is False
    assert attr_bool(a, "bad", True) is True and attr_bool(a, "missing") is False
    assert attr_str(a, "t") == "true" and attr_str(a, "i") == "12" and attr_str(a, "missing", "d") == "d"
    assert attr_int({"x": [1]}, "x", 4) == 4 and attr_float({"x": object()}, "x", 1.0) == 1.0


def test_param_text_escapes() -> None:
    assert param_text("a\\b\tc\nd") == "a\\\\b\\tc\\nd"
    assert param_text(["x'y", "z"]) == "['x\\'y','z']"
    assert param_text(5) == "5" and param_text(True) == "true"


def test_ddl_renders_retention() -> None:
    days = schema.create_statements("otel", retention_days=3)
    assert days[0] == "CREATE DATABASE IF NOT EXISTS `otel`"
    assert "TTL toDateTime(Timestamp) + toIntervalDay(3)" in days[1]
    assert "TTL toDateTime(Start) + toIntervalDay(3)" in days[2]
    hours = schema.create_statements("otel", retention_hours=36)
    assert "toIntervalHour(36)" in hours[1]
    assert "TTL" not in schema.create_statements("otel", retention_days=0)[1]
    with pytest.raises(ValueError):
        schema.create_statements("otel; DROP")
