"""The query service (slow / conversation / why) over an in-memory span source."""

from __future__ import annotations

import json
from typing import Any

import pytest

from otelkv import names
from otelkv.analysis.report import PREFIX_MATCH_LIMIT, BadRef, NotFound, conversation, parse_ref, slow, why
from otelkv.analysis.sources import InMemorySource, StoreSource
from otelkv.spans import SpanRecord
from tests.unit.test_diagnose import T0, S, stored, turn_trace

FORMS = pytest.mark.parametrize("form", [lambda s: s, stored], ids=["native", "stored"])


def lapse_conversation(conv: str = "conv-lapse") -> list[SpanRecord]:
    """Turn 0 (KV kept 12 s, expired), turn 1 after a 20 s tool wait (recomputed), turn 2 pulled."""
    t0 = turn_trace(
        conv,
        0,
        start_s=100.0,
        retention={names.RETENTION_OUTCOME: names.RETENTION_EXPIRED, names.RETENTION_HELD_SECONDS: 12.0},
    )
    t1 = turn_trace(
        conv,
        1,
        start_s=121.0,
        gap_s=20.0,
        prev_trace=t0[0].trace_id,
        prefill={names.PULL_REASON: names.REASON_NO_DECODE_HANDLE},
        router={names.ROUTER_HANDLE: names.ROUTER_HANDLE_STALE},
        retention={names.RETENTION_OUTCOME: names.RETENTION_CONSUMED, names.RETENTION_HELD_SECONDS: 1.0},
    )
    t2 = turn_trace(
        conv,
        2,
        start_s=123.0,
        gap_s=1.0,
        prev_trace=t1[0].trace_id,
        prefill={
            names.PULL_DECISION: names.DECISION_PULL,
            names.TOKENS_PULLED: 256,
            names.TOKENS_COMPUTED: 44,
            names.TOKENS_REMOTE_REUSABLE: 256,
        },
        prefill_transfer={},
    )
    return t0 + t1 + t2


def quick_conversation() -> list[SpanRecord]:
    t0 = turn_trace("conv-quick", 0, start_s=200.0, request_s=0.5)
    t1 = turn_trace("conv-quick", 1, start_s=200.7, gap_s=0.2, request_s=0.5, prev_trace=t0[0].trace_id)
    return t0 + t1


class CountingSource(InMemorySource):
    def __init__(self, spans: list[SpanRecord]) -> None:
        super().__init__(spans)
        self.calls: list[str] = []

    def turn_spans(self, **kw: Any) -> list[SpanRecord]:
        self.calls.append("turn_spans")
        return super().turn_spans(**kw)

    def trace_spans(self, trace_ids: Any) -> list[SpanRecord]:
        self.calls.append("trace_spans")
        return super().trace_spans(trace_ids)

    def tool_spans(self, **kw: Any) -> list[SpanRecord]:
        self.calls.append("tool_spans")
        return super().tool_spans(**kw)


@FORMS
def test_slow_lists_slowest_with_top_diagnosis(form: Any) -> None:
    source = CountingSource(form(lapse_conversation() + quick_conversation()))
    data = slow(source, limit=3)
    json.dumps(data)  # JSON-able
    rows = data["turns"]
    assert len(rows) == 3
    assert rows[0]["conversation_id"] == "conv-lapse" and rows[0]["turn_index"] == 1
    assert rows[0]["total_s"] == pytest.approx(21.0)
    assert rows[0]["phases"]["tool_wait_s"] == pytest.approx(20.0)
    assert rows[0]["diagnoses"][0]["id"] == names.DIAG_TOOL_WAIT_DOMINATES
    assert [r["total_s"] for r in rows] == sorted((r["total_s"] for r in rows), reverse=True)
    assert set(rows[0]) >= {
        "trace_id",
        "conversation_id",
        "turn_index",
        "start_ns",
        "total_s",
        "phases",
        "ttft_s",
        "status",
        "diagnoses",
    }
    assert source.calls == ["turn_spans", "trace_spans", "tool_spans"]


def test_slow_window_and_empty() -> None:
    source = InMemorySource(lapse_conversation() + quick_conversation())
    data = slow(source, since_ns=T0 + 150 * S, limit=10)
    assert {r["conversation_id"] for r in data["turns"]} == {"conv-quick"}
    assert slow(source, since_ns=T0 + 10_000 * S)["turns"] == []


