"""Real sidecar processes, the fake upstream, a checking client and an RSS sampler.

Shared by the fault tests (``test_faults_*.py``), the security tests and
``bench/sidecar_load.py``. Everything talks over loopback to processes started here, and
every process started here is stopped here (killed by pid when it does not stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

from tests.unit import fake_openai

ROOT = Path(__file__).resolve().parents[2]
PROMPT_MARK = "ZEBRA"
"""Every prompt the harness sends holds this word: a store scan for it finds leaked prompts."""
START_TIMEOUT_S = 60.0


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key in [k for k in env if k.startswith("OTEL_") or k == "OTELKV_TOKEN"]:
        del env[key]  # the caller's collector or token must not leak into a test sidecar
    env.update(extra or {})
    return env


def _stop(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


# ------------------------------------------------------------------ the upstream


@contextlib.contextmanager
def upstream() -> Iterator[str]:
    """The fake OpenAI-style upstream in its own process; yields its base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.unit.fake_openai"], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc, 10)
        if proc.stdout is not None:
            proc.stdout.close()


# ------------------------------------------------------------------ the sidecar


@dataclass
class SidecarProc:
    """A sidecar started by :func:`start_runner` or :func:`start_cli`."""

    proc: subprocess.Popen[str]
    proxy_url: str
    admin_url: str
    proxy_pid: int
    store: Path | None
    steerable: bool
    lines: list[str] = field(default_factory=list)

    @property
    def main_pid(self) -> int:
        return self.proc.pid

    @property
    def pids(self) -> dict[str, int]:
        return {"main": self.main_pid, "proxy": self.proxy_pid}

    def command(self, command: str, timeout: float = 60.0) -> dict[str, Any]:
        """Send a runner command and wait for its JSON answer."""
        assert self.steerable and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = _readline(self.proc, timeout)
        answer: dict[str, Any] = json.loads(reply)
        assert answer.get("command") == command and "error" not in answer, answer
        return answer

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.admin_url}/metrics", timeout=30) as resp:
            return str(resp.read().decode())

    def stop(self) -> int:
        """A clean stop; the exit code."""
        if self.proc.poll() is None:
            if self.steerable and self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.write("stop\n")
                    self.proc.stdin.flush()
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    _stop(self.proc)
            else:
                _stop(self.proc, 60)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if psutil.pid_exists(self.proxy_pid):
            with contextlib.suppress(psutil.Error):
                proxy = psutil.Process(self.proxy_pid)
                if proxy.ppid() in (self.main_pid, 1) and proxy.status() != psutil.STATUS_ZOMBIE:
                    proxy.kill()
        return int(self.proc.returncode)


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    """One stdout line, or a clear failure when the process died or went silent."""
    assert proc.stdout is not None
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    if not box or not box[0]:
        raise AssertionError(f"sidecar gave no answer in {timeout} s (exit code {proc.poll()})")
    return box[0]


def start_runner(
    upstream_url: str, store: Path | None, env: dict[str, str] | None = None, **flags: str
) -> SidecarProc:
    """A sidecar in ``tests.unit.sidecar_runner`` (steerable over stdin)."""
    argv = [sys.executable, "-m", "tests.unit.sidecar_runner", "--upstream", upstream_url]
    if store is not None:
        argv += ["--store", str(store)]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", value]
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(env), cwd=ROOT
    )
    try:
        ready = json.loads(_readline(proc, START_TIMEOUT_S))
    except BaseException:
        _stop(proc)
        raise
    return SidecarProc(proc, ready["proxy"], ready["admin"], ready["proxy_pid"], store, True)


def start_cli(upstream_url: str, store: Path | None, env: dict[str, str] | None = None) -> SidecarProc:
    """``otelkv sidecar`` exactly as a user starts it."""
    argv = [
        *(sys.executable, "-m", "otelkv.cli.main", "sidecar", "--upstream", upstream_url),
        *("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"),
        *(("--store", str(store)) if store is not None else ("--no-store",)),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=_env(env), cwd=ROOT)
    try:
        lines = [_readline(proc, START_TIMEOUT_S) for _ in range(4)]
        proxy = re.search(r"send agent traffic to (http://\S+)", lines[0])
        admin = re.search(r"metrics: (http://\S+)/metrics", lines[2])
        assert proxy and admin, lines
        children = psutil.Process(proc.pid).children()
        assert len(children) == 1, children
    except BaseException:
        _stop(proc)
        raise
    return SidecarProc(proc, proxy.group(1), admin.group(1), children[0].pid, store, False, lines)


# ------------------------------------------------------------------ the client


def chat_body(conversation: str, turn: int, stream: bool, words: int = 8) -> bytes:
    """A turn of an agent conversation: the whole history again, as agents send it."""
    messages: list[dict[str, str]] = [{"role": "system", "content": f"{PROMPT_MARK}-system you are an agent"}]
    for k in range(turn + 1):
        messages.append({"role": "user", "content": f"{PROMPT_MARK}-{conversation}-{k} " + "word " * words})
        if k < turn:
            messages.append(
                {"role": "assistant", "content": fake_openai.completion_text({"messages": messages})}
            )
    return json.dumps({"model": "fake-model", "messages": messages, "stream": stream}).encode()


