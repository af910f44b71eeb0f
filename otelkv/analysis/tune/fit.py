"""Cost models fitted from recorded spans: recompute seconds per token, pull seconds per byte.

The what-if trades recomputing ``n`` prompt tokens on the prefill node against reading
them from the decode node, so it needs both prices on *this* fleet, not a datasheet:

* **recompute**: prefill ``kv_request`` spans that pulled nothing, engine time (duration
  minus any KV wait) against tokens computed. Least squares gives a fixed part (HTTP,
  scheduling, the one sampled token) and a per-token slope; only the slope matters to the
  what-if, because a turn is prefilled either way and pulling removes tokens, not requests.
* **pull**: reverse ``kv_transfer`` spans (``D->P``, outcome ok), the time the request waited
  for its KV against bytes read: a fixed part (handshake, posting, notification) and a
  per-byte slope. The fixed part is what makes small pulls lose to recomputing.

Both report their sample count and residual spread, and fall back - saying so - when the
samples cannot carry a line: too few of them, no spread in size, or a slope of the wrong sign.
Units: seconds, tokens, bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from otelkv import names
from otelkv.analysis.diagnose import pull_seconds
from otelkv.analysis.model import Leg, Turn, per_token_compute_s

MIN_SAMPLES = 3
"""Fewest samples for a least-squares line (two points fit any line exactly: no residual)."""
MIN_COMPUTED_TOKENS = 16
"""Prefill requests computing fewer tokens are left out: fixed overhead is all they measure."""

METHOD_LEAST_SQUARES = "least_squares"
METHOD_THROUGH_ORIGIN = "through_origin"
"""No fixed part: the mean cost per unit (too few samples, or a negative intercept)."""
METHOD_FASTEST_RATE = "fastest_rate"
"""Recompute only: the fastest observed seconds per token (``per_token_compute_s``)."""
METHOD_FIXED = "fixed"
"""Pull only: cost did not grow with size in the samples, so their mean, whatever the size."""
METHOD_NONE = "none"


@dataclass(frozen=True)
class LinearFit:
    """``seconds = intercept_s + slope_s * x``, with how well the samples bore it out."""

    unit: str
    intercept_s: float
    slope_s: float
    samples: int
    method: str
    residual_s: float | None = None
    """Root mean square of the residuals, seconds (None: the method leaves none to measure)."""
    r2: float | None = None
    note: str = ""

    @property
    def usable(self) -> bool:
        return self.method != METHOD_NONE

    def predict(self, x: float) -> float:
        return self.intercept_s + self.slope_s * x

    def as_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "fixed_s": _r(self.intercept_s),
            f"seconds_per_{self.unit}": _r(self.slope_s, 12),
            "samples": self.samples,
            "method": self.method,
            "residual_rms_s": _r(self.residual_s),
            "r2": _r(self.r2, 4),
            "note": self.note,
        }


def _r(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """(intercept, slope) of the ordinary least-squares line; None without two distinct x."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def _spread(
    xs: Sequence[float], ys: Sequence[float], intercept: float, slope: float
) -> tuple[float, float | None]:
    """(RMS residual, r²) of a line over the samples; r² is None when y does not vary."""
    res = [y - (intercept + slope * x) for x, y in zip(xs, ys, strict=True)]
    ss_res = sum(r * r for r in res)
    my = sum(ys) / len(ys)
    ss_tot = sum((y - my) ** 2 for y in ys)
    return math.sqrt(ss_res / len(ys)), (1 - ss_res / ss_tot) if ss_tot > 0 else None


def _line(
    unit: str,
    xs: Sequence[float],
    ys: Sequence[float],
    intercept: float,
    slope: float,
    method: str,
    note: str = "",
) -> LinearFit:
    residual, r2 = _spread(xs, ys, intercept, slope)
    return LinearFit(
        unit,
        intercept,
        slope,
        len(xs),
        method,
        residual,
        r2 if method == METHOD_LEAST_SQUARES else None,
        note,
    )


def prefill_legs(turns: Iterable[Turn]) -> list[Leg]:
    """Each prefill leg once: the turns and their linked previous turns (which may repeat)."""
    seen: dict[str, Leg] = {}
    for turn in turns:
        for t in (turn, turn.previous):
            if t is not None and t.prefill is not None:
                seen.setdefault(t.trace_id, t.prefill)
    return list(seen.values())


def _finished(leg: Leg) -> bool:
    return leg.outcome in (None, names.OUTCOME_FINISHED)


def fit_recompute(turns: Sequence[Turn]) -> LinearFit:
    """Seconds per prompt token recomputed on the prefill node (see the module docstring)."""
    samples = [
        (float(leg.computed), leg.compute_s)
        for leg in prefill_legs(turns)
        if _finished(leg) and not leg.pulled and leg.computed and leg.computed >= MIN_COMPUTED_TOKENS
    ]
    xs, ys = [s[0] for s in samples], [s[1] for s in samples]
    line = least_squares(xs, ys) if len(samples) >= MIN_SAMPLES else None
    if line is not None and line[1] > 0:
        return _line("token", xs, ys, line[0], line[1], METHOD_LEAST_SQUARES)
    pool = [t for turn in turns for t in (turn, turn.previous) if t is not None]
    rate = per_token_compute_s(pool, min_tokens=MIN_COMPUTED_TOKENS)
    if rate is None:
        return LinearFit(
            "token",
            0.0,
            0.0,
            0,
            METHOD_NONE,
            note="no finished prefill request computed "
            f"{MIN_COMPUTED_TOKENS}+ tokens: recompute cost unknown",
        )
    why = (
        f"{len(samples)} usable prefill spans (least squares needs {MIN_SAMPLES} of different sizes)"
        if line is None
        else "least squares gave a non-positive slope (queueing noise)"
    )
    return LinearFit(
        "token",
        0.0,
        rate,
        len(samples),
        METHOD_FASTEST_RATE,
        note=f"{why}: fastest observed seconds per token instead, an upper bound on compute",
    )


