"""``otelkv compare A B``: argparse wiring; the work is in :mod:`otelkv.analysis.compare`.

A and B are recorded runs: store directories (``otelkv fleet record --store DIR``, or any
sidecar's store) or ClickHouse URLs (the whole table is taken as one run). chDB opens one
directory per process at a time, so A is read and closed before B is opened.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from otelkv.cli.query_cmds import EXIT_ERROR, EXIT_OK
from otelkv.cli.source import QueryError, open_local


def add_compare_command(subparsers: Any) -> None:
    compare = subparsers.add_parser(
        "compare",
        help="two recorded runs of the same workload side by side (bidirectional on/off, two TTLs, ...)",
        description="TTFT by turn index and by prompt length, prefill split into compute and KV "
        "transfer, pull decisions by reason, retained memory, the turns B made slower (with their "
        "diagnoses) and the settings that differ. Turns pair up by conversation id and turn index. "
        "See docs/compare.md.",
    )
    compare.add_argument("a", metavar="A", help="run A: a store directory or a ClickHouse URL")
    compare.add_argument("b", metavar="B", help="run B: a store directory or a ClickHouse URL")
    compare.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with charts")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    compare.add_argument(
        "--regression",
        type=float,
        default=1.2,
        metavar="FACTOR",
        help="a turn regressed when B's TTFT exceeds A's by this factor (default 1.2)",
    )
    compare.add_argument(
        "--min-delta",
        type=float,
        default=0.02,
        metavar="SECONDS",
        help="... and by at least this many seconds (default 0.02)",
    )
    compare.set_defaults(handler=run_compare)


def _is_url(where: str) -> bool:
    return where.startswith(("http://", "https://"))


def load(where: str, label: str) -> Any:
    """One run, read and closed (QueryError when it cannot be opened)."""
    from otelkv.analysis.compare.rows import load_run, read_manifest

    querier = open_local(clickhouse_url=where) if _is_url(where) else open_local(path=where)
    try:
        manifest = None if _is_url(where) else read_manifest(Path(where).expanduser())
        return load_run(querier.source, label=label, where=where, manifest=manifest)
    finally:
        querier.close()


def run_compare(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    from otelkv.analysis.compare.aggregate import CompareOptions, compare_runs
    from otelkv.cli.compare_report.text import show_compare

    if not args.regression >= 1.0 or args.min_delta < 0:
        print("otelkv compare: --regression must be at least 1 and --min-delta not negative", file=sys.stderr)
        return EXIT_ERROR
    try:
        runs = []
        for label, where in (("A", args.a), ("B", args.b)):
            print(f"reading run {label}: {where}", file=sys.stderr, flush=True)
            runs.append(load(where, label))
    except QueryError as exc:
        print(f"otelkv compare: {exc}", file=sys.stderr)
        return EXIT_ERROR
    data = compare_runs(*runs, CompareOptions(factor=args.regression, min_delta_s=args.min_delta))
    if args.json:
        json.dump(data, out, indent=2)
        out.write("\n")
    else:
        show_compare(data, out)
    if args.html:
        from otelkv.cli.compare_report.html import page

        path = Path(args.html).expanduser()
        try:
            path.write_text(page(data), encoding="utf-8")
        except OSError as exc:
            print(f"otelkv compare: cannot write {path}: {exc}", file=sys.stderr)
            return EXIT_ERROR
        print(f"HTML report: {path}", file=sys.stderr if args.json else out)
    return EXIT_OK
