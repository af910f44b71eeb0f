"""``otelkv slow``, ``otelkv conversation`` and ``otelkv why``: argparse wiring and terminal output.

The answers come from :mod:`otelkv.cli.source` (sidecar API, store directory or
ClickHouse) as the documents of :mod:`otelkv.analysis.report` (turns as the turn object of
:mod:`otelkv.analysis.turn_json`); this module only renders them.
Errors the user can act on print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from otelkv.cli import render
from otelkv.cli.source import Querier, QueryError, resolve, window_ns

EXIT_OK = 0
EXIT_ERROR = 2


def source_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--sidecar", metavar="URL", help="ask a running sidecar (default: $OTELKV_SIDECAR or :8801)"
    )
    group.add_argument(
        "--store", metavar="DIR", help="open a store directory (only when no sidecar runs on it)"
    )
    group.add_argument("--clickhouse", metavar="URL", help="query a ClickHouse fed by the collector")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")


def add_query_commands(subparsers: Any) -> None:
    """Register ``slow``, ``conversation`` and ``why``; each sets ``handler`` (args -> exit code)."""
    slow = subparsers.add_parser(
        "slow",
        help="the slowest agent turns of a window, with where the time went and the top diagnosis",
        description="Lists the slowest turns (gap plus request) with their phase split and the costliest "
        "diagnosis; `otelkv why TRACE_ID` explains one.",
    )
    slow.add_argument(
        "--since",
        default="1h",
        help="window start: a duration before now (15m, 2h, 1d) or an ISO 8601 time (default 1h)",
    )
    slow.add_argument("--until", help="window end: a duration before now or an ISO 8601 time (default: now)")
    slow.add_argument("--limit", type=int, default=10, help="how many turns (default 10)")
    source_options(slow)
    slow.set_defaults(handler=run_slow)

    conv = subparsers.add_parser(
        "conversation",
        help="a conversation's turns as a waterfall: phases, tokens by source, pulls and retention",
        description="One row per turn: a bar of its phases, where its prompt KV came from, the pull "
        "decision and the decode node's retention, and the diagnoses that apply.",
    )
    conv.add_argument("conversation_id", help="the conversation id (gen_ai.conversation.id)")
    source_options(conv)
    conv.set_defaults(handler=run_conversation)

    why = subparsers.add_parser(
        "why",
        help="why one turn was slow or failed: every diagnosis, ranked, with evidence and the fix",
        description="REF is a trace id (32 hex digits) or CONVERSATION#INDEX (0-based turn index).",
    )
    why.add_argument("ref", help="trace id, or CONVERSATION#INDEX")
    source_options(why)
    why.set_defaults(handler=run_why)


def run_query(
    args: argparse.Namespace,
    query: Callable[[Querier], dict[str, Any]],
    show: Callable[[dict[str, Any], TextIO], None],
    out: TextIO | None = None,
) -> int:
    out = out or sys.stdout
    try:
        querier = resolve(
            sidecar=getattr(args, "sidecar", None),
            store=getattr(args, "store", None),
            clickhouse=getattr(args, "clickhouse", None),
        )
        try:
            data = query(querier)
        finally:
            querier.close()
    except QueryError as exc:
        print(f"otelkv {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if getattr(args, "json", False):
        json.dump(data, out, indent=2, sort_keys=False)
        out.write("\n")
    else:
        show(data, out)
    return EXIT_OK


def run_slow(args: argparse.Namespace, out: TextIO | None = None) -> int:
    try:
        since_ns, until_ns = window_ns(args.since, args.until)
    except QueryError as exc:
        print(f"otelkv slow: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.limit < 1:
        print("otelkv slow: --limit must be at least 1", file=sys.stderr)
        return EXIT_ERROR
    return run_query(
        args, lambda q: q.slow(since_ns=since_ns, until_ns=until_ns, limit=args.limit), show_slow, out
    )


def run_conversation(args: argparse.Namespace, out: TextIO | None = None) -> int:
    return run_query(args, lambda q: q.conversation(args.conversation_id), show_conversation, out)


def run_why(args: argparse.Namespace, out: TextIO | None = None) -> int:
    return run_query(args, lambda q: q.why(args.ref), show_why, out)


# ------------------------------------------------------------------ rendering


def _when(start_ns: int | None) -> str:
    if not start_ns:
        return "-"
    return time.strftime("%m-%d %H:%M:%S", time.localtime(start_ns / 1e9))


def _phase(row: dict[str, Any], name: str) -> float | None:
    phases = row.get("phases") or {}
    return phases.get(f"{name}_s")


def _phase_seconds(row: dict[str, Any]) -> dict[str, float] | None:
    """The turn's phases keyed by phase name (what the bar draws)."""
    phases = row.get("phases")
    return {k.removesuffix("_s"): v for k, v in phases.items()} if phases else None


def _turn_ref(row: dict[str, Any]) -> str:
    index = row.get("turn_index")
    conv = row.get("conversation_id") or "?"
    return f"{conv}#{index}" if index is not None else conv


