"""The replay of ``otelkv tune``: vLLM's pull-or-recompute rule, block-seconds and peak memory, by hand."""

from __future__ import annotations

import pytest

from otelkv import names
from otelkv.analysis.model import Leg, Retention, Turn
from otelkv.analysis.tune.fit import METHOD_LEAST_SQUARES, CostModel, Geometry, LinearFit
from otelkv.analysis.tune.replay import (
    NO_NEXT_TURN,
    Handoff,
    Setting,
    fate,
    handoffs,
    model_check,
    peak,
    replay,
    reusable_tokens,
)

S = 1_000_000_000


def accepted_fit(unit: str, intercept: float, slope: float, *, samples: int = 20) -> LinearFit:
    """An exact line over sizes 100..10000 (tokens or bytes x 10 kB) that passes the evidence gate
    with the default ``samples`` (pass fewer to build one it rejects)."""
    scale = 1 if unit == "token" else 10_000
    lo, hi = 100 * scale, 10_000 * scale
    mean = intercept + slope * (lo + hi) / 2
    return LinearFit(unit, intercept, slope, samples, METHOD_LEAST_SQUARES, 0.0, 1.0, "", lo, hi, mean)


COSTS = CostModel(
    accepted_fit("token", 0.01, 0.001),  # 1 ms per token recomputed
    accepted_fit("byte", 0.02, 1e-8),  # 20 ms + 10 ns per byte pulled
    Geometry(10_000, 100_000, "kv_transfer"),  # 10 kB per token, 100 kB per block
)


def h(start_s: float, gap_s: float | None, tokens: int, blocks: int, reason: str | None = None) -> Handoff:
    return Handoff(
        "c",
        f"p{start_s}",
        "n" if gap_s is not None else None,
        round(start_s * S),
        gap_s,
        tokens,
        blocks,
        blocks * 100_000,
        False,
        reason,
    )


HANDOFFS = [
    h(0, 10, 500, 20),  # pulls under (30 s, 64, router 24 s)
    h(5, 40, 1000, 40),  # gap above the router TTL: no handle, held for the whole TTL
    h(20, 3, 20, 10),  # 20 tokens: below threshold 64
    h(30, None, 0, 30),  # last turn: held for the whole TTL
]


def test_fate_follows_vllm_order_and_boundaries() -> None:
    s = Setting(30.0, 64, 24.0)
    assert fate(h(0, 24.0, 500, 1), s) == names.REASON_PULLED  # age == router TTL still forwarded
    assert fate(h(0, 24.01, 500, 1), s) == names.REASON_NO_DECODE_HANDLE
    assert fate(h(0, 3, 0, 1), s) == names.REASON_NOTHING_BEYOND_LOCAL_HIT
    assert fate(h(0, 3, 63, 1), s) == names.REASON_BELOW_THRESHOLD
    assert fate(h(0, 3, 64, 1), s) == names.REASON_PULLED
    no_router = Setting(30.0, 64, None)
    assert fate(h(0, 24.99, 500, 1), no_router) == names.REASON_PULLED
    assert fate(h(0, 25.0, 500, 1), no_router) == names.REASON_DECLINED_EXPIRED  # 25 + 5 >= 30
    assert fate(h(0, 25.0, 63, 1), no_router) == names.REASON_BELOW_THRESHOLD  # no read, no decline
    assert fate(h(0, None, 500, 1), s) == NO_NEXT_TURN


def test_a_handle_guard_refused_never_pulls_whatever_the_setting() -> None:
    """Guard mode refuses a handle whose KV belongs to other tokens after vLLM's threshold test
    and before the read: no TTL or threshold turns it into a pull."""
    refused = names.REASON_CONTINUITY_MISMATCH
    for setting in (Setting(30.0, 64, 24.0), Setting(600.0, 1, None)):
        assert fate(h(0, 3, 500, 1, refused), setting) == refused
    assert fate(h(0, 3, 20, 1, refused), Setting(30.0, 64, 24.0)) == names.REASON_BELOW_THRESHOLD
    assert fate(h(0, 30.0, 500, 1, refused), Setting(30.0, 64, 24.0)) == names.REASON_NO_DECODE_HANDLE


def test_replay_by_hand() -> None:
    r = replay(HANDOFFS, Setting(30.0, 64, 24.0), COSTS)
    assert r.handoffs == 3 and r.pulls == 1 and r.failed == 0
    assert r.fates == {
        names.REASON_PULLED: 1,
        names.REASON_NO_DECODE_HANDLE: 1,
        names.REASON_BELOW_THRESHOLD: 1,
        NO_NEXT_TURN: 1,
    }
    assert r.pulled_tokens == 500
    assert r.prefill_saved_s == pytest.approx(0.5)  # 500 tokens x 1 ms
    assert r.pull_wait_s == pytest.approx(0.07)  # 20 ms + 5 MB x 10 ns
    assert r.ttft_delta_s == pytest.approx(-0.43)
    # held 10 s, 30 s (TTL: the router sent no handle), 3 s, 30 s (last turn)
    assert r.block_seconds == pytest.approx(20 * 10 + 40 * 30 + 10 * 3 + 30 * 30)
    # [0,10) 2 MB, [5,35) 4 MB, [20,23) 1 MB, [30,60) 3 MB: most at once is 4 + 3 MB in [30,35)
    assert (r.peak_bytes, r.peak_blocks) == (7_000_000, 70)


