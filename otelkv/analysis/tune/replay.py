"""Replay the recorded hand-offs under another TTL, threshold and router TTL.

A *hand-off* is one finished decode request whose blocks the decode node keeps for the
conversation's next turn: it starts when the decode request ends and is either read (or
released) by the next turn's prefill request ``gap_s`` later, or freed at the TTL.

For a candidate setting each hand-off is decided as vLLM 0.32.0 decides it:

1. The router forwards the decode handle only if ``gap_s <= router TTL``; otherwise the
   prefill node never hears of the blocks, and they stay held until the TTL.
2. The prefill node counts the reusable tokens beyond its local prefix-cache hit: none ->
   ``nothing_beyond_local_hit``; fewer than the threshold -> ``below_threshold``. Both
   recompute, and the prefill node's notification frees the decode blocks at once.
3. It reads only if ``now + 5 s`` is before the deadline (``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN``):
   with ``gap_s + 5 >= TTL`` the read is declined, which fails the request under
   ``kv_load_failure_policy=fail`` (and parks it under ``recompute``).
4. Otherwise it pulls.

The gap, the reusable tokens and the retained blocks come from the recorded spans and do
not change with the setting (assumption: the agents would have waited just as long).
Units: seconds, tokens, blocks, bytes; block-seconds = blocks x seconds held.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from otelkv import names
from otelkv.analysis.diagnose import READ_EXPIRY_MARGIN_S
from otelkv.analysis.model import Leg, Turn
from otelkv.analysis.tune.fit import CostModel, Geometry, held_tokens

SAFETY_MARGIN_S = READ_EXPIRY_MARGIN_S
"""vLLM declines a reverse read this close to the decode deadline (``pull_worker.py:33``)."""

NO_NEXT_TURN = "no_next_turn"
"""The conversation had no later turn in the window: the blocks are held for the whole TTL."""


@dataclass(frozen=True)
class Handoff:
    """One decode retention and what the conversation's next turn could have done with it."""

    conversation_id: str
    producer_trace_id: str
    consumer_trace_id: str | None
    start_ns: int
    """The decode request's end: the retention starts (and the TTL counts) from here."""
    gap_s: float | None
    """Decode end to the next prefill request's start (None: no next turn)."""
    reusable_tokens: int
    """Tokens the next prefill could read beyond its own local cache hit."""
    blocks: int
    bytes: int
    estimated: bool
    """Blocks and bytes estimated from token counts (no ``kv_retention`` span recorded)."""
    recorded_reason: str | None
    """The next prefill's recorded pull reason (to check the model against)."""


def reusable_tokens(prefill: Leg, producer: Leg | None) -> int:
    """Tokens beyond the prefill node's local hit that the previous decode held.

    The connector records the count whenever a handle arrived; without a handle (router
    dropped it, streamed decode) it records 0, so the count is rebuilt from the previous
    decode request as vLLM would: ``min(remote_num_tokens, prompt) - local hit``.
    """
    if prefill.remote_reusable or prefill.reason == names.REASON_NOTHING_BEYOND_LOCAL_HIT:
        return prefill.remote_reusable or 0
    if producer is not None:
        return max(min(held_tokens(producer), prefill.prompt_tokens) - (prefill.local_cache or 0), 0)
    return prefill.pulled or 0


def _consecutive(a: Turn, b: Turn) -> bool:
    return a.index is None or b.index is None or b.index == a.index + 1


def _pairs(turns: Sequence[Turn]) -> list[tuple[Turn, Turn | None]]:
    """(producer, next turn or None) per turn that ran a decode request, each producer once."""
    by_conv: dict[str, list[Turn]] = defaultdict(list)
    for turn in turns:
        by_conv[turn.conversation_id or turn.trace_id].append(turn)
    pairs: dict[str, tuple[Turn, Turn | None]] = {}
    for conv_turns in by_conv.values():
        conv_turns.sort(key=lambda t: (t.index if t.index is not None else -1, t.start_ns))
        for i, turn in enumerate(conv_turns):
            prev = turn.previous
            if prev is None and i > 0 and _consecutive(conv_turns[i - 1], turn):
                prev = conv_turns[i - 1]
            if prev is not None and turn.prefill is not None:
                pairs[prev.trace_id] = (prev, turn)
        for turn in conv_turns:
            pairs.setdefault(turn.trace_id, (turn, None))
    return [p for p in pairs.values() if p[0].decode is not None]


