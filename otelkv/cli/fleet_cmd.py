"""``otelkv fleet``: keep a reference fleet running for manual exploration, or record a run.

``otelkv fleet record`` runs named scenarios (:mod:`otelkv.fleet.scenarios`) into a store
directory for ``otelkv compare``; the work is in :mod:`otelkv.fleet.record`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from otelkv.cli.errors import EXIT_UNAVAILABLE
from otelkv.cli.query_cmds import EXIT_ERROR
from otelkv.cli.source import QueryError, parse_duration


def add_fleet_command(subparsers: Any) -> None:
    fleet = subparsers.add_parser(
        "fleet",
        help="run the reference fleet until interrupted, or record a scenario run (fleet record)",
        description="Starts the reference fleet and prints its router URL and span file. "
        "`otelkv fleet record` runs named scenarios into a store for `otelkv compare`.",
    )
    fleet.add_argument("--ttl", type=float, default=480.0, help="decoder_kv_blocks_ttl in seconds")
    fleet.add_argument("--threshold", type=int, default=64, help="kv_recompute_threshold in tokens")
    fleet.add_argument("--no-bidirectional", action="store_true", help="turn bidirectional_kv_xfer off")
    fleet.add_argument("--plain", action="store_true", help="vLLM's NixlConnector without otelkv")
    fleet.add_argument("--workdir", help="where logs go (default: a new temp dir)")
    fleet.add_argument("--port", type=int, default=0, help="router port (default: any free port)")
    fleet.set_defaults(handler=run_fleet)
    sub = fleet.add_subparsers(dest="fleet_command", metavar="SUBCOMMAND")
    record = sub.add_parser(
        "record",
        help="run named scenarios on a fresh fleet, its sidecar writing to a store directory",
        description="Starts the reference fleet with otelkv's sidecar writing to --store, runs the "
        "scenarios one after another, waits for retained KV to be read or expire, writes the run's "
        f"settings to a manifest in the store, and stops. Scenarios: {_scenario_help()}. "
        "See docs/compare.md.",
    )
    record.add_argument("--scenario", required=True, metavar="NAME[,NAME]", help="scenarios to run, in order")
    record.add_argument("--store", required=True, metavar="DIR", help="a new (or empty) store directory")
    record.add_argument("--no-bidirectional", action="store_true", help="turn bidirectional_kv_xfer off")
    record.add_argument("--ttl", default="20", help="decoder_kv_blocks_ttl, e.g. 20 or 2m (default 20s)")
    record.add_argument("--threshold", type=int, default=64, help="kv_recompute_threshold (default 64)")
    record.add_argument("--router-ttl", help="the router's handle TTL (default: the decode TTL - 6s)")
    record.add_argument(
        "--stream-decode",
        action="store_true",
        help="the router streams the decode leg (then no handle comes back)",
    )
    record.add_argument(
        "--scenario-ttl",
        help="the TTL the scenario pauses are set against (default --ttl); give both runs the same "
        "one when comparing two TTLs",
    )
    record.add_argument("--scale", type=float, default=1.0, help="more or fewer conversations (default 1)")
    record.add_argument("--seed", type=int, default=0, help="seed of the scenario text (default 0)")
    record.add_argument("--workdir", help="engine logs (default: a new temp dir)")


def _scenario_help() -> str:
    try:
        from otelkv.fleet.scenarios import SCENARIOS
    except ImportError:  # the fleet extra is missing: --help still works
        return "see docs/compare.md"
    return ", ".join(SCENARIOS)


def run_record(args: argparse.Namespace) -> int:
    try:
        from otelkv.fleet.record import RecordOptions, check_store_dir, record
        from otelkv.fleet.scenarios import parse_names
    except ImportError as exc:
        print(f"otelkv fleet record: {exc}; pip install 'otelkv[fleet,cpu]'", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        if not args.scale > 0:
            raise QueryError("--scale must be above 0")
        if args.threshold < 0:
            raise QueryError("--threshold must not be negative")
        check_workdir(args.workdir)
        options = RecordOptions(
            scenarios=tuple(parse_names(args.scenario)),
            store=Path(args.store).expanduser(),
            bidirectional=not args.no_bidirectional,
            ttl_s=parse_duration(args.ttl),
            threshold=int(args.threshold),
            router_ttl_s=parse_duration(args.router_ttl) if args.router_ttl else None,
            stream_decode=bool(args.stream_decode),
            scale=float(args.scale),
            seed=int(args.seed),
            scenario_ttl_s=parse_duration(args.scenario_ttl) if args.scenario_ttl else None,
            workdir=Path(args.workdir) if args.workdir else None,
        )
        check_store_dir(options.store)
    except (QueryError, ValueError) as exc:
        print(f"otelkv fleet record: {exc}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, QueryError) else EXIT_ERROR
    return record_exit_code(record(options))


def record_exit_code(manifest: dict[str, Any]) -> int:
    """0 for a recorded run, failed turns included (they are part of what was recorded and
    the comparison counts them); 1 when no turn succeeded."""
    return 0 if manifest["turns"]["ok"] else 1


def check_workdir(workdir: str | None) -> None:
    """A ``--workdir`` that is a file cannot hold logs: refuse it before any engine starts."""
    if (
        workdir is not None
        and Path(workdir).expanduser().exists()
        and not Path(workdir).expanduser().is_dir()
    ):
        raise QueryError(f"--workdir {workdir} is a file: give a directory (it is created if missing)")


def run_fleet(args: argparse.Namespace) -> int:
    if getattr(args, "fleet_command", None) == "record":
        return run_record(args)
    if not args.ttl > 0 or args.threshold < 0 or not 0 <= args.port <= 65535:
        raise QueryError("--ttl must be above 0, --threshold not negative, --port in 0-65535")
    check_workdir(args.workdir)
    from otelkv.fleet.fleet import Fleet, FleetConfig

    config = FleetConfig(
        instrumented=not args.plain,
        bidirectional=not args.no_bidirectional,
        decoder_ttl_s=float(args.ttl),
        recompute_threshold=int(args.threshold),
        workdir=Path(args.workdir) if args.workdir else None,
        router_port=int(args.port),
    )
    print("starting the reference fleet (a minute or two on 2 cores)...", flush=True)
    with Fleet(config) as fleet:
        assert fleet.prefill is not None and fleet.decode is not None and fleet.sink is not None
        print(f"router (OpenAI-compatible): {fleet.url}/v1/chat/completions  model=tiny-llama")
        print(f"prefill engine: {fleet.prefill.url}   decode engine: {fleet.decode.url}")
        print(f"spans are collected in memory from OTLP at {fleet.sink.endpoint}")
        print(f"logs: {fleet.workdir}")
        print("send requests with an X-Conversation-Id header; Ctrl-C stops everything.", flush=True)
        try:
            while fleet.prefill.is_alive() and fleet.decode.is_alive():
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
    return 0
