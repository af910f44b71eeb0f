"""CPU cost of the instrumented connector's hooks, otelkv on vs off, side by side.

    .venv/bin/python bench/hook_cost.py [--requests 2000] [--repeats 7] [--phases]

Drives the real ``OtelKVConnector`` (scheduler role, as in vLLM's EngineCore) around an
inner connector that does nothing, through the hooks vLLM calls for one P/D request:
arrival, matching (with the continuity check of a decode handle that carries the digest of
``--continuity-tokens`` tokens, which the prompt extends), allocation, a finished KV load
with transfer telemetry, finish with a retention, the retention's release, plus two
engine steps. Spans go the production way:
records to otelkv's exporter process, which builds and OTLP-encodes them and posts them
to a receiver running in another process. The same loop runs with
``otelkv_enabled=false`` (the wrapper forwarding straight through) in alternating
repeats, so machine noise hits both alike.

Each arm runs twice: one request per engine step (an idle engine: every step's own work
is charged to its one request) and ``--batch`` requests per step (a busy engine, where the
per-step hooks are shared). Each step's stats are encoded with vLLM's ``MsgpackEncoder``, as
EngineCore's output thread does in the engine's process.

Prints, per request: the decode side's digest of ``--continuity-tokens`` tokens (what a
decode node adds when a request finishes), then CPU of this process (where vLLM's
scheduler loop would run) for each arm and the difference, of the medians and of each
arm's least run; the exporter process's CPU (off the engine's core); and the difference
as a share of a prefill request's engine time (``--engine-ms``, default 60 ms: the tiny
model's prefill on this CPU; GPU prefills of long prompts take as long or longer). With
``--phases``, also the added CPU of each group of hooks on the scheduler's thread and of
the process's other threads (the span shipper).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.serial_utils import MsgpackEncoder
from vllm.v1.utils import ConstantList

from otelkv import names
from otelkv.engine import continuity, telemetry
from otelkv.engine.connector import OtelKVConnector
from otelkv.engine.messages import OtelKVWorkerMeta, TransferRecord
from tests.unit import fakes

SINK = (
    "import sys, time; from otelkv.fleet.span_sink import SpanSink; s = SpanSink(capacity=1000).start(); "
    "print(s.port, flush=True); sys.stdin.read()"
)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_connector(enabled: bool) -> OtelKVConnector:
    telemetry.reset_for_tests()
    config = fakes.vllm_config({names.CONFIG_ENABLED: enabled})
    return OtelKVConnector(config, KVConnectorRole.SCHEDULER, fakes.kv_cache_config())


HANDLE = fakes.DECODE_HANDLE


class Phases:
    """CPU of the scheduler's thread (this one) per group of hooks, and of the process's other
    threads (the span shipper), summed over runs (``--phases``)."""

    GROUPS = ("arrival", "matching", "allocation", "step", "load", "stats", "finish", "release")

    def __init__(self) -> None:
        self.us: dict[str, float] = dict.fromkeys((*self.GROUPS, "other threads"), 0.0)
        self.requests = 0
        self._last = time.thread_time()

    def start(self) -> None:
        self._last = time.thread_time()

    def mark(self, group: str) -> None:
        """Charge the thread's CPU since the last mark to ``group``."""
        now = time.thread_time()
        self.us[group] += (now - self._last) * 1e6
        self._last = now


