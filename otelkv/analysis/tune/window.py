"""The answer of ``otelkv tune`` for a window: fits, the in-force replay, sweeps, recommendation, flags.

:func:`tune` reads the window from any :class:`~otelkv.analysis.sources.SpanSource` (store
directory, ClickHouse, sidecar, a span list); :func:`tune_turns` does the rest on modelled
turns and is pure. The result is a JSON-able dict the CLI renders (and ``--json`` prints).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from otelkv.analysis import turn_json
from otelkv.analysis.diagnose import suggest_ttl
from otelkv.analysis.model import Turn
from otelkv.analysis.tune.config import InForce, in_force
from otelkv.analysis.tune.fit import fit_costs
from otelkv.analysis.tune.recommend import (
    ROUTER_SLACK_S,
    Recommendation,
    flags,
    matched_router_ttl,
    recommend_router_ttl,
    recommend_threshold,
    recommend_ttl,
)
from otelkv.analysis.tune.replay import (
    SAFETY_MARGIN_S,
    Handoff,
    Replay,
    Setting,
    handoffs,
    model_check,
    replay,
)

DEFAULT_TTLS_S: tuple[float, ...] = (30, 60, 120, 240, 480, 900, 1800)
"""TTL candidates (seconds) besides the one in force and those the gaps suggest."""
DEFAULT_THRESHOLDS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
"""Threshold candidates (tokens) besides the one in force and the break-even."""
VLLM_DEFAULT_THRESHOLD = 64
GAP_QUANTILES = (0.5, 0.9, 0.99)

ASSUMPTIONS = (
    "Agents would have waited just as long between turns under another setting.",
    "A hand-off's reusable tokens are what the next prefill could read beyond its own prefix cache; "
    "the prefill node's local cache does not change with the setting.",
    "Pull and recompute cost what the fitted lines say at that size; queueing is not modelled.",
    f"vLLM declines a read within {SAFETY_MARGIN_S:g}s of the deadline; a declined read fails the request "
    "(kv_load_failure_policy=fail) and is counted as failed, not priced.",
    "The last turn of a conversation in the window leaves its blocks held for the whole TTL.",
    f"Candidate router handle TTLs are the decode TTL - {SAFETY_MARGIN_S + ROUTER_SLACK_S:g}s.",
)


@dataclass(frozen=True)
class TuneOptions:
    ttls_s: tuple[float, ...] = ()
    """TTL candidates in seconds (empty: :data:`DEFAULT_TTLS_S` plus gap-derived ones)."""
    thresholds: tuple[int, ...] = ()
    """Threshold candidates in tokens (empty: :data:`DEFAULT_THRESHOLDS` plus the break-even)."""
    router_ttl_s: float | None = None
    """The router handle TTL that was in force, when the spans do not record it."""
    memory_budget_bytes: int | None = None
    """Most retained bytes at peak a recommended TTL may need."""
    target_share: float = 0.9
    max_turns: int = 20_000


MAX_CANDIDATES = 50
"""Most TTL or threshold candidates one request may ask for (the sweep is their product)."""
MAX_TURNS_LIMIT = 200_000


def _numbers(value: Any, kind: type) -> tuple[Any, ...]:
    items = value.split(",") if isinstance(value, str) else list(value or ())
    out = tuple(kind(float(v)) if kind is int else kind(v) for v in items if str(v).strip())
    if len(out) > MAX_CANDIDATES:
        raise ValueError(f"at most {MAX_CANDIDATES} candidates, got {len(out)}")
    if any(not math.isfinite(v) or v < 0 for v in out):
        raise ValueError(f"candidates must be finite and not negative: {value!r}")
    return out


def _opt(value: Any, kind: type) -> Any:
    if value is None or value == "":
        return None
    number = kind(float(value)) if kind is int else kind(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"must be finite and not negative: {value!r}")
    return number


def options_from_dict(raw: dict[str, Any]) -> TuneOptions:
    """Options from the CLI or the sidecar's query string (strings or numbers); ValueError when bad."""
    try:
        options = TuneOptions(
            ttls_s=_numbers(raw.get("ttls_s"), float),
            thresholds=_numbers(raw.get("thresholds"), int),
            router_ttl_s=_opt(raw.get("router_ttl_s"), float),
            memory_budget_bytes=_opt(raw.get("memory_budget_bytes"), int),
            target_share=_opt(raw.get("target_share"), float) or TuneOptions.target_share,
            max_turns=min(_opt(raw.get("max_turns"), int) or TuneOptions.max_turns, MAX_TURNS_LIMIT),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad tune option: {exc}") from None
    if not 0 < options.target_share <= 1:
        raise ValueError("bad tune option: target_share must be in (0, 1]")
    return options


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (a value that occurred, not an interpolation)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def _gap_summary(hs: Sequence[Handoff]) -> dict[str, Any]:
    gaps = [h.gap_s for h in hs if h.gap_s is not None]
    if not gaps:
        return {"count": 0}
    out: dict[str, Any] = {"count": len(gaps)}
    for q in GAP_QUANTILES:
        out[f"p{round(q * 100)}_s"] = round(quantile(gaps, q), 3)
    out["max_s"] = round(max(gaps), 3)
    return out


def ttl_candidates(given: Iterable[float], cfg: InForce, hs: Sequence[Handoff]) -> list[float]:
    """Given TTLs, else the defaults plus the one in force and TTLs that bridge the common gaps."""
    values = set(given)
    if not values:
        values = set(DEFAULT_TTLS_S)
        gaps = [h.gap_s for h in hs if h.gap_s is not None]
        for q in GAP_QUANTILES[:2] if gaps else ():
            values.add(float(suggest_ttl(quantile(gaps, q) + SAFETY_MARGIN_S + ROUTER_SLACK_S)))
    if cfg.ttl_s is not None:
        values.add(cfg.ttl_s)
    return sorted(v for v in values if v > SAFETY_MARGIN_S + ROUTER_SLACK_S)


def threshold_candidates(given: Iterable[int], cfg: InForce, recommended: int | None) -> list[int]:
    values = set(given) or set(DEFAULT_THRESHOLDS)
    values.update(v for v in (cfg.threshold, recommended) if v is not None)
    return sorted(v for v in values if v >= 0)


def _vs(row: Replay, base: Replay | None) -> dict[str, Any] | None:
    if base is None:
        return None

    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a - b, 6)

    return {
        "pulls": row.pulls - base.pulls,
        "failed_requests": row.failed - base.failed,
        "prefill_saved_s": diff(row.prefill_saved_s, base.prefill_saved_s),
        "ttft_delta_s": diff(row.ttft_delta_s, base.ttft_delta_s),
        "block_seconds": diff(row.block_seconds, base.block_seconds),
        "peak_retained_bytes": row.peak_bytes - base.peak_bytes,
    }


