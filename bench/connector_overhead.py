"""Overhead of the instrumented connector: the same workload, plain vs otelkv, alternating.

    .venv/bin/python bench/connector_overhead.py [--rounds 2] [--conversations 1] [--turns 12]

Runs the reference fleet with vLLM's plain NixlConnector (A) and with otelkv's (B) in
ABBA order (ABBAABBA... for more rounds), so slow drift of a noisy machine hits both
arms alike. Both arms have identical tracing set-up (vLLM's own ``--otlp-traces-endpoint``
on, the router and driver traced); only the connector differs. Each round warms up (NIXL
handshakes) before measuring, and checks that reverse pulls happened.

Measured per turn:
  TTFT     time until the prefill node answered the router (it produces the first token;
           includes queueing, the D->P pull and prefill compute). The client-visible
           first token comes later, after the decode leg, because vLLM 0.32.0 returns the
           decode handle only on non-streaming responses, so the router cannot stream.
  e2e      the agent's full turn latency.
Throughput is completed turns per second of wall time with N concurrent conversations.
Prints the ratios instrumented/plain (1.00 = no overhead) and writes a JSON record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from otelkv.fleet import metrics as prom
from otelkv.fleet.agent import Conversation, Turn
from otelkv.fleet.fleet import Fleet, FleetConfig

WORDS = "the agent reads the file and runs the test then reports the status of the build".split()


@dataclass
class Arm:
    name: str
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)
    pulled_bytes: list[float] = field(default_factory=list)


def workload(tag: str, conversations: int, turns: int, max_tokens: int) -> list[Conversation]:
    out = []
    for c in range(conversations):
        steps = [
            Turn(
                " ".join(WORDS[(c + t) % len(WORDS) :] + WORDS[: (c + t) % len(WORDS)]),
                max_tokens,
                pause_s=0.2,
            )
            for t in range(turns)
        ]
        out.append(Conversation(f"{tag}-{c}", steps))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_round(arm: Arm, instrumented: bool, index: int, args: argparse.Namespace) -> None:
    config = FleetConfig(instrumented=instrumented, decoder_ttl_s=480.0, workdir=None)
    with Fleet(config) as fleet:
        assert fleet.router is not None and fleet.prefill is not None
        driver = fleet.driver()
        driver.run_sync(workload(f"warm{index}", 2, 2, 16))  # NIXL handshakes, first compiles
        before = prom.total(fleet.prefill.metrics_text(), "vllm:nixl_bytes_transferred_sum")
        fleet.router.stats.prefill_seconds.clear()
        started = time.perf_counter()
        results = driver.run_sync(workload(f"r{index}", args.conversations, args.turns, args.max_tokens))
        wall = time.perf_counter() - started
        turns = [t for conv in results for t in conv]
        failed = [t for t in turns if not t.ok]
        if failed:
            raise SystemExit(f"{len(failed)} turns failed in round {index} ({arm.name}): {failed[0].error}")
        pulled = prom.total(fleet.prefill.metrics_text(), "vllm:nixl_bytes_transferred_sum") - before
        if pulled <= 0:
            raise SystemExit(f"round {index} ({arm.name}): no reverse pulls happened; the comparison is void")
        arm.ttft.extend(fleet.router.stats.prefill_seconds)
        arm.e2e.extend(t.latency_s for t in turns)
        arm.throughput.append(len(turns) / wall)
        arm.pulled_bytes.append(pulled)
        print(
            f"  round {index} {arm.name:12s} turns={len(turns)} wall={wall:.1f}s "
            f"TTFT p50={statistics.median(fleet.router.stats.prefill_seconds) * 1000:.1f}ms "
            f"throughput={len(turns) / wall:.2f} turns/s pulled={pulled / 1024:.0f} KiB",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds per arm (default 2)")
    parser.add_argument("--conversations", type=int, default=1, help="concurrent conversations (default 1)")
    parser.add_argument("--turns", type=int, default=12, help="turns per conversation (default 12)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=96,
        help="tokens generated per turn (default 96: enough that the next turn's reusable "
        "tokens clear kv_recompute_threshold=64, so turns pull)",
    )
    parser.add_argument("--out", default="bench/results", help="directory for the JSON record")
    args = parser.parse_args(argv)

    plain, otelkv = Arm("plain"), Arm("instrumented")
    order = []
    for i in range(args.rounds):
        order += [(plain, False), (otelkv, True)] if i % 2 == 0 else [(otelkv, True), (plain, False)]
    print(
        f"connector overhead: {len(order)} fleet runs, order {' '.join(a.name[0].upper() for a, _ in order)}"
    )
    for index, (arm, instrumented) in enumerate(order):
        run_round(arm, instrumented, index, args)

    rows = {
        "TTFT p50 (prefill leg)": (statistics.median(otelkv.ttft), statistics.median(plain.ttft)),
        "TTFT p95 (prefill leg)": (percentile(otelkv.ttft, 0.95), percentile(plain.ttft, 0.95)),
        "e2e p50": (statistics.median(otelkv.e2e), statistics.median(plain.e2e)),
        "e2e p95": (percentile(otelkv.e2e, 0.95), percentile(plain.e2e, 0.95)),
        "throughput (turns/s)": (statistics.mean(otelkv.throughput), statistics.mean(plain.throughput)),
    }
    print(f"\n{'metric':26s} {'plain':>10s} {'otelkv':>10s} {'ratio':>7s}   (ratio = otelkv / plain)")
    record = {
        "args": vars(args),
        "samples": {"plain": len(plain.ttft), "otelkv": len(otelkv.ttft)},
        "metrics": {},
    }
    for name, (ours, base) in rows.items():
        ratio = ours / base
        scale, unit = (1000, "ms") if "throughput" not in name else (1, "")
        print(f"{name:26s} {base * scale:9.2f}{unit:2s} {ours * scale:9.2f}{unit:2s} {ratio:7.3f}")
        record["metrics"][name] = {"plain": base, "otelkv": ours, "ratio": ratio}
    print(f"(samples per arm: {len(plain.ttft)} turns; target: ratios within 1.01 / 0.99)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"connector_overhead-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
