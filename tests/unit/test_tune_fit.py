"""Cost models of ``otelkv tune``: least squares on hand-made prefill and transfer legs, and the evidence gate."""

from __future__ import annotations

import pytest

from otelkv import names
from otelkv.analysis.model import Leg, Retention, Transfer, Turn
from otelkv.analysis.tune.evidence import MIN_FIT_SAMPLES
from otelkv.analysis.tune.fit import (
    METHOD_LEAST_SQUARES,
    METHOD_NONE,
    CostModel,
    Geometry,
    fit_costs,
    fit_geometry,
    fit_pull,
    fit_recompute,
    least_squares,
)
from tests.unit.test_tune_replay import accepted_fit

S = 1_000_000_000


def prefill(
    trace: str, computed: int, seconds: float, *, pulled: int = 0, xfer: tuple[int, float] | None = None
) -> Turn:
    """A turn whose prefill leg computed ``computed`` tokens in ``seconds`` (plus a pull's wait)."""
    wait = xfer[1] if xfer else 0.0
    leg = Leg(
        role=names.ROLE_PREFILL,
        start_ns=0,
        end_ns=round((seconds + wait) * S),
        outcome=names.OUTCOME_FINISHED,
        prompt_tokens=computed + pulled,
        computed=computed,
        pulled=pulled,
    )
    if xfer:
        leg.transfer = Transfer(
            names.DIRECTION_D_TO_P, names.TRANSFER_OK, xfer[0], None, xfer[1], None, pulled, "UCX", 0, 0
        )
    return Turn(trace_id=trace, source="engine", prefill=leg)


def test_least_squares_exact_line_and_degenerate_inputs() -> None:
    assert least_squares([1, 2, 4], [3, 5, 9]) == pytest.approx((1.0, 2.0))
    assert least_squares([1], [3]) is None
    assert least_squares([2, 2, 2], [1, 2, 3]) is None  # no spread in x: no slope


def test_recompute_least_squares() -> None:
    # 10 ms fixed + 1 ms per token, exactly, at 8 prompt lengths; a pulled leg and a 10-token leg are left out.
    turns = [prefill(f"t{n}", n, 0.01 + 0.001 * n) for n in range(100, 900, 100)]
    turns += [prefill("pulled", 100, 5.0, pulled=300), prefill("tiny", 10, 3.0)]
    fit = fit_recompute(turns)
    assert fit.method == METHOD_LEAST_SQUARES and fit.samples == 8
    assert fit.slope_s == pytest.approx(0.001) and fit.intercept_s == pytest.approx(0.01)
    assert fit.residual_s == pytest.approx(0.0, abs=1e-9) and fit.r2 == pytest.approx(1.0)
    assert (fit.size_min, fit.size_max) == (100, 800)
    assert fit.accepted and fit.evidence.reason == "" and fit.evidence.need == ""


def test_recompute_residual_spread() -> None:
    # y = 0.1, 0.3, 0.2 at x = 100, 200, 300: slope 0.0005, intercept 0.1, residuals -0.05, 0.1, -0.05.
    fit = fit_recompute([prefill("a", 100, 0.1), prefill("b", 200, 0.3), prefill("c", 300, 0.2)])
    assert fit.slope_s == pytest.approx(0.0005) and fit.intercept_s == pytest.approx(0.1)
    assert fit.residual_s == pytest.approx((0.015 / 3) ** 0.5)
    assert fit.r2 == pytest.approx(0.25)


def test_gate_rejects_too_few_samples() -> None:
    """Seven samples exactly on a line: a perfect fit, but one sample short of the bar."""
    assert MIN_FIT_SAMPLES == 8
    fit = fit_recompute([prefill(f"t{n}", n, 0.01 + 0.001 * n) for n in range(100, 800, 100)])
    assert fit.samples == 7 and fit.r2 == pytest.approx(1.0)
    assert not fit.accepted
    assert fit.evidence.reason == "7 prefill requests (need 8)"
    assert fit.evidence.need.startswith("need ≥ 8 finished prefill requests")
    assert "run longer or under load" in fit.evidence.need


def test_gate_rejects_a_low_r2() -> None:
    """The 0.25-r² samples above three times over: the same line and r², 9 samples, sizes 3x apart."""
    xy = [(100, 0.1), (200, 0.3), (300, 0.2)] * 3
    fit = fit_recompute([prefill(f"t{i}", x, y) for i, (x, y) in enumerate(xy)])
    assert fit.samples == 9 and fit.r2 == pytest.approx(0.25) and fit.slope_s == pytest.approx(0.0005)
    # residual 0.0707 s against a 0.2 s mean: 35 %, within the bar; only r² fails
    assert fit.evidence.reason == "r² 0.25 below 0.5"


def test_gate_rejects_a_large_residual() -> None:
    """The gate alone (pure): a good r² over a wide range, but points off the line by 60 % of the mean."""
    from otelkv.analysis.tune.evidence import judge_fit

    e = judge_fit(
        what="pulls",
        subject="pull time",
        size_unit="size",
        cost="per-byte",
        samples=20,
        has_line=True,
        slope=1e-8,
        r2=0.9,
        residual_s=0.6,
        mean_s=1.0,
        size_min=1e5,
        size_max=1e7,
        need="more",
    )
    assert not e.accepted and e.reason == "residual 60% of the mean (at most 50%)"
    assert e.facts["relative_residual"] == 0.6


