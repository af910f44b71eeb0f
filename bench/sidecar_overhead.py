"""Sidecar vs direct: added latency (p50/p99) and requests/s at saturation, side by side.

    .venv/bin/python bench/sidecar_overhead.py            # ~2 minutes

An upstream that answers instantly (a small aiohttp server in its own process, so the
numbers are the proxy's, not a model's) serves a chat completion, non-streaming and
streaming (8 SSE chunks). The sidecar runs as a real ``otelkv sidecar`` process in front
of it (with its store: spans go through the same path as in production): its proxy
process relays, its main process builds spans and writes the store. The load generator
alternates direct and sidecar rounds so machine noise hits both arms alike. Also printed:
the CPU each sidecar process spent per turn, a figure the machine's noise barely moves.

Latency: one request at a time; added latency = sidecar percentile - direct percentile.
Saturation: ``--concurrency`` clients for ``--seconds`` per round; ratio = sidecar / direct.
On a 2-core machine the sidecar and the upstream compete for the same cores at
saturation, and this upstream costs about as little per request as the proxy does, so
the ratio here is the proxy's ceiling, not a fleet's: ``bench/sidecar_fleet.py``
measures throughput in front of real engines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from otelkv.fleet.engines import free_port  # noqa: E402

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


def wait_http(url: str, timeout: float = 30.0) -> None:
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
    started = time.perf_counter()
    async with session.post(
        url + "/v1/chat/completions",
        data=request_body(stream, i),
        headers={"Content-Type": "application/json", "X-Conversation-Id": f"bench-{i % 50}"},
    ) as resp:
        await resp.read()
        assert resp.status == 200, resp.status
    return time.perf_counter() - started


async def latency_round(url: str, stream: bool, n: int) -> list[float]:
    async with aiohttp.ClientSession() as session:
        for i in range(20):
            await one(session, url, stream, i)
        return [await one(session, url, stream, i) for i in range(n)]


async def saturation_round(url: str, stream: bool, concurrency: int, seconds: float) -> float:
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
        return done / (time.perf_counter() - started)


def process_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the sidecar's main process and of its proxy process (its child)."""

    def cpu(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    main = psutil.Process(pid)
    return cpu(main), sum(cpu(c) for c in main.children(recursive=True))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="latency requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0, help="saturation seconds per round")
    parser.add_argument("--no-store", action="store_true", help="run the sidecar without its store")
    args = parser.parse_args()

    up_port, px_port, admin_port = free_port(), free_port(), free_port()
    store = tempfile.mkdtemp(prefix="otelkv-bench-store-")
    procs = [subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)])]
    procs.append(
        subprocess.Popen(
            [
                *(sys.executable, "-m", "otelkv.cli.main", "sidecar"),
                *("--upstream", f"http://127.0.0.1:{up_port}", "--listen", f"127.0.0.1:{px_port}"),
                *("--admin-listen", f"127.0.0.1:{admin_port}"),
                *(("--no-store",) if args.no_store else ("--store", store)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    )
    try:
        wait_http(f"http://127.0.0.1:{up_port}/v1/chat/completions")
        wait_http(f"http://127.0.0.1:{admin_port}/api/v1/health")
        direct, sidecar = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{px_port}"
        rows = []
        cpu_before = process_cpu(procs[1].pid)
        for stream in (False, True):
            lat: dict[str, list[float]] = {"direct": [], "sidecar": []}
            rps: dict[str, list[float]] = {"direct": [], "sidecar": []}
            for r in range(args.rounds):
                order = [("direct", direct), ("sidecar", sidecar)]
                if r % 2:
                    order.reverse()
                for arm, url in order:
                    lat[arm] += asyncio.run(latency_round(url, stream, args.requests))
                for arm, url in order:
                    rate = asyncio.run(saturation_round(url, stream, args.concurrency, args.seconds))
                    rps[arm].append(rate)
            kind = "streaming" if stream else "non-streaming"
            for q, label in ((0.5, "p50"), (0.99, "p99")):
                d, s = pct(lat["direct"], q) * 1e3, pct(lat["sidecar"], q) * 1e3
                rows.append((f"{kind} latency {label}", f"{d:.3f} ms", f"{s:.3f} ms", f"+{s - d:.3f} ms"))
            d_rps, s_rps = statistics.median(rps["direct"]), statistics.median(rps["sidecar"])
            rows.append(
                (
                    f"{kind} requests/s (c={args.concurrency})",
                    f"{d_rps:.0f}",
                    f"{s_rps:.0f}",
                    f"ratio {s_rps / d_rps:.3f}",
                )
            )
        # CPU per turn over the whole run, once the store has written everything it was given.
        urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics").read()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics").read().decode()
            queued = [ln for ln in metrics.splitlines() if ln.startswith("otelkv_sidecar_store_queue_spans ")]
            if not queued or float(queued[0].split()[1]) == 0:
                break
            time.sleep(0.5)
        time.sleep(1.0)  # the last batch's insert
        cpu_after = process_cpu(procs[1].pid)
        cpu_main, cpu_proxy = cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1]
        sidecar_turns = sum(
            float(ln.split()[1]) for ln in metrics.splitlines() if ln.startswith("otelkv_turns_total{")
        )
        stored = [ln for ln in metrics.splitlines() if ln.startswith("otelkv_sidecar_spans_received_total")]
        dropped = [ln for ln in metrics.splitlines() if ln.startswith("otelkv_sidecar_spans_dropped_total")]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'direct':>12}  {'sidecar':>12}  {'sidecar vs direct':>18}")
    for name, d, s, delta in rows:
        print(f"{name:{width}}  {d:>12}  {s:>12}  {delta:>18}")
    print(
        f"sidecar CPU per turn (whole run, {sidecar_turns:.0f} turns): proxy process "
        f"{1e6 * cpu_proxy / sidecar_turns:.0f} us, main process (spans, metrics, store) "
        f"{1e6 * cpu_main / sidecar_turns:.0f} us"
    )
    print("turn spans stored:", stored or "0", " dropped:", dropped or "0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
