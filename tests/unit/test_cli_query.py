"""``otelkv slow|conversation|why``: argument handling, sources, rendering and one-line errors."""

from __future__ import annotations

import argparse
import io
import json
import sys
import threading
import types
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from otelkv.analysis import report
from otelkv.analysis.sources import InMemorySource
from otelkv.cli import query_cmds, render, source
from otelkv.cli.source import LocalQuerier, QueryError, parse_duration, window_ns
from tests.unit.test_report import lapse_conversation, quick_conversation

SPANS = lapse_conversation() + quick_conversation()
MEM = InMemorySource(SPANS)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="otelkv")
    sub = p.add_subparsers(dest="command", required=True)
    query_cmds.add_query_commands(sub)
    return p


class FakeSidecar(BaseHTTPRequestHandler):
    """Answers like the sidecar's query API, from the same report functions."""

    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:
        from urllib.parse import parse_qs, unquote, urlparse

        url = urlparse(self.path)
        FakeSidecar.seen.append((self.path, self.headers.get("Authorization")))
        try:
            if url.path == "/api/v1/health":
                body: Any = {"status": "ok"}
            elif url.path == "/api/v1/slow":
                q = {k: int(v[0]) for k, v in parse_qs(url.query).items()}
                body = report.slow(MEM, since_ns=None, until_ns=None, limit=q.get("limit", 10))
            elif url.path.startswith("/api/v1/conversations/"):
                body = report.conversation(MEM, unquote(url.path.rsplit("/", 1)[1]))
            elif url.path.startswith("/api/v1/why/"):
                body = report.why(MEM, unquote(url.path.rsplit("/", 1)[1]))
            elif url.path == "/api/v1/secret":
                self._send(401, {"error": "token required"})
                return
            else:
                self._send(404, {"error": "no such endpoint"})
                return
        except report.NotFound as exc:
            self._send(404, {"error": str(exc)})
            return
        except report.BadRef as exc:
            self._send(400, {"error": str(exc)})
            return
        self._send(200, body)

    def _send(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture
def sidecar() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSidecar)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    args = parser().parse_args(argv)
    out = io.StringIO()
    code = args.handler(args, out)
    return code, out.getvalue(), capsys.readouterr().err


def free_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------ via a sidecar


