"""``otelkv fleet record``: one run of named scenarios on the reference fleet, kept in a store.

A comparison needs two runs that differ only in the setting under test. Recording one is:
start the fleet with the sidecar writing to the run's store directory, run the scenarios
one after another, wait until every retained block has been read or has expired (its
``kv_retention`` span ends, and is exported, only then), flush, stop, and write a small
manifest (:data:`otelkv.names.RUN_MANIFEST_FILE`) into the store directory with the
settings and the scenario parameters, so ``otelkv compare`` can say what differed.

The fleet is passed in as a factory, so the orchestration is tested without engines.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from otelkv import __version__
from otelkv.analysis.compare.rows import manifest_path
from otelkv.fleet.scenarios import ScenarioParams, build

MANIFEST_FORMAT = 1
RETENTION_SETTLE_S = 2.0
"""Waited beyond the decode TTL so the last retentions have ended and been exported."""
EXPORT_SETTLE_S = 1.5
"""Engines export spans every ~0.2 s from a separate process: time for the last batch."""
MAX_FAILURES_LISTED = 20


@dataclass(frozen=True)
class RecordOptions:
    """One run's fleet settings and workload (the ``otelkv fleet record`` flags)."""

    scenarios: tuple[str, ...]
    store: Path
    bidirectional: bool = True
    ttl_s: float = 20.0
    threshold: int = 64
    router_ttl_s: float | None = None
    """The router's handle TTL; None: the fleet's default (decode TTL - 6 s)."""
    stream_decode: bool = False
    scale: float = 1.0
    seed: int = 0
    scenario_ttl_s: float | None = None
    """The TTL the scenario pauses are set against; None: ``ttl_s``. Keep it equal across
    runs that compare two TTLs, or the two runs send different workloads."""
    workdir: Path | None = None

    def scenario_params(self) -> ScenarioParams:
        return ScenarioParams(
            ttl_s=self.scenario_ttl_s if self.scenario_ttl_s is not None else self.ttl_s,
            scale=self.scale,
            seed=self.seed,
            router_ttl_s=self.router_ttl_s,
        )


def fleet_config(options: RecordOptions) -> Any:
    """The :class:`~otelkv.fleet.fleet.FleetConfig` of the run (sidecar on, writing to the store)."""
    from otelkv.fleet.fleet import FleetConfig

    return FleetConfig(
        bidirectional=options.bidirectional,
        decoder_ttl_s=options.ttl_s,
        recompute_threshold=options.threshold,
        router_handle_ttl_s=options.router_ttl_s if options.router_ttl_s is not None else -1.0,
        stream_decode=options.stream_decode,
        sidecar=True,
        sidecar_store=options.store,
        workdir=options.workdir,
    )


def settings(config: Any) -> dict[str, Any]:
    """The settings a comparison shows, keyed as the engines' resources name them."""
    return {
        "bidirectional_kv_xfer": config.bidirectional,
        "decoder_kv_blocks_ttl_s": config.decoder_ttl_s,
        "kv_recompute_threshold": config.recompute_threshold,
        "router_handle_ttl_s": config.effective_router_ttl(),
        "router_decode_streamed": config.stream_decode,
        "kv_load_failure_policy": config.load_failure_policy,
        "prefix_caching_prefill": config.prefix_caching_prefill,
    }


def check_store_dir(store: Path) -> None:
    """A run gets a store of its own: ValueError for a directory that already holds something.

    Two runs in one store would share conversation ids, and a comparison matches turns by them.
    """
    if store.exists() and (not store.is_dir() or any(store.iterdir())):
        raise ValueError(f"{store} is not an empty directory: record each run into a new one")


def record(
    options: RecordOptions,
    *,
    fleet_factory: Callable[[Any], Any] | None = None,
    out: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Record one run; returns the manifest it wrote. ValueError for a store directory in use."""
    out = out or sys.stdout
    store = Path(options.store).expanduser().resolve()
    check_store_dir(store)
    options = replace(options, store=store)
    params = options.scenario_params()
    plan = build(options.scenarios, params)
    config = fleet_config(options)
    if fleet_factory is None:
        from otelkv.fleet.fleet import Fleet

        fleet_factory = Fleet
    bidir = "on" if options.bidirectional else "off"
    print(
        f"otelkv fleet record: bidirectional {bidir}, decoder_kv_blocks_ttl={options.ttl_s:g}s, "
        f"kv_recompute_threshold={options.threshold}; scenarios {', '.join(options.scenarios)}; "
        f"store {store}\nstarting the reference fleet (a minute or two on 2 cores)...",
        file=out,
        flush=True,
    )
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    started = time.monotonic()
    results: list[Any] = []
    with fleet_factory(config) as fleet:
        for name, conversations in plan:
            turns = sum(len(c.turns) for c in conversations)
            print(f"scenario {name}: {len(conversations)} conversations, {turns} turns", file=out, flush=True)
            for run in fleet.driver().run_sync(conversations):
                results.extend(run)
        # The last turns' retentions end when their TTL lapses; only then are their spans exported.
        wait = options.ttl_s + RETENTION_SETTLE_S if options.bidirectional else RETENTION_SETTLE_S
        print(f"waiting {wait:g}s for retained KV to be read or expire...", file=out, flush=True)
        sleep(wait)
        fleet.flush_spans()
        sleep(EXPORT_SETTLE_S)
        fleet.flush_store()
        workdir = str(fleet.workdir)
    manifest = _manifest(options, config, plan, results, started_at, time.monotonic() - started, workdir)
    store.mkdir(parents=True, exist_ok=True)  # the sidecar made it, unless nothing was stored
    manifest_path(store).write_text(json.dumps(manifest, indent=2) + "\n")
    failed = manifest["turns"]["failed"]
    print(
        f"recorded {manifest['turns']['sent']} turns ({failed} failed, "
        f"{manifest['turns']['interrupted']} interrupted on purpose) into {store}",
        file=out,
    )
    for failure in manifest["failures"]:
        print(f"  failed: {failure} (see otelkv why, or the engine logs in {workdir})", file=out)
    print("compare two runs with: otelkv compare RUN_A RUN_B [--html report.html]", file=out)
    return manifest


def _manifest(
    options: RecordOptions,
    config: Any,
    plan: list[tuple[str, list[Any]]],
    results: list[Any],
    started_at: str,
    duration_s: float,
    workdir: str,
) -> dict[str, Any]:
    failures = [r for r in results if not r.ok]
    return {
        "format": MANIFEST_FORMAT,
        "otelkv_version": __version__,
        "recorded_at": started_at,
        "duration_s": round(duration_s, 1),
        "scenarios": list(options.scenarios),
        "scenario_params": options.scenario_params().as_dict(),
        "settings": settings(config),
        "conversations": {name: [c.conversation_id for c in convs] for name, convs in plan},
        "turns": {
            "sent": len(results),
            "ok": len(results) - len(failures),
            "failed": len(failures),
            "interrupted": sum(1 for r in results if r.interrupted),
        },
        "failures": [
            f"{r.conversation_id}#{r.index}: {r.error or r.status}" for r in failures[:MAX_FAILURES_LISTED]
        ],
        "store": str(options.store),
        "workdir": workdir,
    }