@FORMS
def test_conversation_waterfall(form: Any) -> None:
    data = conversation(InMemorySource(form(lapse_conversation() + quick_conversation())), "conv-lapse")
    json.dumps(data)
    rows = data["turns"]
    assert [r["turn_index"] for r in rows] == [0, 1, 2]
    assert rows[0]["decode"]["retention"] == {
        "kind": "decode_ttl",
        "outcome": "expired",
        "held_s": 12.0,
        "ttl_s": 12.0,
        "blocks": 10,
        "bytes": 10 << 16,
    }
    assert names.DIAG_TTL_LAPSED in [d["id"] for d in rows[1]["diagnoses"]]
    assert rows[1]["prefill"]["reason"] == names.REASON_NO_DECODE_HANDLE
    pull = rows[2]["prefill"]
    assert pull["tokens"]["pulled"] == 256 and pull["transfer"]["bytes"] == 1 << 20
    assert pull["decision"] == "pull" and pull["kv_recompute_threshold"] == 64
    assert rows[0]["offset_s"] == 0.0 and rows[1]["offset_s"] == pytest.approx(1.0)
    assert data["turn_count"] == 3


def test_conversation_not_found() -> None:
    with pytest.raises(NotFound, match="no turns for conversation 'nope'"):
        conversation(InMemorySource(lapse_conversation()), "nope")


@FORMS
def test_why_by_trace_id_and_by_index(form: Any) -> None:
    spans = form(lapse_conversation())
    source = InMemorySource(spans)
    by_index = why(source, "conv-lapse#1")
    json.dumps(by_index)
    turn = by_index["turn"]
    by_trace = why(source, turn["trace_id"].upper())
    assert turn == by_trace["turn"]
    found = {d["id"]: d for d in turn["diagnoses"]}
    ttl = found[names.DIAG_TTL_LAPSED]
    assert ttl["evidence"]["gap_s"] == 20.0 and ttl["evidence"]["previous_retention_outcome"] == "expired"
    assert ttl["fix"] and ttl["summary"]
    assert turn["phases"]["tool_wait_s"] == pytest.approx(20.0)
    assert turn["router"]["handle"] == names.ROUTER_HANDLE_STALE
    assert turn["turn_index"] == 1


def test_why_reads_the_trace_once_and_its_predecessor_once() -> None:
    source = CountingSource(lapse_conversation())
    turn = why(source, "conv-lapse#1")["turn"]
    assert turn["previous_trace_id"] and turn["diagnoses"]
    assert source.calls.count("trace_spans") == 2


def test_why_recomputes_gap_split_with_tool_spans() -> None:
    spans = lapse_conversation()
    gap_start = T0 + 101 * S
    tool = SpanRecord(
        "e" * 32,
        "00000000000000ff",
        "",
        "execute_tool deploy",
        "Internal",
        gap_start + 2 * S,
        gap_start + 7 * S,
        {names.GEN_AI_OPERATION_NAME: "execute_tool", names.GEN_AI_CONVERSATION_ID: "conv-lapse"},
        {},
    )
    data = why(InMemorySource([*spans, tool]), "conv-lapse#1")
    turn = data["turn"]
    assert turn["phases"]["tool_wait_s"] == pytest.approx(5.0)
    assert turn["phases"]["app_work_s"] == pytest.approx(15.0)
    assert turn["gap_source"] == names.GAP_SOURCE_AGENT_SPANS
    assert turn["diagnoses"][0]["id"] == names.DIAG_APP_WORK_DOMINATES


def test_why_not_found_and_bad_refs() -> None:
    source = InMemorySource(lapse_conversation())
    with pytest.raises(NotFound, match="no turn 9 in conversation 'conv-lapse'"):
        why(source, "conv-lapse#9")
    with pytest.raises(NotFound, match="no spans for trace"):
        why(source, "0" * 32)
    for bad in ("hello", "conv#x", "#3", "abc", "a" * 33):
        with pytest.raises(BadRef, match="neither a trace id"):
            why(source, bad)


def test_parse_ref() -> None:
    assert parse_ref("AB" * 16) == ("trace", "ab" * 16, None)
    assert parse_ref("team#a#12") == ("turn", "team#a", 12)
    assert parse_ref(" AB12cd ") == ("prefix", "ab12cd", None)
    with pytest.raises(BadRef):
        parse_ref("conv#-1")


def test_engine_only_trace_answers_why() -> None:
    engine_only = [s for s in turn_trace("conv-x", 3) if s.name.startswith(("kv_", "router"))]
    data = why(InMemorySource(engine_only), engine_only[0].trace_id)
    assert data["turn"]["source"] == "engine" and data["turn"]["prefill"] is not None


