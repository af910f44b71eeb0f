"""SIGKILL of either sidecar process: a restart case that must lose no acknowledged span.

- The proxy process killed in the middle of a streamed response: that response is cut
  (the process that relayed it is gone), the main process notices, flushes and closes the
  store and exits 1, so a supervisor restarts the sidecar; the restarted sidecar serves
  byte for byte and its store holds every turn finished before the kill.
- The main process (the one holding the chDB store) killed while turns are being written:
  the proxy process exits with it (no orphan keeps the port), the store reopens, and it
  holds every turn whose write was acknowledged (``flush`` returned) before the kill.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil

from tests.unit import fake_openai
from tests.unit import sidecar_harness as h

MAIN_RSS_MB = 700.0
PROXY_RSS_MB = 100.0
"""Absolute RSS bounds under this test's load. Measured on a quiet 2-core machine: main
peaks at 513-566 MB (about 200 MB at start, chDB loaded; during the writes chDB's global
thread pool grows to ~135 threads, its tracked query memory peaks near 100 MB, and ~50 MB
more of its library's pages are touched), proxy ~30 MB. A bound against runaway growth,
with room for a busier machine than the one measured."""
EXIT_S = 10.0


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_proxy_killed_mid_stream_then_the_sidecar_restarts(fake_upstream: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    sc = h.start_cli(fake_upstream, store)
    try:
        before = h.run_turns(sc.proxy_url, "before", 4, 2)
        assert not h.failures(before)
        streamed: list[h.TurnResult] = []
        slow = {fake_openai.HEADER_DELAY_MS: "200", fake_openai.HEADER_CHUNKS: "20"}
        client = threading.Thread(
            target=lambda: streamed.append(h.chat(sc.proxy_url, "cut", 0, stream=True, headers=slow))
        )
        client.start()
        time.sleep(1.0)  # a few chunks are through
        assert not streamed, "the stream ended before the kill"
        os.kill(sc.proxy_pid, signal.SIGKILL)
        client.join(30)
        assert streamed and not streamed[0].ok  # cut: its relay is gone
        # The main process does not pretend to serve: it stops cleanly and says so.
        sc.proc.wait(EXIT_S)
        assert sc.proc.returncode == 4  # a started process failed
    finally:
        sc.stop()
    restarted = h.start_cli(fake_upstream, store)
    try:
        after = h.run_turns(restarted.proxy_url, "after", 4, 2)
        assert not h.failures(after)
    finally:
        assert restarted.stop() == 0
    stored = h.stored_conversations(store)
    assert all(stored.get(f"{p}-{c}") == 2 for p in ("before", "after") for c in range(4)), stored


def test_main_killed_during_writes_keeps_every_acknowledged_span(fake_upstream: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    sc = h.start_runner(fake_upstream, store)
    finished: list[str] = []
    stop = threading.Event()

    def agent(k: int) -> None:
        i = 0
        while not stop.is_set():
            cid = f"kill-{k}-{i}"
            if h.chat(sc.proxy_url, cid, 0, stream=i % 2 == 0, timeout=5).ok:
                finished.append(cid)
            i += 1

    agents = [threading.Thread(target=agent, args=(k,)) for k in range(4)]
    acknowledged: set[str] = set()
    with h.RssSampler(sc.pids) as rss:
        for thread in agents:
            thread.start()
        try:
            for _ in range(4):
                time.sleep(0.4)
                done = set(finished)  # finished before the flush began: its write is acknowledged
                answer = sc.command("flush")
                stats = answer["stats"]
                assert (
                    answer["flushed"]
                    and stats["dropped_store_error"] == 0
                    and stats["dropped_queue_full"] == 0
                )
                acknowledged |= done
            time.sleep(0.2)  # writes in flight again
            assert sc.command("stats")["stats"]["written"] > 0
            os.kill(sc.main_pid, signal.SIGKILL)
            h.wait_for(lambda: gone(sc.proxy_pid), EXIT_S, "the proxy process to exit with the main one")
        finally:
            stop.set()
            for thread in agents:
                thread.join(30)
            sc.stop()
    assert rss.peak("main") < MAIN_RSS_MB and rss.peak("proxy") < PROXY_RSS_MB, rss.summary("main")
    assert len(acknowledged) > 50
    reopened = h.start_runner(fake_upstream, store)
    try:
        after = h.run_turns(reopened.proxy_url, "reopened", 2, 1)
        assert not h.failures(after)
        assert reopened.command("flush")["stats"]["written"] == 2
    finally:
        assert reopened.stop() == 0
    stored = h.stored_conversations(store)
    missing = acknowledged - set(stored)
    assert not missing, f"{len(missing)} acknowledged turns lost, e.g. {sorted(missing)[:3]}"
    assert {"reopened-0", "reopened-1"} <= set(stored)
