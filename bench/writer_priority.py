"""Why the store writer thread keeps its process's CPU priority.

    .venv/bin/python bench/writer_priority.py            # about a minute
    .venv/bin/python bench/writer_priority.py --hogs 3 --rounds 2

The store writer holds the GIL while it builds each batch's Arrow table (Python code; chDB
then inserts it with the GIL released). If the writer
thread is deprioritised (it once ran at nice 10 so that inserts would "yield" to requests)
and the cores are busy, the GIL holder is the thread that cannot get a CPU, and every other
thread of the process waits behind it. This bench measures that side by side in one run:
busy-loop processes keep the cores full, a writer thread inserts 20 batches of 500 spans
into a real chDB store at nice 0 and at nice 10 (alternating rounds), and a ticker thread of
the same process sleeps 10 ms in a loop and records how late it wakes up. It prints the
insert time and the ticker's lateness for each arm and their ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from store_ingest import synthetic_spans

from otelkv.store.chdb_store import ChdbStore

BATCHES = 20
BATCH_SPANS = 500


def run_arm(store: ChdbStore, nice: int, batches: list) -> tuple[float, float, float]:
    """Insert time (s), ticker p99 and max lateness (ms) with the writer at ``nice``."""
    late: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            started = time.monotonic()
            time.sleep(0.01)
            late.append(time.monotonic() - started - 0.01)

    def write() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        for batch in batches:
            store.insert_spans(batch)
            time.sleep(0.05)

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.monotonic()
    writer = threading.Thread(target=write)
    writer.start()
    writer.join()
    elapsed = time.monotonic() - started
    stop.set()
    ticker.join()
    late.sort()
    return elapsed, late[int(len(late) * 0.99)] * 1000, late[-1] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=3, help="busy-loop processes (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per arm, alternating")
    args = parser.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            store = ChdbStore(Path(tmp) / "store")
            t0 = time.time_ns()
            made = 0  # batches built so far: each starts one second after the last
            arms: dict[int, list[tuple[float, float, float]]] = {0: [], 10: []}
            for r in range(args.rounds):
                for nice in (0, 10) if r % 2 == 0 else (10, 0):
                    batches = [synthetic_spans(BATCH_SPANS, t0 + (made + i) * 10**9) for i in range(BATCHES)]
                    made += BATCHES
                    arms[nice].append(run_arm(store, nice, batches))
                    print(
                        f"round {r} writer nice {nice:2d}: {BATCHES} inserts {arms[nice][-1][0]:.2f}s, "
                        f"ticker p99 {arms[nice][-1][1]:.0f} ms max {arms[nice][-1][2]:.0f} ms",
                        flush=True,
                    )
            store.close()
    finally:
        for hog in hogs:
            hog.kill()
    med = {n: [statistics.median(v[i] for v in arms[n]) for i in range(3)] for n in arms}
    print(f"\nwith {args.hogs} busy processes on {os.cpu_count()} cores (medians of {args.rounds} rounds):")
    for i, (what, unit) in enumerate([("insert time", "s"), ("ticker p99", "ms"), ("ticker max", "ms")]):
        low, high = med[0][i], med[10][i]
        print(
            f"  {what:12s} nice 0 {low:.2f}{unit}  nice 10 {high:.2f}{unit}"
            f"  ratio {high / max(low, 1e-3):.2f}"
        )


if __name__ == "__main__":
    main()