def handoffs(turns: Sequence[Turn], geometry: Geometry) -> list[Handoff]:
    """The window's hand-offs, oldest first."""
    out = []
    for producer, consumer in _pairs(turns):
        decode = producer.decode
        assert decode is not None
        ret = decode.retention
        if ret is not None and ret.blocks > 0:
            blocks, size, estimated = ret.blocks, ret.bytes, False
        else:
            size = round(held_tokens(decode) * (geometry.bytes_per_token or 0.0))
            per_block = geometry.bytes_per_block
            blocks = math.ceil(size / per_block) if per_block else 0
            estimated = True
        gap = tokens = None
        reason = None
        if consumer is not None and consumer.prefill is not None:
            leg = consumer.prefill
            gap = max(leg.start_ns - decode.end_ns, 0) / 1e9 if leg.start_ns else consumer.gap_s
            tokens = reusable_tokens(leg, decode)
            reason = leg.reason
        out.append(
            Handoff(
                conversation_id=producer.conversation_id,
                producer_trace_id=producer.trace_id,
                consumer_trace_id=consumer.trace_id if consumer else None,
                start_ns=decode.end_ns,
                gap_s=gap,
                reusable_tokens=tokens or 0,
                blocks=blocks,
                bytes=size,
                estimated=estimated,
                recorded_reason=reason,
            )
        )
    return sorted(out, key=lambda h: h.start_ns)


@dataclass(frozen=True)
class Setting:
    ttl_s: float
    threshold: int
    router_ttl_s: float | None
    """None: a router that forwards every handle, however old."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "decoder_kv_blocks_ttl_s": self.ttl_s,
            "kv_recompute_threshold": self.threshold,
            "router_handle_ttl_s": self.router_ttl_s,
        }


def fate(h: Handoff, s: Setting) -> str:
    """What the next turn's prefill does with the hand-off under ``s`` (a ``names.REASON_*``)."""
    if h.gap_s is None:
        return NO_NEXT_TURN
    if s.router_ttl_s is not None and h.gap_s > s.router_ttl_s:
        return names.REASON_NO_DECODE_HANDLE
    if h.reusable_tokens <= 0:
        return names.REASON_NOTHING_BEYOND_LOCAL_HIT
    if s.threshold > 0 and h.reusable_tokens < s.threshold:
        return names.REASON_BELOW_THRESHOLD
    if h.recorded_reason == names.REASON_CONTINUITY_MISMATCH:
        # Guard mode refused the handle: its KV belongs to other tokens, whatever the setting.
        return names.REASON_CONTINUITY_MISMATCH
    if h.gap_s + SAFETY_MARGIN_S >= s.ttl_s:
        return names.REASON_DECLINED_EXPIRED
    return names.REASON_PULLED


def held_s(h: Handoff, s: Setting, outcome: str) -> float:
    """Seconds the decode node keeps the blocks: until the prefill node's notice, else the TTL."""
    if outcome in (NO_NEXT_TURN, names.REASON_NO_DECODE_HANDLE) or h.gap_s is None:
        return s.ttl_s
    return min(h.gap_s, s.ttl_s)


def peak(intervals: Iterable[tuple[int, int, int, int]]) -> tuple[int, int]:
    """Most (bytes, blocks) held at once over ``(start_ns, end_ns, bytes, blocks)`` intervals.

    A sweep over start and end events; an interval that ends as another starts does not
    overlap it (ends sort first).
    """
    events = []
    for start, end, size, blocks in intervals:
        if end > start:
            events.append((start, 1, size, blocks))
            events.append((end, 0, -size, -blocks))
    events.sort()
    held_bytes = held_blocks = top_bytes = top_blocks = 0
    for _, _, size, blocks in events:
        held_bytes += size
        held_blocks += blocks
        top_bytes = max(top_bytes, held_bytes)
        top_blocks = max(top_blocks, held_blocks)
    return top_bytes, top_blocks


