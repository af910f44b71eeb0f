"""nginx, HAProxy and the otelkv sidecar in front of the same instant upstream, side by side.

    .venv/bin/python bench/proxy_comparison.py        # ~5 minutes; --arms to pick, --rounds ...

One run, one machine, everything on 127.0.0.1, the upstream and client of
``bench/proxy_load.py`` (the ones ``bench/sidecar_overhead.py`` uses). Arms:

* ``direct``: the client talks to the upstream; the baseline of every ratio and added latency.
* ``nginx``: Debian's nginx, one worker, upstream keep-alive, ``proxy_http_version 1.1``,
  ``proxy_buffering off``, started in the foreground from a config this bench writes.
* ``haproxy``: Debian's HAProxy, ``nbthread 1``, ``mode http``, ``http-reuse always``.
* ``sidecar``: ``otelkv sidecar`` as in production: chDB store, turn spans recorded.
* ``sidecar-nostore``: the same with ``--no-store`` (proxying, turn spans and metrics only).

nginx and HAProxy are installed with ``apt-get`` when missing (said on stderr). Each round
runs every arm, in reverse order on odd rounds, one request at a time (``--requests``) and
then at saturation (``--concurrency`` clients for ``--seconds``), non-streaming then SSE.
After each step the bench waits until the arm's processes are idle again (for the sidecar:
every turn counted and its store queue written), so deferred work is charged to the step
that caused it and never runs during another arm's step.

Printed per arm: CPU per request of all the proxy's processes (nginx master + worker,
haproxy, the sidecar's main and proxy processes; user + system from psutil, summed over
the rounds), added p50/p99 latency against direct (all rounds pooled), requests/s at saturation
(median) and its ratio to direct (median of the per-round ratios: each ratio compares
neighbouring steps); then issue 16's goals for the sidecar with its store, as PASS/FAIL lines
from the same run, and whether every request through it became a turn span in its store
(counted in the store itself once the sidecar has stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from proxy_arms import ARMS, Arm, Fleet, binary, ensure_installed, version
from proxy_load import WARMUP, cpu_seconds, drain, latency_round, metric, pct, saturation_round, scrape

from otelkv import names

SIDECAR = "sidecar"
"""The arm issue 16's goals are about."""
KINDS = ((False, "non-streaming"), (True, "SSE"))


@dataclass
class Tally:
    """One arm's measurements for one kind of request, over all rounds."""

    latencies: list[float] = field(default_factory=list)
    """Seconds per request, one at a time."""
    rates: list[float] = field(default_factory=list)
    """Requests/s at saturation, one per round."""
    cpu: dict[bool, dict[str, float]] = field(default_factory=lambda: {False: {}, True: {}})
    """CPU seconds by process role; key: saturated (else one at a time)."""
    requests: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})
    load: dict[str, float] = field(default_factory=dict)
    """CPU seconds of the client and of the upstream during the saturation rounds."""

    def cpu_per_request(self, saturated: bool, role: str | None = None) -> float:
        """Summed over rounds, not a median: the kernel counts CPU in 10 ms ticks."""
        cpu = self.cpu[saturated]
        return (cpu[role] if role else sum(cpu.values())) / self.requests[saturated]


def settle(arm: Arm, window: float = 0.25, quiet: int = 2, timeout: float = 15.0) -> None:
    """Return once the arm has finished the work it was given: every turn counted and stored
    (sidecar), then ``quiet`` windows in a row in which its processes used no CPU tick
    (the kernel counts CPU time in 10 ms ticks)."""
    if not arm.roles:
        return
    if arm.admin:
        try:
            drain(arm.admin, arm.sent)
        except TimeoutError as exc:  # turns went missing: the closing check says so
            print(f"{arm.name}: {exc}", file=sys.stderr)
    deadline = time.monotonic() + timeout
    last, idle = sum(arm.cpu().values()), 0
    while idle < quiet and time.monotonic() < deadline:
        time.sleep(window)
        now = sum(arm.cpu().values())
        idle = idle + 1 if now - last < 0.005 else 0
        last = now


def finish(arm: Arm, before: dict[str, float], requests: int, tally: Tally, saturated: bool) -> None:
    """Charge the CPU the arm spent since ``before`` (deferred work included) to ``requests``."""
    arm.sent += requests
    settle(arm)
    for role, seconds in arm.cpu().items():
        tally.cpu[saturated][role] = tally.cpu[saturated].get(role, 0.0) + seconds - before[role]
    tally.requests[saturated] += requests


def warm_up(arms: list[Arm], requests: int = 200) -> None:
    """Unmeasured requests of each kind through every arm (imports, caches, the store's first
    inserts); they count as sent, so the closing check covers them."""
    for arm in arms:
        for stream, _ in KINDS:
            asyncio.run(latency_round(arm.url, stream, requests))
            arm.sent += WARMUP + requests
        settle(arm)


