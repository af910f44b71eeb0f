"""``bench/sidecar_load.py`` in small: concurrent streamed conversations for 20 s.

Zero errors (every SSE answer byte for byte), every turn in the store, and memory flat
over the second half: a leak per turn shows as a slope long before it shows as an OOM.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from otelkv import names
from otelkv.sidecar import continuity
from tests.unit import sidecar_harness as h

SECONDS = 20.0
AGENTS = 16
TURNS_PER_CONVERSATION = 6
SECOND_HALF_GROWTH_MB = {"main": 120.0, "proxy": 5.0}
"""RSS each process may gain over the second half besides the proxy's bounded caches. Main:
chDB's merge and cache memory steps up by tens of MB as the parts grow (0-77 MB measured in
15 runs on the 2-core CI machine, 35k-58k turns each, with and without the turns index);
a leak of 6 KB per turn (a turn's span and record kept) would add ~120 MB over the ~20k
turns of a half. Slower leaks are ``bench/sidecar_load.py``'s to find (ten minutes, the
slope of RSS over its second half)."""


def proxy_cache_fill_mb(turns: int, turns_per_conversation: int) -> float:
    """The most the proxy's bounded continuity caches can grow over ``turns`` turns, by their
    documented costs: the recent-turn index (capped in entries) and the per-conversation
    digests (capped in bytes). On a fast host (1,000 turns/s) they are still filling in the
    second half of the run; a leak shows beyond them."""
    recent = min(turns, continuity.RECENT_CAPACITY) * continuity.RECENT_ENTRY_BYTES
    per_conversation = continuity.STATE_OVERHEAD_BYTES + 16 + 8 * 2 * turns_per_conversation
    history = min(turns // turns_per_conversation * per_conversation, continuity.STATE_BUDGET_BYTES)
    return (recent + history) / 1e6


def test_concurrent_streamed_conversations_no_errors_flat_memory(tmp_path: Path) -> None:
    store = tmp_path / "store"
    stats = h.LoadStats()
    with h.upstream() as upstream:
        sc = h.start_cli(upstream, store)
        try:
            with h.RssSampler(sc.pids, interval_s=0.5) as rss:
                asyncio.run(
                    h.agent_load(
                        sc.proxy_url,
                        agents=AGENTS,
                        turns_per_conversation=TURNS_PER_CONVERSATION,
                        seconds=SECONDS,
                        stats=stats,
                    )
                )
            text = sc.metrics()
        finally:
            assert sc.stop() == 0
    assert stats.errors == 0, stats.first_errors
    assert stats.turns > 500
    assert h.metric(text, names.METRIC_SIDECAR_SPANS_DROPPED + "_total") == 0
    caches = proxy_cache_fill_mb(stats.turns, TURNS_PER_CONVERSATION)
    for name, bound in SECOND_HALF_GROWTH_MB.items():
        points = rss.samples[name]
        half = [mb for _, mb in points[len(points) // 2 :]]
        allowed = bound + (caches if name == "proxy" else 0.0)
        assert max(half) - half[0] < allowed, (name, rss.summary(name), stats.turns, allowed)
    assert sum(h.stored_conversations(store).values()) == stats.turns
