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

from otelkv.cli.errors import EXIT_UNAVAILABLE
from otelkv.cli.query_cmds import EXIT_ERROR, EXIT_OK
from otelkv.cli.source import QueryError, UnavailableError, open_local


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
        "--trace-url",
        metavar="TEMPLATE",
        help="in the HTML report, link each trace id to this URL with {trace_id} replaced, e.g. "
        "your Tempo or Grafana Explore (default: trace ids as plain text)",
    )
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
    """One run, read and closed (a :class:`QueryError` subclass when it cannot be opened or read:
    its exit code says whether it is missing, malformed or unreachable)."""
    from otelkv.analysis.compare.rows import load_run, read_manifest
    from otelkv.store.base import StoreError

    querier = open_local(clickhouse_url=where) if _is_url(where) else open_local(path=where)
    try:
        manifest = None if _is_url(where) else read_manifest(Path(where).expanduser())
        return load_run(querier.source, label=label, where=where, manifest=manifest)
    except StoreError as exc:  # ClickHouse unreachable, a query that failed
        raise UnavailableError(f"cannot read run {label}: {' '.join(str(exc).split())[:300]}") from None
    finally:
        querier.close()


def run_compare(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    from otelkv.analysis.compare.aggregate import CompareOptions, compare_runs
    from otelkv.cli.compare_report.text import show_compare

    if not args.regression >= 1.0 or args.min_delta < 0:
        print("otelkv compare: --regression must be at least 1 and --min-delta not negative", file=sys.stderr)
        return EXIT_ERROR
    if args.trace_url is not None and "{trace_id}" not in args.trace_url:
        print("otelkv compare: --trace-url must contain {trace_id}", file=sys.stderr)
        return EXIT_ERROR
    if args.html:  # before reading two stores: a report that cannot be written is a usage error
        html = Path(args.html).expanduser()
        if html.is_dir() or not html.parent.is_dir():
            print(f"otelkv compare: --html {args.html}: not a file in an existing directory", file=sys.stderr)
            return EXIT_ERROR
    try:
        runs = []
        for label, where in (("A", args.a), ("B", args.b)):
            print(f"reading run {label}: {where}", file=sys.stderr, flush=True)
            runs.append(load(where, label))
    except QueryError as exc:
        print(f"otelkv compare: {exc}", file=sys.stderr)
        return exc.exit_code
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
            path.write_text(page(data, trace_url=args.trace_url), encoding="utf-8")
        except OSError as exc:
            print(f"otelkv compare: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        print(f"HTML report: {path}", file=sys.stderr if args.json else out)
    return EXIT_OK