def test_store_source_answers_like_memory(tmp_path: Any) -> None:
    """The same spans give the same answers from a real chDB store (values read back as strings)."""
    import dataclasses
    import time

    from otelkv.store.chdb_store import ChdbStore

    # Recent timestamps: the store's TTL drops spans older than its retention on insert.
    shift = time.time_ns() - T0 - 3600 * S
    # A conversation whose turn 2 goes on from turn 0, not from turn 1 (the agent resumed an
    # earlier state): the latest earlier turn is not always the previous one.
    f0 = turn_trace("conv-fork", 0, start_s=300.0)
    f1 = turn_trace("conv-fork", 1, start_s=302.0, gap_s=0.5, prev_trace=f0[0].trace_id)
    f2 = turn_trace("conv-fork", 2, start_s=304.0, gap_s=0.5, prev_trace=f0[0].trace_id)

    def tool(span_id: str, start_s: float, end_s: float, conv: str | None) -> SpanRecord:
        attrs = {names.GEN_AI_OPERATION_NAME: "execute_tool"}
        if conv is not None:
            attrs[names.GEN_AI_CONVERSATION_ID] = conv
        start, end = T0 + int(start_s * S), T0 + int(end_s * S)
        return SpanRecord("e" * 32, span_id, "", "execute_tool deploy", "Internal", start, end, attrs, {})

    # Tool spans in conv-lapse's 20 s gap before turn 1 (one across the gap's start), one of
    # another conversation and one without a conversation id in the same gap.
    tools = [
        tool("00000000000000f1", 99.0, 104.0, "conv-lapse"),
        tool("00000000000000f2", 110.0, 113.0, "conv-lapse"),
        tool("00000000000000f3", 105.0, 118.0, "conv-quick"),
        tool("00000000000000f4", 106.0, 119.0, None),
    ]
    spans = [
        dataclasses.replace(sp, start_ns=sp.start_ns + shift, end_ns=sp.end_ns + shift)
        for sp in lapse_conversation() + quick_conversation() + f0 + f1 + f2 + tools
    ]
    # The agent's own client span in each turn's trace (as the reference driver sends it):
    # a second turn span in the trace, which must not make a second turn.
    agents = [
        dataclasses.replace(
            sp,
            span_id=f"{i:016x}",
            scope_name=names.SCOPE_FLEET,
            start_ns=sp.start_ns - 1000,
            end_ns=sp.end_ns + 1000,
        )
        for i, sp in enumerate(
            s for s in spans if s.scope_name == names.SCOPE_SIDECAR and s.name.startswith("chat ")
        )
    ]
    assert agents
    spans += agents
    store = ChdbStore(tmp_path / "store")
    try:
        assert store.insert_spans(spans) == len(spans)
        disk, memory = StoreSource(store), InMemorySource(spans)
        assert len(slow(disk, limit=50)["turns"]) == len(agents)
        answers = [lambda src: slow(src, limit=5), lambda src: slow(src, limit=20)]
        for conv, turns in (("conv-lapse", 3), ("conv-quick", 2), ("conv-fork", 3)):
            answers.append(lambda src, conv=conv: conversation(src, conv))
            answers += [lambda src, ref=f"{conv}#{i}": why(src, ref) for i in range(turns)]
        for fn in answers:
            # Through the span index (the previous turn read beside the turn), and without it.
            for store.span_index in (True, False):
                assert json.loads(json.dumps(fn(disk), default=str)) == json.loads(
                    json.dumps(fn(memory), default=str)
                )
        store.span_index = True
        assert why(disk, "conv-fork#2")["turn"]["previous_trace_id"] == f0[0].trace_id
        # The gap before conv-lapse#1 (101 s to 121 s) held conv-lapse's tools for 3 + 3 s.
        assert why(disk, "conv-lapse#1")["turn"]["phases"]["tool_wait_s"] == pytest.approx(6.0)
    finally:
        store.close()


# ------------------------------------------------------------------ short trace ids

ID0 = "abcd0001" + "1" * 24
ID1 = "abcd1234" + "2" * 24
ID2 = "ef012345" + "3" * 24
TOOL_TRACE = "abcd9999" + "4" * 24
"""An agent's tool-call trace: shares the prefix ``abcd`` but holds no turn."""
ENGINE_TRACE = "abcd5555" + "5" * 24
"""An engine request whose trace holds no turn (no sidecar in front): shares ``abcd`` too."""


