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
    data = json.loads(done.stdout)
    check_answer(data)
    assert data["window"]["turns_in_window"] == 8

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

    # Nothing in a window that ends before the spans: an answer, not an error.
    empty = _run_cli("--store", str(tmp_path / "traces"), "--since", "1h", "--json")
    assert empty.returncode == 0, empty.stderr
    assert json.loads(empty.stdout)["window"]["turns"] == 0


def test_terminal_rendering() -> None:
    data = tune(InMemorySource(scenario()), since_ns=None, until_ns=None)
    out = io.StringIO()
    show_tune(data, out)
    text = out.getvalue()
    assert "otelkv tune: 8 turns, 4 hand-offs to a next turn" in text
    assert "recompute  1.0000 ms/token   [least_squares, n=5" in text
    assert "pull       20.00 ms + 10.000 ns/byte (9.8 KiB/token)   [least_squares, n=3" in text
    assert "break-even 22 tokens" in text
    assert "decides 4 of 4 hand-offs as recorded" in text
    now = next(line for line in text.splitlines() if line.startswith("now"))
    assert now.split()[:6] == ["now", "30.0s", "28.0s", "3", "0", "0.70s"]
    picked = next(line for line in text.splitlines() if line.startswith("->"))
    assert picked.split()[:6] == ["->", "1m00s", "54.0s", "4", "0", "1.04s"]
    assert "vs in force: pulls +1, failed +0, TTFT -0.29s" in text


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = str(tmp_path / "none")
    assert main(["tune", "--store", store, "--threshold", "lots"]) == 2
    assert "bad --threshold 'lots'" in capsys.readouterr().err
    assert main(["tune", "--store", store, "--ttl", "soon"]) == 2
    assert "bad duration 'soon'" in capsys.readouterr().err
    assert main(["tune", "--store", store, "--target-share", "1.5"]) == 2
    assert main(["tune", "--store", store]) == 2  # no store there
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
