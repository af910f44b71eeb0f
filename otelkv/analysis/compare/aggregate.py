"""The numbers of a comparison, from two runs' rows (pure: no store access).

Turns pair up by (conversation id, turn index): the scenarios use the same ids on every
run, so ``agent-short-tools-0#3`` in A and in B is the same request. Quantiles are
nearest-rank (a TTFT that occurred, not an interpolation between two), over the turns
whose first token arrived: failed turns are counted, not timed; interrupted ones had
their first token and count.

A turn *regressed* when B's TTFT exceeds A's by the factor and by at least ``min_delta_s``
(on a busy 2-core machine a 10 ms turn easily takes 13 ms), or when it succeeded in A and
failed in B. It comes with B's diagnoses: why B's turn was slow is the question.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from otelkv import names
from otelkv.analysis import turn_json
from otelkv.analysis.compare.rows import (
    OUTCOME_ERROR,
    SETTING_KEYS,
    Run,
    TurnRow,
)
from otelkv.analysis.tune.replay import peak
from otelkv.analysis.tune.window import quantile

PROMPT_TOKEN_BOUNDS = (128, 256, 512, 1024, 2048)
"""Prompt-length buckets (tokens): each bound starts a bucket."""
DEFAULT_FACTOR = 1.2
DEFAULT_MIN_DELTA_S = 0.02


@dataclass(frozen=True)
class CompareOptions:
    factor: float = DEFAULT_FACTOR
    """B slower than A by more than this ratio counts as a regression."""
    min_delta_s: float = DEFAULT_MIN_DELTA_S
    """... and by at least this many seconds."""


def _r(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def prompt_bucket(tokens: int | None) -> str:
    """``<128``, ``128-255``, ... ``2048+`` (``?`` when the prompt length is unknown)."""
    if tokens is None:
        return "?"
    lo = 0
    for bound in PROMPT_TOKEN_BOUNDS:
        if tokens < bound:
            return f"<{bound}" if lo == 0 else f"{lo}-{bound - 1}"
        lo = bound
    return f"{lo}+"


PROMPT_BUCKETS = (
    *(prompt_bucket(b - 1) for b in PROMPT_TOKEN_BOUNDS),
    prompt_bucket(PROMPT_TOKEN_BOUNDS[-1]),
    "?",
)


def stats(values: Sequence[float]) -> dict[str, Any]:
    """Count, nearest-rank p50/p95 and mean of TTFTs (seconds); nulls for no values."""
    if not values:
        return {"count": 0, "p50_s": None, "p95_s": None, "mean_s": None}
    return {
        "count": len(values),
        "p50_s": _r(quantile(values, 0.5)),
        "p95_s": _r(quantile(values, 0.95)),
        "mean_s": _r(sum(values) / len(values)),
    }


def _ttft_by(
    a: Sequence[TurnRow], b: Sequence[TurnRow], key: Callable[[TurnRow], str | None], order: Sequence[str]
) -> list[dict[str, Any]]:
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for side, rows in ((0, a), (1, b)):
        for row in rows:
            bucket = key(row)
            if bucket is not None and row.counts_for_ttft and row.ttft_s is not None:
                groups.setdefault(bucket, ([], []))[side].append(row.ttft_s)
    known = [k for k in order if k in groups]
    return [{"bucket": k, "a": stats(groups[k][0]), "b": stats(groups[k][1])} for k in known]


def _timed(rows: Iterable[TurnRow]) -> list[float]:
    return [r.ttft_s for r in rows if r.counts_for_ttft and r.ttft_s is not None]


def ttft(a: Sequence[TurnRow], b: Sequence[TurnRow]) -> dict[str, Any]:
    return {
        "overall": {"a": stats(_timed(a)), "b": stats(_timed(b))},
        "by_turn_index": _ttft_by(
            a,
            b,
            lambda r: names.turn_index_bucket(r.index) if r.index is not None else None,
            names.TURN_INDEX_BUCKETS,
        ),
        "by_prompt_tokens": _ttft_by(a, b, lambda r: prompt_bucket(r.prompt_tokens), PROMPT_BUCKETS),
    }


def prefill_split(rows: Sequence[TurnRow]) -> dict[str, Any]:
    """Prefill seconds of the run's turns that had a prefill request: engine compute, and waiting
    for pulled KV; summed, and per turn (mean, and the median of compute + transfer).

    Per turn is what two runs can be compared by: they rarely have the same number of turns
    (failed or cut-short conversations), and a sum grows with the count.
    """
    legs = [r for r in rows if r.prefill_compute_s is not None]
    compute = sum(r.prefill_compute_s or 0.0 for r in legs)
    transfer = sum(r.prefill_transfer_s or 0.0 for r in legs)
    pulled = sum(r.pulled_tokens for r in legs)
    totals = [(r.prefill_compute_s or 0.0) + (r.prefill_transfer_s or 0.0) for r in legs]
    return {
        "turns": len(legs),
        "compute_s": _r(compute),
        "transfer_s": _r(transfer),
        "compute_per_turn_s": _r(compute / len(legs)) if legs else None,
        "transfer_per_turn_s": _r(transfer / len(legs)) if legs else None,
        "prefill_p50_s": _r(quantile(totals, 0.5)) if totals else None,
        "turns_with_pull": sum(1 for r in legs if r.pulled_tokens > 0),
        "pulled_tokens": pulled,
        "pulled_tokens_per_turn": _r(pulled / len(legs), 3) if legs else None,
        "computed_tokens": sum(r.computed_tokens or 0 for r in legs),
    }


def pulls_by_reason(rows: Sequence[TurnRow]) -> dict[str, int]:
    counts = Counter(r.pull_reason for r in rows if r.pull_reason)
    return dict(sorted(counts.items()))


def retained(rows: Sequence[TurnRow]) -> dict[str, Any]:
    """Per retention kind: how many, block-seconds held (in all and per turn of the run), most
    bytes and blocks held at once."""
    out: dict[str, Any] = {}
    kinds = sorted({h.kind for r in rows for h in r.held})
    for kind in kinds:
        held = [h for r in rows for h in r.held if h.kind == kind]
        top_bytes, top_blocks = peak(
            (h.start_ns, h.start_ns + round(h.held_s * 1e9), h.bytes, h.blocks) for h in held
        )
        out[kind] = {
            "count": len(held),
            "block_seconds": _r(sum(h.blocks * h.held_s for h in held), 3),
            "block_seconds_per_turn": _r(sum(h.blocks * h.held_s for h in held) / len(rows), 3),
            "peak_bytes": top_bytes,
            "peak_blocks": top_blocks,
            "outcomes": dict(sorted(Counter(h.outcome or "-" for h in held).items())),
        }
    return out


def _latest(rows: Iterable[TurnRow]) -> tuple[dict[tuple[str, int], TurnRow], int]:
    """Rows with a turn index by key (the latest when a key repeats) and how many repeated."""
    out: dict[tuple[str, int], TurnRow] = {}
    repeats = 0
    for row in sorted(rows, key=lambda r: r.start_ns):
        if row.index is None:
            continue
        key = (row.conversation_id, row.index)
        repeats += key in out
        out[key] = row
    return out, repeats


def match(a: Sequence[TurnRow], b: Sequence[TurnRow]) -> tuple[list[tuple[TurnRow, TurnRow]], dict[str, int]]:
    """Turn pairs present in both runs, in key order, and the counts of what did not pair."""
    ka, rep_a = _latest(a)
    kb, rep_b = _latest(b)
    pairs = [(ka[k], kb[k]) for k in sorted(ka.keys() & kb.keys())]
    return pairs, {
        "matched": len(pairs),
        "only_a": len(ka.keys() - kb.keys()),
        "only_b": len(kb.keys() - ka.keys()),
        "unindexed_a": sum(1 for r in a if r.index is None),
        "unindexed_b": sum(1 for r in b if r.index is None),
        "repeated_keys_a": rep_a,
        "repeated_keys_b": rep_b,
    }


def _pair(a: TurnRow, b: TurnRow, ratio: float | None, kind: str) -> dict[str, Any]:
    """One matched pair: what differs, and each side as the turn object's fields."""
    return {
        "ref": b.ref,
        "conversation_id": b.conversation_id,
        "turn_index": b.index,
        "kind": kind,
        "ratio": _r(ratio, 3),
        "delta_s": _r(b.ttft_s - a.ttft_s) if a.ttft_s is not None and b.ttft_s is not None else None,
        "prompt_tokens": b.prompt_tokens,
        "a": a.as_turn(),
        "b": b.as_turn(),
    }


