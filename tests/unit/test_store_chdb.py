"""The embedded chDB store, for real: spans in a temporary directory, read back through the
same SQL a fleet ClickHouse would run (no mocks, chDB is the engine).

Timestamps are "now": the table's TTL with ``ttl_only_drop_parts`` drops parts older than
the retention as soon as they are written.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otelkv import names
from otelkv.analysis.model import request_compute_rate
from otelkv.analysis.sources import InMemorySource
from otelkv.spans import SpanRecord, attr_bool, attr_float, attr_int, is_tool_span
from otelkv.spans import sql as span_sql
from otelkv.store import StoreError, open_store, queries, schema
from otelkv.store.chdb_store import ChdbStore

NOW = time.time_ns() - 3_600 * 10**9
SEC = 10**9


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChdbStore]:
    s = ChdbStore(tmp_path / "traces")
    yield s
    s.close()


def span(
    trace: str,
    sid: str,
    name: str,
    start: int,
    dur_s: float,
    attrs: dict | None = None,
    *,
    scope: str = "otelkv.fleet",
    parent: str = "",
) -> SpanRecord:
    return SpanRecord(
        trace_id=trace.ljust(32, "0"),
        span_id=sid.ljust(16, "0"),
        parent_span_id=parent.ljust(16, "0") if parent else "",
        name=name,
        kind="Internal",
        start_ns=start,
        end_ns=start + int(dur_s * SEC),
        attributes=dict(attrs or {}),
        resource={"service.name": "agent", "host.name": "h1"},
        scope_name=scope,
    )


def turn(
    conv: str, index: int, start: int, dur_s: float, total_s: float | None, trace: str, **kw
) -> SpanRecord:
    attrs = {
        names.GEN_AI_OPERATION_NAME: names.OPERATION_CHAT,
        names.GEN_AI_CONVERSATION_ID: conv,
        names.TURN_INDEX: index,
    }
    if total_s is not None:
        attrs[names.TURN_TOTAL_SECONDS] = total_s
    return span(trace, f"{trace}{index}", "chat tiny", start, dur_s, attrs, **kw)


HOSTILE = {
    "quote": 'it\'s "quoted" `back`',
    "backslash": "C:\\path\\n\\t not escapes \\",
    "newline": "line1\nline2\r\n\ttab",
    "emoji": "😀 héllo 中文",
    "control": "nul\x00 bell\x07 esc\x1b del\x7f",
    "sql": "'); DROP TABLE otel.otel_traces; --",
    "huge": "x" * 300_000,
    "json_like": '{"a": [1, 2]}',
}


def test_round_trip_with_hostile_strings(store: ChdbStore) -> None:
    original = SpanRecord(
        trace_id="ab" * 16,
        span_id="cd" * 8,
        parent_span_id="ef" * 8,
        name="kv_request decode 'x'\n",
        kind="Server",
        start_ns=NOW + 123_456_789,
        end_ns=NOW + 2 * SEC,
        attributes={**HOSTILE, "int": 42, "float": 0.25, "bool": True, "list": [1, "a"], "big": 2**62},
        resource={"service.name": "vllm\tdecode", "k\n": "v'"},
        scope_name="otelkv.engine",
        scope_version="0.1",
        status_code="Error",
        status_message="boom \\ 'x' \n",
        trace_state="k=v",
        events=[{"time_ns": NOW + 5, "name": "ev\n", "attributes": {"a": 1, "q": "'"}}],
        links=[
            {"trace_id": "11" * 16, "span_id": "22" * 8, "trace_state": "t=1", "attributes": {"x": False}}
        ],
    )
    lone = span("cafe", "beef", "lone surrogate", NOW, 0.1, {"bad": "a\ud800b"})
    assert store.insert_spans([original, lone]) == 2
    back = queries.trace_spans(store, [original.trace_id])
    assert len(back) == 1
    got = back[0]
    assert (got.trace_id, got.span_id, got.parent_span_id) == (
        original.trace_id,
        original.span_id,
        original.parent_span_id,
    )
    assert got.name == original.name and got.kind == "Server"
    assert (got.start_ns, got.end_ns) == (original.start_ns, original.end_ns)
    for key, value in HOSTILE.items():
        assert got.attributes[key] == value, key
    assert got.attributes["int"] == "42" and got.attributes["float"] == "0.25"
    assert got.attributes["bool"] == "true" and got.attributes["list"] == '[1,"a"]'
    assert attr_int(got.attributes, "big") == 2**62 and attr_bool(got.attributes, "bool") is True
    assert attr_float(got.attributes, "float") == 0.25
    assert got.resource == {"service.name": "vllm\tdecode", "k\n": "v'"}
    assert got.service_name == "vllm\tdecode"
    assert (got.scope_name, got.scope_version) == ("otelkv.engine", "0.1")
    assert (got.status_code, got.status_message, got.trace_state) == ("Error", original.status_message, "k=v")
    assert got.events == [{"time_ns": NOW + 5, "name": "ev\n", "attributes": {"a": "1", "q": "'"}}]
    assert got.links == [
        {"trace_id": "11" * 16, "span_id": "22" * 8, "trace_state": "t=1", "attributes": {"x": "false"}}
    ]
    (stored_lone,) = queries.trace_spans(store, [lone.trace_id])
    assert stored_lone.attributes["bad"] == "a\ufffdb"
    assert queries.count_spans(store) == 2
    # The MV filled the trace-id lookup table.
    rows = store.query(
        "SELECT count() AS n FROM otel.otel_traces_trace_id_ts WHERE TraceId = {t:String}",
        {"t": original.trace_id},
    )
    assert rows == [{"n": 1}]


def test_query_parameters_are_not_sql(store: ChdbStore) -> None:
    store.insert_spans([turn("conv'); DROP TABLE x; --\\n\t", 0, NOW, 1.0, 1.0, "a1")])
    got = queries.turn_spans(store, conversation_id="conv'); DROP TABLE x; --\\n\t")
    assert len(got) == 1
    assert queries.turn_spans(store, conversation_id="conv") == []


def test_turn_spans_ordering_and_filters(store: ChdbStore) -> None:
    spans = [
        turn("c1", 0, NOW, 1.0, 5.0, "t1"),  # total_s wins over duration
        turn("c1", 1, NOW + 10 * SEC, 9.0, None, "t2"),  # no total_s: duration 9 s
        turn("c1", 2, NOW + 20 * SEC, 3.0, 0.0, "t3"),  # total_s 0: duration 3 s
        turn("c2", 0, NOW + 30 * SEC, 7.0, 7.0, "t4"),
        span(
            "t5",
            "x",
            "chat tiny",
            NOW,
            100.0,
            {names.GEN_AI_OPERATION_NAME: names.OPERATION_CHAT, names.GEN_AI_CONVERSATION_ID: "c1"},
        ),  # an agent's chat span without a turn index
        span("t6", "y", "kv_request decode", NOW, 50.0, {names.TURN_INDEX: 1}),  # not a turn span
    ]
    store.insert_spans(spans)
    slowest = queries.turn_spans(store)
    assert [s.trace_id[:2] for s in slowest] == ["t2", "t4", "t1", "t3"]
    assert [s.trace_id[:2] for s in queries.turn_spans(store, slowest_first=False)] == [
        "t3",
        "t1",
        "t4",
        "t2",
    ]
    assert len(queries.turn_spans(store, limit=2)) == 2
    window = queries.turn_spans(store, since_ns=NOW + 5 * SEC, until_ns=NOW + 25 * SEC)
    assert [s.trace_id[:2] for s in window] == ["t2", "t3"]
    conv = queries.turn_spans(store, conversation_id="c1")
    assert [attr_int(s.attributes, names.TURN_INDEX) for s in conv] == [0, 1, 2]


def test_find_turn_prefers_sidecar_span(store: ChdbStore) -> None:
    store.insert_spans(
        [
            turn("c9", 3, NOW, 1.0, 1.0, "f1", scope="otelkv.fleet"),
            turn("c9", 3, NOW + SEC, 1.0, 1.0, "f1", scope=names.SCOPE_SIDECAR),
            turn("c9", 4, NOW + 2 * SEC, 1.0, 1.0, "f2"),
        ]
    )
    found = queries.find_turn(store, "c9", 3)
    assert found is not None and found.scope_name == names.SCOPE_SIDECAR
    assert queries.find_turn(store, "c9", 4) is not None
    assert queries.find_turn(store, "c9", 5) is None
    assert queries.find_turn(store, "other", 3) is None


def gap_view(span: SpanRecord) -> tuple[Any, ...]:
    """What a turn's gap split reads of a tool span (all a span index row gives of one)."""
    conv = span.attributes.get(names.GEN_AI_CONVERSATION_ID)
    return (
        is_tool_span(span),
        span.trace_id,
        span.span_id,
        span.start_ns,
        span.end_ns,
        span.scope_name,
        conv,
    )


