"""``otelkv tune``: argparse wiring and the terminal rendering of :mod:`otelkv.analysis.tune`.

The answer is the dict of :func:`otelkv.analysis.tune.window.tune`, from a sidecar, a store
directory or ClickHouse (:mod:`otelkv.cli.source`); this module only parses options and
renders. Options the user can get wrong print one line and exit 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, TextIO

from otelkv.cli import render
from otelkv.cli.query_cmds import EXIT_ERROR, run_query, source_options
from otelkv.cli.source import QueryError, parse_duration, window_ns

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNIT = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


def parse_size(text: str) -> int:
    """Bytes in ``1073741824``, ``512MiB``, ``2GiB``, ``1.5GB`` (KiB/MiB/GiB are powers of 1024)."""
    match = _SIZE.match(text or "")
    if not match:
        raise QueryError(f"bad size {text!r}: use bytes or a unit, e.g. 512MiB, 2GiB")
    unit = (match.group(2) or "").lower()
    base = 1024 ** " kmgt".index(unit[0]) if "i" in unit else _SIZE_UNIT[unit[:1]]
    return int(float(match.group(1)) * base)


def add_tune_command(subparsers: Any) -> None:
    tune = subparsers.add_parser(
        "tune",
        help="what another decode TTL, recompute threshold or router TTL would have done to recorded turns",
        description="Fits recompute and pull costs from the window's spans, replays every hand-off "
        "(decode end -> next prefill) under candidate settings the way vLLM decides pull or recompute, "
        "and prints pulls, prefill seconds saved, first-token change, block-seconds held and peak retained "
        "memory per setting, a recommendation, and flags for settings that are clearly wrong. "
        "See docs/tune.md.",
    )
    tune.add_argument(
        "--since", default="1d", help="window start: a duration before now or an ISO 8601 time (default 1d)"
    )
    tune.add_argument("--until", help="window end: a duration before now or an ISO 8601 time (default: now)")
    tune.add_argument("--ttl", metavar="LIST", help="decoder_kv_blocks_ttl candidates, e.g. 30s,2m,8m")
    tune.add_argument("--threshold", metavar="LIST", help="kv_recompute_threshold candidates, e.g. 16,64,256")
    tune.add_argument(
        "--router-ttl", metavar="DURATION", help="the router's handle TTL in force, when its spans do not say"
    )
    tune.add_argument("--memory-budget", metavar="SIZE", help="most retained memory at peak, e.g. 4GiB")
    tune.add_argument(
        "--target-share",
        type=float,
        default=0.9,
        help="share of the best TTFT saving the recommended TTL must keep (default 0.9)",
    )
    tune.add_argument(
        "--max-turns", type=int, default=20_000, help="most recent turns modelled (default 20000)"
    )
    source_options(tune)
    tune.set_defaults(handler=run_tune)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    if not 0 < args.target_share <= 1:
        raise QueryError("--target-share must be in (0, 1]")
    if args.max_turns < 1:
        raise QueryError("--max-turns must be at least 1")
    thresholds = []
    for item in (args.threshold or "").split(","):
        if item.strip():
            if not item.strip().isdigit():
                raise QueryError(f"bad --threshold {item!r}: whole numbers of tokens, e.g. 16,64,256")
            thresholds.append(int(item))
    return {
        "ttls_s": [parse_duration(t) for t in (args.ttl or "").split(",") if t.strip()],
        "thresholds": thresholds,
        "router_ttl_s": parse_duration(args.router_ttl) if args.router_ttl else None,
        "memory_budget_bytes": parse_size(args.memory_budget) if args.memory_budget else None,
        "target_share": args.target_share,
        "max_turns": args.max_turns,
    }


def run_tune(args: argparse.Namespace, out: TextIO | None = None) -> int:
    try:
        since_ns, until_ns = window_ns(args.since, args.until)
        options = _options(args)
    except QueryError as exc:
        print(f"otelkv tune: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return run_query(
        args, lambda q: q.tune(since_ns=since_ns, until_ns=until_ns, options=options), show_tune, out
    )


# ------------------------------------------------------------------ rendering


def _s(value: float | None) -> str:
    """Seconds with a sign (a change), or a plain duration."""
    if value is None:
        return "-"
    return ("-" if value < 0 else "") + render.seconds(abs(value))


def _delta(value: float | None) -> str:
    if value is None:
        return "-"
    return ("+" if value > 0 else "") + _s(value)


def _num(value: float) -> str:
    """Three significant figures without exponent noise: 0.205, 10.0, 953."""
    value = float(f"{value:.3g}")  # round first, so 0.99999 reads 1.00, not 1
    a = abs(value)
    if a >= 100:
        return f"{value:.0f}"
    if a >= 10:
        return f"{value:.1f}"
    if a >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _fit_facts(e: dict[str, Any]) -> str:
    """The evidence of one fit in a few words: n, r², residual against the mean, size range."""
    parts = [f"n={e.get('samples', 0)}"]
    if e.get("r2") is not None:
        parts.append(f"r² {e['r2']:.2f}")
    if e.get("residual_rms_s") is not None:
        rel = e.get("relative_residual")
        parts.append(
            f"residual {_num(e['residual_rms_s'] * 1e3)} ms"
            + (f" ({rel:.0%} of the mean)" if rel is not None else "")
        )
    if e.get("size_ratio") is not None:
        parts.append(f"sizes {e['size_ratio']:.1f}x apart")
    return ", ".join(parts)


def _fit_line(label: str, fit: dict[str, Any], geometry: dict[str, Any] | None = None) -> str:
    """One fit: its price when the gate accepted it, else "not enough evidence", why and what would do."""
    evidence = fit.get("evidence") or {}
    pad = " " * 13
    if not evidence.get("accepted"):
        text = f"  {label:<10} not enough evidence ({_fit_facts(evidence)})"
        if fit.get("note"):
            text += f"\n{pad}{fit['note']}"
        return text + f"\n{pad}{evidence.get('reason')}\n{pad}{evidence.get('need')}"
    if fit["unit"] == "token":
        cost = f"{_num(fit['seconds_per_token'] * 1e3)} ms/token"
    else:
        fixed = max(fit["fixed_s"] or 0.0, 0.0)
        cost = f"{_num(fixed * 1e3)} ms + {_num(fit['seconds_per_byte'] * 1e9)} ns/byte"
        bpt = (geometry or {}).get("bytes_per_token")
        if bpt:
            cost += f" ({render.human_bytes(bpt)}/token)"
    return f"  {label:<10} {cost}   [{_fit_facts(evidence)}]"


UNAVAILABLE = "n/a"
"""A seconds cell whose fit the evidence gate rejected."""


def _row(row: dict[str, Any], first: list[Any]) -> list[Any]:
    saved, ttft = row["prefill_saved_s"], row["ttft_delta_s"]
    return [
        *first,
        row["pulls"],
        row["failed_requests"],
        UNAVAILABLE if saved is None else _s(saved),
        UNAVAILABLE if ttft is None else _delta(ttft),
        f"{row['block_seconds']:.0f}",
        render.human_bytes(row["peak_retained_bytes"]),
    ]


_COLUMNS = ["PULLS", "FAILED", "PREFILL SAVED", "TTFT CHANGE", "BLOCK-S", "PEAK MEM"]


def _header(data: dict[str, Any], out: TextIO) -> None:
    w = data.get("window") or {}
    cfg = data.get("in_force") or {}
    out.write(
        f"otelkv tune: {w.get('turns', 0)} turns, "
        f"{w.get('handoffs_with_next_turn', 0)} hand-offs to a next turn"
        + (
            f" (most recent {w['turns']} of {w['turns_in_window']})"
            if w.get("turns_in_window", 0) > w.get("turns", 0)
            else ""
        )
        + "\n"
    )
    router = cfg.get("router_handle_ttl_s")
    out.write(
        f"in force: decoder_kv_blocks_ttl {_s(cfg.get('decoder_kv_blocks_ttl_s'))}, kv_recompute_threshold "
        f"{cfg.get('kv_recompute_threshold', '-')}, router handle TTL {_s(router)} "
        f"({cfg.get('router_handle_ttl_source')})\n"
    )
    g = data.get("gaps") or {}
    if g.get("count"):
        out.write(
            f"gaps decode end -> next prefill: p50 {_s(g['p50_s'])}  p90 {_s(g['p90_s'])}  "
            f"p99 {_s(g['p99_s'])}"
            f"  max {_s(g['max_s'])}  (n={g['count']})\n"
        )
    costs = data.get("costs") or {}
    out.write("costs fitted from the window:\n")
    out.write(_fit_line("recompute", costs.get("recompute") or {}) + "\n")
    out.write(_fit_line("pull", costs.get("pull") or {}, costs.get("geometry")) + "\n")
    be = costs.get("break_even_tokens")
    if be is not None:
        out.write(f"  break-even {be:.0f} tokens: pulling fewer is slower than recomputing them\n")
    check = data.get("model_check")
    if check and check.get("compared"):
        out.write(
            f"model check: replaying the settings in force decides {check['agree']} of {check['compared']} "
            f"hand-offs as recorded (pulls: {check['modelled_pulls']} modelled, "
            f"{check['recorded_pulls']} recorded)\n"
        )


def _unavailable(costs: dict[str, Any]) -> str:
    """The legend line for seconds columns a rejected fit leaves empty ("" when none is)."""
    rec = ((costs.get("recompute") or {}).get("evidence") or {}).get("accepted")
    pull = ((costs.get("pull") or {}).get("evidence") or {}).get("accepted")
    if rec and pull:
        return ""
    if not rec:
        cols = "PREFILL SAVED and TTFT CHANGE are"
        which = "the recompute fit" + (" and the pull fit" if not pull else "")
    else:
        cols, which = "TTFT CHANGE is", "the pull fit"
    return f"{UNAVAILABLE}: {cols} unavailable: {which} did not pass the evidence gate (see costs above).\n"


def show_tune(data: dict[str, Any], out: TextIO) -> None:
    w = data.get("window") or {}
    if w.get("empty"):
        span = f"{w.get('since') or 'the beginning'} to {w.get('until') or 'now'}"
        out.write(f"otelkv tune: {w['empty']} ({span}).\n")
        return
    _header(data, out)
    rec = data.get("recommended") or {}
    current = data.get("current")
    rec_ttl = rec.get("decoder_kv_blocks_ttl_s")
    rows = []
    if current:
        rows.append(
            _row(current, ["now", _s(current["decoder_kv_blocks_ttl_s"]), _s(current["router_handle_ttl_s"])])
        )
    for row in data.get("ttl_sweep") or []:
        mark = "->" if row["decoder_kv_blocks_ttl_s"] == rec_ttl else ""
        rows.append(_row(row, [mark, _s(row["decoder_kv_blocks_ttl_s"]), _s(row["router_handle_ttl_s"])]))
    out.write(
        f"\nTTL sweep at kv_recompute_threshold {data.get('sweep_threshold')} (router TTL = TTL - 6s; "
        f"'now' is the setting in force, threshold {(current or {}).get('kv_recompute_threshold', '-')}):\n"
    )
    out.write(render.table(["", "TTL", "ROUTER", *_COLUMNS], rows, right=(1, 2, 3, 4, 5, 6, 7, 8)) + "\n")
    trows = [_row(r, [r["kv_recompute_threshold"]]) for r in data.get("threshold_sweep") or []]
    if trows:
        out.write(f"\nthreshold sweep at TTL {_s(data.get('sweep_ttl_s'))}:\n")
        out.write(render.table(["THRESHOLD", *_COLUMNS], trows, right=tuple(range(7))) + "\n")
    out.write(
        "\nPREFILL SAVED: prefill compute the pulls avoid. TTFT CHANGE: first-token seconds summed over the\n"
        "window vs recomputing every hand-off (negative is faster). FAILED: reads vLLM would decline (the\n"
        "request fails). BLOCK-S: blocks x seconds held. PEAK MEM: most bytes retained at once.\n"
    )
    out.write(_unavailable(data.get("costs") or {}))
    _recommendation(rec, out)
    for flag in data.get("flags") or []:
        out.write(f"\n[{flag['severity']}] {flag['id']}: {flag['summary']}\n  fix: {flag['fix']}\n")


def _rests_on(evidence: dict[str, Any]) -> str:
    """What an accepted recommendation rests on, in a few words."""
    parts = []
    handoffs = evidence.get("hand-offs") or {}
    if "handoffs" in handoffs:
        parts.append(f"{handoffs['handoffs']} hand-offs")
    for name in ("recompute fit", "pull fit"):
        if name in evidence:
            parts.append(f"{name} {_fit_facts(evidence[name])}")
    return "; ".join(parts)


def _refused(evidence: dict[str, Any]) -> str:
    """Why the gate refused a recommendation, pointing at the fits above rather than repeating them."""
    if evidence.get("accepted", True):
        return ""
    parts = []
    handoffs = evidence.get("hand-offs") or {}
    if handoffs and not handoffs.get("accepted"):
        parts.append(f"{handoffs['handoffs']} hand-offs to a next turn (need {handoffs['minimum']})")
    fits = [n for n in ("recompute fit", "pull fit") if n in evidence and not evidence[n].get("accepted")]
    if fits:
        parts.append(f"{' and '.join(fits)} not accepted (see costs above)")
    return "not enough evidence: " + "; ".join(parts) if parts else ""


def _recommendation(rec: dict[str, Any], out: TextIO) -> None:
    ttl = rec.get("decoder_kv_blocks_ttl_s")
    thr = rec.get("kv_recompute_threshold")
    details = rec.get("details") or {}
    parts = []
    if ttl is not None:
        parts.append(f"decoder_kv_blocks_ttl={ttl:g}s, router handle TTL={rec.get('router_handle_ttl_s'):g}s")
    if thr is not None:
        parts.append(f"kv_recompute_threshold={thr}")
    out.write("\nrecommended: " + (", ".join(parts) or "nothing") + "\n")
    for label, key in (("TTL", "decoder_kv_blocks_ttl_s"), ("threshold", "kv_recompute_threshold")):
        item = details.get(key) or {}
        evidence = item.get("evidence") or {}
        out.write(f"  {label}: {_refused(evidence) or item.get('reason')}\n")
        if evidence.get("accepted"):
            out.write(f"    rests on {_rests_on(evidence)}\n")
        elif item.get("need"):
            out.write(f"    {item['need']}\n")
    vs = rec.get("vs_current")
    if vs:
        out.write(
            f"  vs in force: pulls {vs['pulls']:+d}, failed {vs['failed_requests']:+d}, TTFT "
            f"{_delta(vs['ttft_delta_s'])}, block-s {vs['block_seconds']:+.0f}, peak memory "
            f"{'+' if vs['peak_retained_bytes'] >= 0 else '-'}"
            f"{render.human_bytes(abs(vs['peak_retained_bytes']))}\n"
        )
