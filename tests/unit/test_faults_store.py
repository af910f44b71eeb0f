"""Store faults under a real sidecar: requests go on byte for byte, drops are counted,
memory stays bounded, and the store resumes once the fault is gone.

Each case runs the real two-process sidecar (``tests.unit.sidecar_runner``) against the
fake streaming upstream. Faults are real where the machine allows it: a tmpfs of a few MB
filled to the last byte (disk full, chDB answers ``NOT_ENOUGH_SPACE``) and a read-only
bind mount over the store directory (``EROFS``); both need root (mount), else the
unwritable case falls back to ``chmod`` (which root ignores, hence the root path first).
The closed store and raising inserts are injected inside the sidecar process.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from otelkv import names
from tests.unit import sidecar_harness as h

MAIN_GROWTH_MB = 150.0
"""RSS the main process may gain while a store fault persists (chDB's error paths and
caches; measured +47 MB at most). Unbounded queueing would grow without limit."""
PROXY_GROWTH_MB = 20.0
FAULT_ROUNDS = 6
CONVERSATIONS = 8


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: int) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)):
        pytest.skip("disk full needs a tmpfs: run as root with CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[str]:
    """``path`` unwritable for new files: a read-only bind mount (root) or chmod (others)."""
    if os.geteuid() == 0:
        if not (_mount("--bind", str(path), str(path)) and _mount("-o", "remount,bind,ro", str(path))):
            subprocess.run(["umount", "-l", str(path)], check=False)
            pytest.skip("no read-only bind mount here (needs CAP_SYS_ADMIN)")
        try:
            yield "read-only bind mount"
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        dirs = [path, *(p for p in path.rglob("*") if p.is_dir())]
        modes = {d: d.stat().st_mode for d in dirs}
        for d in dirs:
            d.chmod(0o555)
        try:
            yield "chmod 555"
        finally:
            for d, mode in modes.items():
                d.chmod(mode)


def fill(path: Path) -> Path:
    """Write zeros to ``path/filler`` until the filesystem has no byte left."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for block in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * block)
    finally:
        os.close(fd)
    return filler


def turns_during_fault(sc: h.SidecarProc, prefix: str) -> tuple[int, h.RssSampler]:
    """Rounds of turns (streamed and not) while the fault persists; all must succeed."""
    sent = 0
    with h.RssSampler(sc.pids) as rss:
        for r in range(FAULT_ROUNDS):
            results = h.run_turns(sc.proxy_url, f"{prefix}{r}", CONVERSATIONS, 2)
            assert not h.failures(results), h.failures(results)[:3]
            sent += len(results)
            sc.command("flush")
    return sent, rss


def assert_bounded(rss: h.RssSampler, baseline: dict[str, float]) -> None:
    assert rss.peak("main") < baseline["main"] + MAIN_GROWTH_MB, rss.summary("main")
    assert rss.peak("proxy") < baseline["proxy"] + PROXY_GROWTH_MB, rss.summary("proxy")


def baseline_rss(sc: h.SidecarProc) -> dict[str, float]:
    sampler = h.RssSampler(sc.pids)
    sampler.sample()
    return {name: points[-1][1] for name, points in sampler.samples.items()}


def warm_up(sc: h.SidecarProc, prefix: str) -> int:
    """Turns that must all be written: the store works (again)."""
    before = sc.command("stats")["stats"]
    results = h.run_turns(sc.proxy_url, prefix, 4, 2)
    assert not h.failures(results)
    stats = sc.command("flush")["stats"]
    assert stats["written"] == before["written"] + len(results)
    assert stats["dropped_store_error"] == before["dropped_store_error"]
    return len(results)


def store_error_drops(sc: h.SidecarProc) -> float:
    return h.metric(sc.metrics(), names.METRIC_SIDECAR_SPANS_DROPPED + "_total", reason="store_error")


@pytest.mark.parametrize("fault", ["closed", "raising", "unwritable"])
def test_store_unavailable_requests_go_on_and_drops_are_counted(
    fault: str, fake_upstream: str, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    sc = h.start_runner(fake_upstream, store)
    try:
        written = warm_up(sc, "warm")
        baseline = baseline_rss(sc)
        with contextlib.ExitStack() as fault_on:
            if fault == "closed":
                sc.command("close-store")
            elif fault == "raising":
                sc.command("fail-inserts")
                fault_on.callback(sc.command, "heal-inserts")
            else:
                fault_on.enter_context(read_only(store))
            sent, rss = turns_during_fault(sc, "fault")
            stats = sc.command("flush")["stats"]
            assert stats["dropped_store_error"] >= sent and stats["written"] == written
            assert store_error_drops(sc) == stats["dropped_store_error"]
            assert stats["queued"] == 0
            assert_bounded(rss, baseline)
        if fault == "closed":
            # The query API says the store is unavailable; it neither hangs nor crashes.
            assert h.http_status(f"{sc.admin_url}/api/v1/slow") == 503
            assert h.http_status(f"{sc.admin_url}/api/v1/health") == 200
            return
        # The fault is gone: the same writer writes again, without a restart.
        assert warm_up(sc, "healed") == 8
    finally:
        assert sc.stop() == 0
    stored = h.stored_conversations(store)
    assert {f"warm-{c}" for c in range(4)} | {f"healed-{c}" for c in range(4)} <= set(stored)
    assert not [c for c in stored if c.startswith("fault")]


def test_disk_full_requests_go_on_then_the_store_recovers(fake_upstream: str, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", 48) as disk:
        store = disk / "store"
        sc = h.start_runner(fake_upstream, store)
        try:
            written = warm_up(sc, "warm")
            baseline = baseline_rss(sc)
            filler = fill(disk)
            assert os.statvfs(disk).f_bavail == 0
            sent, rss = turns_during_fault(sc, "full")
            stats = sc.command("flush")["stats"]
            assert stats["dropped_store_error"] >= sent and stats["written"] == written
            assert store_error_drops(sc) == stats["dropped_store_error"]
            assert_bounded(rss, baseline)
            filler.unlink()
            assert warm_up(sc, "freed") == 8
        finally:
            assert sc.stop() == 0
        stored = h.stored_conversations(store)
        assert {f"warm-{c}" for c in range(4)} | {f"freed-{c}" for c in range(4)} <= set(stored)
