"""The evidence gate of ``otelkv tune``: is a fit, or a count of hand-offs, enough to act on?

A recommendation is only as good as the samples under it. On a short window a least-squares
line through six prefill spans can say anything (a negative slope, an r² of 0.04, a residual
larger than the values), and a break-even computed from it is a number with nothing behind
it. Every recommendation and every warning that rests on a fit therefore passes this gate
first; when it fails, ``otelkv tune`` says "not enough evidence" and what would give it,
never a number.

A cost line ``seconds = fixed + slope x size`` passes when all of these hold:

* at least :data:`MIN_FIT_SAMPLES` samples;
* a positive slope (time grows with size: otherwise there is no per-unit cost to compare);
* r² of at least :data:`MIN_R2`;
* an RMS residual of at most :data:`MAX_RELATIVE_RESIDUAL` of the mean sample;
* sizes covering a ratio of at least :data:`MIN_SIZE_RATIO` (largest / smallest).

The TTL recommendation also needs :data:`MIN_HANDOFFS` hand-offs to a next turn, and the
``ttl_below_common_gap`` warning needs :data:`MIN_GAPS` gaps. The values, and why, are
documented on each constant and in docs/tune.md. Everything here is pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MIN_FIT_SAMPLES = 8
"""Fewest samples for a cost line. With 8 samples (6 degrees of freedom) an r² of
:data:`MIN_R2` = 0.5 is a slope t-statistic of sqrt(6) = 2.45, just above the two-sided 95 %
critical value 2.447: the two bars together mean "the slope is not plausibly zero". Fewer
samples would need a higher r² for the same confidence (0.77 at 5 samples), and a handful of
prefill spans on a busy host is exactly where queueing noise passes for a line."""
MIN_R2 = 0.5
"""Least share of the samples' variance the line must explain: below half, something other
than size (queueing, CPU contention, a cold cache) decides the time, and the slope is not the
fleet's price per token or byte."""
MAX_RELATIVE_RESIDUAL = 0.5
"""Largest RMS residual, as a share of the mean sample. The what-if adds up predictions over
the window; when a typical sample misses the line by more than half its own size, the sums
are dominated by what the line does not model. (r² alone does not catch this: a wide range
of sizes gives a high r² even when every point is off by a large absolute amount.)"""
MIN_SIZE_RATIO = 2.0
"""Least ratio of the largest to the smallest sample size. The fixed part of a pull (what
makes small pulls lose) is the line extrapolated to size 0; with sizes within a factor of 2
that extrapolation reaches further from the data than the data spans."""
MIN_HANDOFFS = 10
"""Fewest hand-offs to a next turn for a TTL recommendation. The TTL is the shortest that
keeps 90 % (the default ``--target-share``) of the best saving: with fewer than 10 hand-offs
not even one can fall beyond that knee, so the single longest gap would set the TTL."""
MIN_GAPS = 5
"""Fewest gaps for the ``ttl_below_common_gap`` warning: a median of 5 is shared by at least
three turns, not set by one or two."""

RUN_LONGER = "run longer or under load"


@dataclass(frozen=True)
class Evidence:
    """Whether a recommendation may rest on something, the facts that decided it, and what is missing.

    ``reason`` names every check that failed, in words; ``needs`` are the observations
    that would pass them. Both are empty when ``accepted``.
    """

    accepted: bool
    facts: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    needs: tuple[str, ...] = ()

    @property
    def need(self) -> str:
        """What would give the evidence, as one sentence ("" when accepted)."""
        return f"need {'; '.join(self.needs)} ({RUN_LONGER})" if self.needs else ""

    def as_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted, **self.facts, "reason": self.reason, "need": self.need}


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def judge_fit(
    *,
    what: str,
    subject: str,
    size_unit: str,
    cost: str,
    samples: int,
    has_line: bool,
    slope: float,
    r2: float | None,
    residual_s: float | None,
    mean_s: float | None,
    size_min: float | None,
    size_max: float | None,
    need: str,
) -> Evidence:
    """The gate for one cost line (see the module docstring).

    ``what`` names the samples in the reason ("prefill requests", "pulls"), ``subject`` their
    time ("prefill time", "pull time"), ``size_unit`` what grows ("prompt length", "size"),
    ``cost`` the price the slope is ("per-token", "per-byte"); ``need`` is what the samples
    would have to be to pass, e.g. "≥ 8 pulls of sizes at least 2x apart". The result's
    ``facts`` keep the numbers the gate looked at and its bars, for ``--json``.
    """
    ratio = size_max / size_min if size_min and size_max else None
    relative = residual_s / mean_s if residual_s is not None and mean_s else None
    facts = {
        "samples": samples,
        "r2": _r(r2),
        "residual_rms_s": _r(residual_s, 6),
        "relative_residual": _r(relative),
        "size_ratio": _r(ratio, 2),
        "slope_positive": has_line and slope > 0,
        "min_samples": MIN_FIT_SAMPLES,
        "min_r2": MIN_R2,
        "max_relative_residual": MAX_RELATIVE_RESIDUAL,
        "min_size_ratio": MIN_SIZE_RATIO,
    }
    failed = []
    if samples < MIN_FIT_SAMPLES:
        failed.append(f"{samples} {what} (need {MIN_FIT_SAMPLES})")
    if not has_line:
        if samples:
            failed.append(f"no line: every one of the {what} has the same {size_unit}")
    elif slope <= 0 or r2 is None:  # r² None: the times do not vary at all
        failed.append(f"{subject} did not grow with {size_unit}: no {cost} cost measured")
    else:
        if r2 < MIN_R2:
            failed.append(f"r² {r2:.2f} below {MIN_R2:g}")
        if relative is not None and relative > MAX_RELATIVE_RESIDUAL:
            failed.append(f"residual {relative:.0%} of the mean (at most {MAX_RELATIVE_RESIDUAL:.0%})")
    if has_line and (ratio is None or ratio < MIN_SIZE_RATIO):
        failed.append(
            f"{size_unit}s only {ratio:.1f}x apart (need {MIN_SIZE_RATIO:g}x)"
            if ratio is not None
            else f"{size_unit}s unknown"
        )
    if not failed:
        return Evidence(True, facts)
    return Evidence(False, facts, "; ".join(failed), (need,))


def judge_count(count: int, minimum: int, *, key: str, what: str, need: str) -> Evidence:
    """The gate for a count of observations (hand-offs): ``facts`` are ``{key: count, "minimum": ...}``."""
    facts = {key: count, "minimum": minimum}
    if count >= minimum:
        return Evidence(True, facts)
    return Evidence(False, facts, f"{count} {what} (need {minimum})", (need,))


def combined(parts: dict[str, Evidence]) -> Evidence:
    """All of ``parts`` together: accepted when every one is, the failures named by part."""
    facts = {name: {"accepted": e.accepted, **e.facts} for name, e in parts.items()}
    failed = [(name, e) for name, e in parts.items() if not e.accepted]
    if not failed:
        return Evidence(True, facts)
    reason = "; ".join(f"{name}: {e.reason}" for name, e in failed)
    return Evidence(False, facts, reason, tuple(n for _, e in failed for n in e.needs))