def test_trace_spans_and_tool_spans(store: ChdbStore) -> None:
    conv = {names.GEN_AI_CONVERSATION_ID: "c1"}
    inserted = [
        turn("c1", 0, NOW, 2.0, 2.0, "aa"),
        span("aa", "r1", "kv_request prefill", NOW + 1, 0.5, parent="aa0"),
        span("bb", "r2", "kv_request decode", NOW + 2, 0.5),
        span("t7", "u1", "execute_tool search", NOW + 5 * SEC, 2.0, conv),
        span("t7", "u2", "execute_tool fetch", NOW + 20 * SEC, 1.0, {names.GEN_AI_CONVERSATION_ID: "c2"}),
        span("t7", "u3", "chat tiny", NOW + 6 * SEC, 1.0, conv),
    ]
    store.insert_spans(inserted)
    aa = queries.trace_spans(store, ["aa".ljust(32, "0")])
    assert [s.name for s in aa] == ["chat tiny", "kv_request prefill"]
    both = queries.trace_spans(store, ["aa".ljust(32, "0"), "bb".ljust(32, "0"), "missing"])
    assert len(both) == 3
    assert queries.trace_spans(store, []) == []
    # [NOW+6s, NOW+10s] overlaps the search tool (NOW+5s..NOW+7s) only.
    by_id = {s.span_id: s for s in inserted}
    search, fetch = (by_id[s.span_id] for s in inserted[3:5])
    tools = queries.tool_spans(store, since_ns=NOW + 6 * SEC, until_ns=NOW + 10 * SEC)
    assert list(map(gap_view, tools)) == [gap_view(search)]
    tools = queries.tool_spans(store, since_ns=NOW, until_ns=NOW + 60 * SEC)
    assert list(map(gap_view, tools)) == [gap_view(search), gap_view(fetch)]
    tools = queries.tool_spans(store, since_ns=NOW, until_ns=NOW + 60 * SEC, conversation_id="c2")
    assert list(map(gap_view, tools)) == [gap_view(fetch)]
    # Windows narrow the range: each keeps the tools overlapping it, as in memory.
    cases = [
        [(NOW + 6 * SEC, NOW + 6 * SEC), (NOW + 30 * SEC, NOW + 40 * SEC)],  # search only
        [(NOW + 21 * SEC, NOW + 22 * SEC)],  # fetch only (started before the window)
        [(NOW + 8 * SEC, NOW + 19 * SEC)],  # between the two: none
        [],
    ]
    memory = InMemorySource(inserted)
    for windows in cases:
        expected = memory.tool_spans(since_ns=NOW, until_ns=NOW + 60 * SEC, windows=windows)
        for store.span_index in (True, False):  # through the span index, and without it
            for conv_ids in (None, ["c1", "c2"], ["c2"]):
                tools = queries.tool_spans(
                    store, since_ns=NOW, until_ns=NOW + 60 * SEC, windows=windows, conversation_ids=conv_ids
                )
                wanted = [
                    s
                    for s in expected
                    if conv_ids is None or s.attributes[names.GEN_AI_CONVERSATION_ID] in conv_ids
                ]
                # Whole spans without the index; what the gap split reads of them with it.
                got = tools if not store.span_index else list(map(gap_view, tools))
                assert got == (wanted if not store.span_index else list(map(gap_view, wanted)))
    store.span_index = True
    assert len(queries.tool_spans(store, since_ns=NOW, until_ns=NOW + 60 * SEC, windows=cases[0])) == 1


