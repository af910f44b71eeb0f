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
import statistics
import sys
import tempfile
import time

from proxy_load import (  # first: it puts the repository on sys.path
    drain,
    latency_round,
    metric,
    pct,
    process_cpu,
    saturation_round,
    start_sidecar,
    start_upstream,
    wait_http,
)

from otelkv import names
from otelkv.fleet.engines import free_port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="latency requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0, help="saturation seconds per round")
    parser.add_argument("--no-store", action="store_true", help="run the sidecar without its store")
    args = parser.parse_args()

    up_port, px_port, admin_port = free_port(), free_port(), free_port()
    store = None if args.no_store else tempfile.mkdtemp(prefix="otelkv-bench-store-")
    procs = [
        start_upstream(up_port),
        start_sidecar(f"http://127.0.0.1:{up_port}", px_port, admin_port, store),
    ]
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
                    load = asyncio.run(saturation_round(url, stream, args.concurrency, args.seconds))
                    rps[arm].append(load.rate)
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
        metrics = drain(f"http://127.0.0.1:{admin_port}")
        time.sleep(1.0)  # the last batch's insert
        cpu_after = process_cpu(procs[1].pid)
        cpu_main, cpu_proxy = cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1]
        sidecar_turns = metric(metrics, names.METRIC_TURNS + "_total")
        stored = [
            ln for ln in metrics.splitlines() if ln.startswith(names.METRIC_SIDECAR_SPANS_RECEIVED + "_total")
        ]
        dropped = [
            ln for ln in metrics.splitlines() if ln.startswith(names.METRIC_SIDECAR_SPANS_DROPPED + "_total")
        ]
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
