"""Recommendation and flags of ``otelkv tune`` on hand-made hand-offs and replays."""

from __future__ import annotations

import pytest

from otelkv import names
from otelkv.analysis.tune.config import ROUTER_TTL_RECORDED, ROUTER_TTL_UNKNOWN, InForce
from otelkv.analysis.tune.fit import CostModel
from otelkv.analysis.tune.recommend import (
    SEVERITY_ERROR,
    SEVERITY_WARNING,
    choose_ttl,
    flags,
    matched_router_ttl,
    recommend_router_ttl,
    recommend_threshold,
    recommend_ttl,
    recommended_threshold,
)
from otelkv.analysis.tune.replay import Replay, Setting, replay
from tests.unit.test_tune_replay import COSTS, accepted_fit, h


def cfg(ttl: float = 30.0, threshold: int = 64, router: float | None = 24.0, **kw: object) -> InForce:
    source = ROUTER_TTL_RECORDED if router is not None else ROUTER_TTL_UNKNOWN
    return InForce(ttl, threshold, router, source, **kw)  # type: ignore[arg-type]


def ids(found: list) -> list[tuple[str, str]]:
    return [(f.id, f.severity) for f in found]


def test_matched_router_ttl_and_threshold() -> None:
    assert matched_router_ttl(30.0) == 24.0 and matched_router_ttl(4.0) == 0.0
    assert recommended_threshold(COSTS) == 32  # break-even 22.2 tokens
    free = CostModel(COSTS.recompute, accepted_fit("byte", 0.0, 1e-8), COSTS.geometry)
    assert recommended_threshold(free) == 16  # no fixed pull cost: the smallest step


def test_router_flags() -> None:
    hs = [h(0, 10, 500, 10)]
    assert ids(flags(cfg(router=31.0), COSTS, hs, None, None)) == [
        (names.TUNE_ROUTER_TTL_ABOVE_DECODE_TTL, SEVERITY_ERROR)
    ]
    assert ids(flags(cfg(router=26.0), COSTS, hs, None, None)) == [
        (names.TUNE_ROUTER_TTL_ABOVE_DECODE_TTL, SEVERITY_WARNING)
    ]
    assert flags(cfg(router=25.0), COSTS, hs, None, None) == []
    # no router TTL recorded, but it forwarded a 26 s-old handle against a 30 s decode TTL
    found = flags(cfg(router=None, oldest_forwarded_s=26.0), COSTS, hs, None, None)
    assert ids(found) == [(names.TUNE_ROUTER_TTL_ABOVE_DECODE_TTL, SEVERITY_ERROR)]


def test_ttl_below_common_gap() -> None:
    hs = [h(0, g, 500, 10) for g in (20, 25, 30, 35, 40)] + [h(0, None, 0, 10)]
    found = flags(cfg(ttl=15.0, router=9.0), COSTS, hs, None, 60.0)
    assert ids(found) == [(names.TUNE_TTL_BELOW_COMMON_GAP, SEVERITY_WARNING)]
    assert found[0].evidence == {
        "median_gap_s": 30.0,
        "decoder_kv_blocks_ttl_s": 15.0,
        "late_turns": 5,
        "turns": 5,
    }
    assert "60s" in found[0].fix
    assert flags(cfg(ttl=36.0, router=30.0), COSTS, hs, None, None) == []  # median 30 + 5 < 36
    # four gaps: a median two turns can set, not evidence (MIN_GAPS = 5)
    assert flags(cfg(ttl=15.0, router=9.0), COSTS, hs[1:], None, 60.0) == []


def test_threshold_flags() -> None:
    hs = [h(0, 3, 20, 10), h(0, 3, 500, 10), h(0, 40, 20, 10)]  # the 40 s one is too late for a 30 s TTL
    low = flags(cfg(threshold=16), COSTS, hs, None, None)
    assert ids(low) == [(names.TUNE_THRESHOLD_BELOW_BREAK_EVEN, SEVERITY_WARNING)]
    # one timely 20-token pull: 0.022 s to pull vs 0.020 s to recompute
    assert low[0].evidence["losing_pulls"] == 1 and low[0].evidence["seconds_lost"] == pytest.approx(0.002)
    high = flags(cfg(threshold=512), COSTS, hs, None, None)
    assert ids(high) == [(names.TUNE_THRESHOLD_ABOVE_BREAK_EVEN, SEVERITY_WARNING)]
    # the 500-token prefix recomputed: 0.5 s, against a 0.07 s pull
    assert high[0].evidence["missed_pulls"] == 1 and high[0].evidence["seconds_missed"] == pytest.approx(0.43)
    assert flags(cfg(threshold=32), COSTS, hs, None, None) == []


def test_pull_never_faster() -> None:
    slow = CostModel(COSTS.recompute, accepted_fit("byte", 0.02, 1e-7), COSTS.geometry)
    hs = [h(0, 3, 500, 10)]
    current = replay(hs, Setting(30.0, 64, 24.0), slow)
    found = flags(cfg(), slow, hs, current, None)
    assert ids(found) == [(names.TUNE_PULL_NEVER_FASTER, SEVERITY_ERROR)]
    assert found[0].evidence["modelled_pulls"] == 1