def test_trace_spans_without_lookup_rows(store: ChdbStore) -> None:
    """Rows written before the materialized view existed must still be found."""
    store.insert_spans([span("dd", "s1", "x", NOW, 1.0)])
    store.query("TRUNCATE TABLE otel.otel_traces_trace_id_ts")
    assert len(queries.trace_spans(store, ["dd".ljust(32, "0")])) == 1


def test_data_persists_after_reopen(tmp_path: Path) -> None:
    path = tmp_path / "persist"
    with ChdbStore(path) as first:
        first.insert_spans([turn("p", 0, NOW, 1.0, 1.0, "pp")])
    again = open_store(path=path)
    try:
        assert queries.count_spans(again) == 1
        assert queries.find_turn(again, "p", 0) is not None
    finally:
        again.close()


def test_closed_store_raises(tmp_path: Path) -> None:
    s = ChdbStore(tmp_path / "closed")
    s.close()
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.query("SELECT 1")


def test_ttl_clause_and_contrib_schema(store: ChdbStore) -> None:
    ddl = store.query("SHOW CREATE TABLE otel.otel_traces")[0]["statement"]
    assert "TTL toDateTime(Timestamp) + toIntervalDay(7)" in ddl
    assert "ttl_only_drop_parts = 1" in ddl and "PARTITION BY toDate(Timestamp)" in ddl
    # The embedded store's own merge tuning, added to the collector's table settings.
    assert "vertical_merge_algorithm_min_rows_to_activate = 1" in ddl
    lookup = store.query("SHOW CREATE TABLE otel.otel_traces_trace_id_ts")[0]["statement"]
    assert "TTL toDateTime(Start) + toIntervalDay(7)" in lookup
    tables = {r["name"] for r in store.query("SELECT name FROM system.tables WHERE database = 'otel'")}
    assert tables == {
        "otel_traces",
        "otel_traces_trace_id_ts",
        "otel_traces_trace_id_ts_mv",
        "otelkv_span_index",
        "otelkv_span_index_mv",
    }
    index = store.query("SHOW CREATE TABLE otel.otelkv_span_index")[0]["statement"]
    assert "TTL toDateTime(Timestamp) + toIntervalDay(7)" in index


