"""``otelkv funnel``: argparse wiring and the terminal rendering of :mod:`otelkv.analysis.funnel`.

The answer is the ``funnel`` document, from a sidecar, a store directory or ClickHouse
(:mod:`otelkv.cli.source`); this module only parses options and renders it: one line per
step (turns that reached it, their share of the follow-up turns, reusable tokens and
prefill seconds at stake) and under it the turns lost there, by reason.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from otelkv import names
from otelkv.cli import render
from otelkv.cli.query_cmds import run_query, source_options
from otelkv.cli.source import window_ns


def add_funnel_command(subparsers: Any) -> None:
    funnel = subparsers.add_parser(
        "funnel",
        help="how often follow-up turns could read their KV back from decode, and where the rest were lost",
        description="Walks every follow-up turn of the window through the steps of reverse KV reuse "
        "(conversation id, decode handle, KV still held, threshold, pull, pull faster than recompute) "
        "and prints how many reached each step, how many were lost there and why, and the reusable "
        "tokens and prefill seconds at stake. See docs/funnel.md.",
    )
    funnel.add_argument(
        "--since", default="1h", help="window start: a duration before now or an ISO 8601 time (default 1h)"
    )
    funnel.add_argument(
        "--until", help="window end: a duration before now or an ISO 8601 time (default: now)"
    )
    source_options(funnel)
    funnel.set_defaults(handler=run_funnel)


def run_funnel(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """A bad window raises :class:`QueryError`, which ``otelkv.cli.main.run`` prints as one line (exit 2)."""
    since_ns, until_ns = window_ns(args.since, args.until)
    return run_query(args, lambda q: q.funnel(since_ns=since_ns, until_ns=until_ns), show_funnel, out)


# ------------------------------------------------------------------ rendering


def _window(data: dict[str, Any]) -> str:
    """The window as the other tables write times: ``2026-12-02 07:33:02Z`` (UTC)."""
    since = (data.get("since") or "?")[:19].replace("T", " ") + "Z"
    if data.get("until"):
        return f"{since} to {data['until'][:19].replace('T', ' ')}Z"
    return f"since {since}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _stake(row: dict[str, Any]) -> str:
    unknown = row.get("tokens_unknown_turns") or 0
    tokens = f"{row['tokens']}" + (f" (+{unknown} turns unknown)" if unknown else "")
    return f"{tokens} tokens, {_seconds(row.get('recompute_s') or 0.0)}"


def _seconds(value: float) -> str:
    """Recompute time: milliseconds below a second (a small model's turns cost a few)."""
    return f"{value * 1e3:.1f} ms" if value < 1 else render.seconds(value)


_BEFORE_PULL = (names.FUNNEL_CONVERSATION_ID, names.FUNNEL_DECODE_HANDLE, names.FUNNEL_KV_HELD)


def show_funnel(data: dict[str, Any], out: TextIO) -> None:
    """The funnel in at most 100 columns; an empty window in one line."""
    follow = data.get("follow_up_turns") or 0
    if not follow:
        out.write(
            f"no follow-up turns {_window(data)} ({data.get('turn_count', 0)} turns in all): nothing to "
            "reuse; widen --since\n"
        )
        return
    per_token = data.get("per_token_compute_s")
    rate = f"{per_token * 1e3:.3f} ms/token" if per_token else "unknown"
    out.write(
        f"reuse funnel, {_window(data)}: {follow} follow-up turns of {data['turn_count']} "
        f"(recompute {rate})\n"
    )
    if data.get("turns_left_out"):
        out.write(f"(the {data['turns_left_out']} oldest turns of the window were left out)\n")
    out.write("\n")
    out.write(f"{'STEP':<44} {'TURNS':>6} {'SHARE':>6}  AT STAKE (reusable tokens, recompute)\n")
    for step in data["steps"]:
        out.write(f"{step['title'][:44]:<44} {step['turns']:>6} {_share(step['share']):>6}  {_stake(step)}\n")
        for lost in step["lost"]:
            # A turn lost before the pull step that pulled all the same (a fingerprint id the
            # router keyed its handle by): say so, the loss is a risk there, not a miss.
            early = step["id"] in _BEFORE_PULL and lost.get("pulled_anyway")
            anyway = f"; {lost['pulled_anyway']} pulled anyway" if early else ""
            line = f"  lost {lost['turns']:>4}  {lost['reason']:<30} {_stake(lost)}{anyway}"
            out.write(line[:100] + "\n")
    lost_total = data.get("turns_lost", 0)
    out.write(
        f"\n{data['ends']} of {follow} follow-up turns reused their KV with a pull that paid off; "
        f"{lost_total} were lost on the way.\n"
    )
