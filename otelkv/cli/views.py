"""What ``otelkv slow``, ``otelkv conversation`` and ``otelkv why`` print on a terminal.

Each view renders the JSON document of :mod:`otelkv.analysis.report` (the same one
``--json`` prints and the sidecar's API returns). Tables fit the terminal's width (100
columns when the output is not a terminal): trace ids are shortened to their first
:data:`~otelkv.analysis.report.SHORT_ID_DIGITS` hex digits, which ``otelkv why`` accepts
as they are printed, and over-long conversation ids or diagnosis ids are clipped in the
middle or at the end; ``wide`` prints everything whole. Times are UTC (``Z``); ``--json``
keeps nanoseconds.
"""

from __future__ import annotations

import time
from typing import Any, TextIO

from otelkv import names
from otelkv.analysis.report import SHORT_ID_DIGITS
from otelkv.cli import render

FAILED_MARK = "!"
"""Follows the TOTAL of a turn that failed (an error status or HTTP status >= 400)."""
BAR_MIN = 12
"""Narrowest phase bar ``conversation`` draws when the terminal is narrow."""
FIRST_TURN = "first turn"
"""What the PULL column says of a conversation's first turn: nothing earlier to read."""


def when(start_ns: int | None) -> str:
    """A start time as ``2026-12-02 07:33:02Z`` (UTC, to the second; ``-`` when unknown)."""
    if not start_ns:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(start_ns / 1e9))


def short_id(trace_id: str | None, *, wide: bool = False) -> str:
    """The trace id as the tables print it: its first hex digits, or whole with ``wide``."""
    if not trace_id:
        return "-"
    return trace_id if wide else trace_id[:SHORT_ID_DIGITS]


def turn_ref(row: dict[str, Any]) -> str:
    """``CONVERSATION#INDEX`` (what ``otelkv why`` accepts), or the conversation id alone."""
    index = row.get("turn_index")
    conv = row.get("conversation_id") or "?"
    return f"{conv}#{index}" if index is not None else conv


def _phase(row: dict[str, Any], name: str) -> float | None:
    phases = row.get("phases") or {}
    return phases.get(f"{name}_s")  # type: ignore[no-any-return]


def _phase_seconds(row: dict[str, Any]) -> dict[str, float] | None:
    """The turn's phases keyed by phase name (what the bar draws)."""
    phases = row.get("phases")
    return {k.removesuffix("_s"): v for k, v in phases.items()} if phases else None


def _total(row: dict[str, Any]) -> str:
    failed = row.get("status") == names.TURN_STATUS_ERROR
    return render.seconds(row.get("total_s")) + (FAILED_MARK if failed else "")


# ------------------------------------------------------------------ slow

SLOW_LEGEND = (
    "TOOL, APP: tool wait and app work before the request. TTFT: time to first token (routing, "
    f"queueing, KV pull, prefill). GEN: generation. They add up to TOTAL ({FAILED_MARK}: failed)."
)


def show_slow(data: dict[str, Any], out: TextIO, *, wide: bool = False, width: int | None = None) -> None:
    rows = data.get("turns") or []
    if not rows:
        out.write("no turns in this window (try a longer --since)\n")
        return
    width = width or render.terminal_width()
    table_rows = [
        [
            when(row.get("start_ns")),
            turn_ref(row),
            _total(row),
            render.seconds(_phase(row, "tool_wait")),
            render.seconds(_phase(row, "app_work")),
            render.seconds(_phase(row, "input_processing")),
            render.seconds(_phase(row, "generation")),
            short_id(row.get("trace_id"), wide=wide),
            ((row.get("diagnoses") or [{}])[0]).get("id") or "-",
        ]
        for row in rows
    ]
    headers = ["START", "TURN", "TOTAL", "TOOL", "APP", "TTFT", "GEN", "TRACE", "TOP DIAGNOSIS"]
    shrink = None if wide else {1: (14, render.clip_ref), 8: (14, render.clip_end)}
    out.write(
        render.table(
            headers, table_rows, right=(2, 3, 4, 5, 6), tight=(3, 4, 5, 6), width=width, shrink=shrink
        )
        + "\n\n"
    )
    out.write(render.wrap(SLOW_LEGEND, width) + "\n")
    out.write(
        render.wrap(
            "`otelkv why TRACE` explains a turn, `otelkv conversation ID` its conversation (--wide: "
            "whole ids).",
            width,
        )
        + "\n"
    )