def run(
    connector: OtelKVConnector,
    requests: int,
    handle: dict,
    prompt_ids: list[int],
    prompt_hashes: list[bytes],
    batch: int = 1,
    phases: Phases | None = None,
) -> float:
    """Engine-process CPU per request: ``requests`` requests through the hooks, ``batch`` of
    them sharing each engine step (arrivals, matching and allocation, then one step's
    ``build_connector_meta``, the step output reporting every load, the step's stats; then
    every finish, and one step reporting the releases, with its stats), as vLLM's scheduler
    calls them. Each step's stats go through vLLM's msgpack encoder as EngineCore's output
    thread sends them (in the engine's process). ``phases``: also charge each group of hooks
    its CPU (a clock read between groups, in both arms alike)."""
    fakes.RETURNS.update(
        {
            "get_num_new_matched_tokens": (98, True),
            "request_finished_all_groups": (True, None),
            "get_kv_connector_stats": None,
        }
    )
    status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    encoder = MsgpackEncoder()
    # What vLLM's Request carries and the hooks read (a missing attribute would charge them
    # the cost of a failed lookup that never happens in an engine).
    all_ids = ConstantList(list(prompt_ids))
    sampling = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)

    def step_stats() -> None:
        stats = connector.get_kv_connector_stats()
        if stats is not None:
            encoder.encode(stats.to_dict())

    mark = phases.mark if phases is not None else None
    started = time.process_time()
    thread_started = time.thread_time()
    for first in range(0, requests, batch):
        group = []
        for i in range(first, min(first + batch, requests)):
            rid = f"chatcmpl-{i:08x}-12345678"
            group.append(
                SimpleNamespace(
                    request_id=rid,
                    kv_transfer_params=dict(handle),
                    prompt_token_ids=prompt_ids,
                    all_token_ids=all_ids,
                    sampling_params=sampling,
                    block_hashes=prompt_hashes,
                    trace_headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
                    session_id="conv-1",
                    num_prompt_tokens=len(prompt_ids),
                    num_output_tokens=1,
                    status=status,
                )
            )
        if mark:
            phases.start()  # type: ignore[union-attr]
        for request in group:
            connector.on_new_request(request)  # type: ignore[arg-type]
            if mark:
                mark("arrival")
            connector.get_num_new_matched_tokens(request, 32)  # type: ignore[arg-type]
            if mark:
                mark("matching")
            connector.update_state_after_alloc(request, None, 98)  # type: ignore[arg-type]
            if mark:
                mark("allocation")
        connector.build_connector_meta(None)  # type: ignore[arg-type]
        if mark:
            mark("step")
        ids = {request.request_id for request in group}
        transfers = {
            rid: TransferRecord(rid, "ok", bytes=262144, descriptors=2, handles=1, xfer_s=0.01, post_s=0.001)
            for rid in ids
        }
        meta = OtelKVWorkerMeta(transfers=transfers)
        loaded = KVConnectorOutput(finished_recving=ids, kv_connector_worker_meta=meta)
        if mark:
            phases.start()  # type: ignore[union-attr]
        connector.update_connector_output(loaded)
        if mark:
            mark("load")
        step_stats()
        if mark:
            mark("stats")
        for request in group:
            connector.request_finished_all_groups(request, ([1, 2, 3, 4, 5],))  # type: ignore[arg-type]
        if mark:
            mark("finish")
        released = KVConnectorOutput(finished_sending=ids)
        if mark:
            phases.start()  # type: ignore[union-attr]
        connector.update_connector_output(released)
        if mark:
            mark("release")
        step_stats()
        if mark:
            mark("stats")
        # The recording inner connector keeps every call's arguments (for the unit tests):
        # dropped each step, so the heap the garbage collector scans stays an engine's, not
        # a growing list of every request ever made.
        fakes.CALLS.clear()
    telemetry.flush()  # includes marshalling the records into the pipe (a thread of this process)
    process_s = time.process_time() - started
    if phases is not None:
        phases.us["other threads"] += (process_s - (time.thread_time() - thread_started)) * 1e6
        phases.requests += requests
    return process_s / requests * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--engine-ms", type=float, default=60.0, help="engine time of one request (ms)")
    parser.add_argument(
        "--continuity-tokens",
        type=int,
        default=2048,
        help="tokens the decode handle's digest covers (0: none)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=16,
        help="requests sharing each engine step in the loaded arm (a busy engine's batch)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also print each group of hooks' CPU on the scheduler's thread, otelkv on minus off",
    )
    args = parser.parse_args(argv)
    batches = (1, max(args.batch, 1))
    held = list(range(1000, 1000 + args.continuity_tokens))
    prompt_ids = [*held, *range(64)] if held else list(range(150))
    # vLLM's EngineCore hashes every request's blocks whether or not otelkv runs (for prefix
    # caching and for any KV connector): computed here once, outside the timed loops.
    prompt_hashes = fakes.vllm_block_hashes(prompt_ids)
    held_hashes = fakes.vllm_block_hashes(held)
    hashing = fakes.block_hashing()
    handle = dict(HANDLE)
    if held:
        handle.update(
            remote_num_tokens=len(held),
            **{
                names.XARG_CONTINUITY: continuity.digest(
                    held_hashes, held, len(held), len(held) - 64, hashing
                )
            },
        )
    digest_us = []
    for _ in range(args.repeats):
        started = time.process_time()
        for _ in range(200):
            continuity.digest(held_hashes, held, len(held), len(held) - 64, hashing)
        digest_us.append((time.process_time() - started) / 200 * 1e6)

    sink = subprocess.Popen(
        [sys.executable, "-c", SINK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert sink.stdout is not None
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = (
        f"http://127.0.0.1:{sink.stdout.readline().strip()}/v1/traces"
    )
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    on_us: dict[int, list[float]] = {b: [] for b in batches}
    off_us: dict[int, list[float]] = {b: [] for b in batches}
    exporter_us: list[float] = []
    phases = {(enabled, b): Phases() for enabled in (True, False) for b in batches} if args.phases else {}
    try:
        for repeat in range(args.repeats):
            for batch in batches:
                for enabled in (True, False) if repeat % 2 == 0 else (False, True):
                    fakes.reset()
                    connector = make_connector(enabled)
                    # vLLM's EngineCore freezes its startup heap (vllm.utils.gc_utils.freeze_gc_heap)
                    # before serving: without the same here, every collection the hooks' allocations
                    # trigger would scan vLLM's and torch's import-time objects and be charged to otelkv.
                    gc.collect()
                    gc.freeze()
                    writer = connector._sched._writer if connector._sched else None  # type: ignore[union-attr]
                    child = getattr(getattr(writer, "_proc", None), "pid", None)
                    child_before = cpu_seconds(child) if child else 0.0
                    (on_us if enabled else off_us)[batch].append(
                        run(
                            connector,
                            args.requests,
                            handle,
                            prompt_ids,
                            prompt_hashes,
                            batch,
                            phases.get((enabled, batch)),
                        )
                    )
                    if child:
                        time.sleep(1.0)  # let the exporter process finish the last batch
                        exporter_us.append((cpu_seconds(child) - child_before) / args.requests * 1e6)
                    telemetry.reset_for_tests()
                    gc.unfreeze()
    finally:
        sink.kill()
    print(
        f"decode side: digest of {len(held)} tokens when a request finishes "
        f"{statistics.median(digest_us):8.1f} us (median of {args.repeats} x 200)"
    )
    print(
        f"CPU per P/D request through the hooks (median of {args.repeats} x {args.requests} requests; "
        f"3 spans recorded, a {len(held)}-token continuity check):"
    )
    added_serial = 0.0
    for batch in batches:
        on, off = statistics.median(on_us[batch]), statistics.median(off_us[batch])
        added = on - off
        added_serial = added if batch == 1 else added_serial
        label = "one request per engine step" if batch == 1 else f"{batch} requests per engine step"
        print(f"  {label}:")
        print(f"    engine process, otelkv off (pure forwarding) {off:8.1f} us")
        print(f"    engine process, otelkv on                    {on:8.1f} us")
        print(f"    added on the engine's process                {added:8.1f} us per request")
        # Noise on a shared machine only ever adds CPU time (another process's cache misses,
        # a neighbour's turbo budget): the least of each arm is the steadiest estimate of
        # the hooks' own cost, the medians' difference what a busy machine sees.
        least = min(on_us[batch]) - min(off_us[batch])
        print(f"    added, least of each arm                     {least:8.1f} us per request")
    exporter = statistics.median(exporter_us)
    print(f"  otelkv's exporter process (another core)       {exporter:8.1f} us per request")
    for batch in batches if phases else ():
        on_p, off_p = phases[(True, batch)], phases[(False, batch)]
        print(f"  where the added CPU goes, {batch} per step (us per request, on minus off, all repeats):")
        for group in on_p.us:
            added = on_p.us[group] / on_p.requests - off_p.us[group] / off_p.requests
            print(f"    {group:<14} {added:6.1f}")
    share = added_serial / (args.engine_ms * 1000)
    print(
        f"  engine-side share of a {args.engine_ms:g} ms engine request (one per step): "
        f"{share:.4%}  (ratio {1 + share:.5f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
