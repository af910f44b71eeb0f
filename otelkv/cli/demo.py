"""``otelkv demo``: a real 1P1D fleet, an agent workload, and what the spans recorded.

The workload has one conversation of each kind that decides whether reverse pull pays
off: quick tool calls (pulls), a tool call longer than the decode TTL (the handle lapses
and prefill recomputes), short answers (below ``kv_recompute_threshold``) and a client
that sends no conversation id (nothing can be reused).
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
from otelkv.analysis.turns import TurnSummary, summarize_turns
from otelkv.cli.render import human_bytes, table


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


def _note(turn: TurnSummary, ttl_s: float) -> str:
    p = turn.prefill
    if p is None:
        return "no prefill span"
    if p.outcome and p.outcome != names.OUTCOME_FINISHED:
        return f"prefill {p.outcome}: {p.status_message}"[:90]
    reason = p.reason
    if reason == names.REASON_PULLED:
        return f"reused {p.pulled} tokens from decode instead of recomputing"
    if reason == names.REASON_BELOW_THRESHOLD:
        return f"only {p.remote_reusable} reusable tokens < threshold: recomputed"
    if reason == names.REASON_NOTHING_BEYOND_LOCAL_HIT:
        return "prefill's own cache already held everything decode had"
    if reason == names.REASON_NO_DECODE_HANDLE:
        if turn.router_handle == names.ROUTER_HANDLE_STALE:
            return f"handle older than the router TTL (decode TTL {ttl_s:g}s): dropped"
        if turn.router_handle == names.ROUTER_HANDLE_NO_CONVERSATION:
            return "no conversation id: the router cannot pair turns"
        if turn.turn_index == 0:
            return "first turn: nothing to reuse yet"
        return "router had no decode handle for this conversation"
    return reason or ""


def _rows(turns: list[TurnSummary], ttl_s: float) -> list[list[Any]]:
    rows = []
    for t in turns:
        p, d = t.prefill, t.decode
        rows.append(
            [
                t.conversation_id or "(none)",
                t.turn_index,
                f"{t.latency_s:.2f}s" if t.latency_s is not None else "-",
                t.router_handle,
                f"{p.decision}/{p.reason}" if p and p.decision else "-",
                p.local_hit if p else None,
                p.pulled if p else None,
                p.computed if p else None,
                human_bytes(p.transfer_bytes) if p and p.transfer_bytes else "-",
                f"{p.transfer_wait_s * 1000:.0f}" if p and p.transfer_wait_s is not None else "-",
                d.retention_outcome if d else "-",
                _note(t, ttl_s),
            ]
        )
    return rows


def run_demo(args: argparse.Namespace) -> int:
    from otelkv.fleet import metrics as prom
    from otelkv.fleet.fleet import WARMUP_CONVERSATION, Fleet, FleetConfig

    ttl = float(args.ttl)
    config = FleetConfig(decoder_ttl_s=ttl, workdir=Path(args.workdir) if args.workdir else None)
    out = sys.stderr if args.json else sys.stdout
    print(
        "otelkv demo: starting a real prefill + decode vLLM pair (CPU build, NixlConnector over UCX,\n"
        f"instrumented by otelkv; decoder_kv_blocks_ttl={ttl:g}s, kv_recompute_threshold="
        f"{config.recompute_threshold}). This takes a minute or two on 2 cores...",
        file=out,
        flush=True,
    )
    started = time.monotonic()
    with Fleet(config) as fleet:
        print(f"fleet ready in {time.monotonic() - started:.0f}s; router at {fleet.url}", file=out)
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
        assert fleet.sink is not None and fleet.prefill is not None and fleet.decode is not None
        spans = fleet.sink.spans()
        p_metrics, d_metrics = fleet.prefill.metrics_text(), fleet.decode.metrics_text()
        spans_path = fleet.workdir / "spans.jsonl"
        with spans_path.open("w") as fh:
            for span in spans:
                fh.write(json.dumps(dataclasses.asdict(span), default=str) + "\n")
        turns = [t for t in summarize_turns(spans) if t.conversation_id != WARMUP_CONVERSATION]
        if args.json:
            json.dump([dataclasses.asdict(t) for t in turns], sys.stdout, indent=2, default=str)
            print()
            return 1 if failed else 0

        print()
        print(
            table(
                [
                    "conversation",
                    "turn",
                    "latency",
                    "router",
                    "prefill decision",
                    "local",
                    "pulled",
                    "computed",
                    "D->P bytes",
                    "pull ms",
                    "kept on D",
                    "why",
                ],
                _rows(turns, ttl),
                right=(1, 5, 6, 7, 8, 9),
            )
        )
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
        print(
            "\nWhere the data is:\n"
            f"  spans (one JSON object per line): {spans_path}\n"
            f"  engine logs: {fleet.prefill.log_path}, {fleet.decode.log_path}\n"
            f"  engines' /metrics (otelkv_* next to vllm:nixl_*) were scraped from {fleet.prefill.url} "
            f"and {fleet.decode.url}\n"
            "On your own fleet, add kv_connector_module_path=otelkv.engine.nixl to the engines' "
            "--kv-transfer-config and point --otlp-traces-endpoint at your collector (README)."
        )
        return 1 if failed else 0


def _kv(values: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(values.items())) or "none"