def rate_spans() -> list[SpanRecord]:
    """Every mix of the facts a compute rate depends on, one span each, a millisecond apart
    (as the store returns attributes: strings; a missing value is no attribute)."""
    values: dict[str, list[str | None]] = {
        names.ROLE: [names.ROLE_PREFILL, names.ROLE_DECODE, None],
        names.TOKENS_COMPUTED: ["0", "15", "16", "300", "x", "NaN", "+Inf", None],
        names.REQUEST_OUTCOME: [names.OUTCOME_FINISHED, "aborted", None],
        names.REMOTE_KV_WAIT_SECONDS: ["0", "0.25", "5", "-1", "NaN", "+Inf", "-Inf", None],
    }
    out = []
    combos = itertools.product(
        *values.values(), ["kv_request prefill", "kv_request", "chat tiny"], [2.0, 0.5]
    )
    for i, (*attr_values, name, dur_s) in enumerate(combos):
        attrs = {k: v for k, v in zip(values, attr_values, strict=True) if v is not None}
        out.append(span(f"r{i}", f"s{i}", name, NOW + i * 10**6, dur_s, {**attrs, "other": "1"}))
    return out


def test_the_store_prices_each_request_as_the_analysis_does(store: ChdbStore) -> None:
    """The span index's rate rows and the SQL over ``otel_traces`` give every request the rate
    ``request_compute_rate`` gives it (and none where it gives none), and the fastest of a
    window is the least of those."""
    spans = rate_spans()
    store.insert_spans(spans)
    python = {s.start_ns: request_compute_rate(s) for s in spans}
    wanted = {start: rate for start, rate in python.items() if rate is not None}
    assert len(wanted) >= 8 and len(python) - len(wanted) >= 3000  # both kinds are exercised
    table = store.query(
        "SELECT toUnixTimestamp64Nano(Timestamp) AS ns, Latency FROM otel.otelkv_span_index WHERE Kind = 'rate'"
    )
    assert {int(r["ns"]): pytest.approx(r["Latency"], rel=1e-12) for r in table} == wanted
    sql = store.query(
        f"SELECT toUnixTimestamp64Nano(Timestamp) AS ns, {span_sql.COMPUTE_RATE_S} AS Rate "
        f"FROM otel.otel_traces WHERE {span_sql.COMPUTE_MEASURING_SPANS}"
    )
    assert {int(r["ns"]): pytest.approx(r["Rate"], rel=1e-12) for r in sql} == wanted
    starts = sorted(python)
    windows = [
        (starts[0], starts[-1] + 1),
        (starts[0], starts[len(starts) // 3]),
        (starts[-1], starts[-1] + 1),
    ]
    for lo, hi in windows:
        truth = min((r for t, r in wanted.items() if lo <= t < hi), default=None)
        for store.span_index in (True, False):  # from the index, and as on a ClickHouse without it
            got = queries.fastest_compute_rate(store, since_ns=lo, until_ns=hi)
            assert got == (None if truth is None else pytest.approx(truth, rel=1e-12)), (lo, hi)
    store.span_index = True


def test_skip_indexes_are_built_by_merges(store: ChdbStore) -> None:
    """Inserts skip the index files; the merged part has them; the spans are found either way."""
    first, second = span("ix1", "a", "x", NOW, 1.0), span("ix2", "b", "x", NOW, 1.0)
    store.insert_spans([first])
    store.insert_spans([second])

    def index_bytes() -> list[int]:
        rows = store.query(
            "SELECT secondary_indices_compressed_bytes AS b FROM system.parts "
            "WHERE active AND database = 'otel' AND table = 'otel_traces'"
        )
        return [r["b"] for r in rows]

    assert index_bytes() == [0, 0]
    assert [s.span_id for s in queries.trace_spans(store, [second.trace_id])] == [second.span_id]
    store.query("OPTIMIZE TABLE otel.otel_traces FINAL")
    (merged,) = index_bytes()
    assert merged > 0
    assert [s.span_id for s in queries.trace_spans(store, [first.trace_id])] == [first.span_id]


def test_second_process_gets_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "locked"
    with ChdbStore(path):
        code = textwrap.dedent(
            f"""
            import sys
            from otelkv.store import StoreError
            from otelkv.store.chdb_store import ChdbStore
            try:
                ChdbStore({str(path)!r})
            except StoreError as exc:
                print(exc)
                sys.exit(3)
            sys.exit(0)
            """
        )
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).parents[2],
        )
    assert done.returncode == 3, done.stderr
    assert "is open in another process" in done.stdout
    assert "otelkv sidecar" in done.stdout and "--sidecar URL" in done.stdout