def test_gate_rejects_one_stalled_pull() -> None:
    """Ten pulls of 1..10 MB at 20 ms + 1 ns/byte, the largest stalled 3 s (a starved process)."""
    sizes = [k * 10**6 for k in range(1, 11)]
    waits = [0.02 + 1e-9 * b for b in sizes[:-1]] + [3.0]
    fit = fit_pull(
        [
            prefill(f"p{b}", 50, 0.1, pulled=b // 10_000, xfer=(b, y))
            for b, y in zip(sizes, waits, strict=True)
        ]
    )
    assert fit.samples == 10 and fit.slope_s > 0 and not fit.accepted
    assert "below 0.5" in fit.evidence.reason and "of the mean (at most 50%)" in fit.evidence.reason


def test_gate_rejects_flat_pull_time_in_words() -> None:
    """Eight pulls of 1..8 MB that all waited 16 ms: no per-byte cost, said so, and no number for it."""
    from otelkv.cli.tune_cmd import _fit_line

    fit = fit_pull([prefill(f"p{k}", 50, 0.1, pulled=100 * k, xfer=(k * 10**6, 0.016)) for k in range(1, 9)])
    assert fit.samples == 8 and fit.slope_s == pytest.approx(0.0, abs=1e-15) and not fit.accepted
    assert fit.evidence.reason == "pull time did not grow with size: no per-byte cost measured"
    line = _fit_line("pull", fit.as_dict())
    assert "not enough evidence" in line and "did not grow with size" in line
    assert "ns/byte" not in line and "0.000" not in line


def test_gate_rejects_sizes_too_close() -> None:
    """Eight pulls on an exact line but all between 1.0 and 1.7 MB: the fixed part is a long extrapolation."""
    sizes = [10**6 + k * 10**5 for k in range(8)]
    fit = fit_pull([prefill(f"p{b}", 50, 0.1, pulled=100, xfer=(b, 0.02 + 1e-8 * b)) for b in sizes])
    assert fit.r2 == pytest.approx(1.0)
    assert fit.evidence.reason == "sizes only 1.7x apart (need 2x)"


def test_no_line_without_samples_or_spread() -> None:
    fit = fit_recompute([prefill("tiny", 8, 0.1)])
    assert fit.method == METHOD_NONE and not fit.usable and not fit.accepted
    assert fit.evidence.reason == "0 prefill requests (need 8)"
    same = fit_pull([prefill(f"p{i}", 50, 0.1, pulled=100, xfer=(10**6, 0.05)) for i in range(9)])
    assert same.method == METHOD_NONE and same.samples == 9
    assert same.evidence.reason == "no line: every one of the pulls has the same size"
    assert fit_pull([prefill("a", 100, 0.1)]).method == METHOD_NONE


def test_pull_fixed_plus_per_byte() -> None:
    # 20 ms + 10 ns per byte, at 8 sizes from 1 to 8 MB.
    turns = [
        prefill(f"p{b}", 50, 0.1, pulled=b // 10_000, xfer=(b, 0.02 + 1e-8 * b))
        for b in (k * 10**6 for k in range(1, 9))
    ]
    fit = fit_pull(turns)
    assert fit.method == METHOD_LEAST_SQUARES and fit.samples == 8 and fit.accepted
    assert fit.intercept_s == pytest.approx(0.02) and fit.slope_s == pytest.approx(1e-8)


def test_geometry_from_transfers_then_retentions() -> None:
    pulled = prefill("p", 50, 0.1, pulled=200, xfer=(2_000_000, 0.05))
    assert fit_geometry([pulled]).bytes_per_token == pytest.approx(10_000)
    decode = Leg(role=names.ROLE_DECODE, prompt_tokens=300, output_tokens=21)  # holds 320 tokens
    decode.retention = Retention(
        names.RETENTION_DECODE_TTL, names.RETENTION_EXPIRED, 10.0, 10, 3_200_000, 10.0
    )
    geo = fit_geometry([Turn(trace_id="d", source="engine", decode=decode)])
    assert (geo.bytes_per_token, geo.bytes_per_block, geo.source) == (10_000, 320_000, "kv_retention")


def test_break_even() -> None:
    costs = CostModel(
        accepted_fit("token", 0.01, 0.001),
        accepted_fit("byte", 0.02, 1e-8),
        Geometry(10_000, None, "kv_transfer"),
    )
    # 0.02 s / (0.001 - 1e-8 * 10_000) s per token = 22.2 tokens.
    assert costs.break_even_tokens() == pytest.approx(0.02 / 0.0009)
    assert costs.pull_s(100) == pytest.approx(0.03) and costs.recompute_s(100) == pytest.approx(0.1)
    slow = CostModel(costs.recompute, accepted_fit("byte", 0.0, 1e-7), costs.geometry)
    assert slow.break_even_tokens() is None  # 1 ms per token either way: a pull never wins


def test_a_rejected_fit_prices_nothing() -> None:
    """The same prices, but the recompute line from 3 samples: no break-even, no seconds."""
    weak = CostModel(
        accepted_fit("token", 0.01, 0.001, samples=3),
        accepted_fit("byte", 0.02, 1e-8),
        Geometry(10_000, None, "kv_transfer"),
    )
    assert not weak.recompute_priced and weak.pull_priced and not weak.priced
    assert weak.break_even_tokens() is None


def test_fit_costs_reports_counts() -> None:
    turns = [prefill(f"t{n}", n, 0.01 + 0.001 * n) for n in range(100, 900, 100)]
    data = fit_costs(turns).as_dict()
    assert data["recompute"]["samples"] == 8
    assert data["recompute"]["seconds_per_token"] == pytest.approx(0.001)
    assert data["recompute"]["evidence"]["accepted"] is True
    assert data["pull"]["method"] == METHOD_NONE and data["break_even_tokens"] is None
    assert data["pull"]["evidence"]["accepted"] is False