def fit_pull(turns: Sequence[Turn]) -> LinearFit:
    """Seconds a reverse pull added to its request, fixed plus per byte read."""
    samples = []
    for leg in prefill_legs(turns):
        t = leg.transfer
        if t is None or t.direction != names.DIRECTION_D_TO_P or t.outcome not in (None, names.TRANSFER_OK):
            continue
        seconds = pull_seconds(leg)
        if t.bytes > 0 and seconds is not None and seconds > 0:
            samples.append((float(t.bytes), seconds))
    xs, ys = [s[0] for s in samples], [s[1] for s in samples]
    if not samples:
        return LinearFit(
            "byte", 0.0, 0.0, 0, METHOD_NONE, note="no successful D->P pull recorded: pull cost unknown"
        )
    line = least_squares(xs, ys) if len(samples) >= MIN_SAMPLES else None
    if line is not None and line[0] >= 0 and line[1] >= 0:
        return _line("byte", xs, ys, line[0], line[1], METHOD_LEAST_SQUARES)
    if line is not None and line[1] < 0:
        mean = sum(ys) / len(ys)
        return _line(
            "byte",
            xs,
            ys,
            mean,
            0.0,
            METHOD_FIXED,
            "pull time did not grow with bytes in these samples: their mean, whatever the size",
        )
    why = (
        "least squares gave a negative fixed cost"
        if line is not None
        else (f"{len(samples)} pulls (a fixed part needs {MIN_SAMPLES} of different sizes)")
    )
    return _line(
        "byte",
        xs,
        ys,
        0.0,
        sum(ys) / sum(xs),
        METHOD_THROUGH_ORIGIN,
        f"{why}: mean seconds per byte, no fixed part (small pulls look cheaper than they are)",
    )


@dataclass(frozen=True)
class Geometry:
    """Bytes per token (what a pull of n tokens reads) and per block (what a retention holds)."""

    bytes_per_token: float | None
    bytes_per_block: float | None
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_per_token": _r(self.bytes_per_token, 3),
            "bytes_per_block": _r(self.bytes_per_block, 3),
            "source": self.source,
        }


def held_tokens(decode: Leg) -> int:
    """Tokens a finished decode request leaves computed (vLLM's ``remote_num_tokens``)."""
    return max(decode.prompt_tokens + (decode.output_tokens or 0) - 1, 0)


def fit_geometry(turns: Sequence[Turn]) -> Geometry:
    """KV size per token and per block, from transfers first, else from retentions."""
    legs = prefill_legs(turns)
    moved = [(leg.transfer.bytes, leg.transfer.tokens or leg.pulled or 0) for leg in legs if leg.transfer]
    moved = [(b, n) for b, n in moved if b > 0 and n > 0]
    decodes: dict[str, Leg] = {}
    for turn in turns:
        for t in (turn, turn.previous):
            if t is not None and t.decode is not None and t.decode.retention is not None:
                decodes.setdefault(t.trace_id, t.decode)
    kept = [(d.retention.bytes, d.retention.blocks, held_tokens(d)) for d in decodes.values() if d.retention]
    kept = [k for k in kept if k[0] > 0 and k[1] > 0]
    per_block = sum(k[0] for k in kept) / sum(k[1] for k in kept) if kept else None
    if moved:
        return Geometry(sum(b for b, _ in moved) / sum(n for _, n in moved), per_block, "kv_transfer")
    with_tokens = [k for k in kept if k[2] > 0]
    if with_tokens:
        per_token = sum(k[0] for k in with_tokens) / sum(k[2] for k in with_tokens)
        return Geometry(per_token, per_block, "kv_retention")
    return Geometry(None, per_block, "none")


@dataclass(frozen=True)
class CostModel:
    """Everything the replay prices with."""

    recompute: LinearFit
    pull: LinearFit
    geometry: Geometry

    @property
    def priced(self) -> bool:
        """Whether pulls and recomputes can both be priced (else seconds are reported as None)."""
        return self.recompute.usable and self.pull.usable and self.geometry.bytes_per_token is not None

    def recompute_s(self, tokens: int) -> float:
        """Marginal prefill seconds of ``tokens`` more tokens (the fixed part is paid either way)."""
        return self.recompute.slope_s * tokens

    def pull_s(self, tokens: int) -> float:
        return self.pull.predict(tokens * (self.geometry.bytes_per_token or 0.0))

    def break_even_tokens(self) -> float | None:
        """Reusable tokens above which a pull beats recomputing; None if it never does (or unknown)."""
        if not self.priced:
            return None
        gain = self.recompute.slope_s - self.pull.slope_s * (self.geometry.bytes_per_token or 0.0)
        if gain <= 0:
            return None
        return self.pull.intercept_s / gain

    def as_dict(self) -> dict[str, Any]:
        be = self.break_even_tokens()
        return {
            "recompute": self.recompute.as_dict(),
            "pull": self.pull.as_dict(),
            "geometry": self.geometry.as_dict(),
            "break_even_tokens": _r(be, 1),
        }


def fit_costs(turns: Sequence[Turn]) -> CostModel:
    return CostModel(fit_recompute(turns), fit_pull(turns), fit_geometry(turns))
