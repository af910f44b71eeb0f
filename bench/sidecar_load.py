"""Many concurrent streamed agent conversations through a real sidecar, for minutes.

    nice -n 19 .venv/bin/python bench/sidecar_load.py              # 3 minutes (--minutes)

``--agents`` agents (default 64) each run multi-turn conversations (``--turns`` turns,
whole history resent every turn, SSE answers checked byte for byte) through a real
``otelkv sidecar`` with its chDB store, against the fake streaming upstream
(``tests/unit/fake_openai.py``, its own process). The RSS of both sidecar processes is
sampled every few seconds. What it answers: does the sidecar stay correct and flat in
memory under sustained concurrent streaming, and does every turn reach the store.

Prints turns, turns/s, errors, RSS start/peak/end per process, the RSS slope over the
second half (MB/min), store rows against turns, and the drops the sidecar counted.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from otelkv import names  # noqa: E402
from tests.unit import sidecar_harness as h  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8, help="turns per conversation")
    parser.add_argument("--sample-s", type=float, default=3.0, help="RSS sampling interval")
    args = parser.parse_args()
    seconds = args.minutes * 60
    with tempfile.TemporaryDirectory(prefix="otelkv-load-") as tmp, h.upstream() as upstream:
        store = Path(tmp) / "store"
        sc = h.start_cli(upstream, store)
        stats = h.LoadStats()
        try:
            print(f"{args.agents} agents x {args.turns}-turn streamed conversations, {args.minutes:g} min")
            with h.RssSampler(sc.pids, interval_s=args.sample_s) as rss:
                started = time.monotonic()
                asyncio.run(
                    h.agent_load(
                        sc.proxy_url,
                        agents=args.agents,
                        turns_per_conversation=args.turns,
                        seconds=seconds,
                        stats=stats,
                    )
                )
                elapsed = time.monotonic() - started
            text = sc.metrics()
        finally:
            code = sc.stop()
        stored = sum(h.stored_conversations(store).values())
    dropped_store = h.metric(text, names.METRIC_SIDECAR_SPANS_DROPPED + "_total")
    dropped_proxy = h.metric(text, names.METRIC_SIDECAR_SPANS_DROPPED + "_total", reason="proxy_channel_full")
    print()
    print(f"turns            {stats.turns}")
    print(f"turns/s          {stats.turns / elapsed:.1f}")
    print(f"errors           {stats.errors}  {stats.first_errors[:3] if stats.errors else ''}")
    print(f"store rows       {stored} turn spans for {stats.turns + stats.errors} turns sent")
    print(f"drops            {dropped_store:.0f} spans (of which proxy channel {dropped_proxy:.0f})")
    print(f"sidecar exit     {code}")
    print()
    print(f"{'process':<8} {'RSS start':>10} {'peak':>8} {'end':>8} {'slope 2nd half':>16}")
    for name in ("proxy", "main"):
        s = rss.summary(name)
        print(
            f"{name:<8} {s['start']:>8.1f}MB {s['peak']:>6.1f}MB {s['end']:>6.1f}MB "
            f"{s['slope_mb_per_min']:>+10.2f} MB/min"
        )
    return 0 if stats.errors == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
