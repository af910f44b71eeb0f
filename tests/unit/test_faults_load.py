"""``bench/sidecar_load.py`` in small: concurrent streamed conversations for 20 s.

Zero errors (every SSE answer byte for byte), every turn in the store, and memory flat
over the second half: a leak per turn shows as a slope long before it shows as an OOM.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from otelkv import names
from tests.unit import sidecar_harness as h

SECONDS = 20.0
AGENTS = 16
SECOND_HALF_GROWTH_MB = {"main": 60.0, "proxy": 5.0}
"""RSS each process may gain over the second half (main: chDB caches and merges settle in
steps of tens of MB, and fall again; a leak of 1 KB per turn would add ~10 MB here)."""


def test_concurrent_streamed_conversations_no_errors_flat_memory(tmp_path: Path) -> None:
    store = tmp_path / "store"
    stats = h.LoadStats()
    with h.upstream() as upstream:
        sc = h.start_cli(upstream, store)
        try:
            with h.RssSampler(sc.pids, interval_s=0.5) as rss:
                asyncio.run(
                    h.agent_load(
                        sc.proxy_url, agents=AGENTS, turns_per_conversation=6, seconds=SECONDS, stats=stats
                    )
                )
            text = sc.metrics()
        finally:
            assert sc.stop() == 0
    assert stats.errors == 0, stats.first_errors
    assert stats.turns > 500
    assert h.metric(text, names.METRIC_SIDECAR_SPANS_DROPPED + "_total") == 0
    for name, bound in SECOND_HALF_GROWTH_MB.items():
        points = rss.samples[name]
        half = [mb for _, mb in points[len(points) // 2 :]]
        assert max(half) - half[0] < bound, (name, rss.summary(name))
    assert sum(h.stored_conversations(store).values()) == stats.turns