def test_threshold_flags_need_accepted_fits() -> None:
    """The losing 20-token pull of test_threshold_flags, but the pull line rests on 7 pulls: no warning."""
    weak = CostModel(COSTS.recompute, accepted_fit("byte", 0.02, 1e-8, samples=7), COSTS.geometry)
    hs = [h(0, 3, 20, 10), h(0, 3, 500, 10)]
    assert flags(cfg(threshold=16), weak, hs, None, None) == []
    assert flags(cfg(threshold=512), weak, hs, None, None) == []
    slow = CostModel(COSTS.recompute, accepted_fit("byte", 0.02, 1e-7, samples=7), COSTS.geometry)
    assert flags(cfg(), slow, hs, replay(hs, Setting(30.0, 64, 24.0), slow), None) == []


def test_threshold_recommendation_from_a_good_fit_and_refused_from_a_weak_one() -> None:
    """Truth: recompute 1 ms/token, pull 20 ms + 10 ns/byte at 10 kB/token, so a pull of n tokens wins when
    0.001 n > 0.02 + 0.0001 n, i.e. n > 22.2: the threshold is 32 (the next multiple of 16)."""
    good = recommend_threshold(COSTS)
    assert good.value == 32 and good.evidence.accepted and "break-even 22 tokens" in good.reason
    assert good.as_dict()["need"] is None
    weak = CostModel(accepted_fit("token", 0.01, 0.001, samples=6), COSTS.pull, COSTS.geometry)
    refused = recommend_threshold(weak)
    assert refused.value is None
    assert refused.reason == "not enough evidence: recompute fit: 6 prefill requests (need 8)"
    data = refused.as_dict()
    assert data["recommendation"] is None and data["need"].startswith("need ≥ 8 finished prefill requests")
    assert data["evidence"]["recompute fit"]["samples"] == 6 and data["evidence"]["pull fit"]["accepted"]


def test_ttl_recommendation_needs_enough_handoffs() -> None:
    rows = [row(120, 1.0, 300), row(30, 0.1, 100), row(60, 0.95, 200)]
    ten = [h(k, 10, 500, 10) for k in range(10)]
    rec, picked = recommend_ttl(rows, COSTS, ten, target_share=0.9, budget_bytes=None)
    assert rec.value == 60 and picked is not None and picked.setting.ttl_s == 60
    assert recommend_router_ttl(rec).value == 54.0
    # nine hand-offs, and a tenth conversation that ended (no next turn): not enough
    nine = [*ten[:9], h(99, None, 0, 10)]
    rec, picked = recommend_ttl(rows, COSTS, nine, target_share=0.9, budget_bytes=None)
    assert rec.value is None and picked is None
    assert rec.reason == "not enough evidence: hand-offs: 9 hand-offs to a next turn (need 10)"
    router = recommend_router_ttl(rec)
    assert router.value is None and router.as_dict()["need"] == rec.as_dict()["need"]
    # enough hand-offs, but the pull fit is rejected: the saving is in seconds, so no TTL either
    weak = CostModel(COSTS.recompute, accepted_fit("byte", 0.02, 1e-8, samples=4), COSTS.geometry)
    rec, _ = recommend_ttl(rows, weak, ten, target_share=0.9, budget_bytes=None)
    assert rec.value is None and rec.reason.startswith("not enough evidence: pull fit: 4 pulls (need 8)")


def test_config_mixed() -> None:
    found = flags(cfg(mixed={"decoder_kv_blocks_ttl_s": [15.0, 30.0]}), COSTS, [], None, None)
    assert ids(found) == [(names.TUNE_CONFIG_MIXED, SEVERITY_WARNING)]


def row(ttl: float, saved: float, peak: int) -> Replay:
    return Replay(Setting(ttl, 64, matched_router_ttl(ttl)), 10, {}, 0, saved, 0.0, -saved, 0.0, peak, 0)


def test_choose_ttl_knee_and_budget() -> None:
    rows = [row(120, 1.0, 300), row(30, 0.1, 100), row(60, 0.95, 200)]
    assert choose_ttl(rows, target_share=0.9, budget_bytes=None).row.setting.ttl_s == 60  # type: ignore[union-attr]
    assert choose_ttl(rows, target_share=0.99, budget_bytes=None).row.setting.ttl_s == 120  # type: ignore[union-attr]
    capped = choose_ttl(rows, target_share=0.9, budget_bytes=150)
    assert capped.row is not None and capped.row.setting.ttl_s == 30 and "10%" in capped.reason
    assert choose_ttl(rows, target_share=0.9, budget_bytes=50).row is None
    assert choose_ttl([row(30, 0.0, 1)], target_share=0.9, budget_bytes=None).row is None