def load_cpu(upstream: psutil.Process) -> dict[str, float]:
    """CPU seconds of this process (the client) and of the upstream."""
    return {"client": cpu_seconds([psutil.Process()]), "upstream": cpu_seconds([upstream])}


def run_round(
    arms: list[Arm],
    upstream: psutil.Process,
    tallies: dict[tuple[str, bool], Tally],
    args: argparse.Namespace,
) -> None:
    """Each kind of request: every arm one at a time, then every arm at saturation."""
    for stream, _ in KINDS:
        for arm in arms:
            tally, before = tallies[arm.name, stream], arm.cpu()
            tally.latencies += asyncio.run(latency_round(arm.url, stream, args.requests))
            finish(arm, before, WARMUP + args.requests, tally, saturated=False)
        for arm in arms:
            tally, before, ends = tallies[arm.name, stream], arm.cpu(), load_cpu(upstream)
            load = asyncio.run(saturation_round(arm.url, stream, args.concurrency, args.seconds))
            tally.rates.append(load.rate)
            for key, seconds in load_cpu(upstream).items():
                tally.load[key] = tally.load.get(key, 0.0) + seconds - ends[key]
            finish(arm, before, load.requests, tally, saturated=True)


def median_ratio(tally: Tally, direct: Tally) -> float:
    """Median over rounds of this arm's requests/s over direct's in the same round."""
    return statistics.median(a / d for a, d in zip(tally.rates, direct.rates, strict=True))


def table(arms: list[Arm], tallies: dict[tuple[str, bool], Tally], concurrency: int) -> list[str]:
    rows: list[tuple[str, list[str]]] = []
    for saturated, mode in ((True, f"{concurrency} clients"), (False, "one at a time")):
        for stream, kind in KINDS:
            cells = [
                f"{tallies[a.name, stream].cpu_per_request(saturated) * 1e6:.0f} us" if a.roles else "-"
                for a in arms
            ]
            rows.append((f"CPU/request, {mode}, {kind}", cells))
    for end in ("client", "upstream"):
        for stream, kind in KINDS:
            ts = [tallies[a.name, stream] for a in arms]
            cells = [f"{t.load[end] / t.requests[True] * 1e6:.0f} us" for t in ts]
            rows.append((f"{end} CPU/request, {concurrency} clients, {kind}", cells))
    for stream, kind in KINDS:
        direct = tallies["direct", stream]
        tallies_ = [tallies[a.name, stream] for a in arms]
        rows.append(
            (
                f"requests/s, {concurrency} clients, {kind}",
                [f"{statistics.median(t.rates):.0f}" for t in tallies_],
            )
        )
        rows.append(("  ratio to direct", [f"{median_ratio(t, direct):.2f}" for t in tallies_]))
    for stream, kind in KINDS:
        direct = tallies["direct", stream]
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            base = pct(direct.latencies, q)
            cells = [
                f"{base * 1e3:.3f} ms"
                if a.name == "direct"
                else f"{(pct(tallies[a.name, stream].latencies, q) - base) * 1e3:+.3f} ms"
                for a in arms
            ]
            rows.append((f"{label} {kind} (direct; others added)", cells))
    width = max(len(name) for name, _ in rows)
    cols = [max(11, len(a.name)) for a in arms]
    lines = [" " * width + "".join(f"  {a.name:>{w}}" for a, w in zip(arms, cols, strict=True))]
    lines += [
        f"{name:{width}}" + "".join(f"  {c:>{w}}" for c, w in zip(cells, cols, strict=True))
        for name, cells in rows
    ]
    lines.append(f"CPU/request by process ({concurrency} clients; one at a time):")
    for arm in arms:
        for stream, kind in KINDS:
            t = tallies[arm.name, stream]
            split = "; ".join(
                " + ".join(f"{role} {t.cpu_per_request(saturated, role) * 1e6:.0f}" for role in arm.roles)
                for saturated in (True, False)
            )
            if arm.roles:
                lines.append(f"  {arm.name}, {kind}: {split} us")
    return lines


def stored_turns(store_dir: str) -> int:
    """The sidecar's turn spans in its chDB store (open it only once the sidecar has stopped)."""
    from otelkv.spans import sql as span_sql
    from otelkv.store import DEFAULT_DATABASE, open_store, schema

    store = open_store(path=store_dir)
    try:
        table = f"{schema.quote_ident(DEFAULT_DATABASE)}.{schema.quote_ident(schema.TRACES_TABLE)}"
        rows = store.query(f"SELECT count() AS n FROM {table} WHERE {span_sql.SIDECAR_TURN_SPANS}")
        return int(rows[0]["n"])
    finally:
        store.close()