def test_slow_via_sidecar(
    sidecar: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTELKV_TOKEN", "s3cret")
    code, out, err = run(["slow", "--sidecar", sidecar, "--since", "1d", "--limit", "3"], capsys)
    assert code == 0, err
    assert "TOP DIAGNOSIS" in out and "conv-lapse#1" in out and "tool_wait_dominates" in out
    path, auth = FakeSidecar.seen[-1]
    assert path.startswith("/api/v1/slow?") and "limit=3" in path and "since_ns=" in path
    assert auth == "Bearer s3cret"


def test_slow_json_via_sidecar(sidecar: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["slow", "--sidecar", sidecar, "--json"], capsys)
    assert code == 0 and json.loads(out)["turns"][0]["turn_index"] == 1


def test_conversation_and_why_via_sidecar_quote_ids(sidecar: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["conversation", "--sidecar", sidecar, "conv-lapse"], capsys)
    assert code == 0 and "PHASES:" in out and "|" in out and "ttl_lapsed_during_gap" in out
    code, out, _ = run(["why", "--sidecar", sidecar, "conv-lapse#1"], capsys)
    assert code == 0 and "[ttl_lapsed_during_gap]" in out and "fix:" in out and "evidence:" in out
    assert FakeSidecar.seen[-1][0] == "/api/v1/why/conv-lapse%231"


def test_not_found_via_sidecar(sidecar: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["why", "--sidecar", sidecar, "nope#3"], capsys)
    assert code == 3 and out == ""  # not found
    assert err.strip().startswith("otelkv why: no conversation 'nope' in the store;")
    code, out, err = run(["why", "--sidecar", sidecar, "conv-lapse#7"], capsys)
    assert (
        code == 3
        and err.strip() == "otelkv why: no turn 7 in conversation 'conv-lapse' (turn indexes are 0-based)"
    )
    code, _, err = run(["conversation", "--sidecar", sidecar, "a/b c"], capsys)
    assert code == 3 and "no turns for conversation 'a/b c'" in err and "Traceback" not in err


def test_sidecar_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    url = free_url()
    code, _, err = run(["slow", "--sidecar", url], capsys)
    assert code == 4 and err.startswith(f"otelkv slow: sidecar at {url} is unreachable")
    assert len(err.strip().splitlines()) == 1


def test_sidecar_token_refused(sidecar: str) -> None:
    with pytest.raises(QueryError, match="set OTELKV_TOKEN"):
        source.SidecarClient(sidecar)._request("/api/v1/secret")


# ------------------------------------------------------------------ options and local sources


def test_bad_since(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["slow", "--since", "yesterday", "--sidecar", "http://x"], capsys)
    assert code == 2 and "bad time 'yesterday'" in err
    code, _, err = run(["slow", "--since", "1h", "--until", "2h", "--sidecar", "http://x"], capsys)
    assert code == 2 and "--until 2h is not after --since 1h" in err


def test_durations() -> None:
    assert parse_duration("15m") == 900 and parse_duration("2h") == 7200 and parse_duration("1d") == 86400
    assert parse_duration("90") == 90 and parse_duration("1.5h") == 5400
    assert window_ns("1h", None, now_ns=10_000 * 10**9) == (6400 * 10**9, None)
    with pytest.raises(QueryError):
        parse_duration("-5m")


def test_window_takes_iso_times_as_well() -> None:
    now = 1_800_000_000 * 10**9
    assert window_ns("2026-12-01T22:00:00Z", "2026-12-01T22:00:01.5+00:00", now_ns=now) == (
        1_796_162_400 * 10**9,
        1_796_162_401_500_000_000,
    )
    assert window_ns("2026-12-01T22:00:00", None, now_ns=now)[0] == 1_796_162_400 * 10**9  # UTC
    with pytest.raises(QueryError, match="ISO 8601"):
        window_ns("yesterday", None, now_ns=now)


def test_store_locked_by_sidecar(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class StoreLockedError(RuntimeError):
        pass

    def open_store(**kw: Any) -> Any:
        raise StoreLockedError("directory is locked by another process")

    monkeypatch.setitem(sys.modules, "otelkv.store", types.SimpleNamespace(open_store=open_store))
    (tmp_path / "metadata").mkdir()  # what chDB leaves in a store directory
    code, _, err = run(["why", "--store", str(tmp_path), "c#1"], capsys)
    assert code == 4  # locked: unavailable
    assert err.strip() == (
        f"otelkv why: store {tmp_path} is locked by a running sidecar; ask it instead: "
        "--sidecar URL (or set OTELKV_SIDECAR)"
    )


def test_store_missing_dir(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["slow", "--store", str(tmp_path / "none")], capsys)
    assert code == 3 and "no store at" in err


def test_store_opened_directly(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[bool] = []
    store = types.SimpleNamespace(close=lambda: closed.append(True))
    import otelkv.store

    monkeypatch.setattr(otelkv.store, "open_store", lambda **kw: store)
    monkeypatch.setattr(source, "LocalQuerier", lambda _src, closer=None: _Mem(closer))
    (tmp_path / "metadata").mkdir()  # what chDB leaves in a store directory
    code, out, _ = run(["conversation", "--store", str(tmp_path), "conv-quick", "--json"], capsys)
    assert code == 0 and json.loads(out)["turn_count"] == 2 and closed == [True]


class _Mem(LocalQuerier):
    def __init__(self, closer: Any) -> None:
        super().__init__(MEM, closer=closer)


def test_default_resolution(sidecar: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTELKV_SIDECAR", sidecar)
    chosen = source.resolve()
    assert isinstance(chosen, source.SidecarClient) and chosen.url == sidecar
    monkeypatch.setenv("OTELKV_SIDECAR", free_url())
    monkeypatch.setenv("OTELKV_STORE", str(tmp_path / "absent"))
    with pytest.raises(QueryError, match="no store at"):
        source.resolve()


def test_local_querier_maps_not_found() -> None:
    q = LocalQuerier(MEM)
    assert q.why("conv-quick#0")["turn"]["turn_index"] == 0
    with pytest.raises(QueryError, match="neither a trace id"):
        q.why("bogus")


# ------------------------------------------------------------------ rendering


def test_phase_bar_and_seconds() -> None:
    bar = render.phase_bar(
        {"tool_wait": 20.0, "app_work": 0.0, "input_processing": 0.4, "generation": 0.6}, 21.0
    )
    assert len(bar) == render.BAR_WIDTH and bar.startswith("~") and "#" in bar and "=" in bar
    assert render.phase_bar({"tool_wait": 1.0}, 10.0).strip() == "~" * 4
    assert render.phase_bar(None, 1.0) == " " * render.BAR_WIDTH
    assert render.seconds(0.123) == "0.12s" and render.seconds(75) == "1m15s" and render.seconds(None) == "-"
    assert "~ tool wait" in render.bar_legend()


def test_empty_slow_message() -> None:
    out = io.StringIO()
    query_cmds.show_slow({"turns": []}, out)
    assert "no turns in this window" in out.getvalue()


def test_wide_prints_whole_trace_ids(sidecar: str, capsys: pytest.CaptureFixture[str]) -> None:
    whole = report.why(MEM, "conv-lapse#1")["turn"]["trace_id"]
    code, out, _ = run(["slow", "--sidecar", sidecar, "--limit", "1"], capsys)
    assert code == 0 and whole[:8] in out and whole not in out
    for argv in (["slow", "--limit", "1"], ["conversation", "conv-lapse"]):
        code, out, _ = run([*argv, "--sidecar", sidecar, "--wide"], capsys)
        assert code == 0 and whole in out
