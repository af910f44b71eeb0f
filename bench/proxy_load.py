"""What the proxy benches share: the instant upstream, the client, the sidecar and CPU accounting.

``bench/sidecar_overhead.py`` (sidecar vs direct) and ``bench/proxy_comparison.py`` (sidecar
vs nginx and HAProxy) import this module, so both measure with the same upstream, the same
requests and the same clock.

* :data:`UPSTREAM`: a small aiohttp server (run it with :func:`start_upstream`, its own
  process, so the numbers are the proxy's, not a model's) that answers a chat completion
  instantly, non-streaming or as 8 SSE chunks.
* :func:`latency_round`: one request at a time (:data:`WARMUP` requests first, not timed);
  :func:`saturation_round`: ``concurrency`` clients for ``seconds``.
* CPU: user + system seconds of processes (psutil), read before and after.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from otelkv import names  # noqa: E402

UPSTREAM = r"""
import asyncio, json, sys
from aiohttp import web
BODY = json.dumps({"id": "c1", "object": "chat.completion", "model": "m", "choices": [{"index": 0,
    "message": {"role": "assistant", "content": "hello there"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 2}}).encode()
CHUNK = (b'data: {"id":"c1","object":"chat.completion.chunk","model":"m",'
         b'"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n')
async def chat(request):
    body = await request.read()
    if b'"stream": true' in body or b'"stream":true' in body:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(8):
            await resp.write(CHUNK)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    return web.Response(body=BODY, content_type="application/json")
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
try:
    import uvloop; uvloop.install()
except ImportError:
    pass
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""

WARMUP = 20
"""Untimed requests at the start of each :func:`latency_round` (they still reach the proxy)."""


def start_upstream(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", UPSTREAM, str(port)])


def start_sidecar(
    upstream: str, port: int, admin_port: int, store: str | None, log: IO[bytes] | int = subprocess.DEVNULL
) -> subprocess.Popen[bytes]:
    """A real ``otelkv sidecar`` process: with its chDB store at ``store``, or ``--no-store``."""
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "otelkv.cli.main", "sidecar"),
            *("--upstream", upstream, "--listen", f"127.0.0.1:{port}"),
            *("--admin-listen", f"127.0.0.1:{admin_port}"),
            *(("--store", store) if store else ("--no-store",)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def wait_http(url: str, timeout: float = 30.0) -> None:
    """Return once ``url`` answers at all (any HTTP status)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


def request_body(stream: bool, i: int) -> bytes:
    messages = [
        {"role": "system", "content": "you are a helpful agent"},
        {"role": "user", "content": f"turn {i}: summarize the build log please"},
    ]
    return json.dumps({"model": "m", "messages": messages, "stream": stream, "max_tokens": 8}).encode()


async def one(session: aiohttp.ClientSession, url: str, stream: bool, i: int) -> float:
    """One chat completion through ``url``; its duration in seconds. Raises unless 200."""
    started = time.perf_counter()
    async with session.post(
        url + "/v1/chat/completions",
        data=request_body(stream, i),
        headers={"Content-Type": "application/json", "X-Conversation-Id": f"bench-{i % 50}"},
    ) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}")
    return time.perf_counter() - started


async def latency_round(url: str, stream: bool, n: int) -> list[float]:
    """``WARMUP + n`` requests one at a time; the durations of the last ``n``."""
    async with aiohttp.ClientSession() as session:
        for i in range(WARMUP):
            await one(session, url, stream, i)
        return [await one(session, url, stream, i) for i in range(n)]


@dataclass(frozen=True)
class Saturation:
    requests: int
    """Requests completed (every one of them reached the proxy)."""
    seconds: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


async def saturation_round(url: str, stream: bool, concurrency: int, seconds: float) -> Saturation:
    """``concurrency`` clients, each sending its next request when the last one is answered."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(session: aiohttp.ClientSession, k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < deadline:
            await one(session, url, stream, i)
            done += 1
            i += concurrency

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session, k) for k in range(concurrency)))
        return Saturation(done, time.perf_counter() - started)


def cpu_seconds(processes: Iterable[psutil.Process]) -> float:
    """User + system CPU seconds the processes have used so far."""
    total = 0.0
    for p in processes:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def process_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the sidecar's main process and of its proxy process (its child)."""
    main = psutil.Process(pid)
    return cpu_seconds([main]), cpu_seconds(main.children(recursive=True))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def scrape(admin_url: str) -> str:
    """The sidecar's ``/metrics`` (its proxy's finished turns counted first)."""
    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=10) as resp:
        return resp.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name or sample.startswith(name + "{"):
            if all(w in sample for w in wanted):
                total += float(value)
    return total


def drain(admin_url: str, turns: int | None = None, timeout: float = 60.0) -> str:
    """Wait until the sidecar has counted ``turns`` turns (when given) and its store queue
    is empty (queued spans include the batch being inserted); return its last ``/metrics``."""
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(admin_url)
        counted = metric(text, names.METRIC_TURNS + "_total")
        if (turns is None or counted >= turns) and metric(text, names.METRIC_SIDECAR_STORE_QUEUE) == 0:
            return text
        if time.monotonic() > deadline:
            raise TimeoutError(f"sidecar still busy after {timeout:.0f} s ({counted:.0f}/{turns} turns)")
        time.sleep(0.2)