def drops(arm: Arm, metrics: str, stored: int | None) -> tuple[bool, str]:
    """Did every request the client sent through ``arm`` become a turn (span in the store)?"""
    turns = metric(metrics, names.METRIC_TURNS + "_total")
    received = metric(
        metrics, names.METRIC_SIDECAR_SPANS_RECEIVED + "_total", source=names.SPAN_SOURCE_SIDECAR
    )
    dropped = metric(metrics, names.METRIC_SIDECAR_SPANS_DROPPED + "_total")
    ok = turns == arm.sent and dropped == 0
    text = f"client sent {arm.sent}, turns counted {turns:.0f}"
    if arm.store is not None:
        ok = ok and received == arm.sent and stored == arm.sent
        text += f", turn spans received {received:.0f}, dropped {dropped:.0f}, in the store {stored}"
    else:
        text += f", dropped {dropped:.0f}"
    return ok, text


def goals(tallies: dict[tuple[str, bool], Tally], arms: list[str], concurrency: int) -> list[str]:
    def line(ok: bool, text: str) -> str:
        return f"{'PASS' if ok else 'FAIL'}  {text}"

    out = []
    if "nginx" in arms:
        for saturated, mode in ((True, f"{concurrency} clients"), (False, "one at a time")):
            for stream, kind in KINDS:
                s = tallies[SIDECAR, stream].cpu_per_request(saturated) * 1e6
                n = tallies["nginx", stream].cpu_per_request(saturated) * 1e6
                out.append(
                    line(
                        s <= 2 * n, f"CPU/request <= 2x nginx's, {mode}, {kind}: {s:.0f} us vs 2 x {n:.0f} us"
                    )
                )
    for stream, kind in KINDS:
        ratio = median_ratio(tallies[SIDECAR, stream], tallies["direct", stream])
        out.append(line(ratio >= 0.75, f"requests/s >= 0.75 of direct, {kind}: {ratio:.2f}"))
    if "nginx" in arms:
        for stream, kind in KINDS:
            direct = pct(tallies["direct", stream].latencies, 0.5)
            s = (pct(tallies[SIDECAR, stream].latencies, 0.5) - direct) * 1e3
            n = (pct(tallies["nginx", stream].latencies, 0.5) - direct) * 1e3
            out.append(
                line(s <= n + 0.2, f"added p50 <= nginx's + 0.2 ms, {kind}: {s:+.3f} ms vs {n:+.3f} + 0.2 ms")
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--requests", type=int, default=1000, help="one-at-a-time requests per round and kind"
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="saturation seconds per round and kind")
    parser.add_argument("--concurrency", type=int, default=32, help="clients at saturation")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    args = parser.parse_args()
    chosen = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(chosen) - set(ARMS))
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    arm_names = ["direct", *(a for a in ARMS if a in chosen and a != "direct")]  # direct: the baseline
    ensure_installed([a for a in ("nginx", "haproxy") if a in arm_names])

    busy = psutil.cpu_percent(interval=1.0)  # other work on the machine skews every arm
    tmp = Path(tempfile.mkdtemp(prefix="otelkv-proxy-bench-"))
    fleet = Fleet(tmp)
    tallies = {(a, stream): Tally() for a in arm_names for stream, _ in KINDS}
    try:
        fleet.start(arm_names, args.concurrency)
        warm_up(fleet.arms)
        upstream = fleet.upstream_process
        assert upstream is not None
        for r in range(args.rounds):
            order = fleet.arms if r % 2 == 0 else fleet.arms[::-1]
            print(f"round {r + 1}/{args.rounds}: {' '.join(a.name for a in order)}", file=sys.stderr)
            run_round(order, upstream, tallies, args)
        final = {a.name: scrape(a.admin) for a in fleet.arms if a.admin}  # settled after each step
    finally:
        fleet.stop()  # the sidecar writes what it holds to its store before it exits
    arms = fleet.arms
    checks = {
        a.name: drops(a, final[a.name], stored_turns(a.store) if a.store else None) for a in arms if a.admin
    }
    shutil.rmtree(tmp, ignore_errors=True)

    versions = [version([binary(p) or p, "-v"]) for p in ("nginx", "haproxy") if p in arm_names]
    print(f"{psutil.cpu_count()} CPUs, {busy:.0f}% busy before the run; {'; '.join(versions) or 'no proxy'}")
    print(
        f"{args.rounds} rounds x (one at a time: {args.requests} requests; saturation: "
        f"{args.concurrency} clients x {args.seconds:g} s), non-streaming and SSE (8 chunks); "
        "CPU = all of the proxy's processes, per request over all rounds; requests/s: median of "
        "rounds; latency: all rounds pooled"
    )
    print()
    print("\n".join(table(arms, tallies, args.concurrency)))
    print()
    if SIDECAR in arm_names:
        print("issue 16 goals, sidecar with its store:")
        print("\n".join(goals(tallies, arm_names, args.concurrency)))
    for name, (ok, text) in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  nothing dropped, {name}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
