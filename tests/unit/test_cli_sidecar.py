"""``otelkv sidecar`` as a user starts it: a real process, its addresses, a clean stop."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path


def test_sidecar_command_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "otelkv.cli.main", "sidecar"),
            *("--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"),
            *("--admin-listen", "127.0.0.1:0", "--store", str(tmp_path / "store")),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(4)]
        proxy = re.search(r"send agent traffic to (http://\S+)", lines[0])
        admin = re.search(r"metrics: (http://\S+)/metrics", lines[2])
        assert proxy and admin, lines
        health = json.loads(urllib.request.urlopen(f"{admin.group(1)}/api/v1/health", timeout=10).read())
        assert health["ok"] is True
        assert str(tmp_path / "store") in health["store"]  # says where the data lives
        # The upstream (port 9) is down: the client gets a clear 502, not a hang or a crash.
        request = urllib.request.Request(
            f"{proxy.group(1)}/v1/chat/completions",
            data=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
            headers={"Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(request, timeout=10)
            raise AssertionError("expected a 502")
        except urllib.error.HTTPError as exc:
            assert exc.code == 502
            assert "unreachable" in json.loads(exc.read())["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, _err = proc.communicate(timeout=30)  # drains and closes both pipes
    assert proc.returncode == 0, _err


def test_sidecar_command_refuses_a_store_another_process_holds(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from otelkv.store import open_store; "
            "s = open_store(path=pathlib.Path(sys.argv[1])); print('open', flush=True); sys.stdin.read()",
            str(tmp_path / "store"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        out = subprocess.run(
            [
                *(sys.executable, "-m", "otelkv.cli.main", "sidecar", "--upstream", "http://127.0.0.1:9"),
                *(
                    "--listen",
                    "127.0.0.1:0",
                    "--admin-listen",
                    "127.0.0.1:0",
                    "--store",
                    str(tmp_path / "store"),
                ),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 4  # the store is locked: unavailable
        assert "open in another process" in out.stderr
    finally:
        holder.communicate("", timeout=30)


def test_a_query_right_after_a_turn_answers_with_that_turn(fake_upstream: str, tmp_path: Path) -> None:
    """The query API writes what the sidecar has received before it reads the store: a turn
    whose response the client has is in the answer, though the writer's flush interval has
    not passed (the turn and the query a few milliseconds apart)."""
    from tests.unit import sidecar_harness as h

    sidecar = h.start_cli(fake_upstream, tmp_path / "store")
    try:
        for turn in range(3):
            result = h.chat(sidecar.proxy_url, "conv-fresh", turn, stream=turn == 1)
            assert result.ok, result
            with urllib.request.urlopen(
                f"{sidecar.admin_url}/api/v1/conversations/conv-fresh", timeout=30
            ) as r:
                answer = json.loads(r.read())
            assert len(answer["turns"]) == turn + 1, answer
    finally:
        assert sidecar.stop() == 0