@dataclass
class TurnResult:
    status: int
    body: bytes
    expected: bytes
    error: str = ""

    @property
    def ok(self) -> bool:
        """200 and exactly the upstream's bytes."""
        return not self.error and self.status == 200 and self.body == self.expected


def chat(
    proxy_url: str,
    conversation: str,
    turn: int,
    *,
    stream: bool,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> TurnResult:
    """One turn through the sidecar with ``http.client`` (a fresh connection, like many agents)."""
    body = chat_body(conversation, turn, stream)
    expected = fake_openai.expected_body(body)
    where = urlsplit(proxy_url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=body,
            headers={
                "Content-Type": "application/json",
                "X-Conversation-Id": conversation,
                **(headers or {}),
            },
        )
        resp = conn.getresponse()
        return TurnResult(resp.status, resp.read(), expected)
    except (OSError, http.client.HTTPException) as exc:
        return TurnResult(0, b"", expected, f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def run_turns(proxy_url: str, prefix: str, conversations: int, turns: int) -> list[TurnResult]:
    """``conversations`` x ``turns`` turns, streaming and not alternating, in turn order."""
    results = []
    for t in range(turns):
        for c in range(conversations):
            results.append(chat(proxy_url, f"{prefix}-{c}", t, stream=(c + t) % 2 == 0))
    return results


def failures(results: list[TurnResult]) -> list[str]:
    return [f"{r.status} {r.error or r.body[:120]!r}" for r in results if not r.ok]


# ------------------------------------------------------------------ the load loop


@dataclass
class LoadStats:
    turns: int = 0
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)

    def add(self, ok: bool, what: str) -> None:
        if ok:
            self.turns += 1
        else:
            self.errors += 1
            if len(self.first_errors) < 5:
                self.first_errors.append(what)


async def agent_load(
    proxy_url: str, *, agents: int, turns_per_conversation: int, seconds: float, stats: LoadStats
) -> None:
    """``agents`` concurrent agents, each running multi-turn streamed conversations until time is up.

    Each agent keeps one keep-alive connection (aiohttp), sends the whole history every turn
    and checks every answer byte for byte; a finished conversation is followed by a new one.
    """
    import aiohttp

    deadline = time.monotonic() + seconds

    async def agent(k: int) -> None:
        conversation = 0
        timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < deadline:
                cid = f"load-{k}-{conversation}"
                for turn in range(turns_per_conversation):
                    if time.monotonic() >= deadline:
                        return
                    body = chat_body(cid, turn, stream=True, words=32)
                    try:
                        async with session.post(
                            f"{proxy_url}/v1/chat/completions",
                            data=body,
                            headers={"Content-Type": "application/json", "X-Conversation-Id": cid},
                        ) as resp:
                            got = await resp.read()
                            ok = resp.status == 200 and got == fake_openai.expected_body(body)
                            stats.add(ok, f"{resp.status} {got[:80]!r}")
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                        stats.add(False, f"{type(exc).__name__}: {exc}")
                conversation += 1

    await asyncio.gather(*(agent(k) for k in range(agents)))


# ------------------------------------------------------------------ RSS


class RssSampler:
    """Samples the RSS of named processes on a thread (MB), until :meth:`stop`."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.25) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.interval_s = interval_s
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.started = time.monotonic()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def sample(self) -> None:
        now = time.monotonic() - self.started
        for name, proc in self.procs.items():
            with contextlib.suppress(psutil.Error):
                self.samples[name].append((now, proc.memory_info().rss / 1e6))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak(self, name: str) -> float:
        return max(mb for _, mb in self.samples[name])

    def summary(self, name: str) -> dict[str, float]:
        """start, peak, end (MB) and the slope (MB/min) over the second half of the run."""
        points = self.samples[name]
        half = points[len(points) // 2 :]
        return {
            "start": points[0][1],
            "peak": self.peak(name),
            "end": points[-1][1],
            "slope_mb_per_min": slope(half) * 60,
        }


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y) points (y units per second); 0 for fewer than 2."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / var if var else 0.0


# ------------------------------------------------------------------ metrics and the store


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample's values whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        match = re.match(r"^(\w+)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


STORE_READER = r"""
import json, sys
from otelkv.store import open_store
store = open_store(path=sys.argv[1])
try:
    print(json.dumps(store.query(sys.argv[2])))
finally:
    store.close()
"""


def store_query(path: Path, sql: str) -> list[dict[str, Any]]:
    """Rows of ``sql`` on a stopped sidecar's store, read by a process of its own (chDB: one
    directory per process)."""
    out = subprocess.run(
        [sys.executable, "-c", STORE_READER, str(path), sql],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
    return rows


def stored_conversations(path: Path) -> dict[str, int]:
    """Turn spans per conversation id in the store at ``path``."""
    rows = store_query(
        path,
        "SELECT SpanAttributes['gen_ai.conversation.id'] AS c, count() AS n FROM otel.otel_traces "
        "WHERE SpanName LIKE 'chat %' GROUP BY c",
    )
    return {row["c"]: int(row["n"]) for row in rows}


def wait_for(probe: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def http_status(url: str, *, data: bytes | None = None, headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)
