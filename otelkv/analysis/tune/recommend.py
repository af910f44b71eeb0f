"""Choosing values from the replayed sweep, and flagging settings that are clearly wrong.

Every recommendation, and every flag that rests on a fitted cost, first passes the evidence
gate of :mod:`.evidence`; when it does not, the recommendation is None with "not enough
evidence", the failed checks and what would give it (:class:`Recommendation`).

* **Threshold**: a pull pays off once the recompute it avoids outweighs its fixed cost,
  i.e. above ``break_even = pull_fixed_s / (recompute_s_per_token - pull_s_per_byte x
  bytes_per_token)`` tokens. The threshold does not change memory (the decode node keeps the
  blocks whatever the prefill node decides), so the recommendation is that break-even,
  rounded up to a multiple of :data:`THRESHOLD_STEP`. Needs both cost fits accepted.
* **TTL**: longer TTLs catch more turns but hold more memory. The recommendation is the
  shortest TTL in the sweep that keeps ``target_share`` of the TTFT saving of the best TTL
  tried, within the memory budget when one is given - the knee of the curve, not its end.
  Needs both cost fits (the saving is in seconds) and :data:`~.evidence.MIN_HANDOFFS` hand-offs.
* **Router TTL**: always :func:`matched_router_ttl` of the recommended TTL, so the router never
  forwards a handle the prefill node would decline (which fails the request in vLLM 0.32.0).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from otelkv import names
from otelkv.analysis.tune.config import ROUTER_TTL_UNKNOWN, InForce
from otelkv.analysis.tune.evidence import MIN_GAPS, MIN_HANDOFFS, Evidence, combined, judge_count
from otelkv.analysis.tune.fit import CostModel, LinearFit
from otelkv.analysis.tune.replay import SAFETY_MARGIN_S, Handoff, Replay

THRESHOLD_STEP = 16
"""Recommended thresholds are multiples of this many tokens (and at least this many)."""
ROUTER_SLACK_S = 1.0
"""Router TTL headroom beyond vLLM's 5 s margin: the router times a handle from the decode
response it received, the decode node from the request's end, and the read comes a little
after the router forwards it."""
SEVERITY_ERROR = "error"
SEVERITY_WARNING = "warning"


def matched_router_ttl(ttl_s: float) -> float:
    """The longest router handle TTL that never forwards a handle vLLM would decline."""
    return max(ttl_s - SAFETY_MARGIN_S - ROUTER_SLACK_S, 0.0)


def recommended_threshold(costs: CostModel) -> int | None:
    """Break-even rounded up to :data:`THRESHOLD_STEP`; None when pulls never win (or are unpriced)."""
    be = costs.break_even_tokens()
    if be is None:
        return None
    return max(THRESHOLD_STEP, math.ceil(be / THRESHOLD_STEP) * THRESHOLD_STEP)


def _benefit(row: Replay) -> float:
    """TTFT seconds saved over the window (rows are only compared once both fits are accepted)."""
    return -row.ttft_delta_s if row.ttft_delta_s is not None else 0.0


@dataclass(frozen=True)
class TtlChoice:
    row: Replay | None
    reason: str


def choose_ttl(rows: Sequence[Replay], *, target_share: float, budget_bytes: int | None) -> TtlChoice:
    """The knee of the TTL sweep (``rows`` at one threshold, any order)."""
    if not rows:
        return TtlChoice(None, "no TTL candidates")
    rows = sorted(rows, key=lambda r: r.setting.ttl_s)
    fits = [r for r in rows if budget_bytes is None or r.peak_bytes <= budget_bytes]
    if not fits:
        return TtlChoice(
            None, f"every TTL tried holds more than the memory budget ({budget_bytes} bytes) at peak"
        )
    best = max(_benefit(r) for r in rows)
    if best <= 0:
        return TtlChoice(
            None, "no TTL tried makes pulls pay off on this traffic (nothing to gain from retention)"
        )
    for row in fits:
        if _benefit(row) >= target_share * best:
            return TtlChoice(
                row, f"shortest TTL with at least {target_share:.0%} of the best TTFT saving tried"
            )
    top = max(fits, key=_benefit)
    share = _benefit(top) / best
    return TtlChoice(top, f"the memory budget caps the saving at {share:.0%} of the best TTL tried")


NOT_ENOUGH_EVIDENCE = "not enough evidence"


@dataclass(frozen=True)
class Recommendation:
    """One recommended setting, or None with why not; always with the evidence it rests on."""

    value: float | None
    reason: str
    evidence: Evidence

    def as_dict(self) -> dict[str, Any]:
        return {
            "recommendation": self.value,
            "reason": self.reason,
            "need": self.evidence.need or None,
            "evidence": self.evidence.as_dict(),
        }


def fit_evidence(costs: CostModel) -> Evidence:
    """Both cost fits through the gate (what the threshold and every seconds figure rest on)."""
    return combined({"recompute fit": costs.recompute.evidence, "pull fit": costs.pull.evidence})


def _refused(evidence: Evidence) -> str:
    return f"{NOT_ENOUGH_EVIDENCE}: {evidence.reason}"


def recommend_threshold(costs: CostModel) -> Recommendation:
    """The break-even threshold when both fits pass the gate; otherwise None, saying why."""
    evidence = fit_evidence(costs)
    if not evidence.accepted:
        return Recommendation(None, _refused(evidence), evidence)
    be = costs.break_even_tokens()
    if costs.geometry.bytes_per_token is None:
        return Recommendation(None, "KV bytes per token unknown: no pull can be priced", evidence)
    if be is None:
        return Recommendation(
            None, "pulls never beat recomputing on this link (see pull_never_faster)", evidence
        )
    return Recommendation(
        recommended_threshold(costs),
        f"break-even {be:.0f} tokens rounded up to a multiple of {THRESHOLD_STEP}",
        evidence,
    )


def ttl_evidence(costs: CostModel, hs: Sequence[Handoff]) -> Evidence:
    """What a TTL recommendation rests on: enough hand-offs and both fits (its saving is in seconds)."""
    count = sum(1 for h in hs if h.gap_s is not None)
    return combined(
        {
            "hand-offs": judge_count(
                count,
                MIN_HANDOFFS,
                key="handoffs",
                what="hand-offs to a next turn",
                need=f"≥ {MIN_HANDOFFS} hand-offs (a turn followed by its conversation's next turn)",
            ),
            "recompute fit": costs.recompute.evidence,
            "pull fit": costs.pull.evidence,
        }
    )


def recommend_ttl(
    rows: Sequence[Replay],
    costs: CostModel,
    hs: Sequence[Handoff],
    *,
    target_share: float,
    budget_bytes: int | None,
) -> tuple[Recommendation, Replay | None]:
    """The knee of the TTL sweep when the evidence holds, with the replayed row it picked."""
    evidence = ttl_evidence(costs, hs)
    if not evidence.accepted:
        return Recommendation(None, _refused(evidence), evidence), None
    choice = choose_ttl(rows, target_share=target_share, budget_bytes=budget_bytes)
    value = choice.row.setting.ttl_s if choice.row else None
    return Recommendation(value, choice.reason, evidence), choice.row


def recommend_router_ttl(ttl: Recommendation) -> Recommendation:
    """The router TTL matched to the recommended decode TTL (the same evidence)."""
    evidence = Evidence(
        ttl.evidence.accepted, {"follows": "decoder_kv_blocks_ttl_s"}, ttl.evidence.reason, ttl.evidence.needs
    )
    if ttl.value is None:
        return Recommendation(None, "follows the decode TTL, and none is recommended", evidence)
    return Recommendation(
        matched_router_ttl(ttl.value),
        f"the recommended decode TTL - {SAFETY_MARGIN_S:g}s vLLM safety margin - {ROUTER_SLACK_S:g}s",
        evidence,
    )


def _fit_facts(fit: LinearFit) -> dict[str, Any]:
    """The evidence a flag resting on ``fit`` prints: samples, r² and relative residual."""
    e = fit.evidence.facts
    return {"samples": e["samples"], "r2": e["r2"], "relative_residual": e["relative_residual"]}


@dataclass(frozen=True)
class Flag:
    id: str
    severity: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "severity": self.severity,
            "summary": self.summary,
            "evidence": self.evidence,
            "fix": self.fix,
        }


def _router_flag(cfg: InForce, current: Replay | None) -> Flag | None:
    ttl, router = cfg.ttl_s, cfg.router_ttl_s
    if ttl is None:
        return None
    limit = matched_router_ttl(ttl)
    evidence = {
        "decoder_kv_blocks_ttl_s": ttl,
        "router_handle_ttl_s": router,
        "router_handle_ttl_source": cfg.router_ttl_source,
        "oldest_forwarded_handle_s": cfg.oldest_forwarded_s,
        "modelled_failed_requests": current.failed if current else None,
    }
    fix = (
        f"Set the router's handle TTL to at most {limit:g}s (decoder_kv_blocks_ttl - {SAFETY_MARGIN_S:g}s "
        f"vLLM safety margin - {ROUTER_SLACK_S:g}s). (kv_load_failure_policy=recompute is no way "
        "out on vLLM 0.32.0: the declined request then waits for remote KV forever.)"
    )
    if router is not None and cfg.router_ttl_source != ROUTER_TTL_UNKNOWN and router > ttl - SAFETY_MARGIN_S:
        above = router > ttl
        summary = (
            f"The router keeps decode handles {router:g}s but the decode node frees them after {ttl:g}s"
            if above
            else f"The router keeps decode handles {router:g}s, inside the {SAFETY_MARGIN_S:g}s before the "
            f"{ttl:g}s decode TTL in which vLLM declines reads"
        )
        return Flag(
            names.TUNE_ROUTER_TTL_ABOVE_DECODE_TTL,
            SEVERITY_ERROR if above else SEVERITY_WARNING,
            summary + "; a turn in that window fails its request instead of recomputing.",
            evidence,
            fix,
        )
    old = cfg.oldest_forwarded_s
    if router is None and old is not None and old + SAFETY_MARGIN_S >= ttl:
        return Flag(
            names.TUNE_ROUTER_TTL_ABOVE_DECODE_TTL,
            SEVERITY_ERROR,
            f"The router forwarded a {old:.1f}s-old decode handle with a {ttl:g}s decode TTL: it has no "
            "handle TTL below the decode TTL, so late turns fail instead of recomputing.",
            evidence,
            fix,
        )
    return None


def _gap_flag(cfg: InForce, hs: Sequence[Handoff], suggested: float | None) -> Flag | None:
    gaps = [h.gap_s for h in hs if h.gap_s is not None]
    if cfg.ttl_s is None or len(gaps) < MIN_GAPS:
        return None
    median = statistics.median(gaps)
    if median + SAFETY_MARGIN_S < cfg.ttl_s:
        return None
    late = sum(1 for g in gaps if g + SAFETY_MARGIN_S >= cfg.ttl_s)
    return Flag(
        names.TUNE_TTL_BELOW_COMMON_GAP,
        SEVERITY_WARNING,
        f"The median gap between turns is {median:.1f}s but decoder_kv_blocks_ttl is {cfg.ttl_s:g}s: "
        f"{late} of "
        f"{len(gaps)} turns came too late to read the previous turn's KV.",
        {
            "median_gap_s": round(median, 3),
            "decoder_kv_blocks_ttl_s": cfg.ttl_s,
            "late_turns": late,
            "turns": len(gaps),
        },
        f"Raise decoder_kv_blocks_ttl to about {suggested:g}s (the recommendation below) "
        "if the memory is there."
        if suggested
        else "Raise decoder_kv_blocks_ttl above the common gap plus 5s, if the memory is there.",
    )


def _threshold_flags(
    cfg: InForce, costs: CostModel, hs: Sequence[Handoff], current: Replay | None
) -> list[Flag]:
    if not costs.priced or cfg.threshold is None:  # priced: both fits passed the evidence gate
        return []
    fits = {"recompute_fit": _fit_facts(costs.recompute), "pull_fit": _fit_facts(costs.pull)}
    thr = cfg.threshold
    be = costs.break_even_tokens()
    rec = recommended_threshold(costs)
    timely = [h for h in hs if h.gap_s is not None and h.gap_s + SAFETY_MARGIN_S < (cfg.ttl_s or math.inf)]
    if be is None:
        pulls = current.pulls if current else 0
        return [
            Flag(
                names.TUNE_PULL_NEVER_FASTER,
                SEVERITY_ERROR if pulls else SEVERITY_WARNING,
                "On this link a pull costs more per token than recomputing, so no pull pays off; "
                f"{pulls} turns would pull at kv_recompute_threshold={thr}.",
                {
                    "recompute_s_per_token": costs.recompute.slope_s,
                    "pull_s_per_byte": costs.pull.slope_s,
                    "bytes_per_token": costs.geometry.bytes_per_token,
                    "modelled_pulls": pulls,
                    **fits,
                },
                "Raise kv_recompute_threshold above the longest reusable prefix "
                "(or turn bidirectional_kv_xfer off), "
                "or speed up the link (UCX_TLS with RDMA or shared memory rather than TCP).",
            )
        ]
    out = []
    losing = [h for h in timely if thr <= h.reusable_tokens < be]
    if thr < be and losing:
        lost = sum(costs.pull_s(h.reusable_tokens) - costs.recompute_s(h.reusable_tokens) for h in losing)
        out.append(
            Flag(
                names.TUNE_THRESHOLD_BELOW_BREAK_EVEN,
                SEVERITY_WARNING,
                f"kv_recompute_threshold={thr} lets {len(losing)} turns pull fewer than {be:.0f} tokens, "
                "where a pull "
                f"is slower than recomputing ({lost:.3f}s of first-token time lost in all).",
                {
                    "kv_recompute_threshold": thr,
                    "break_even_tokens": round(be, 1),
                    "losing_pulls": len(losing),
                    "seconds_lost": round(lost, 6),
                    **fits,
                },
                f"Raise kv_recompute_threshold to {rec}.",
            )
        )
    missed = [h for h in timely if rec is not None and max(rec, be) <= h.reusable_tokens < thr]
    if missed:
        gain = sum(costs.recompute_s(h.reusable_tokens) - costs.pull_s(h.reusable_tokens) for h in missed)
        out.append(
            Flag(
                names.TUNE_THRESHOLD_ABOVE_BREAK_EVEN,
                SEVERITY_WARNING,
                f"kv_recompute_threshold={thr} made {len(missed)} turns recompute prefixes "
                "a pull would have served "
                f"faster ({gain:.3f}s of first-token time in all).",
                {
                    "kv_recompute_threshold": thr,
                    "break_even_tokens": round(be, 1),
                    "missed_pulls": len(missed),
                    "seconds_missed": round(gain, 6),
                    **fits,
                },
                f"Lower kv_recompute_threshold to {rec}.",
            )
        )
    return out


def _mixed_flag(cfg: InForce) -> Flag | None:
    if not cfg.mixed:
        return None
    text = "; ".join(f"{k}: {', '.join(f'{v:g}' for v in vs)}" for k, vs in cfg.mixed.items())
    return Flag(
        names.TUNE_CONFIG_MIXED,
        SEVERITY_WARNING,
        f"Engines in the window ran with different settings ({text}); the replay uses the most common.",
        dict(cfg.mixed),
        "Tune over a window with one configuration (--since/--until), or align the engines.",
    )


def flags(
    cfg: InForce, costs: CostModel, hs: Sequence[Handoff], current: Replay | None, suggested_ttl: float | None
) -> list[Flag]:
    """Every flag that applies, errors first.

    Flags that rest on fitted costs (``threshold_*``, ``pull_never_faster``) need both fits
    through the evidence gate; ``ttl_below_common_gap`` needs :data:`~.evidence.MIN_GAPS` gaps;
    the router and mixed-configuration flags rest on recorded settings alone.
    """
    found = [_router_flag(cfg, current), _gap_flag(cfg, hs, suggested_ttl), _mixed_flag(cfg)]
    out = [f for f in found if f is not None] + _threshold_flags(cfg, costs, hs, current)
    return sorted(out, key=lambda f: f.severity != SEVERITY_ERROR)
