"""``otelkv fleet``: keep a reference fleet running for manual exploration."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def run_fleet(args: argparse.Namespace) -> int:
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