def test_slowest_turn_spans_pick_one_span_per_trace_however_far_down(store: ChdbStore) -> None:
    """Traces whose agent span is slower than the sidecar's span (which speaks for them) fill
    the first candidates: the answer is still the one-span-per-trace ranking, in a window."""
    spans, expected = [], []
    for i in range(40):
        trace = f"s{i:02d}"
        start = NOW + i * SEC
        # The agent's span: slow, not the trace's turn span (the sidecar's is).
        spans.append(turn(f"c{i}", 0, start - 1000, 1.0, 500.0 + i, trace, scope="agent"))
        spans.append(turn(f"c{i}", 0, start, 1.0, 10.0 + i, trace, scope=names.SCOPE_SIDECAR))
        expected.append((10.0 + i, trace))
    for i in range(5):  # traces with an agent's span only: that span speaks for them
        spans.append(turn(f"d{i}", 0, NOW + i * SEC, 1.0, 30.5 + i, f"a{i:02d}", scope="agent"))
        expected.append((30.5 + i, f"a{i:02d}"))
    store.insert_spans(spans)
    expected.sort(reverse=True)
    for limit in (1, 3, 12, 100):
        got = queries.turn_spans(store, limit=limit)
        assert [s.trace_id[:3] for s in got] == [t for _, t in expected[:limit]]
        assert all(s.scope_name == names.SCOPE_SIDECAR for s in got if s.trace_id.startswith("s"))
    window = queries.turn_spans(store, since_ns=NOW + 10 * SEC, until_ns=NOW + 20 * SEC, limit=4)
    # s20's sidecar span starts at the window's end, its agent's span just inside: that one counts.
    assert [(s.trace_id[:3], s.scope_name) for s in window] == [
        ("s20", "agent"),
        ("s19", names.SCOPE_SIDECAR),
        ("s18", names.SCOPE_SIDECAR),
        ("s17", names.SCOPE_SIDECAR),
    ]
    assert queries.turn_spans(store, limit=0) == []
    # The sidecar span starts in the window, the agent's before it: the sidecar's is picked.
    edge = queries.turn_spans(store, since_ns=NOW + 39 * SEC, limit=5)
    assert [(s.trace_id[:3], s.scope_name) for s in edge] == [("s39", names.SCOPE_SIDECAR)]


def test_trace_spans_read_each_trace_in_its_own_range(store: ChdbStore) -> None:
    """Traces days apart, one lasting past a whole second, and more traces than ranges."""
    far = [
        span("f1", "a", "x", NOW - 2 * 86400 * SEC, 0.1),
        span("f1", "b", "y", NOW - 2 * 86400 * SEC + 1, 0.1),
    ]
    edge = [span("e1", "a", "x", NOW, 0.1), span("e1", "b", "y", NOW + SEC + SEC - 1, 0.1)]
    many = [span(f"m{i:03d}", "a", "x", NOW + i * 10 * SEC, 0.1) for i in range(queries.MAX_TIME_RANGES + 5)]
    store.insert_spans(far + edge + many)
    assert [s.span_id[:1] for s in queries.trace_spans(store, ["f1".ljust(32, "0")])] == ["a", "b"]
    assert [s.span_id[:1] for s in queries.trace_spans(store, ["e1".ljust(32, "0")])] == ["a", "b"]
    ids = [s.trace_id for s in far + edge + many]
    assert len(queries.trace_spans(store, ids)) == len(far + edge + many)


def test_merge_ranges() -> None:
    assert queries.merge_ranges([], 3) == []
    assert queries.merge_ranges([(5, 6), (0, 2), (2, 3)], 3) == [(0, 3), (5, 6)]
    # Four ranges into two: the widest gap (10 -> 50) stays a break.
    assert queries.merge_ranges([(0, 1), (3, 4), (8, 10), (50, 51)], 2) == [(0, 10), (50, 51)]
    assert queries.merge_ranges([(0, 1), (3, 4)], 1) == [(0, 4)]


