"""The settings in force during the window, read from the spans that recorded them.

The engines put their configuration on their resources (:class:`~otelkv.analysis.model.
EngineConfig`): ``decoder_kv_blocks_ttl`` on the decode node, ``kv_recompute_threshold`` on
the prefill node. The router records its handle TTL on its span when it has one; a router
that does not can still be bounded by what it did: a handle it forwarded at age ``a``
means its TTL is at least ``a``, one it judged stale at age ``a`` means below ``a``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from otelkv import names
from otelkv.analysis.model import Turn

ROUTER_TTL_RECORDED = "recorded"
"""``otelkv.router.handle_ttl_s`` on the router's spans."""
ROUTER_TTL_BELOW_STALE_AGE = "below_youngest_stale_handle"
"""No TTL recorded; the youngest handle the router judged stale bounds it from above."""
ROUTER_TTL_UNKNOWN = "unknown"
"""Neither: modelled as a router that forwards every handle, however old."""
ROUTER_TTL_GIVEN = "given"
"""``--router-ttl`` on the command line."""


@dataclass(frozen=True)
class InForce:
    """Decode TTL (s), threshold (tokens) and router handle TTL (s) during the window."""

    ttl_s: float | None
    threshold: int | None
    router_ttl_s: float | None
    router_ttl_source: str
    oldest_forwarded_s: float | None = None
    """Oldest handle the router forwarded (its TTL is at least this)."""
    mixed: dict[str, list[float]] = field(default_factory=dict)
    """Settings the engines disagreed on, with every value seen."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "decoder_kv_blocks_ttl_s": self.ttl_s,
            "kv_recompute_threshold": self.threshold,
            "router_handle_ttl_s": self.router_ttl_s,
            "router_handle_ttl_source": self.router_ttl_source,
            "oldest_forwarded_handle_s": self.oldest_forwarded_s,
            "mixed": self.mixed,
        }


def _all_turns(turns: Iterable[Turn]) -> list[Turn]:
    seen: dict[str, Turn] = {}
    for turn in turns:
        for t in (turn, turn.previous):
            if t is not None:
                seen.setdefault(t.trace_id, t)
    return list(seen.values())


def _most_common(values: Sequence[float]) -> float | None:
    """The value most requests ran with (ties: the larger, the one an operator raised to)."""
    if not values:
        return None
    counts = Counter(values)
    return max(counts, key=lambda v: (counts[v], v))


def in_force(turns: Sequence[Turn], *, router_ttl_s: float | None = None) -> InForce:
    """What was configured, from the spans; ``router_ttl_s`` overrides the router's (``--router-ttl``)."""
    pool = _all_turns(turns)
    ttls = [
        t.decode.config.decoder_ttl_s for t in pool if t.decode and t.decode.config.decoder_ttl_s is not None
    ]
    if not ttls:  # no resource attribute: the retentions' own TTL (a few microseconds short)
        ttls = [
            round(t.decode.retention.ttl_s, 3)
            for t in pool
            if t.decode and t.decode.retention and t.decode.retention.ttl_s is not None
        ]
    thresholds = [float(t.prefill.threshold) for t in pool if t.prefill and t.prefill.threshold is not None]
    recorded = [t.router.handle_ttl_s for t in pool if t.router and t.router.handle_ttl_s is not None]
    hits = [
        t.router.handle_age_s
        for t in pool
        if t.router and t.router.handle == names.ROUTER_HANDLE_HIT and t.router.handle_age_s is not None
    ]
    stale = [
        t.router.handle_age_s
        for t in pool
        if t.router and t.router.handle == names.ROUTER_HANDLE_STALE and t.router.handle_age_s is not None
    ]
    mixed = {
        key: sorted(set(values))
        for key, values in (
            ("decoder_kv_blocks_ttl_s", ttls),
            ("kv_recompute_threshold", thresholds),
            ("router_handle_ttl_s", recorded),
        )
        if len(set(values)) > 1
    }
    if router_ttl_s is not None:
        router, source = router_ttl_s, ROUTER_TTL_GIVEN
    elif recorded:
        router, source = _most_common(recorded), ROUTER_TTL_RECORDED
    elif stale:
        router, source = min(stale), ROUTER_TTL_BELOW_STALE_AGE
    else:
        router, source = None, ROUTER_TTL_UNKNOWN
    threshold = _most_common(thresholds)
    return InForce(
        ttl_s=_most_common(ttls),
        threshold=int(threshold) if threshold is not None else None,
        router_ttl_s=router,
        router_ttl_source=source,
        oldest_forwarded_s=max(hits) if hits else None,
        mixed=mixed,
    )
