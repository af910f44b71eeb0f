"""ClickHouseHttpStore against a tiny local ``http.server`` fake (pure logic: no ClickHouse
server is available here). The fake checks the request shape the real HTTP interface
expects: POST body = SQL, ``param_<name>`` URL parameters, Basic auth, JSONEachRow rows."""

from __future__ import annotations

import base64
import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from otelkv.spans import SpanRecord
from otelkv.store import StoreError, open_store, queries
from otelkv.store.clickhouse_http import ClickHouseHttpStore


class Fake:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.reply = b""
        self.answers: dict[str, bytes] = {}
        """Replies by the request body's start (else :attr:`reply`)."""
        self.status = 200


@pytest.fixture
def fake() -> Iterator[tuple[Fake, str]]:
    state = Fake()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            url = urllib.parse.urlsplit(self.path)
            state.requests.append(
                {
                    "path": url.path,
                    "query": dict(urllib.parse.parse_qsl(url.query)),
                    "body": self.rfile.read(length).decode("utf-8"),
                    "auth": self.headers.get("Authorization"),
                }
            )
            self.send_response(state.status)
            self.end_headers()
            body = state.requests[-1]["body"]
            self.wfile.write(next((a for k, a in state.answers.items() if body.startswith(k)), state.reply))

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_schema_created_on_open(fake: tuple[Fake, str]) -> None:
    state, url = fake
    ClickHouseHttpStore(url, retention_days=3)
    bodies = [r["body"] for r in state.requests]
    assert bodies[0] == "EXISTS TABLE `otel`.`otelkv_span_index`"  # the fake answers no: backfilled below
    assert bodies[1] == "CREATE DATABASE IF NOT EXISTS `otel`"
    assert "CREATE TABLE IF NOT EXISTS `otel`.`otel_traces`" in bodies[2] and "toIntervalDay(3)" in bodies[2]
    assert "otel_traces_trace_id_ts_mv" in bodies[4]
    assert (
        "CREATE TABLE IF NOT EXISTS `otel`.`otelkv_span_index`" in bodies[5]
        and "toIntervalDay(3)" in bodies[5]
    )
    assert "otelkv_span_index_mv" in bodies[6]
    assert bodies[7].startswith("INSERT INTO `otel`.`otelkv_span_index`") and len(bodies) == 8


def test_query_commands_open_a_fleet_clickhouse_without_ddl(fake: tuple[Fake, str]) -> None:
    """The CLI reads a collector-fed ClickHouse: it must not need CREATE rights there."""
    from otelkv.cli.source import open_local

    state, url = fake
    open_local(clickhouse_url=url)
    assert not any("CREATE" in r["body"] for r in state.requests)


def test_an_index_from_before_its_rates_is_upgraded_on_open(fake: tuple[Fake, str]) -> None:
    """The index exists and its view indexes no prefill rates: the stored rates are indexed,
    then the view is replaced (in that order: an upgrade cut short is redone)."""
    state, url = fake
    state.answers = {"EXISTS TABLE": b"1\n", "SELECT count() AS n FROM system.tables": b"1\n"}
    ClickHouseHttpStore(url, retention_days=3)
    bodies = [r["body"] for r in state.requests]
    check = next(i for i, b in enumerate(bodies) if b.startswith("SELECT count() AS n FROM system.tables"))
    assert "name = 'otelkv_span_index_mv'" in bodies[check] and "\\'rate\\'" in bodies[check]
    upgrade = bodies[check + 1 :]
    assert upgrade[0].startswith("INSERT INTO `otel`.`otelkv_span_index`") and "'rate'" in upgrade[0]
    assert upgrade[1] == "DROP VIEW IF EXISTS `otel`.`otelkv_span_index_mv`"
    assert upgrade[2].startswith("CREATE MATERIALIZED VIEW IF NOT EXISTS `otel`.`otelkv_span_index_mv`")
    assert len(upgrade) == 3 and not any(b.startswith("INSERT") for b in bodies[:check])
    state.requests.clear()
    state.answers["SELECT count() AS n FROM system.tables"] = b"0\n"  # upgraded: nothing more
    ClickHouseHttpStore(url, retention_days=3)
    assert not any(r["body"].startswith(("INSERT", "DROP")) for r in state.requests)


