"""``otelkv demo``: a real 1P1D fleet, an agent workload, and what the spans recorded.

The workload has one conversation of each kind that decides whether reverse pull pays
off: quick tool calls (pulls), a tool call longer than the decode TTL (the handle lapses
and prefill recomputes), short answers (below ``kv_recompute_threshold``) and a client
that sends no conversation id (the sidecar fingerprints it, so its turns still pair up).
Everything goes through otelkv's sidecar into its chDB store; the demo then prints what
``otelkv slow`` and ``otelkv conversation`` say.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from otelkv import names
from otelkv.cli.render import human_bytes


def demo_conversations(long_pause_s: float) -> list[Any]:
    from otelkv.fleet.agent import Conversation, Turn

    return [
        Conversation(
            "support-agent",
            [
                Turn("please find the open issue about the slow build and summarize it", 96),
                Turn("issue ticket build slow cache timeout high priority", 96, pause_s=1.5, tool="search"),
                Turn(
                    "log error timeout in the build step after ten minutes", 96, pause_s=2.5, tool="read_file"
                ),
                Turn("now draft a reply to the user", 48, pause_s=1.0),
            ],
        ),
        Conversation(
            "research-agent",
            [
                Turn("what is the weather forecast for paris london and tokyo this week", 96),
                Turn("paris sunny london rain tokyo cloudy", 64, pause_s=long_pause_s, tool="weather_api"),
                Turn("and which city is best for a meeting tomorrow", 64, pause_s=1.0),
            ],
        ),
        Conversation(
            "quick-chat",
            [
                Turn("yes or no", 8),
                Turn("why", 8, pause_s=1.0),
                Turn("ok thanks", 8, pause_s=1.0),
            ],
        ),
        Conversation(
            "anonymous-client",
            [Turn("list the files in the repository", 64), Turn("open the first one", 64, pause_s=1.0)],
            send_conversation_id=False,
        ),
    ]


def run_demo(args: argparse.Namespace) -> int:
    from otelkv.cli.fleet_cmd import check_workdir
    from otelkv.cli.source import QueryError

    if not args.ttl > 0 or not args.long_pause >= 0:  # before a minute of engine start-up
        raise QueryError("--ttl must be above 0 and --long-pause not negative (seconds)")
    check_workdir(args.workdir)
    from otelkv.analysis import report
    from otelkv.analysis.sources import StoreSource
    from otelkv.cli.views import show_conversation, show_slow
    from otelkv.fleet import metrics as prom
    from otelkv.fleet.fleet import Fleet, FleetConfig

    ttl = float(args.ttl)
    workdir = Path(args.workdir) if args.workdir else None
    config = FleetConfig(decoder_ttl_s=ttl, workdir=workdir, sidecar=True)
    out = sys.stderr if args.json else sys.stdout
    print(
        "otelkv demo: starting a real prefill + decode vLLM pair (CPU build, NixlConnector over UCX,\n"
        f"instrumented by otelkv; decoder_kv_blocks_ttl={ttl:g}s, kv_recompute_threshold="
        f"{config.recompute_threshold}), the reference router, and otelkv's sidecar in front of it.\n"
        "This takes a minute or two on 2 cores...",
        file=out,
        flush=True,
    )
    started = time.monotonic()
    with Fleet(config) as fleet:
        assert fleet.sidecar is not None and fleet.router is not None
        print(
            f"fleet ready in {time.monotonic() - started:.0f}s; agents talk to the sidecar at {fleet.url} "
            f"(router behind it at {fleet.router.url})",
            file=out,
        )
        conversations = demo_conversations(float(args.long_pause))
        print(
            f"running {len(conversations)} agent conversations (one waits {args.long_pause:g}s in a tool "
            f"call, longer than the {ttl:g}s TTL)...",
            file=out,
            flush=True,
        )
        results = fleet.driver().run_sync(conversations)
        failed = [r for conv in results for r in conv if not r.ok]
        print(
            f"waiting {ttl + 2:g}s for the last turns' retained KV to be read or expire...",
            file=out,
            flush=True,
        )
        time.sleep(ttl + 2)
        fleet.flush_spans()
        time.sleep(1.5)
        fleet.flush_store()
        assert fleet.sink is not None and fleet.prefill is not None and fleet.decode is not None
        spans = fleet.sink.spans()
        p_metrics, d_metrics = fleet.prefill.metrics_text(), fleet.decode.metrics_text()
        spans_path = fleet.workdir / "spans.jsonl"
        with spans_path.open("w") as fh:
            for span in spans:
                fh.write(json.dumps(dataclasses.asdict(span), default=str) + "\n")
        source = StoreSource(fleet.sidecar.store)
        slow = report.slow(source, limit=8)  # the fleet's warm-up turns do not count (analysis.scope)
        waterfall = report.conversation(source, "research-agent")
        why = report.why(source, "research-agent#1")
        if args.json:
            json.dump(
                {"slow": slow, "conversation": waterfall, "why": why}, sys.stdout, indent=2, default=str
            )
            print()
            return 1 if failed else 0

        print("\n$ otelkv slow")
        show_slow(slow, sys.stdout)
        print("\n$ otelkv conversation research-agent")
        show_conversation(waterfall, sys.stdout)
        print()
        decisions = prom.by_label(p_metrics, names.METRIC_PULL_DECISIONS + "_total", "reason")
        print("prefill decisions (otelkv_pull_decisions_total):", _kv(decisions))
        print(
            "KV read over NIXL:",
            f"D->P {human_bytes(prom.total(p_metrics, names.METRIC_TRANSFER_BYTES + '_total'))} by prefill,",
            f"P->D {human_bytes(prom.total(d_metrics, names.METRIC_TRANSFER_BYTES + '_total'))} by decode",
        )
        retentions = prom.by_label(d_metrics, names.METRIC_RETENTIONS + "_total", "outcome")
        block_s = prom.total(d_metrics, names.METRIC_RETENTION_BLOCK_SECONDS + "_total")
        print(f"decode retentions: {_kv(retentions)}; memory cost {block_s:.0f} block-seconds")
        if failed:
            print(
                f"\n{len(failed)} turn(s) failed: "
                + "; ".join(f"{r.conversation_id}#{r.index}: {r.error}" for r in failed)
            )
        store_dir = fleet.workdir / "store"
        print(
            "\nWhere the data is:\n"
            f"  trace store (chDB, the OpenTelemetry Collector ClickHouse schema, table otel.otel_traces): "
            f"{store_dir}\n"
            f"  the same spans as JSON lines: {spans_path}\n"
            f"  engine logs: {fleet.prefill.log_path}, {fleet.decode.log_path}\n"
            "Ask it yourself (the fleet has stopped, so open the store directly):\n"
            f"  otelkv slow --since 1h --store {store_dir}\n"
            f"  otelkv why research-agent#1 --store {store_dir}\n"
            f"  otelkv conversation support-agent --store {store_dir} --json\n"
            "On your own fleet: kv_connector_module_path=otelkv.engine.nixl in the engines' "
            "--kv-transfer-config, `otelkv sidecar --upstream ROUTER` in front of the router, and the "
            "engines' OTLP endpoint pointed at the sidecar (README)."
        )
        return 1 if failed else 0


def _kv(values: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(values.items())) or "none"
