"""``otelkv tune`` end to end: spans written into a real chDB store, the CLI run on the directory."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otelkv.analysis.sources import InMemorySource
from otelkv.analysis.tune.window import tune
from otelkv.cli.main import main
from otelkv.cli.tune_cmd import parse_size, show_tune
from tests.schema import assert_valid
from tests.unit.test_diagnose import T0, S
from tests.unit.test_tune_window import check_answer, scenario

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``otelkv ARGS`` in a fresh process (chDB: one store directory per process), no sidecar."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OTELKV_SIDECAR": "http://127.0.0.1:9"}
    return subprocess.run(
        [sys.executable, "-m", "otelkv.cli.main", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("tune", *args)


def test_tune_on_a_chdb_store_directory(tmp_path: Path) -> None:
    from otelkv.store.chdb_store import ChdbStore

    # Two hours ago: the store's TTL drops parts older than its retention as soon as they land.
    base_s = (time.time_ns() - 2 * 3600 * S - T0) / S
    spans = scenario(base_s)
    store = ChdbStore(tmp_path / "traces")
    try:
        assert store.insert_spans(spans) == len(spans)
    finally:
        store.close()

    done = _run_cli("--store", str(tmp_path / "traces"), "--since", "3h", "--json")
    assert done.returncode == 0, done.stderr
    data = assert_valid(json.loads(done.stdout))
    check_answer(data)
    assert data["window"]["turns_in_window"] == 24

    text = _run_cli("--store", str(tmp_path / "traces"), "--since", "3h", "--ttl", "30s,1m")
    assert text.returncode == 0, text.stderr
    assert (
        "in force: decoder_kv_blocks_ttl 30.0s, kv_recompute_threshold 64, router handle TTL 28.0s"
        in text.stdout
    )
    assert (
        "recommended: decoder_kv_blocks_ttl=60s, router handle TTL=54s, kv_recompute_threshold=32"
        in text.stdout
    )
    assert "[warning] router_ttl_above_decode_ttl" in text.stdout

    # Nothing in a window that starts after the spans: an answer (exit 0), one line, not tables of zeros.
    empty = _run_cli("--store", str(tmp_path / "traces"), "--since", "1h", "--json")
    assert empty.returncode == 0, empty.stderr
    answer = assert_valid(json.loads(empty.stdout))
    assert answer["window"]["turns"] == 0 and answer["window"]["empty"] == "no turns in the window"
    assert answer["recommended"]["kv_recompute_threshold"] is None and answer["grid"] == []
    text = _run_cli("--store", str(tmp_path / "traces"), "--since", "1h")
    assert text.returncode == 0, text.stderr
    assert len(text.stdout.splitlines()) == 1
    assert text.stdout.startswith("otelkv tune: no turns in the window (")


def test_tune_on_an_empty_store(tmp_path: Path) -> None:
    """A real chDB store that holds nothing at all: the same one-line answer, exit 0 (docs/tune.md)."""
    from otelkv.store.chdb_store import ChdbStore

    ChdbStore(tmp_path / "traces").close()
    done = _run_cli("--store", str(tmp_path / "traces"), "--since", "1d")
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.startswith("otelkv tune: no turns in the window (") and len(done.stdout.splitlines()) == 1
    )
    assert "None" not in done.stdout and "0.00s" not in done.stdout
    data = assert_valid(
        json.loads(_run_cli("--store", str(tmp_path / "traces"), "--since", "1d", "--json").stdout)
    )
    details = data["recommended"]["details"]
    assert {k: v["recommendation"] for k, v in details.items()} == {
        "decoder_kv_blocks_ttl_s": None,
        "kv_recompute_threshold": None,
        "router_handle_ttl_s": None,
    }
    assert details["kv_recompute_threshold"]["reason"] == "no turns in the window"


def test_terminal_rendering() -> None:
    data = tune(InMemorySource(scenario()), since_ns=None, until_ns=None)
    out = io.StringIO()
    show_tune(data, out)
    text = out.getvalue()
    assert "otelkv tune: 24 turns, 12 hand-offs to a next turn" in text
    assert (
        "recompute  1.00 ms/token   [n=15, r² 1.00, residual 0 ms (0% of the mean), sizes 4.0x apart]" in text
    )
    assert "pull       20.0 ms + 10.0 ns/byte (9.8 KiB/token)   [n=9, r² 1.00" in text
    assert "break-even 22 tokens" in text
    assert "decides 12 of 12 hand-offs as recorded" in text
    now = next(line for line in text.splitlines() if line.startswith("now"))
    assert now.split()[:7] == ["now", "30.0s", "28.0s", "9", "0", "2.10s", "-1.71s"]
    picked = next(line for line in text.splitlines() if line.startswith("->"))
    assert picked.split()[:6] == ["->", "1m00s", "54.0s", "12", "0", "3.12s"]
    assert "vs in force: pulls +3, failed +0, TTFT -0.86s" in text
    assert (
        "  threshold: break-even 22 tokens rounded up to a multiple of 16\n    rests on recompute fit n=15"
        in text
    )
    assert "n/a" not in text and "not enough evidence" not in text


def test_terminal_rendering_of_weak_evidence() -> None:
    """Two conversations (2 prefill samples, 2 pulls): counts shown, seconds n/a, no recommended number."""
    data = tune(InMemorySource(scenario()), since_ns=None, until_ns=T0 + int(450 * S))
    out = io.StringIO()
    show_tune(data, out)
    text = out.getvalue()
    assert "  recompute  not enough evidence (n=2, r² 1.00" in text
    assert "2 prefill requests (need 8)" in text and "2 pulls (need 8)" in text
    now = next(line for line in text.splitlines() if line.startswith("now"))
    assert now.split()[:7] == ["now", "30.0s", "28.0s", "2", "0", "n/a", "n/a"]
    assert "n/a: PREFILL SAVED and TTFT CHANGE are unavailable" in text
    assert "\nrecommended: nothing\n" in text
    assert "  threshold: not enough evidence: recompute fit and pull fit not accepted" in text
    assert "  TTL: not enough evidence: 2 hand-offs to a next turn (need 10);" in text
    assert "run longer or under load" in text
    assert "ms/token" not in text and "ns/byte" not in text and "break-even" not in text


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = str(tmp_path / "none")
    assert main(["tune", "--store", store, "--threshold", "lots"]) == 2
    assert "bad --threshold 'lots'" in capsys.readouterr().err
    assert main(["tune", "--store", store, "--ttl", "soon"]) == 2
    assert "bad duration 'soon'" in capsys.readouterr().err
    assert main(["tune", "--store", store, "--target-share", "1.5"]) == 2
    assert main(["tune", "--store", store]) == 3  # no store there: not found
    assert "no store at" in capsys.readouterr().err


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 * 1024**3 and parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("1000") == 1000


def test_tune_through_the_sidecar_query_api(capsys: pytest.CaptureFixture[str]) -> None:
    """The sidecar's real ``/api/v1/tune`` route (it owns the store while it runs), options passed through."""
    import asyncio
    import threading

    from aiohttp import web

    from otelkv.sidecar.api import QueryApi

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.add_routes(QueryApi(InMemorySource(scenario()), "memory").routes())
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        # The scenario lies in 2023: --since covers it.
        assert main(["tune", "--sidecar", url, "--since", "1000w", "--json"]) == 0
        check_answer(json.loads(capsys.readouterr().out))
        assert (
            main(
                ["tune", "--sidecar", url, "--since", "1000w", "--ttl", "45", "--threshold", "128", "--json"]
            )
            == 0
        )
        data = json.loads(capsys.readouterr().out)
        assert sorted({r["decoder_kv_blocks_ttl_s"] for r in data["grid"]}) == [30.0, 45.0]
        assert main(["tune", "--sidecar", url, "--since", "1000w", "--memory-budget", "lots"]) == 2
        assert "bad size" in capsys.readouterr().err
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.run_until_complete(runner.cleanup())
        loop.close()