def short_id_spans(shift_ns: int = 0) -> list[SpanRecord]:
    """conv-lapse with trace ids chosen here (two share ``abcd``), plus a tool span and an
    engine request whose trace ids share it too, all moved ``shift_ns`` (a store drops spans
    older than its retention)."""
    import dataclasses

    spans = lapse_conversation()
    order = sorted(
        {s.trace_id for s in spans}, key=lambda t: min(s.start_ns for s in spans if s.trace_id == t)
    )
    ids = dict(zip(order, (ID0, ID1, ID2), strict=True))
    out = [
        dataclasses.replace(
            s,
            trace_id=ids[s.trace_id],
            start_ns=s.start_ns + shift_ns,
            end_ns=s.end_ns + shift_ns,
            attributes={k: ids.get(v, v) if isinstance(v, str) else v for k, v in s.attributes.items()},
        )
        for s in spans
    ]
    tool = SpanRecord(
        TOOL_TRACE,
        "00000000000000fe",
        "",
        "execute_tool search",
        "Internal",
        T0 + 102 * S + shift_ns,
        T0 + 103 * S + shift_ns,
        {names.GEN_AI_OPERATION_NAME: "execute_tool", names.GEN_AI_CONVERSATION_ID: "conv-lapse"},
        {},
    )
    request = SpanRecord(
        ENGINE_TRACE,
        "00000000000000fd",
        "",
        "kv_request prefill",
        "Internal",
        T0 + 200 * S + shift_ns,
        T0 + 201 * S + shift_ns,
        {names.ROLE: names.ROLE_PREFILL},
        {},
    )
    return [*out, tool, request]


def check_short_ids(source: Any) -> None:
    """The lookup by prefix, against the ids the spans were given (not ones read back)."""
    assert why(source, "conv-lapse#1")["turn"]["trace_id"] == ID1  # the spans are what we built
    assert why(source, ID1[:8])["turn"]["trace_id"] == ID1  # as `slow` prints it
    assert why(source, ID1[:8].upper())["turn"]["turn_index"] == 1
    assert why(source, "ef01")["turn"]["trace_id"] == ID2  # any unique prefix of 4 or more
    assert why(source, ID0[:20])["turn"]["turn_index"] == 0
    assert why(source, ENGINE_TRACE[:8])["turn"]["trace_id"] == ENGINE_TRACE  # an engine request alone
    with pytest.raises(BadRef, match=r"^abcd is ambiguous: 3 turns have a trace id starting with it"):
        why(source, "abcd")  # ID0, ID1 and the engine request; the tool trace is no turn
    with pytest.raises(NotFound, match=r"^no turn's trace id starts with abcd9999"):
        why(source, "abcd9999")  # a trace, but no turn in it
    with pytest.raises(NotFound, match=r"^no turn's trace id starts with ffff0000"):
        why(source, "ffff0000")


def test_short_ids_in_memory() -> None:
    check_short_ids(InMemorySource(short_id_spans()))


def test_short_id_over_the_limit_says_so() -> None:
    import dataclasses

    base = turn_trace("conv-many", 0)
    spans = [
        dataclasses.replace(s, trace_id=f"beef{i:028x}") for i in range(PREFIX_MATCH_LIMIT + 2) for s in base
    ]
    with pytest.raises(BadRef, match=rf"^beef is ambiguous: over {PREFIX_MATCH_LIMIT} turns"):
        why(InMemorySource(spans), "beef")