def test_replay_without_router_ttl_fails_late_reads_and_lower_threshold_pulls_more() -> None:
    r = replay(HANDOFFS, Setting(30.0, 16, None), COSTS)
    assert r.fates[names.REASON_DECLINED_EXPIRED] == 1 and r.failed == 1  # 40 s gap, handle forwarded
    assert r.pulls == 2 and r.pulled_tokens == 520
    assert r.ttft_delta_s == pytest.approx((0.07 - 0.5) + (0.022 - 0.02))
    longer = replay(HANDOFFS, Setting(60.0, 64, 54.0), COSTS)
    assert longer.pulls == 2 and longer.failed == 0  # the 40 s gap is caught
    assert longer.block_seconds == pytest.approx(20 * 10 + 40 * 40 + 10 * 3 + 30 * 60)


def test_seconds_need_the_fits_they_rest_on() -> None:
    """A recompute fit the gate rejects: prefill saved and TTFT change are None; counts, pull wait stay."""
    weak = CostModel(accepted_fit("token", 0.01, 0.001, samples=5), COSTS.pull, COSTS.geometry)
    r = replay(HANDOFFS, Setting(30.0, 64, 24.0), weak)
    good = replay(HANDOFFS, Setting(30.0, 64, 24.0), COSTS)
    assert (r.pulls, r.pulled_tokens, r.block_seconds) == (good.pulls, good.pulled_tokens, good.block_seconds)
    assert r.prefill_saved_s is None and r.ttft_delta_s is None
    assert r.pull_wait_s == pytest.approx(0.02 + 1e-8 * 500 * 10_000)  # the one 500-token pull
    no_pull = replay(
        HANDOFFS, Setting(30.0, 64, 24.0), CostModel(COSTS.recompute, weak.recompute, COSTS.geometry)
    )
    assert no_pull.prefill_saved_s == pytest.approx(0.5) and no_pull.pull_wait_s is None


def test_peak_touching_intervals_do_not_overlap() -> None:
    assert peak([(0, 10, 5, 1), (10, 20, 7, 2)]) == (7, 2)
    assert peak([(0, 10, 5, 1), (9, 20, 7, 2), (0, 0, 100, 100)]) == (12, 3)


def _leg(role: str, start_s: float, end_s: float, **kw: object) -> Leg:
    return Leg(role=role, start_ns=round(start_s * S), end_ns=round(end_s * S), **kw)  # type: ignore[arg-type]


def test_handoffs_from_turns() -> None:
    d0 = _leg(names.ROLE_DECODE, 1.0, 2.0, prompt_tokens=300, output_tokens=41)  # holds 340 tokens
    d0.retention = Retention(names.RETENTION_DECODE_TTL, names.RETENTION_CONSUMED, 7.5, 11, 1_100_000, 30.0)
    t0 = Turn(trace_id="a", source="sidecar", conversation_id="c", index=0, decode=d0)
    p1 = _leg(
        names.ROLE_PREFILL,
        9.5,
        9.8,
        prompt_tokens=400,
        local_cache=64,
        reason=names.REASON_NO_DECODE_HANDLE,
        remote_reusable=0,
    )
    d1 = _leg(
        names.ROLE_DECODE, 9.8, 11.0, prompt_tokens=400, output_tokens=10
    )  # no retention span: estimated
    t1 = Turn(trace_id="b", source="sidecar", conversation_id="c", index=1, prefill=p1, decode=d1)
    first, last = handoffs([t1, t0], COSTS.geometry)
    assert (first.producer_trace_id, first.consumer_trace_id) == ("a", "b")
    assert first.gap_s == pytest.approx(7.5)  # decode end 2.0 s -> next prefill start 9.5 s
    assert first.reusable_tokens == 340 - 64  # rebuilt: the router sent no handle, so 0 was recorded
    assert (first.blocks, first.bytes, first.estimated) == (11, 1_100_000, False)
    assert first.recorded_reason == names.REASON_NO_DECODE_HANDLE
    assert last.gap_s is None and last.estimated
    assert (last.bytes, last.blocks) == (409 * 10_000, 41)  # 409 tokens x 10 kB, in 100 kB blocks
    check = model_check([first, last], Setting(30.0, 64, None))
    assert check == {"compared": 1, "agree": 0, "share": 0.0, "modelled_pulls": 1, "recorded_pulls": 0}


def test_reusable_tokens_prefers_the_recorded_count() -> None:
    p = Leg(
        role=names.ROLE_PREFILL,
        prompt_tokens=400,
        local_cache=0,
        remote_reusable=120,
        reason=names.REASON_BELOW_THRESHOLD,
    )
    assert reusable_tokens(p, Leg(role=names.ROLE_DECODE, prompt_tokens=300, output_tokens=40)) == 120
    nothing = Leg(
        role=names.ROLE_PREFILL,
        prompt_tokens=400,
        remote_reusable=0,
        reason=names.REASON_NOTHING_BEYOND_LOCAL_HIT,
    )
    assert reusable_tokens(nothing, Leg(role=names.ROLE_DECODE, prompt_tokens=300)) == 0