@dataclass(frozen=True)
class Replay:
    """The window under one setting.

    Counts, block-seconds and memory are facts of the replay (recorded gaps and sizes). Seconds
    are None when the fit they rest on did not pass the evidence gate: prefill saved needs the
    recompute fit, pull wait the pull fit, the first-token change both.
    """

    setting: Setting
    handoffs: int
    """Hand-offs with a next turn (the turns that could have pulled)."""
    fates: dict[str, int]
    pulled_tokens: int
    prefill_saved_s: float | None
    """Prefill compute avoided by the pulls (vs recomputing every hand-off), seconds."""
    pull_wait_s: float | None
    """Seconds the pulling requests waited for their KV."""
    ttft_delta_s: float | None
    """Sum over pulls of (pull wait - recompute avoided): negative is faster first tokens."""
    block_seconds: float
    peak_bytes: int
    peak_blocks: int

    @property
    def pulls(self) -> int:
        return self.fates.get(names.REASON_PULLED, 0)

    @property
    def failed(self) -> int:
        """Declined expired reads: failed requests under vLLM's default failure policy."""
        return self.fates.get(names.REASON_DECLINED_EXPIRED, 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.setting.as_dict(),
            "handoffs": self.handoffs,
            "pulls": self.pulls,
            "failed_requests": self.failed,
            "fates": dict(sorted(self.fates.items())),
            "pulled_tokens": self.pulled_tokens,
            "prefill_saved_s": _r(self.prefill_saved_s),
            "pull_wait_s": _r(self.pull_wait_s),
            "ttft_delta_s": _r(self.ttft_delta_s),
            "ttft_delta_per_turn_s": _r(self.ttft_delta_s / self.handoffs)
            if self.ttft_delta_s is not None and self.handoffs
            else None,
            "block_seconds": _r(self.block_seconds, 3),
            "peak_retained_bytes": self.peak_bytes,
            "peak_retained_blocks": self.peak_blocks,
        }


def _r(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def replay(hs: Sequence[Handoff], s: Setting, costs: CostModel) -> Replay:
    fates: Counter[str] = Counter()
    pulled = 0
    saved = wait = 0.0
    block_s = 0.0
    intervals = []
    for h in hs:
        outcome = fate(h, s)
        fates[outcome] += 1
        held = held_s(h, s, outcome)
        block_s += h.blocks * held
        intervals.append((h.start_ns, h.start_ns + round(held * 1e9), h.bytes, h.blocks))
        if outcome == names.REASON_PULLED:
            pulled += h.reusable_tokens
            saved += costs.recompute_s(h.reusable_tokens)
            wait += costs.pull_s(h.reusable_tokens)
    top_bytes, top_blocks = peak(intervals)
    return Replay(
        setting=s,
        handoffs=sum(n for f, n in fates.items() if f != NO_NEXT_TURN),
        fates=dict(fates),
        pulled_tokens=pulled,
        prefill_saved_s=saved if costs.recompute_priced else None,
        pull_wait_s=wait if costs.pull_priced else None,
        ttft_delta_s=(wait - saved) if costs.priced else None,
        block_seconds=block_s,
        peak_bytes=top_bytes,
        peak_blocks=top_blocks,
    )


def model_check(hs: Sequence[Handoff], s: Setting) -> dict[str, Any]:
    """How often the replay under the settings in force decides as the prefill node recorded.

    Only pull-or-not is compared: reasons the replay does not model (a failed transfer,
    bidirectional off) count as recorded recomputes.
    """
    compared = agree = modelled = recorded = 0
    for h in hs:
        if h.gap_s is None or h.recorded_reason is None:
            continue
        compared += 1
        m = fate(h, s) == names.REASON_PULLED
        r = h.recorded_reason == names.REASON_PULLED
        modelled += m
        recorded += r
        agree += m == r
    return {
        "compared": compared,
        "agree": agree,
        "share": _r(agree / compared, 4) if compared else None,
        "modelled_pulls": modelled,
        "recorded_pulls": recorded,
    }