# ------------------------------------------------------------------ conversation


def count(n: int | None) -> str:
    """A token count in at most 5 characters: ``9999``, ``123k``, ``1.0M``, ``12M``."""
    if n is None:
        return "-"
    if n < 10_000:
        return str(n)
    if n < 1_000_000:
        return f"{n // 1000}k"
    return f"{n / 1e6:.1f}M" if n < 10_000_000 else f"{n // 1_000_000}M"


def _tokens(row: dict[str, Any]) -> str:
    """computed/local/pulled prompt tokens (the header says ``c/l/p``)."""
    t = (row.get("prefill") or {}).get("tokens") or {}
    keys = ("computed", "local_cache", "pulled")
    if all(t.get(k) is None for k in keys):
        return "-"
    return "/".join(count(t.get(k) or 0) for k in keys)


def is_first_turn(row: dict[str, Any]) -> bool:
    """Turn 0 of its conversation, unless it resumed another conversation (``resumed_from``):
    a first turn has nothing to reuse, so reaching prefill without a decode handle is no
    failure; a resumed one could have read the other conversation's KV. (A turn without an
    index is an engine-only one, of no known place in a conversation.)"""
    return row.get("turn_index") == 0 and not row.get("resumed_from")


def _pull(row: dict[str, Any]) -> str:
    """What this turn's prefill read from the decode node, or why it recomputed instead."""
    p = row.get("prefill") or {}
    reason, decision = p.get("reason"), p.get("decision")
    if reason == names.REASON_NO_DECODE_HANDLE and is_first_turn(row):
        return FIRST_TURN
    if not decision and not reason:
        return "-"
    if reason != names.REASON_PULLED:
        return str(reason or decision)
    t = p.get("transfer") or {}
    text = "pulled"
    if t.get("bytes"):
        text += f" {render.human_bytes(t['bytes'])}"
    if t.get("wait_s") is not None:
        text += f" {render.seconds(t['wait_s'])}"
    return text


def _retention(row: dict[str, Any]) -> str:
    """What the decode node did with this turn's KV for the next turn: outcome, held/TTL."""
    r = (row.get("decode") or {}).get("retention") or {}
    if not r.get("outcome"):
        return "-"
    return f"{r['outcome']} {render.seconds(r.get('held_s'))}/{render.seconds(r.get('ttl_s'))}"


CONVERSATION_LEGEND = (
    "TOKENS c/l/p: prompt tokens computed, read from the prefill node's prefix cache, pulled from "
    "the decode node. PULL: what this turn read from the decode node (bytes, wait), or why it recomputed. "
    "RETENTION: what became of the KV it left on the decode node for the next turn (held/TTL)."
)


