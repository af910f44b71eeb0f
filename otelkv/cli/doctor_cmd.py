"""``otelkv doctor``: each prerequisite of reverse KV reuse as pass / warn / fail / skip, with the fix.

The checks run where the spans are (:mod:`otelkv.analysis.doctor`, through a sidecar, a
store directory or ClickHouse); the engines' ``/metrics`` named with ``--engine`` are read
here, by the CLI, and sent along. Exit status: 0 when nothing fails, 1 when a prerequisite
fails, 2 when the question could not be answered (one line on stderr).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, TextIO

from otelkv import names
from otelkv.cli.query_cmds import EXIT_ERROR, run_query, source_options
from otelkv.cli.source import QueryError, window_ns

EXIT_FAILED = 1

MARK = {
    names.CHECK_PASS: "pass",
    names.CHECK_WARN: "WARN",
    names.CHECK_FAIL: "FAIL",
    names.CHECK_SKIP: "skip",
}


def add_doctor_command(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="is every prerequisite of reverse KV reuse in place? pass/warn/fail each, with the fix",
        description="Reads the window's turns and engine requests, the engines' configuration in force "
        "and (with --engine) their /metrics, and checks each prerequisite of reverse KV reuse. "
        "Exits 1 when one fails.",
    )
    p.add_argument(
        "--since", default="1h", help="window start: a duration before now or an ISO 8601 time (default 1h)"
    )
    p.add_argument("--until", help="window end: a duration before now or an ISO 8601 time (default: now)")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="an engine's HTTP address, e.g. http://prefill-0:8000 (repeatable): its /metrics is read",
    )
    p.add_argument(
        "--router-handle-ttl",
        type=float,
        metavar="SECONDS",
        help="how long the router keeps a decode handle (routers without otelkv's spans do not say)",
    )
    source_options(p)
    p.set_defaults(handler=run_doctor)


def run_doctor(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from otelkv.analysis.engine_probe import probe

    try:
        since_ns, until_ns = window_ns(args.since, args.until)
    except QueryError as exc:
        print(f"otelkv doctor: {exc}", file=sys.stderr)
        return EXIT_ERROR
    ttl = args.router_handle_ttl
    if ttl is not None and (not math.isfinite(ttl) or ttl < 0):
        print("otelkv doctor: --router-handle-ttl must be a number of seconds >= 0", file=sys.stderr)
        return EXIT_ERROR
    probes = [probe(url).as_dict() for url in dict.fromkeys(args.engine)]
    answer: dict[str, Any] = {}

    def query(q: Any) -> dict[str, Any]:
        answer.update(q.doctor(since_ns=since_ns, until_ns=until_ns, probes=probes, router_handle_ttl_s=ttl))
        return answer

    code = run_query(args, query, show_doctor, out)
    if code == 0 and answer.get("verdict") == names.CHECK_FAIL:
        return EXIT_FAILED
    return code


def show_doctor(data: dict[str, Any], out: TextIO) -> None:
    turns, reqs = data.get("turn_count", 0), data.get("engine_request_count", 0)
    out.write(f"otelkv doctor: {turns} turns and {reqs} engine requests in the window")
    if data.get("turns_left_out"):
        out.write(f" ({data['turns_left_out']} older turns not read)")
    out.write("\n")
    for engine in data.get("engines", []):
        out.write(
            f"  engine {engine['key']}: model={engine.get('model')} block_size={engine.get('block_size')} "
            f"dtype={engine.get('kv_cache_dtype')} bidirectional={engine.get('bidirectional_kv_xfer')} "
            f"ttl={engine.get('decoder_kv_blocks_ttl_s')} requests={engine.get('requests')}\n"
        )
    for p in data.get("probes", []):
        state = p["error"] or ("otelkv connector found" if p.get("otelkv_metrics") else "no otelkv_* series")
        out.write(f"  /metrics {p['url']}: {state}\n")
    out.write("\n")
    for check in data.get("checks", []):
        out.write(f"[{MARK.get(check['status'], check['status'])}] {check['title']}: {check['summary']}\n")
        if check.get("fix"):
            out.write(f"       fix: {check['fix']}\n")
    out.write(f"\nverdict: {data.get('verdict')}\n")
