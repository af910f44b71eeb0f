"""Cost models of ``otelkv tune``: least squares on hand-made prefill and transfer legs, and the fallbacks."""

from __future__ import annotations

import pytest

from otelkv import names
from otelkv.analysis.model import Leg, Retention, Transfer, Turn
from otelkv.analysis.tune.fit import (
    METHOD_FASTEST_RATE,
    METHOD_FIXED,
    METHOD_LEAST_SQUARES,
    METHOD_NONE,
    METHOD_THROUGH_ORIGIN,
    CostModel,
    Geometry,
    LinearFit,
    fit_costs,
    fit_geometry,
    fit_pull,
    fit_recompute,
    least_squares,
)

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
    # 10 ms fixed + 1 ms per token, exactly; a pulled leg and a 10-token leg are left out.
    turns = [prefill(f"t{n}", n, 0.01 + 0.001 * n) for n in (100, 200, 400)]
    turns += [prefill("pulled", 100, 5.0, pulled=300), prefill("tiny", 10, 3.0)]
    fit = fit_recompute(turns)
    assert fit.method == METHOD_LEAST_SQUARES and fit.samples == 3
    assert fit.slope_s == pytest.approx(0.001) and fit.intercept_s == pytest.approx(0.01)
    assert fit.residual_s == pytest.approx(0.0, abs=1e-9) and fit.r2 == pytest.approx(1.0)


def test_recompute_residual_spread() -> None:
    # y = 0.1, 0.3, 0.2 at x = 100, 200, 300: slope 0.0005, intercept 0.1, residuals -0.05, 0.1, -0.05.
    fit = fit_recompute([prefill("a", 100, 0.1), prefill("b", 200, 0.3), prefill("c", 300, 0.2)])
    assert fit.slope_s == pytest.approx(0.0005) and fit.intercept_s == pytest.approx(0.1)
    assert fit.residual_s == pytest.approx((0.015 / 3) ** 0.5)
    assert fit.r2 == pytest.approx(0.25)


def test_recompute_falls_back_to_fastest_rate_with_two_samples() -> None:
    fit = fit_recompute([prefill("a", 100, 0.5), prefill("b", 400, 0.8)])
    assert fit.method == METHOD_FASTEST_RATE and fit.samples == 2
    assert fit.slope_s == pytest.approx(0.002) and fit.intercept_s == 0.0  # 0.8 s / 400 tokens
    assert "2 usable prefill spans" in fit.note


def test_recompute_unknown_without_samples() -> None:
    fit = fit_recompute([prefill("tiny", 8, 0.1)])
    assert fit.method == METHOD_NONE and not fit.usable


def test_pull_fixed_plus_per_byte() -> None:
    # 20 ms + 10 ns per byte.
    turns = [
        prefill(f"p{b}", 50, 0.1, pulled=b // 10_000, xfer=(b, 0.02 + 1e-8 * b))
        for b in (10**6, 2 * 10**6, 4 * 10**6)
    ]
    fit = fit_pull(turns)
    assert fit.method == METHOD_LEAST_SQUARES and fit.samples == 3
    assert fit.intercept_s == pytest.approx(0.02) and fit.slope_s == pytest.approx(1e-8)


def test_pull_fallbacks() -> None:
    one = fit_pull([prefill("p", 50, 0.1, pulled=100, xfer=(10**6, 0.05))])
    assert one.method == METHOD_THROUGH_ORIGIN and one.slope_s == pytest.approx(5e-8) and one.intercept_s == 0
    flat = fit_pull(
        [
            prefill(f"p{i}", 50, 0.1, pulled=100, xfer=(b, y))
            for i, (b, y) in enumerate([(1e6, 0.05), (2e6, 0.04), (3e6, 0.03)])
        ]
    )
    assert flat.method == METHOD_FIXED and flat.intercept_s == pytest.approx(0.04) and flat.slope_s == 0.0
    assert fit_pull([prefill("a", 100, 0.1)]).method == METHOD_NONE


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
        LinearFit("token", 0.01, 0.001, 3, METHOD_LEAST_SQUARES),
        LinearFit("byte", 0.02, 1e-8, 3, METHOD_LEAST_SQUARES),
        Geometry(10_000, None, "kv_transfer"),
    )
    # 0.02 s / (0.001 - 1e-8 * 10_000) s per token = 22.2 tokens.
    assert costs.break_even_tokens() == pytest.approx(0.02 / 0.0009)
    assert costs.pull_s(100) == pytest.approx(0.03) and costs.recompute_s(100) == pytest.approx(0.1)
    slow = CostModel(costs.recompute, LinearFit("byte", 0.0, 1e-7, 3, METHOD_LEAST_SQUARES), costs.geometry)
    assert slow.break_even_tokens() is None  # 1 ms per token either way: a pull never wins


def test_fit_costs_reports_counts() -> None:
    turns = [prefill(f"t{n}", n, 0.01 + 0.001 * n) for n in (100, 200, 400)]
    data = fit_costs(turns).as_dict()
    assert data["recompute"]["samples"] == 3 and data["recompute"]["seconds_per_token"] == pytest.approx(
        0.001
    )
    assert data["pull"]["method"] == METHOD_NONE and data["break_even_tokens"] is None