def regressions(pairs: Sequence[tuple[TurnRow, TurnRow]], options: CompareOptions) -> dict[str, Any]:
    """Turns B made slower (or failed), worst first; and how many B made faster by the same test."""
    found, faster, points = [], 0, []
    for a, b in pairs:
        if a.outcome != OUTCOME_ERROR and b.outcome == OUTCOME_ERROR:
            found.append(_pair(a, b, None, "failed"))
            continue
        if not (a.counts_for_ttft and b.counts_for_ttft) or a.ttft_s is None or b.ttft_s is None:
            continue
        ratio = b.ttft_s / a.ttft_s if a.ttft_s > 0 else None
        slower = b.ttft_s > a.ttft_s * options.factor and b.ttft_s - a.ttft_s >= options.min_delta_s
        points.append({"ref": b.ref, "a_ttft_s": _r(a.ttft_s), "b_ttft_s": _r(b.ttft_s), "regressed": slower})
        if slower:
            found.append(_pair(a, b, ratio, "slower"))
        elif a.ttft_s > b.ttft_s * options.factor and a.ttft_s - b.ttft_s >= options.min_delta_s:
            faster += 1
    found.sort(key=lambda p: (p["kind"] != "failed", -(p["delta_s"] or 0.0), p["ref"]))
    return {
        "factor": options.factor,
        "min_delta_s": options.min_delta_s,
        "compared": len(points),
        "count": len(found),
        "faster_count": faster,
        "turns": found,
        "points": points,
    }