def test_an_index_from_before_its_rates_gets_them_when_opened(tmp_path: Path) -> None:
    """A span index whose view indexed turns and tools only: at open the view is replaced and
    the prefill rates already stored are indexed, once; later inserts are indexed by the view."""
    old = ChdbStore(tmp_path / "old")
    old.query("DROP TABLE otel.otelkv_span_index_mv")
    old.query(
        "CREATE MATERIALIZED VIEW otel.otelkv_span_index_mv TO otel.otelkv_span_index AS SELECT "
        f"if({span_sql.TURN_SPANS}, 'turn', 'tool') AS Kind, Timestamp, Duration, TraceId, SpanId, ScopeName, "
        f"{span_sql.attr(names.GEN_AI_CONVERSATION_ID)} AS ConversationId, {span_sql.TURN_LATENCY_S} AS Latency "
        f"FROM otel.otel_traces WHERE {span_sql.TURN_SPANS} OR {span_sql.TOOL_SPANS}"
    )
    prefill = {names.ROLE: names.ROLE_PREFILL, names.TOKENS_COMPUTED: 100, names.REQUEST_OUTCOME: "finished"}
    old.insert_spans(
        [turn("u", 0, NOW, 1.0, 1.0, "u0"), span("u0", "p1", "kv_request prefill", NOW + 2, 0.5, prefill)]
    )
    assert old.query("SELECT count() AS n FROM otel.otelkv_span_index WHERE Kind = 'rate'")[0]["n"] == 0
    # A reader of such an index (a fleet's ClickHouse nobody upgraded) prices from the spans.
    assert queries.fastest_compute_rate(old, since_ns=NOW, until_ns=NOW + SEC) == pytest.approx(0.005)
    old.close()
    for _ in range(2):  # opened twice: upgraded once
        reopened = ChdbStore(tmp_path / "old")
        try:
            kinds = reopened.query(
                "SELECT Kind, count() AS n FROM otel.otelkv_span_index GROUP BY Kind ORDER BY Kind"
            )
            assert kinds == [{"Kind": "rate", "n": 1}, {"Kind": "turn", "n": 1}]
            assert queries.fastest_compute_rate(reopened, since_ns=NOW, until_ns=NOW + SEC) == pytest.approx(
                0.005
            )
        finally:
            reopened.close()
    again = ChdbStore(tmp_path / "old")
    try:
        again.insert_spans([span("u1", "p2", "kv_request prefill", NOW + 3, 0.2, prefill)])  # the new view
        assert queries.fastest_compute_rate(again, since_ns=NOW, until_ns=NOW + SEC) == pytest.approx(0.002)
    finally:
        again.close()


def test_insert_encoded_takes_an_encoded_batch(store: ChdbStore) -> None:
    batch = store.encode_spans([turn("ia", 0, NOW, 1.0, 1.0, "ia"), turn("ia", 1, NOW + SEC, 1.0, 1.0, "ib")])
    assert store.insert_encoded(batch) == 2
    assert store.insert_encoded(store.encode_spans([])) == 0
    assert queries.find_turn(store, "ia", 1) is not None
    with pytest.raises(StoreError, match="ARROW_SCHEMA"):
        store.insert_encoded(batch.drop_columns(["TraceId"]))


def test_slowest_turn_spans_equal_the_whole_ranking(store: ChdbStore) -> None:
    """The two-step read gives the head of the one-statement ranking (``limit=None`` reads
    every turn span of the window in one query), on traces with one, two or three turn spans."""
    rng = random.Random(7)
    spans = []
    for i in range(300):
        trace = f"r{i:03d}"
        start = NOW + rng.randrange(0, 600) * SEC + i
        scopes = rng.choice(
            [[names.SCOPE_SIDECAR], ["agent"], ["agent", names.SCOPE_SIDECAR], ["agent", "agent"]]
        )
        for j, scope in enumerate(scopes):
            total = rng.choice([None, 0.0, rng.uniform(0.1, 100.0)])
            spans.append(
                turn(
                    f"c{i % 17}",
                    j,
                    start + j * rng.randrange(-5, 5) * SEC,
                    rng.uniform(0.1, 90.0),
                    total,
                    trace,
                    scope=scope,
                )
            )
    store.insert_spans(spans)
    for since, until in ((None, None), (NOW + 100 * SEC, NOW + 400 * SEC), (NOW + 590 * SEC, None)):
        whole = queries.turn_spans(store, since_ns=since, until_ns=until, limit=None)
        for limit in (1, 5, 40, 400):
            # Through the span index, and as on a ClickHouse without it.
            for store.span_index in (True, False):
                got = queries.turn_spans(store, since_ns=since, until_ns=until, limit=limit)
                assert got == whole[:limit], store.span_index
                # The same turns with their traces, read together through the index.
                turns, traces = queries.slowest_turns(store, since_ns=since, until_ns=until, limit=limit)
                assert turns == whole[:limit], store.span_index
                wanted = {s.trace_id for s in turns} if store.span_index else set()
                assert wanted <= set(traces) and all(s in traces[s.trace_id] for s in turns if wanted)
    for conv in ("c0", "c5", "c16", "nobody"):  # one conversation's turns, in time order
        for limit in (1, 3, 100):
            answers, traces = [], []
            for store.span_index in (True, False):
                answers.append(queries.turn_spans(store, conversation_id=conv, limit=limit))
                traces.append(queries.conversation_spans(store, conv, limit=limit))
            assert answers[0] == answers[1] and len(answers[0]) <= limit, conv
            assert (len(answers[0]) > 0) == (conv != "nobody")
            # Those turns' whole traces, found with or without the index.
            assert traces[0] == traces[1] == queries.trace_spans(store, [s.trace_id for s in answers[0]])
    store.span_index = True


