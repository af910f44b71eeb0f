"""``otelkv`` command line. Each subcommand lives in its own module and is imported lazily,
so ``otelkv --help`` works without the heavy extras installed."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otelkv",
        description="Observability for multi-turn agent traffic on disaggregated vLLM fleets.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="start the reference fleet, run an agent workload, show what the spans recorded",
        description="Starts a real prefill/decode vLLM pair (CPU build) with the instrumented "
        "NixlConnector, drives agent conversations with short and long tool waits, and prints "
        "per-turn prefill decisions, KV transfers and retention from the engines' spans.",
    )
    demo.add_argument("--ttl", type=float, default=15.0, help="decoder_kv_blocks_ttl in seconds (default 15)")
    demo.add_argument(
        "--long-pause", type=float, default=18.0, help="tool wait longer than the TTL (default 18)"
    )
    demo.add_argument("--workdir", help="where logs and spans.jsonl go (default: a new temp dir)")
    demo.add_argument("--json", action="store_true", help="print the turn summaries as JSON")

    from otelkv.cli.fleet_cmd import add_fleet_command

    add_fleet_command(sub)

    from otelkv.cli.sidecar_cmd import add_sidecar_command

    add_sidecar_command(sub)
    from otelkv.cli.query_cmds import add_query_commands

    add_query_commands(sub)
    from otelkv.cli.tune_cmd import add_tune_command

    add_tune_command(sub)
    from otelkv.cli.doctor_cmd import add_doctor_command

    add_doctor_command(sub)
    from otelkv.cli.compare_cmd import add_compare_command

    add_compare_command(sub)
    from otelkv.cli.dashboards_cmd import add_dashboards_command

    add_dashboards_command(sub)
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Unwind normally on SIGTERM, so context managers stop every process they started.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.command == "demo":
        from otelkv.cli.demo import run_demo

        return run_demo(args)
    if args.command == "fleet":
        from otelkv.cli.fleet_cmd import run_fleet

        return run_fleet(args)
    if args.command == "sidecar":
        from otelkv.cli.sidecar_cmd import run_sidecar

        return run_sidecar(args)
    handler = getattr(args, "handler", None)
    if handler is None:
        return 2
    try:
        return int(handler(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, never a traceback
        message = " ".join(str(exc).split())
        print(f"otelkv {args.command}: failed: {type(exc).__name__}: {message}"[:500], file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