def test_query_uses_server_side_parameters_and_auth(fake: tuple[Fake, str], monkeypatch: Any) -> None:
    state, url = fake
    monkeypatch.setenv("CLICKHOUSE_PASSWORD", "env-pw")
    store = ClickHouseHttpStore(url.replace("http://", "http://alice@"), create_schema=False)
    state.reply = (
        b'{"StartNs":1000,"TraceId":"t","SpanId":"s","SpanName":"chat m","Duration":"5",'
        b'"SpanAttributes":{"otelkv.turn.index":"2"}}\n'
    )
    got = queries.turn_spans(store, conversation_id="c'1\n", limit=3)
    # Asked once whether the span index exists (the fake says no), then the query itself.
    exists, req = state.requests
    assert exists["body"] == "EXISTS TABLE `otel`.`otelkv_span_index`"
    assert req["auth"] == "Basic " + base64.b64encode(b"alice:env-pw").decode()
    assert req["query"]["param_conversation_id"] == "c'1\\n"  # escaped text, not SQL
    assert req["query"]["param_limit"] == "3" and req["query"]["default_format"] == "JSONEachRow"
    assert "{conversation_id:String}" in req["body"] and "c'1" not in req["body"]
    assert got[0].end_ns == 1005 and got[0].attributes == {"otelkv.turn.index": "2"}


def test_insert_posts_json_each_row(fake: tuple[Fake, str]) -> None:
    state, url = fake
    store = open_store(clickhouse_url=url + "/", retention_days=1)
    state.requests.clear()
    span = SpanRecord(
        "ab" * 16,
        "cd" * 8,
        "",
        "x",
        "Server",
        1_700_000_000_123_456_789,
        1_700_000_001_000_000_000,
        {"q": 'it\'s "x"\n', "n": 3},
        {"service.name": "svc"},
        events=[{"time_ns": 1_700_000_000_000_000_001, "name": "e", "attributes": {}}],
    )
    assert store.insert_spans([span, span]) == 2
    (req,) = state.requests
    head, *lines = req["body"].strip("\n").split("\n")
    assert head.startswith("INSERT INTO `otel`.`otel_traces` (`Timestamp`") and head.endswith(
        "FORMAT JSONEachRow"
    )
    row = json.loads(lines[0])
    assert len(lines) == 2
    assert row["Timestamp"] == "1700000000.123456789" and row["Duration"] == 876_543_211
    assert row["SpanAttributes"] == {"q": 'it\'s "x"\n', "n": "3"} and row["ServiceName"] == "svc"
    assert row["Events.Timestamp"] == ["1700000000.000000001"]


def test_http_errors_become_store_errors(fake: tuple[Fake, str]) -> None:
    state, url = fake
    store = ClickHouseHttpStore(url, create_schema=False)
    state.status, state.reply = 500, b"Code: 60. DB::Exception: Table otel.otel_traces does not exist"
    with pytest.raises(StoreError, match=r"HTTP 500.*does not exist"):
        queries.count_spans(store)
    with pytest.raises(StoreError, match="cannot reach"):
        ClickHouseHttpStore("http://127.0.0.1:9", timeout=2)
    with pytest.raises(StoreError, match="http://host:8123"):
        ClickHouseHttpStore("localhost:8123")
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.query("SELECT 1")


def test_the_sidecar_sends_a_clickhouse_server_inserts_of_one_batch(fake: tuple[Fake, str]) -> None:
    """Only the embedded store takes a backlog in larger inserts (its cost per span falls
    with the insert's size); a server over HTTP gets JSON bodies of one batch at most."""
    from pathlib import Path

    from otelkv.sidecar.app import Sidecar, SidecarConfig
    from otelkv.store.writer import BatchWriter

    _, url = fake
    sidecar = Sidecar(
        SidecarConfig(upstream="http://127.0.0.1:9", clickhouse_url=url, store_path=Path("unused"))
    )
    sidecar._open_store()
    try:
        assert sidecar.writer is not None
        assert sidecar.writer.max_batch_spans == sidecar.writer.batch_spans == BatchWriter.BATCH_SPANS
    finally:
        assert sidecar.writer is not None and sidecar.writer.close()
        sidecar.store.close()
