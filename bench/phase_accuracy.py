"""How close are the sidecar's turn phases to the client's own clock?

    .venv/bin/python bench/phase_accuracy.py [--scenarios agent-short-tools,resumed] [--ttl 20]   # ~4 minutes

Method. Start the reference fleet with otelkv's sidecar in front, run the named scenarios'
conversations all at once (the agents, the router and the span sink share the test
process, so the machine is as busy as in the suite), then compare, turn by turn, the
sidecar's turn span with what the client measured itself:

* request: input processing + generation vs the client's request sent -> last byte read;
* gap: tool wait + app work vs the client's last byte read -> next request sent.

The client's times are taken two ways, side by side: its kernel's (``TCP_INFO`` of its
socket: when the request's last bytes left, when the response's last bytes arrived) and
its process's (``time.time()`` around the HTTP call, which includes the client's own
scheduling delays). The sidecar's side is shown as it stamps arrival (the kernel's receive
time) and as a proxy stamping at read time would have (arrival + ``otelkv.turn.socket_wait_s``):
the difference is what the kernel's receive time buys.

Prints median, p95 and max of |error| per comparison, and the signed extremes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from otelkv import names
from otelkv.fleet.agent import TurnResult
from otelkv.fleet.fleet import Fleet, FleetConfig
from otelkv.fleet.scenarios import SCENARIOS, ScenarioParams, build, parse_names

EXPORT_SETTLE_S = 3.0


def quantile(sorted_values: list[float], q: float) -> float:
    index = min(round(q * (len(sorted_values) - 1)), len(sorted_values) - 1)
    return sorted_values[index]


def summary(label: str, errors: list[float]) -> str:
    size = sorted(abs(e) for e in errors)
    return (
        f"{label:44} n={len(errors):3}  median {statistics.median(size) * 1000:7.1f} ms  "
        f"p95 {quantile(size, 0.95) * 1000:7.1f} ms  max {size[-1] * 1000:7.1f} ms  "
        f"(signed {min(errors) * 1000:+.0f}..{max(errors) * 1000:+.0f} ms)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="agent-short-tools,resumed", help=", ".join(SCENARIOS))
    parser.add_argument("--ttl", type=float, default=20.0, help="decoder_kv_blocks_ttl (s)")
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args(argv)
    plan = build(parse_names(args.scenarios), ScenarioParams(ttl_s=args.ttl, scale=args.scale))
    conversations = [c for _, convs in plan for c in convs]
    with Fleet(FleetConfig(decoder_ttl_s=args.ttl, sidecar=True)) as fleet:
        runs = fleet.driver().run_sync(conversations)
        time.sleep(EXPORT_SETTLE_S)
        fleet.flush_store()
        assert fleet.sink is not None
        turn_spans = {s.trace_id: s for s in fleet.sink.spans() if s.scope_name == names.SCOPE_SIDECAR}
    answered = sum(t.ok for run in runs for t in run)
    print(f"{answered}/{sum(len(r) for r in runs)} turns answered in {len(runs)} conversations (all at once)")

    errors: dict[str, list[float]] = {}

    def add(label: str, value: float) -> None:
        errors.setdefault(label, []).append(value)

    def kernel(t: TurnResult) -> tuple[float, float] | None:
        if t.sent_kernel_unix is None or t.done_kernel_unix is None:
            return None
        return t.sent_kernel_unix, t.done_kernel_unix

    for run in runs:
        previous: TurnResult | None = None
        for turn in run:
            span = turn_spans.get(turn.trace_id)
            if span is None:
                previous = None
                continue
            a = span.attributes
            wait = float(a.get(names.TURN_SOCKET_WAIT_SECONDS) or 0.0)
            request = float(a[names.TURN_INPUT_PROCESSING_SECONDS]) + float(a[names.TURN_GENERATION_SECONDS])
            gap = float(a[names.TURN_TOOL_WAIT_SECONDS]) + float(a[names.TURN_APP_WORK_SECONDS])
            add("socket wait (kernel receive -> sidecar read)", wait)
            k = kernel(turn)
            if k is not None:
                add("request vs client kernel", request - (k[1] - k[0]))
                add("request vs client kernel, read-time arrival", request - wait - (k[1] - k[0]))
            add("request vs client process", request - (turn.done_unix - turn.started_unix))
            if previous is not None:
                pk = kernel(previous)
                if k is not None and pk is not None:
                    add("gap vs client kernel", gap - (k[0] - pk[1]))
                    add("gap vs client kernel, read-time arrival", gap + wait - (k[0] - pk[1]))
                add("gap vs client process", gap - (turn.started_unix - previous.done_unix))
            previous = turn
    print("\n|sidecar phase - client's clock| per turn")
    for label, values in errors.items():
        print(summary(label, values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