def show_conversation(
    data: dict[str, Any], out: TextIO, *, wide: bool = False, width: int | None = None
) -> None:
    rows = data.get("turns") or []
    width = width or render.terminal_width()
    out.write(
        render.wrap(
            f"conversation {data.get('conversation_id')}: {len(rows)} turns, "
            f"{render.seconds(data.get('total_s'))} in all",
            width,
        )
        + "\n\n"
    )
    cells = [
        [
            row.get("turn_index") if row.get("turn_index") is not None else "-",
            _total(row),
            short_id(row.get("trace_id"), wide=wide),
            _tokens(row),
            _pull(row),
            _retention(row),
        ]
        for row in rows
    ]
    headers = ["#", "TOTAL", "TRACE", "TOKENS\nc/l/p", "PULL\nthis turn read", "RETENTION\nleft for next"]
    # The bar takes what the other columns leave, within [BAR_MIN, BAR_WIDTH].
    used = sum(
        max([len(h) for h in head.split("\n")] + [len(str(r[i])) for r in cells])
        for i, head in enumerate(headers)
    )
    bar_width = max(BAR_MIN, min(render.BAR_WIDTH, width - used - 2 * len(headers) - 2))
    scale = max((r.get("total_s") or 0.0 for r in rows), default=0.0)
    for row, line in zip(rows, cells, strict=True):
        line.insert(2, "|" + render.phase_bar(_phase_seconds(row), scale, bar_width) + "|")
    headers.insert(2, "PHASES")
    shrink = None if wide else {5: (16, render.clip_end)}  # PULL, once the bar is at its narrowest
    out.write(render.table(headers, cells, right=(0, 1), width=width, shrink=shrink) + "\n\n")
    out.write(render.wrap(f"PHASES: {render.bar_legend()} (the longest turn fills the bar)", width) + "\n")
    out.write(render.wrap(CONVERSATION_LEGEND, width) + "\n")
    diagnosed = [
        (f"#{row['turn_index'] if row.get('turn_index') is not None else '-'}", [d["id"] for d in diags])
        for row in rows
        if (diags := row.get("diagnoses"))
    ]
    if diagnosed:
        out.write(
            "\n"
            + render.wrap(
                f"diagnoses, costliest first (`otelkv why {data.get('conversation_id')}#INDEX` explains "
                "them):",
                width,
            )
            + "\n"
        )
        pad = max(len(label) for label, _ in diagnosed)
        for label, ids in diagnosed:
            out.write(render.wrap(", ".join(ids), width, indent=f"  {label.ljust(pad)}  ") + "\n")


# ------------------------------------------------------------------ why


def show_why(data: dict[str, Any], out: TextIO, *, width: int | None = None) -> None:
    """One turn: where its time went, then every diagnosis with evidence and the fix, wrapped
    to ``width`` (the terminal's) with each part's indentation kept on its later lines."""
    width = width or render.terminal_width()
    turn = data.get("turn") or {}
    head = f"turn {turn_ref(turn)}  trace {turn.get('trace_id')}  start {when(turn.get('start_ns'))}"
    out.write(render.wrap(head, width, hang="  ") + "\n")
    text = f"status {turn.get('status', '-')}  total {_total(turn)}"
    phases = _phase_seconds(turn) or {}
    if phases:
        text += ": " + "  ".join(
            f"{label} {render.seconds(phases.get(p))}" for p, _, label in render.BAR_SEGMENTS
        )
        text += (
            f"  (gap split: {turn.get('gap_source') or '-'}, first token: {turn.get('ttft_source') or '-'})"
        )
    out.write(render.wrap(text, width, indent="  ") + "\n")
    diagnoses = turn.get("diagnoses") or []
    if not diagnoses:
        message = "no diagnosis applies: nothing in this turn's spans points at a known problem"
        out.write("\n" + render.wrap(message, width) + "\n")
        return
    for i, diag in enumerate(diagnoses, 1):
        title = f"{i}. {diag['title']} [{diag['id']}]  ~{render.seconds(diag.get('cost_s'))}"
        out.write("\n" + render.wrap(title, width, hang="   ") + "\n")
        out.write(render.wrap(str(diag.get("summary", "")), width, indent="   ") + "\n")
        evidence = diag.get("evidence") or {}
        shown = ", ".join(f"{k}={v}" for k, v in evidence.items() if v is not None)
        if shown:
            out.write(render.wrap(shown, width, indent="   evidence: ", hang=" " * 13) + "\n")
        out.write(render.wrap(str(diag.get("fix", "")), width, indent="   fix: ", hang=" " * 8) + "\n")