def test_a_store_from_before_the_span_index_is_indexed_when_opened(tmp_path: Path) -> None:
    old = ChdbStore(tmp_path / "old")
    old.query("DROP TABLE otel.otelkv_span_index_mv")
    old.query("DROP TABLE otel.otelkv_span_index")
    tool = span("ot", "u1", "execute_tool search", NOW + 1, 0.5, {names.GEN_AI_CONVERSATION_ID: "o"})
    prefill = {names.ROLE: names.ROLE_PREFILL, names.TOKENS_COMPUTED: 100, names.REQUEST_OUTCOME: "finished"}
    request = span("o0", "p1", "kv_request prefill", NOW + 2, 0.5, prefill)
    old.insert_spans(
        [turn("o", i, NOW + i * SEC, 1.0 + i, 1.0 + i, f"o{i}") for i in range(3)] + [tool, request]
    )
    old.close()
    reopened = ChdbStore(tmp_path / "old")
    try:
        rate = queries.fastest_compute_rate(reopened, since_ns=NOW, until_ns=NOW + SEC)
        assert rate == pytest.approx(0.005)  # 0.5 s over 100 tokens, from the filled index
        kinds = reopened.query(
            "SELECT Kind, count() AS n FROM otel.otelkv_span_index GROUP BY Kind ORDER BY Kind"
        )
        assert kinds == [{"Kind": "rate", "n": 1}, {"Kind": "tool", "n": 1}, {"Kind": "turn", "n": 3}]
        assert [s.span_id for s in queries.tool_spans(reopened, since_ns=NOW, until_ns=NOW + SEC)] == [
            tool.span_id
        ]
        reopened.insert_spans([turn("o", 3, NOW + 3 * SEC, 9.0, 9.0, "o3")])  # the view, from now on
        slowest = queries.turn_spans(reopened, limit=2)
        assert [attr_int(s.attributes, names.TURN_INDEX) for s in slowest] == [3, 2]
    finally:
        reopened.close()
    again = ChdbStore(tmp_path / "old")  # backfilled once: opening again adds nothing
    try:
        assert again.query("SELECT count() AS n FROM otel.otelkv_span_index")[0]["n"] == 6
    finally:
        again.close()


def test_a_turn_is_read_with_the_turn_before_it_in_the_hour_before(store: ChdbStore) -> None:
    """why's and slow's reads take the latest earlier turn of the conversation in the hour
    before a turn along with it (a guess the linker checks); none beyond the hour, none
    without a conversation id; the same when the trace-id lookup lacks the traces."""
    hour = 3600 * SEC
    turns = [
        turn("g", 0, NOW - 3 * hour, 1.0, 1.0, "g0"),
        turn("g", 1, NOW - 3 * hour + 10 * SEC, 1.0, 9.0, "g1"),
        turn("g", 2, NOW - hour, 1.0, 8.0, "g2"),  # two hours after g1
        turn("", 0, NOW - hour + 5 * SEC, 1.0, 7.0, "n0"),
        turn("", 1, NOW - hour + 9 * SEC, 1.0, 1.0, "n1"),
    ]
    store.insert_spans(turns)
    ids = {s.trace_id[:2]: s.trace_id for s in turns}

    def traces(spans: list[SpanRecord]) -> set[str]:
        return {s.trace_id for s in spans}

    assert traces(queries.turn_trace_spans(store, ids["g1"])) == {ids["g1"], ids["g0"]}
    assert traces(queries.turn_trace_spans(store, ids["g2"])) == {ids["g2"]}
    assert traces(queries.turn_trace_spans(store, ids["n1"])) == {ids["n1"]}
    slowest, read = queries.slowest_turns(store, since_ns=None, until_ns=None, limit=3)
    assert [s.trace_id for s in slowest] == [ids["g1"], ids["g2"], ids["n0"]]
    assert set(read) == {ids["g1"], ids["g0"], ids["g2"], ids["n0"]}
    store.span_index = False  # as on a ClickHouse without the index: the trace alone
    try:
        assert traces(queries.turn_trace_spans(store, ids["g1"])) == {ids["g1"]}
        assert queries.slowest_turns(store, since_ns=None, until_ns=None, limit=3) == (slowest, {})
    finally:
        store.span_index = True
    whole = queries.turn_trace_spans(store, ids["g1"])
    store.query("TRUNCATE TABLE otel.otel_traces_trace_id_ts")  # spans from before its view
    assert queries.turn_trace_spans(store, ids["g1"]) == whole
    assert traces(queries.turn_trace_spans(store, ids["g2"])) == {ids["g2"]}


