"""Sidecar vs direct at saturation on the real reference fleet (vLLM prefill + decode + router).

    .venv/bin/python bench/sidecar_fleet.py            # ~6 minutes (engine start included)

``bench/sidecar_overhead.py`` measures the proxy against an upstream that does no work,
which isolates the hop's latency but says little about throughput: there the proxy's
few tens of microseconds compete with an upstream that costs as little. What an operator
asks is "how many turns does my fleet still serve with the sidecar in front of it?"; this
bench answers that on the machine at hand: the reference fleet (real vLLM engines, real
NixlConnector over UCX, the router), saturated by ``--concurrency`` agents, alternating
rounds sent to the router directly and through the sidecar (ABBA order, so drift hits
both arms alike). The engines export their spans to the sidecar in both arms, as in a
deployment; the difference between arms is the proxy hop and the turn span.

Two figures, because on 2 cores round-to-round noise is large (UCX progress threads
busy-poll): the measured turns/s ratio, and the CPU the sidecar used per turn (its proxy
process plus its threads in this process) next to the fleet's CPU per turn - the bound a
CPU-saturated machine puts on the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from otelkv.fleet.fleet import Fleet, FleetConfig  # noqa: E402

WORDS = "the agent reads the file and runs the test then reports the status of the build".split()


def _tree_cpu(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _thread_cpu(prefixes: tuple[str, ...]) -> float:
    """CPU seconds of this process's threads whose names start with ``prefixes``."""
    wanted = {t.native_id for t in threading.enumerate() if t.name.startswith(prefixes)}
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in wanted)


ERRORS: dict[str, int] = {}
"""Failed turns per URL (a failed turn ends its conversation; the agent starts another)."""
LATENCIES: dict[str, list[float]] = {}
"""Seconds per successful turn, per URL. The median is robust to the multi-second stalls of
KV reads of an idle engine that this 2-core machine shows (docs/diagnoses.md,
slow_kv_handoff), which make turns/s over a 30 s round swing by 2x on their own."""
STALL_S = 5.0
"""A turn slower than this counts as stalled (a tiny-model turn takes well under 1 s)."""


