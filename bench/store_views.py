"""What the span index's materialized view adds to an embedded-store insert, side by side.

    .venv/bin/python bench/store_views.py [--spans 50000] [--batches 500,5000] [--repeats 3]

One chDB store; the same ``--spans`` synthetic spans (``store_ingest.py``'s), cut into
batches of each ``--batches`` size and built as Arrow tables before the clock starts, are
inserted with ``ChdbStore.insert_encoded`` with the span index's view and without it
(the collector's own trace-id view stays in both), arms alternating, each from empty
tables, merges stopped (they would land in whichever arm runs next). Printed per batch
size: the median over ``--repeats`` of the process CPU per insert (chDB's threads
included) in each arm, and what the view adds per insert and per span. The sidecar's
writer inserts every 5 s or at 5,000 spans: 500 spans an insert is 100 spans a second.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--spans", type=int, default=50_000)
    parser.add_argument("--batches", default="500,5000", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    view = next(s for s in schema.create_statements() if f"EXISTS `otel`.`{schema.INDEX_MV}`" in s)
    print(f"{args.spans:,} spans, median of {args.repeats}, process CPU per insert")
    print(f"  {'batch':>6} {'with view':>12} {'without':>12} {'view adds':>12} {'per span':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        store = ChdbStore(Path(tmp) / "store")
        store.query("SYSTEM STOP MERGES")
        spans = synthetic_spans(args.spans, time.time_ns() - 3600 * 10**9)
        for size in [int(b) for b in args.batches.split(",")]:
            batches = [store.encode_spans(spans[i : i + size]) for i in range(0, len(spans), size)]
            ms: dict[bool, list[float]] = {True: [], False: []}
            for repeat in range(args.repeats):
                for with_view in (repeat % 2 == 0, repeat % 2 == 1):
                    store.query(f"DROP VIEW IF EXISTS otel.{schema.INDEX_MV}")
                    if with_view:
                        store.query(view)
                    for table in (schema.TRACES_TABLE, schema.TRACE_ID_TS_TABLE, schema.INDEX_TABLE):
                        store.query(f"TRUNCATE TABLE otel.{table}")
                    cpu = time.process_time()
                    for batch in batches:
                        store.insert_encoded(batch)
                    ms[with_view].append((time.process_time() - cpu) * 1e3 / len(batches))
            with_ms, without_ms = statistics.median(ms[True]), statistics.median(ms[False])
            added = with_ms - without_ms
            print(
                f"  {size:>6} {with_ms:>9.1f} ms {without_ms:>9.1f} ms {added:>9.1f} ms"
                f" {added * 1e3 / size:>7.1f} us"
            )
        store.close()


if __name__ == "__main__":
    main()
