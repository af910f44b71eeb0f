"""``otelkv slow``, ``otelkv conversation`` and ``otelkv why``: argparse wiring and terminal output.

The answers come from :mod:`otelkv.cli.source` (sidecar API, store directory or
ClickHouse) as the documents of :mod:`otelkv.analysis.report` (turns as the turn object of
:mod:`otelkv.analysis.turn_json`); :mod:`otelkv.cli.views` renders them.
Errors the user can act on print one line and exit with the code of :mod:`otelkv.cli.errors`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from otelkv.cli.source import Querier, QueryError, resolve, window_ns
from otelkv.cli.views import show_conversation, show_slow, show_why

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


WIDE_HELP = "print whole trace and conversation ids, however wide the table gets"


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
    slow.add_argument("--wide", action="store_true", help=WIDE_HELP)
    source_options(slow)
    slow.set_defaults(handler=run_slow)

    conv = subparsers.add_parser(
        "conversation",
        help="a conversation's turns as a waterfall: phases, tokens by source, pulls and retention",
        description="One row per turn: a bar of its phases, where its prompt KV came from, the pull "
        "decision and the decode node's retention, and the diagnoses that apply.",
    )
    conv.add_argument("conversation_id", help="the conversation id (gen_ai.conversation.id)")
    conv.add_argument("--wide", action="store_true", help=WIDE_HELP)
    source_options(conv)
    conv.set_defaults(handler=run_conversation)

    why = subparsers.add_parser(
        "why",
        help="why one turn was slow or failed: every diagnosis, ranked, with evidence and the fix",
        description="REF is a trace id (32 hex digits), its first digits as the tables print them "
        "(any unique prefix of 4 or more), or CONVERSATION#INDEX (0-based turn index).",
    )
    why.add_argument("ref", help="trace id or a unique prefix of it, or CONVERSATION#INDEX")
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
        return exc.exit_code
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
        args,
        lambda q: q.slow(since_ns=since_ns, until_ns=until_ns, limit=args.limit),
        lambda data, out: show_slow(data, out, wide=args.wide),
        out,
    )


def run_conversation(args: argparse.Namespace, out: TextIO | None = None) -> int:
    return run_query(
        args,
        lambda q: q.conversation(args.conversation_id),
        lambda data, out: show_conversation(data, out, wide=args.wide),
        out,
    )


def run_why(args: argparse.Namespace, out: TextIO | None = None) -> int:
    return run_query(args, lambda q: q.why(args.ref), show_why, out)