async def saturate(url: str, concurrency: int, seconds: float, turns: int, tag: str) -> int:
    """Agents each run conversations of ``turns`` turns back to back; returns turns done."""
    done = 0
    deadline = time.monotonic() + seconds

    async def agent(session: aiohttp.ClientSession, k: int) -> None:
        nonlocal done
        n = 0
        while time.monotonic() < deadline:
            conversation = f"{tag}-{k}-{n}"
            n += 1
            messages = [{"role": "system", "content": "you are a build agent"}]
            for t in range(turns):
                words = " ".join(WORDS[(t + k + i) % len(WORDS)] for i in range(24))
                messages.append({"role": "user", "content": f"turn {t}: {words}"})
                body = {"model": "tiny-llama", "messages": messages, "max_tokens": 8, "temperature": 0}
                sent = time.monotonic()
                async with session.post(
                    url + "/v1/chat/completions",
                    json=body,
                    headers={"X-Conversation-Id": conversation},
                ) as resp:
                    data = await resp.json(content_type=None)
                if resp.status != 200:
                    ERRORS[url] = ERRORS.get(url, 0) + 1
                    print(f"  {tag}: turn failed with {resp.status}: {str(data)[:160]}", flush=True)
                    break
                done += 1
                LATENCIES.setdefault(url, []).append(time.monotonic() - sent)
                messages.append(data["choices"][0]["message"])
                if time.monotonic() >= deadline:
                    return

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(agent(session, k) for k in range(concurrency)))
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="ABBA pairs")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    fleet = Fleet(FleetConfig(sidecar=True, collect_spans=False)).start()
    try:
        assert fleet.router is not None and fleet.sidecar is not None
        direct, sidecar = fleet.router.url, fleet.sidecar.url
        proxy_proc = psutil.Process(fleet.sidecar.proxy.pid)
        engines = [psutil.Process(e.pid) for e in (fleet.prefill, fleet.decode) if e is not None]
        # A short warm-up through both paths (NIXL handshakes, prefix caches).
        asyncio.run(saturate(direct, 2, 5, 2, "warm-d"))
        asyncio.run(saturate(sidecar, 2, 5, 2, "warm-s"))
        LATENCIES.clear()
        rates: dict[str, list[float]] = {"direct": [], "sidecar": []}
        cpu: dict[str, list[tuple[float, float, float]]] = {"direct": [], "sidecar": []}
        order = []
        for r in range(args.rounds):
            order += [("direct", direct), ("sidecar", sidecar)][:: 1 if r % 2 == 0 else -1]
            order += [("direct", direct), ("sidecar", sidecar)][:: -1 if r % 2 == 0 else 1]
        for i, (arm, url) in enumerate(order):
            fleet_before = sum(_tree_cpu(e) for e in engines) + _thread_cpu(("otelkv-router",))
            side_before = _tree_cpu(proxy_proc) + _thread_cpu(
                ("otelkv-sidecar", "otelkv-proxy", "otelkv-store")
            )
            started = time.monotonic()
            done = asyncio.run(saturate(url, args.concurrency, args.seconds, args.turns, f"{arm}{i}"))
            elapsed = time.monotonic() - started
            fleet_cpu = sum(_tree_cpu(e) for e in engines) + _thread_cpu(("otelkv-router",)) - fleet_before
            side_cpu = (
                _tree_cpu(proxy_proc)
                + _thread_cpu(("otelkv-sidecar", "otelkv-proxy", "otelkv-store"))
                - side_before
            )
            rates[arm].append(done / elapsed)
            cpu[arm].append((done, fleet_cpu, side_cpu))
            print(f"round {i}: {arm:8s} {done / elapsed:6.2f} turns/s ({done} turns)", flush=True)
        fleet.flush_store()
    finally:
        fleet.stop()

    d, s = statistics.median(rates["direct"]), statistics.median(rates["sidecar"])
    s_turns = sum(c[0] for c in cpu["sidecar"])
    fleet_ms = 1e3 * sum(c[1] for c in cpu["sidecar"]) / max(s_turns, 1)
    side_ms = 1e3 * sum(c[2] for c in cpu["sidecar"]) / max(s_turns, 1)
    lat_d, lat_s = LATENCIES.get(direct, [0.0]), LATENCIES.get(sidecar, [0.0])
    med_d, med_s = statistics.median(lat_d), statistics.median(lat_s)
    stalled_d = sum(x > STALL_S for x in lat_d)
    stalled_s = sum(x > STALL_S for x in lat_s)
    rows = [
        ("turns/s at saturation (median)", f"{d:.2f}", f"{s:.2f}", f"ratio {s / d:.3f}"),
        (
            "turn latency, median",
            f"{med_d * 1e3:.0f} ms",
            f"{med_s * 1e3:.0f} ms",
            f"direct/sidecar {med_d / med_s:.3f}",
        ),
        (
            f"turns stalled > {STALL_S:g} s",
            f"{stalled_d}/{len(lat_d)}",
            f"{stalled_s}/{len(lat_s)}",
            "",
        ),
        ("failed turns", str(ERRORS.get(direct, 0)), str(ERRORS.get(sidecar, 0)), ""),
        (
            "turns/s, every round",
            " ".join(f"{x:.1f}" for x in rates["direct"]),
            " ".join(f"{x:.1f}" for x in rates["sidecar"]),
            "",
        ),
        ("fleet CPU per turn (engines+router)", "", f"{fleet_ms:.1f} ms", ""),
        (
            "sidecar CPU per turn (proxy+telemetry)",
            "",
            f"{side_ms:.3f} ms",
            f"bound {fleet_ms / (fleet_ms + side_ms):.3f}",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'':{width}}  {'direct':>14}  {'sidecar':>14}  {'sidecar vs direct':>18}")
    for name, a, b, c in rows:
        print(f"{name:{width}}  {a:>14}  {b:>14}  {c:>18}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rates": rates,
                    "latency_median_s": {"direct": med_d, "sidecar": med_s},
                    "stalled": {"direct": stalled_d, "sidecar": stalled_s},
                    "fleet_cpu_ms_per_turn": fleet_ms,
                    "sidecar_cpu_ms_per_turn": side_ms,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