MANIFEST_ALIASES = {"decoder_kv_blocks_ttl_s": "decoder_kv_blocks_ttl"}
"""Setting keys a manifest may name without their unit (``otelkv fleet record`` of 0.x)."""


def settings_rows(a: Run, b: Run) -> list[dict[str, Any]]:
    """Each setting for A and B: the spans' value (what was in force), else the manifest's."""
    out = []
    for key in SETTING_KEYS:
        va, sa = _setting(a, key)
        vb, sb = _setting(b, key)
        out.append({"key": key, "a": va, "b": vb, "a_source": sa, "b_source": sb, "differs": va != vb})
    return out


def _setting(run: Run, key: str) -> tuple[Any, str | None]:
    value = run.settings.get(key)
    if value is not None:
        return value, "spans"
    settings = (run.manifest or {}).get("settings") or {}
    recorded = settings.get(key, settings.get(MANIFEST_ALIASES.get(key, "")))
    return (recorded, "manifest") if recorded is not None else (None, None)


def workload_notes(a: Run, b: Run, counts: dict[str, int]) -> list[str]:
    """What makes the two runs not the same workload (the comparison is then weaker)."""
    notes = []
    ma, mb = a.manifest or {}, b.manifest or {}
    if not ma or not mb:
        missing = " and ".join(r.label for r, m in ((a, ma), (b, mb)) if not m)
        notes.append(f"no run manifest for {missing}: settings are read from the spans only")
    for run, manifest in ((a, ma), (b, mb)):
        recorded = manifest.get("turns") or {}
        failed = recorded.get("failed") or 0
        if failed:
            listed = manifest.get("failures") or []
            first = "" if len(listed) >= failed else f"the first {len(listed)}: "
            which = f" ({first}{'; '.join(listed)})" if listed else ""
            notes.append(
                f"{run.label}: {failed} of {recorded.get('sent', '?')} turns failed while recording"
                f"{which}; they count as errors, not in TTFT"
            )
    for key in ("scenarios", "scenario_params"):
        if ma and mb and ma.get(key) != mb.get(key):
            notes.append(
                f"the runs differ in {key}: A {ma.get(key)} vs B {mb.get(key)} (not the same workload)"
            )
    if counts["only_a"] or counts["only_b"]:
        notes.append(
            f"{counts['only_a']} turns only in A and {counts['only_b']} only in B (failed or cut-short "
            "conversations, or different workloads)"
        )
    for side, key in (("A", "repeated_keys_a"), ("B", "repeated_keys_b")):
        if counts[key]:
            notes.append(
                f"{counts[key]} turn ids repeat in {side} (more than one run in its store?): the latest kept"
            )
    return notes


def compare_runs(a: Run, b: Run, options: CompareOptions | None = None) -> dict[str, Any]:
    """The whole comparison as a JSON-able document (what ``--json`` prints and the renderers read)."""
    options = options or CompareOptions()
    pairs, counts = match(a.rows, b.rows)
    return {
        "schema_version": turn_json.SCHEMA_VERSION,
        "kind": "compare",
        "a": a.summary(),
        "b": b.summary(),
        "settings": settings_rows(a, b),
        "matching": counts,
        "notes": workload_notes(a, b, counts),
        "ttft": ttft(a.rows, b.rows),
        "prefill": {"a": prefill_split(a.rows), "b": prefill_split(b.rows)},
        "pulls_by_reason": {"a": pulls_by_reason(a.rows), "b": pulls_by_reason(b.rows)},
        "retained": {"a": retained(a.rows), "b": retained(b.rows)},
        "regressions": regressions(pairs, options),
    }
