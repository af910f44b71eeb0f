"""What the reference fleet's engines cost the host, started as vLLM starts them and quieted.

    .venv/bin/python bench/fleet_idle.py            # about 5 minutes: two fleets, one after the other
    .venv/bin/python bench/fleet_idle.py --ttl 20 --window 10

For each arm, a fresh reference fleet (real vLLM prefill and decode, NIXL over UCX):
``vllm`` is ``FleetConfig(as_vllm_starts=True)`` (NIXL's progress thread on, both engines'
KV threads on the host's last core), ``quiet`` the fleet's default
(:mod:`otelkv.fleet.engine_hooks`). In each it measures the CPU of every engine process
(``/proc`` times over a window) and how late a 50 ms sleep loop in this process wakes up:

* while the decode node retains the warm-up turn's blocks (vLLM steps its engine core every
  1 ms for the whole TTL then),
* idle, once the TTL has lapsed,

then runs one pulling conversation (6 turns, 0.5 s tool waits) and a TTL lapse, timing
each turn on the client's clock, and reads back from the engines' own spans how many
tokens each turn pulled and how each of its retentions ended (by kind), so the two arms can
be checked for doing the same KV work. It prints one table with both arms and the ratios quiet / vllm.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import psutil

from otelkv import names
from otelkv.fleet.agent import Conversation, Turn
from otelkv.fleet.fleet import Fleet, FleetConfig


def engine_processes(fleet: Fleet) -> dict[str, psutil.Process]:
    found = {}
    for engine in (fleet.prefill, fleet.decode):
        assert engine is not None and engine.pid is not None
        root = psutil.Process(engine.pid)
        for proc in [root, *root.children(recursive=True)]:
            name, cmdline = proc.name(), " ".join(proc.cmdline())
            if proc is root:
                label = "api server"
            elif name.startswith("VLLM::"):
                label = name.removeprefix("VLLM::").lower()
            elif "exporter_process" in cmdline:
                label = "otelkv exporter"
            else:
                continue  # multiprocessing's resource tracker
            found[f"{engine.spec.role} {label}"] = proc
    return found


def window(fleet: Fleet, seconds: float) -> dict[str, float]:
    """Cores used per engine process over ``seconds``, plus the sleep loop's worst lateness."""
    procs = engine_processes(fleet)

    def cpu(p: psutil.Process) -> float:
        t = p.cpu_times()
        return float(t.user + t.system)

    before = {k: cpu(p) for k, p in procs.items()}
    late = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        time.sleep(0.05)
        late.append(time.monotonic() - started - 0.05)
    out = {k: (cpu(p) - before[k]) / seconds for k, p in procs.items()}
    out["all engine processes"] = sum(out.values())
    out["sleep loop lateness max (ms)"] = max(late) * 1000
    return out


def run_arm(as_vllm_starts: bool, ttl: float, seconds: float) -> dict[str, Any]:
    config = FleetConfig(decoder_ttl_s=ttl, router_handle_ttl_s=None, as_vllm_starts=as_vllm_starts)
    with Fleet(config) as fleet:
        warm = time.monotonic()  # the warm-up's last turn just left blocks on the decode node
        retaining = window(fleet, seconds)
        time.sleep(max(0.0, warm + ttl + 3 - time.monotonic()))
        idle = window(fleet, seconds)
        pulls = Conversation(
            "bench-pulls",
            [Turn("what is the weather in paris today", 80)]
            + [Turn(f"and tomorrow in city number {i} please", 64, pause_s=0.5) for i in range(5)],
        )
        lapse = Conversation(
            "bench-lapse",
            [Turn("plan the deploy of the new build", 80), Turn("ok", 16, pause_s=ttl + 2, tool="deploy")],
        )
        results = fleet.driver().run_sync([pulls, lapse])
        time.sleep(3)
        fleet.flush_spans()
        assert fleet.sink is not None
        spans = fleet.sink.spans()
    prefill = [s for s in spans if s.name == names.engine_request_span_name(names.ROLE_PREFILL)]
    pulled = [
        (s.attributes.get(names.GEN_AI_CONVERSATION_ID), s.attributes.get(names.TOKENS_PULLED))
        for s in sorted(prefill, key=lambda s: s.start_ns)
        if s.attributes.get(names.GEN_AI_CONVERSATION_ID, "").startswith("bench-")
    ]
    traces = {t.trace_id for run in results for t in run}
    retentions: dict[str, int] = {}
    for s in spans:
        if s.name.startswith("kv_retention") and s.trace_id in traces:
            key = f"{s.attributes.get(names.RETENTION_KIND)} {s.attributes.get(names.RETENTION_OUTCOME)}"
            retentions[key] = retentions.get(key, 0) + 1
    turns = [t for run in results for t in run]
    pulling = [t.latency_s for t in results[0][1:]]
    return {
        "retaining": retaining,
        "idle": idle,
        "statuses": [t.status for t in turns],
        "pulling turn latency median (s)": statistics.median(pulling),
        "pulling turn latency max (s)": max(pulling),
        "pulled tokens": [n for c, n in pulled if c == "bench-pulls"],
        "retention outcomes": dict(sorted(retentions.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ttl", type=float, default=20.0, help="decoder_kv_blocks_ttl (s)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds per CPU window")
    args = parser.parse_args()
    arms = {}
    for label, as_vllm in (("vllm", True), ("quiet", False)):
        print(f"arm {label}: starting a fleet...", flush=True)
        arms[label] = run_arm(as_vllm, args.ttl, args.window)
    vllm, quiet = arms["vllm"], arms["quiet"]
    print(f"\n{'':44} {'vllm':>8} {'quiet':>8} {'quiet/vllm':>10}")
    for phase in ("retaining", "idle"):
        for key in vllm[phase]:
            a, b = vllm[phase][key], quiet[phase].get(key, float("nan"))
            unit = "" if "ms" in key else " cores"
            ratio = f"{b / a:10.2f}" if a > 0.005 else f"{'-':>10}"
            print(f"{phase + ': ' + key + unit:44} {a:8.2f} {b:8.2f} {ratio}")
    for key in ("pulling turn latency median (s)", "pulling turn latency max (s)"):
        a, b = vllm[key], quiet[key]
        print(f"{key:44} {a:8.2f} {b:8.2f} {b / a:10.2f}")
    for key in ("statuses", "pulled tokens", "retention outcomes"):
        same = "same" if vllm[key] == quiet[key] else "DIFFERENT"
        print(f"{key}: vllm {vllm[key]} / quiet {quiet[key]} ({same})")


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