def show_slow(data: dict[str, Any], out: TextIO) -> None:
    rows = data.get("turns") or []
    if not rows:
        out.write("no turns in this window (try a longer --since)\n")
        return
    table_rows = []
    for row in rows:
        top = (row.get("diagnoses") or [{}])[0]
        table_rows.append(
            [
                _when(row.get("start_ns")),
                _turn_ref(row),
                render.seconds(row.get("total_s")),
                render.seconds(_phase(row, "tool_wait")),
                render.seconds(_phase(row, "app_work")),
                render.seconds(_phase(row, "input_processing")),
                render.seconds(_phase(row, "generation")),
                render.seconds(row.get("ttft_s")),
                row.get("status") or "-",
                top.get("id") or "-",
                row.get("trace_id") or "-",
            ]
        )
    headers = [
        "START",
        "TURN",
        "TOTAL",
        "TOOL",
        "APP",
        "INPUT",
        "GEN",
        "TTFT",
        "STATUS",
        "TOP DIAGNOSIS",
        "TRACE",
    ]
    out.write(render.table(headers, table_rows, right=(2, 3, 4, 5, 6, 7)) + "\n")
    out.write("\n`otelkv why TRACE` explains a turn; `otelkv conversation ID` shows its conversation.\n")


def _tokens(row: dict[str, Any]) -> str:
    t = (row.get("prefill") or {}).get("tokens") or {}
    parts = [f"{t.get(k)}{label}" for k, label in (("computed", "c"), ("local_cache", "l"), ("pulled", "p"))]
    if all(t.get(k) is None for k in ("computed", "local_cache", "pulled")):
        return "-"
    return "/".join(p.replace("None", "0") for p in parts)


def _pull(row: dict[str, Any]) -> str:
    p = row.get("prefill") or {}
    if not p.get("decision") and not p.get("reason"):
        return "-"
    text = f"{p.get('decision') or '?'}:{p.get('reason') or '?'}"
    t = p.get("transfer") or {}
    if t.get("bytes"):
        text += f" {render.human_bytes(t['bytes'])}"
    if t.get("wait_s") is not None:
        text += f" {render.seconds(t['wait_s'])}"
    return text


def _retention(row: dict[str, Any]) -> str:
    r = (row.get("decode") or {}).get("retention") or {}
    if not r.get("outcome"):
        return "-"
    held = render.seconds(r.get("held_s"))
    ttl = render.seconds(r.get("ttl_s"))
    return f"{r['outcome']} {held}/{ttl}"


def show_conversation(data: dict[str, Any], out: TextIO) -> None:
    rows = data.get("turns") or []
    out.write(
        f"conversation {data.get('conversation_id')}: {len(rows)} turns, "
        f"{render.seconds(data.get('total_s'))} in all\n\n"
    )
    scale = max((r.get("total_s") or 0.0 for r in rows), default=0.0)
    table_rows = []
    for row in rows:
        table_rows.append(
            [
                row.get("turn_index") if row.get("turn_index") is not None else "-",
                render.seconds(row.get("total_s")),
                "|" + render.phase_bar(_phase_seconds(row), scale) + "|",
                _tokens(row),
                _pull(row),
                _retention(row),
                ",".join(d["id"] for d in row.get("diagnoses") or []) or "-",
            ]
        )
    headers = ["#", "TOTAL", "PHASES", "TOKENS c/l/p", "PULL", "RETENTION held/ttl", "DIAGNOSES"]
    out.write(render.table(headers, table_rows, right=(0, 1)) + "\n\n")
    out.write(f"legend: {render.bar_legend()}   (bars share one scale: the longest turn fills the width)\n")
    out.write("tokens: c computed, l local prefix cache, p pulled from the decode node\n")


def show_why(data: dict[str, Any], out: TextIO) -> None:
    turn = data.get("turn") or {}
    ref = _turn_ref(turn)
    out.write(f"turn {ref}  trace {turn.get('trace_id')}  total {render.seconds(turn.get('total_s'))}")
    out.write(f"  status {turn.get('status', '-')}\n")
    phases = _phase_seconds(turn) or {}
    if phases:
        out.write(
            "  "
            + "  ".join(f"{label} {render.seconds(phases.get(p))}" for p, _, label in render.BAR_SEGMENTS)
            + f"  (gap split: {turn.get('gap_source') or '-'},"
            + f" first token: {turn.get('ttft_source') or '-'})\n"
        )
    diagnoses = turn.get("diagnoses") or []
    if not diagnoses:
        out.write("\nno diagnosis applies: nothing in this turn's spans points at a known problem\n")
        return
    for i, diag in enumerate(diagnoses, 1):
        out.write(f"\n{i}. {diag['title']} [{diag['id']}]  ~{render.seconds(diag.get('cost_s'))}\n")
        out.write(f"   {diag.get('summary', '')}\n")
        evidence = diag.get("evidence") or {}
        shown = ", ".join(f"{k}={v}" for k, v in evidence.items() if v is not None)
        if shown:
            out.write(f"   evidence: {shown}\n")
        out.write(f"   fix: {diag.get('fix', '')}\n")
