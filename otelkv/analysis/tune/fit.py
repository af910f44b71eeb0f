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

Both report their sample count, r² and residual spread and pass the evidence gate of
:mod:`.evidence` before anything is priced with them: a line with too few samples, a slope
that is not positive (time did not grow with size), a poor r², a large residual or sizes
too close together is reported with its evidence and not used. There is no fallback price:
a number from samples that cannot carry a line would be a guess.
Units: seconds, tokens, bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from otelkv import names
from otelkv.analysis.diagnose import pull_seconds
from otelkv.analysis.model import Leg, Turn
from otelkv.analysis.tune.evidence import MIN_FIT_SAMPLES, MIN_SIZE_RATIO, Evidence, judge_fit
from otelkv.spans.kinds import MIN_COMPUTED_TOKENS

METHOD_LEAST_SQUARES = "least_squares"
METHOD_NONE = "none"
"""No line: no samples, or all of one size."""

RECOMPUTE_NEED = (
    f"≥ {MIN_FIT_SAMPLES} finished prefill requests that pulled nothing, of prompt lengths at least "
    f"{MIN_SIZE_RATIO:g}x apart"
)
"""What the recompute fit needs to pass the gate, in words."""
PULL_NEED = f"≥ {MIN_FIT_SAMPLES} hand-offs that pulled, of sizes at least {MIN_SIZE_RATIO:g}x apart"
"""What the pull fit needs to pass the gate, in words."""


@dataclass(frozen=True)
class LinearFit:
    """``seconds = intercept_s + slope_s * x``, with how well the samples bore it out.

    :attr:`evidence` is the gate's verdict; only an accepted fit prices anything.
    """

    unit: str
    intercept_s: float
    slope_s: float
    samples: int
    method: str
    residual_s: float | None = None
    """Root mean square of the residuals, seconds."""
    r2: float | None = None
    note: str = ""
    size_min: float | None = None
    """Smallest and largest sample size (tokens or bytes)."""
    size_max: float | None = None
    mean_s: float | None = None
    """Mean sample, seconds (what the residual is measured against)."""

    @property
    def usable(self) -> bool:
        """A line exists (whatever its quality)."""
        return self.method != METHOD_NONE

    @property
    def evidence(self) -> Evidence:
        unit = self.unit
        return judge_fit(
            what="prefill requests" if unit == "token" else "pulls",
            subject="prefill time" if unit == "token" else "pull time",
            size_unit="prompt length" if unit == "token" else "size",
            cost=f"per-{unit}",
            samples=self.samples,
            has_line=self.usable,
            slope=self.slope_s,
            r2=self.r2,
            residual_s=self.residual_s,
            mean_s=self.mean_s,
            size_min=self.size_min,
            size_max=self.size_max,
            need=RECOMPUTE_NEED if unit == "token" else PULL_NEED,
        )

    @property
    def accepted(self) -> bool:
        return self.evidence.accepted

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
            f"{self.unit}s_min": self.size_min,
            f"{self.unit}s_max": self.size_max,
            "note": self.note,
            "evidence": self.evidence.as_dict(),
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


def fit_line(unit: str, samples: Sequence[tuple[float, float]], empty_note: str) -> LinearFit:
    """The least-squares line through ``(size, seconds)`` samples, or :data:`METHOD_NONE` without one."""
    xs, ys = [s[0] for s in samples], [s[1] for s in samples]
    if not samples:
        return LinearFit(unit, 0.0, 0.0, 0, METHOD_NONE, note=empty_note)
    sizes = {"size_min": min(xs), "size_max": max(xs), "mean_s": sum(ys) / len(ys)}
    line = least_squares(xs, ys)
    if line is None:
        return LinearFit(
            unit, 0.0, 0.0, len(xs), METHOD_NONE, note=f"every sample has the same {unit} count", **sizes
        )
    residual, r2 = _spread(xs, ys, *line)
    return LinearFit(unit, line[0], line[1], len(xs), METHOD_LEAST_SQUARES, residual, r2, **sizes)


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
    return fit_line(
        "token",
        samples,
        f"no finished prefill request computed {MIN_COMPUTED_TOKENS}+ tokens without pulling",
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
    return fit_line("byte", samples, "no successful D->P pull recorded")


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
    """Everything the replay prices with, and which prices passed the evidence gate."""

    recompute: LinearFit
    pull: LinearFit
    geometry: Geometry

    @property
    def recompute_priced(self) -> bool:
        """Recompute seconds can be given (the recompute fit passed the gate)."""
        return self.recompute.accepted

    @property
    def pull_priced(self) -> bool:
        """Pull seconds can be given (the pull fit passed the gate and bytes per token are known)."""
        return self.pull.accepted and self.geometry.bytes_per_token is not None

    @property
    def priced(self) -> bool:
        """Pulls and recomputes can both be priced (else first-token changes are reported as None)."""
        return self.recompute_priced and self.pull_priced

    def recompute_s(self, tokens: int) -> float:
        """Marginal prefill seconds of ``tokens`` more tokens (the fixed part is paid either way)."""
        return self.recompute.slope_s * tokens

    def pull_s(self, tokens: int) -> float:
        """Seconds a pull of ``tokens`` waits (never below 0: a negative fixed part is noise around 0)."""
        return max(self.pull.predict(tokens * (self.geometry.bytes_per_token or 0.0)), 0.0)

    def break_even_tokens(self) -> float | None:
        """Reusable tokens above which a pull beats recomputing; None if it never does or is not priced."""
        if not self.priced:
            return None
        gain = self.recompute.slope_s - self.pull.slope_s * (self.geometry.bytes_per_token or 0.0)
        if gain <= 0:
            return None
        return max(self.pull.intercept_s, 0.0) / gain

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
