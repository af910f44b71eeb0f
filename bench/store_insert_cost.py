"""What one embedded-store insert costs, by size: the store's INSERT against the same with
chDB's default analyzer, side by side.

    .venv/bin/python bench/store_insert_cost.py [--sizes 1,10,100,1000,5000,20000] [--repeats 5]

One chDB store (``ChdbStore``, its two materialized views included); synthetic spans
(``store_ingest.py``'s) built as Arrow tables before the clock starts; the tables
truncated before each size. Two arms:

* store: ``ChdbStore.insert_encoded``, the statement every embedded-store insert uses;
* default analyzer: the same statement without ``enable_analyzer = 0``, i.e. what the
  insert costs when ClickHouse analyzes the views' queries with its default analyzer.

The arms take turns insert by insert (``--inserts`` each per repeat, fewer for the largest
sizes), so the store's background merges, which run as in the sidecar, land on both alike.
Merges are not stopped: with them stopped the parts pile up and chDB's background work
over them adds 30-40 ms of system time to every insert, in both arms, which is not what a
running store pays.

Printed per size: the median over ``--repeats`` of the process CPU per insert of each arm
(user + system, chDB's threads included), and the ratio store / default analyzer (the
median of the repeats' ratios). An insert's cost is mostly per insert, not per span: the
sidecar's writer inserts every 5 s (``store_flush_s``) or at 5,000 spans, so below ~1,000
spans a second its inserts are small and this fixed part is what it pays.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from store_ingest import synthetic_spans

from otelkv.store import schema
from otelkv.store.chdb_store import ChdbStore

SETTING = "enable_analyzer = 0"
SETTLE_S = 1.0
"""Pause after truncating, before the clock starts: chDB removes the old parts in the background."""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,10,100,1000,5000,20000", help="spans per insert")
    parser.add_argument(
        "--inserts", type=int, default=20, help="inserts of each arm per repeat (at most 100,000 spans)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        store = ChdbStore(Path(tmp) / "store")
        if SETTING not in store.insert_settings:
            sys.exit(f"this chDB does not take {SETTING!r}: nothing to compare")
        shipped = store._insert_sql
        arms = {
            "store": store.insert_sql(store.insert_settings),
            "default analyzer": store.insert_sql([s for s in store.insert_settings if s != SETTING]),
        }
        if arms["store"] != shipped:
            sys.exit("the store's insert is not insert_sql(insert_settings): this bench is out of date")
        spans = synthetic_spans(max(sizes), time.time_ns() - 3600 * 10**9)
        # A fresh chDB's first few dozen inserts cost up to twice as much (system time: its
        # thread pool and memory growing); neither arm should get them.
        warm = store.encode_spans(spans[:100])
        for arm in (*arms, *arms) * 20:
            store._insert_sql = arms[arm]
            store.insert_encoded(warm)
        print(f"process CPU per insert (user + system), median of {args.repeats}; merges on")
        print(f"  {'spans':>6} {'store':>24} {'default analyzer':>24} {'store / default':>10}")
        for size in sizes:
            inserts = max(1, min(args.inserts, 100_000 // size))
            batch = store.encode_spans(spans[:size])
            user: dict[str, list[float]] = {arm: [] for arm in arms}
            system: dict[str, list[float]] = {arm: [] for arm in arms}
            ratios = []
            for table in (schema.TRACES_TABLE, schema.TRACE_ID_TS_TABLE, schema.INDEX_TABLE):
                store.query(f"TRUNCATE TABLE otel.{table}")
            time.sleep(SETTLE_S)
            for repeat in range(args.repeats):
                spent = {arm: [0.0, 0.0] for arm in arms}
                for i in range(2 * inserts):  # the arms take turns insert by insert
                    arm = list(arms)[(i + repeat) % 2]
                    store._insert_sql = arms[arm]
                    before = resource.getrusage(resource.RUSAGE_SELF)
                    store.insert_encoded(batch)
                    after = resource.getrusage(resource.RUSAGE_SELF)
                    spent[arm][0] += after.ru_utime - before.ru_utime
                    spent[arm][1] += after.ru_stime - before.ru_stime
                for arm, (u, k) in spent.items():
                    user[arm].append(u * 1e3 / inserts)
                    system[arm].append(k * 1e3 / inserts)
                ratios.append(sum(spent["store"]) / sum(spent["default analyzer"]))
            store._insert_sql = shipped
            cells = []
            for arm in arms:
                u, k = statistics.median(user[arm]), statistics.median(system[arm])
                cells.append(f"{u + k:>6.1f} ms ({u:>5.1f} + {k:>5.1f})")
            print(f"  {size:>6} {cells[0]:>24} {cells[1]:>24} {statistics.median(ratios):>10.2f}")
        store.close()


if __name__ == "__main__":
    main()