class _ChdbOverHttp:
    """A ClickHouse HTTP interface in front of a real chDB store: the SQL and the
    ``param_<name>`` values of :class:`~otelkv.store.clickhouse_http.ClickHouseHttpStore`
    run on the chDB engine, so the ClickHouse path runs the same SQL for real."""

    def __init__(self, store: Any) -> None:
        import threading
        import urllib.parse
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                params = {k.removeprefix("param_"): v for k, v in query.items() if k.startswith("param_")}
                sql = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                try:
                    with lock:
                        result = store._session.query(sql, "JSONEachRow", params=params or None)
                    body, code = (result.bytes() if result is not None else b""), 200
                except RuntimeError as exc:
                    body, code = str(exc).encode(), 500
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_short_ids_on_chdb_clickhouse_and_the_sidecar_api(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same lookup on a real chDB store, through the ClickHouse HTTP store (same SQL on
    the chDB engine) and through the sidecar's query API, with the CLI's exit codes."""
    import asyncio
    import dataclasses
    import threading
    import time

    from aiohttp import web

    from otelkv.cli.main import main
    from otelkv.sidecar.api import QueryApi
    from otelkv.store import queries, schema
    from otelkv.store.chdb_store import ChdbStore
    from otelkv.store.clickhouse_http import ClickHouseHttpStore

    store = ChdbStore(tmp_path / "store")
    http = _ChdbOverHttp(store)
    loop = asyncio.new_event_loop()
    runner = None
    serving = threading.Thread(target=loop.run_forever, daemon=True)
    try:
        spans = short_id_spans(time.time_ns() - T0 - 3600 * S)
        assert store.insert_spans(spans) == len(spans)
        check_short_ids(StoreSource(store))
        check_short_ids(StoreSource(ClickHouseHttpStore(http.url, create_schema=False)))
        store.span_index = False  # a fleet's ClickHouse without the span index
        try:
            check_short_ids(StoreSource(store))
        finally:
            store.span_index = True

        app = web.Application()
        app.add_routes(QueryApi(StoreSource(store), "chdb").routes())
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        serving.start()
        capsys.readouterr()
        assert main(["why", ID1[:8], "--sidecar", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["turn"]["trace_id"] == ID1
        assert main(["why", "abcd", "--sidecar", url]) == 2  # ambiguous: the input's fault
        err = capsys.readouterr().err
        assert err.startswith("otelkv why: abcd is ambiguous: 3 turns") and err.count("\n") == 1
        assert main(["why", "ffff0000", "--sidecar", url]) == 3  # not found
        assert "no turn's trace id starts with ffff0000" in capsys.readouterr().err

        # A prefix shared by more traces than are checked one by one: searched by prefix.
        with monkeypatch.context() as patched:
            patched.setattr(queries, "PREFIX_CANDIDATES", 2)
            check_short_ids(StoreSource(store))
        # Spans the trace-id lookup lacks (inserted before its view existed): found by prefix,
        # also when the lookup names only a trace sharing the prefix that holds no turn.
        store.query(f"TRUNCATE TABLE otel.{schema.TRACE_ID_TS_TABLE}")
        check_short_ids(StoreSource(store))
        tool = next(s for s in spans if s.trace_id == TOOL_TRACE)
        assert store.insert_spans([dataclasses.replace(tool, trace_id="abcd7777" + "6" * 24)]) == 1
        assert queries.traces_with_prefix(store, "abcd7777") == []
        check_short_ids(StoreSource(store))
    finally:
        if serving.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            serving.join(timeout=10)
        if runner is not None:
            loop.run_until_complete(runner.cleanup())
        loop.close()
        http.close()
        store.close()


def test_why_names_a_shortened_table_id_and_prices_from_the_hour_before() -> None:
    """A conversation id copied from a table with '..' gets told so, and why prices recomputing
    from the engine requests of the hour before the turn, not only the turn and its predecessor."""
    from otelkv.analysis.report import NotFound, diagnosis_context
    from otelkv.spans import SpanRecord

    source = InMemorySource(short_id_spans())
    with pytest.raises(NotFound, match="shortened in tables"):
        why(source, "conv-la..apse#1")

    def prefill(duration_s: float, computed: int, wait_s: float = 0.0, start_ns: int = 0) -> SpanRecord:
        return SpanRecord(
            trace_id="a" * 32, span_id="b" * 16, parent_span_id="", name="kv_request prefill",
            kind="Internal", start_ns=start_ns, end_ns=start_ns + int(duration_s * 1e9), resource={}, attributes={
                names.ROLE: names.ROLE_PREFILL, names.TOKENS_COMPUTED: computed,
                names.REQUEST_OUTCOME: names.OUTCOME_FINISHED, names.REMOTE_KV_WAIT_SECONDS: wait_s,
            },
        )  # fmt: skip

    measured = [prefill(0.5, 100), prefill(0.3, 100, wait_s=0.2), prefill(0.1, 8), prefill(0.1, 100, 0.2)]
    # 5 ms/token; 1 ms/token; too few tokens to measure; the wait covered the span
    rate = InMemorySource(measured).fastest_compute_rate(since_ns=0, until_ns=1)
    assert diagnosis_context([], measured_rate=rate).per_token_s == pytest.approx(0.001)
    assert InMemorySource(measured).fastest_compute_rate(since_ns=1, until_ns=2) is None
    assert diagnosis_context([], measured_rate=None).per_token_s is None

    # why's window: a request of the half hour before the turn prices it, a faster one two
    # hours before does not (1 us and 0.1 us a token: far below what the turns measure).
    inside, outside = (
        prefill(0.0001, 100, start_ns=T0 - 1800 * S),
        prefill(0.00001, 100, start_ns=T0 - 7200 * S),
    )
    assert why(InMemorySource([*short_id_spans(), inside, outside]), "conv-lapse#1")[
        "per_token_compute_s"
    ] == pytest.approx(1e-6)