def test_the_sidecar_lets_the_embedded_store_take_a_backlog_in_larger_inserts(tmp_path: Any) -> None:
    """chDB's cost per span falls with the insert's size; a ClickHouse server over HTTP keeps
    one batch per insert (``test_store_clickhouse_http``)."""
    from otelkv.sidecar.app import Sidecar, SidecarConfig
    from otelkv.store.writer import BatchWriter

    sidecar = Sidecar(SidecarConfig(upstream="http://127.0.0.1:9", store_path=tmp_path / "store"))
    sidecar._open_store()
    try:
        assert sidecar.writer is not None
        assert sidecar.writer.batch_spans == BatchWriter.BATCH_SPANS
        assert sidecar.writer.max_batch_spans == ChdbStore.largest_insert_spans > BatchWriter.BATCH_SPANS
    finally:
        assert sidecar.writer is not None and sidecar.writer.close()
        sidecar.store.close()


def test_the_views_write_what_their_queries_select_under_the_default_analyzer(store: ChdbStore) -> None:
    """Inserts run the views under the old analyzer (cheaper per insert); the span index and
    the trace-id lookup must hold what the views' queries select from ``otel_traces`` under
    ClickHouse's default analyzer, which every read uses."""
    assert "enable_analyzer = 0" in store.insert_settings
    sidecar = {names.GEN_AI_OPERATION_NAME: names.OPERATION_CHAT, names.GEN_AI_CONVERSATION_ID: "cs"}
    spans = [
        *rate_spans(),
        turn("c1", 0, NOW, 2.0, 2.5, "aa"),
        turn("c1", 1, NOW + 5 * SEC, 1.0, None, "ab"),
        span(
            "ac",
            "s1",
            "chat tiny",
            NOW + 9 * SEC,
            1.5,
            {**sidecar, names.TURN_TOTAL_SECONDS: "x"},
            scope="otelkv.sidecar",
        ),
        span(
            "ad",
            "s2",
            "chat",
            NOW + 9 * SEC,
            1.5,
            {names.GEN_AI_OPERATION_NAME: "text_completion"},
            scope="otelkv.sidecar",
        ),
        span(
            "ae", "s3", "chat tiny", NOW + 9 * SEC, 1.5, {names.GEN_AI_OPERATION_NAME: names.OPERATION_CHAT}
        ),
        span("t7", "u1", "execute_tool search", NOW + 5 * SEC, 2.0, {names.GEN_AI_CONVERSATION_ID: "c1"}),
        span("t7", "u2", "lookup", NOW + 6 * SEC, 2.0, {names.GEN_AI_OPERATION_NAME: "execute_tool"}),
        span("o1", "u3", "orphan", NOW + 7 * SEC, 0.1, HOSTILE),
    ]
    for i in range(0, len(spans), 700):  # several inserts, each running the views
        store.insert_spans(spans[i : i + 700])
    columns = (
        "Kind, toUnixTimestamp64Nano(Timestamp) AS ns, Duration, TraceId, SpanId, ScopeName, "
        "ConversationId, Latency"
    )
    indexed = store.query(f"SELECT {columns} FROM otel.otelkv_span_index ORDER BY ALL")
    selected = store.query(
        f"SELECT {columns} FROM ({schema.index_select()}) ORDER BY ALL SETTINGS enable_analyzer = 1"
    )
    assert indexed == selected
    assert {r["Kind"] for r in indexed} == {"turn", "tool", "rate"}
    assert sum(r["Kind"] == "turn" for r in indexed) == 4  # c1's two, the sidecar's chat and completion
    looked_up = store.query(
        "SELECT TraceId, min(Start) AS lo, max(End) AS hi FROM otel.otel_traces_trace_id_ts "
        "GROUP BY TraceId ORDER BY TraceId"
    )
    wanted = store.query(  # the lookup's columns are DateTime: its view's rows, so converted
        "SELECT TraceId, toDateTime(min(Start)) AS lo, toDateTime(max(End)) AS hi "
        f"FROM ({schema.trace_id_lookup_select()}) GROUP BY TraceId ORDER BY TraceId "
        "SETTINGS enable_analyzer = 1"
    )
    assert looked_up == wanted and len(wanted) == len({s.trace_id for s in spans})


def test_an_insert_setting_this_chdb_does_not_know_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from otelkv.store import chdb_store

    monkeypatch.setattr(chdb_store, "_INSERT_SETTINGS", (*chdb_store._INSERT_SETTINGS, "no_such_setting = 1"))
    store = ChdbStore(tmp_path / "traces")
    try:
        assert store.insert_settings == chdb_store._INSERT_SETTINGS[:-1]
        assert store.insert_spans([turn("u", 0, NOW, 1.0, 1.0, "u1")]) == 1
        assert queries.find_turn(store, "u", 0) is not None
    finally:
        store.close()