def empty_reason(turns: Sequence[Turn], hs: Sequence[Handoff]) -> str | None:
    """One line when the window holds nothing to replay (None when it does)."""
    if not turns:
        return "no turns in the window"
    if not any(h.gap_s is not None for h in hs):
        return (
            f"{len(turns)} turn{'s' if len(turns) != 1 else ''} but no hand-off to a next turn in the window "
            "(no conversation has a turn after one that ran a decode request): nothing to replay"
        )
    return None


def tune_turns(turns: Sequence[Turn], options: TuneOptions | None = None) -> dict[str, Any]:
    """The whole answer for modelled turns (pure: no store access).

    Every recommendation is gated on evidence (:mod:`.evidence`): ``recommended`` holds the
    values (None when the gate refused) and, in ``details`` under the same keys, the reason,
    what is missing and the evidence. ``window.empty`` is one line when there is nothing to
    replay; the sweeps and the grid are then empty.
    """
    options = options or TuneOptions()
    cfg = in_force(turns, router_ttl_s=options.router_ttl_s)
    costs = fit_costs(turns)
    hs = handoffs(turns, costs.geometry)
    empty = empty_reason(turns, hs)
    current = None
    if cfg.ttl_s is not None and not empty:
        now = Setting(
            cfg.ttl_s,
            cfg.threshold if cfg.threshold is not None else VLLM_DEFAULT_THRESHOLD,
            cfg.router_ttl_s,
        )
        current = replay(hs, now, costs)
    threshold = recommend_threshold(costs)
    rec_thr = int(threshold.value) if threshold.value is not None else None
    sweep_thr = rec_thr if rec_thr is not None else (cfg.threshold or VLLM_DEFAULT_THRESHOLD)
    ttls = ttl_candidates(options.ttls_s, cfg, hs) if not empty else []
    thresholds = threshold_candidates(options.thresholds, cfg, rec_thr) if not empty else []
    grid = {(t, k): replay(hs, Setting(t, k, matched_router_ttl(t)), costs) for t in ttls for k in thresholds}
    if sweep_thr not in thresholds:
        for t in ttls:
            grid[(t, sweep_thr)] = replay(hs, Setting(t, sweep_thr, matched_router_ttl(t)), costs)
    ttl_rows = [grid[(t, sweep_thr)] for t in ttls]
    ttl, picked = recommend_ttl(
        ttl_rows, costs, hs, target_share=options.target_share, budget_bytes=options.memory_budget_bytes
    )
    if empty:
        ttl = Recommendation(None, empty, ttl.evidence)
        threshold = Recommendation(None, empty, threshold.evidence)
    router = recommend_router_ttl(ttl)
    chosen_ttl = ttl.value if ttl.value is not None else (cfg.ttl_s or (ttls[-1] if ttls else None))
    threshold_rows = [grid[(chosen_ttl, k)] for k in thresholds] if chosen_ttl in ttls else []
    return {
        "schema_version": turn_json.SCHEMA_VERSION,
        "kind": "tune",
        "window": {
            "turns": len(turns),
            "handoffs": len(hs),
            "handoffs_with_next_turn": sum(1 for h in hs if h.gap_s is not None),
            "retentions_estimated": sum(1 for h in hs if h.estimated),
            "empty": empty,
        },
        "in_force": cfg.as_dict(),
        "gaps": _gap_summary(hs),
        "costs": costs.as_dict(),
        "model_check": model_check(hs, current.setting) if current else None,
        "current": current.as_dict() if current else None,
        "recommended": {
            "decoder_kv_blocks_ttl_s": ttl.value,
            "kv_recompute_threshold": rec_thr if threshold.value is not None else None,
            "router_handle_ttl_s": router.value,
            "details": {
                "decoder_kv_blocks_ttl_s": ttl.as_dict(),
                "kv_recompute_threshold": threshold.as_dict(),
                "router_handle_ttl_s": router.as_dict(),
            },
            "replay": picked.as_dict() if picked else None,
            "vs_current": _vs(picked, current) if picked else None,
        },
        "sweep_threshold": sweep_thr if not empty else None,
        "ttl_sweep": [r.as_dict() for r in ttl_rows],
        "sweep_ttl_s": chosen_ttl if threshold_rows else None,
        "threshold_sweep": [r.as_dict() for r in threshold_rows],
        "grid": [grid[key].as_dict() for key in sorted(grid)],
        "flags": [f.as_dict() for f in flags(cfg, costs, hs, current, ttl.value)],
        "assumptions": list(ASSUMPTIONS),
    }


def tune(
    source: Any, *, since_ns: int | None, until_ns: int | None, options: TuneOptions | None = None
) -> dict[str, Any]:
    """``otelkv tune`` over a window of a span source."""
    from otelkv.analysis.linker import window_turns

    options = options or TuneOptions()
    turns, total = window_turns(source, since_ns=since_ns, until_ns=until_ns, max_turns=options.max_turns)
    data = tune_turns(turns, options)
    data["window"].update(**turn_json.window(since_ns, until_ns), turns_in_window=total)
    return data
