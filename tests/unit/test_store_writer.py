"""BatchWriter against in-memory fake stores (pure logic, no database): bounded queue,
drop counting, surviving store failures, and flushing on close."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from otelkv.spans import SpanRecord
from otelkv.store.writer import DROP_QUEUE_FULL, DROP_STORE_ERROR, BatchWriter


def spans(n: int) -> list[SpanRecord]:
    return [SpanRecord(f"{i:032x}", f"{i:016x}", "", "s", "Internal", 0, 1, {}, {}) for i in range(n)]


class FakeStore:
    database = "otel"

    def __init__(self, fail_first: int = 0, gate: threading.Event | None = None) -> None:
        self.batches: list[int] = []
        self.encoded: list[int] = []
        self.inserted_ids: list[str] = []
        self.fail_first = fail_first
        self.gate = gate
        self.entered = threading.Event()
        """Set once the writer is inside insert_encoded (holding its batch)."""

    def insert_spans(self, batch: Sequence[SpanRecord]) -> int:
        return self.insert_encoded(self.encode_spans(batch))

    def encode_spans(self, batch: Sequence[SpanRecord]) -> list[SpanRecord]:
        self.encoded.append(len(batch))
        return list(batch)

    def insert_encoded(self, batch: list[SpanRecord]) -> int:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail_first > 0:
            self.fail_first -= 1
            raise RuntimeError("disk full")
        self.batches.append(len(batch))
        self.inserted_ids.extend(s.span_id for s in batch)
        return len(batch)

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        return []

    def describe(self) -> str:
        return "fake"

    def close(self) -> None:
        pass


def test_batches_and_close_flushes() -> None:
    store = FakeStore()
    writer = BatchWriter(store, batch_spans=4, flush_interval_s=10.0)
    assert writer.submit(spans(3)) and writer.submit(spans(6)) and writer.submit([])
    assert writer.close(timeout=5)
    assert sum(store.batches) == 9 and max(store.batches) <= 4
    stats = writer.stats()
    assert stats["written"] == 9 and stats["queued"] == 0 and stats["batches"] == len(store.batches)
    assert not writer.submit(spans(1))  # closed: dropped, counted
    assert writer.stats()["dropped_queue_full"] == 1


def test_full_queue_drops_new_spans_and_counts() -> None:
    gate = threading.Event()
    drops: list[tuple[str, int]] = []
    store = FakeStore(gate=gate)
    writer = BatchWriter(
        store,
        max_queue_spans=20,
        batch_spans=10,
        flush_interval_s=0.01,
        on_drop=lambda r, n: drops.append((r, n)),
    )
    assert writer.submit(spans(10))
    assert store.entered.wait(5)  # the writer holds the batch, stuck in the store
    assert writer.submit(spans(10))  # room for it: the bound counts the batch in the store
    assert not writer.submit(spans(5))  # full: the new spans are dropped
    assert writer.stats()["dropped_queue_full"] == 5 and writer.stats()["queued"] == 20
    assert drops == [(DROP_QUEUE_FULL, 5)]
    gate.set()
    assert writer.flush(timeout=5)
    assert writer.stats()["written"] == 20
    writer.close()


def test_the_next_batch_is_encoded_while_one_is_inserted_and_order_holds() -> None:
    gate = threading.Event()
    store = FakeStore(gate=gate)
    writer = BatchWriter(store, batch_spans=4, flush_interval_s=0.01)
    sent = spans(12)
    writer.submit(sent[:4])
    assert store.entered.wait(5)  # the first batch is stuck in the store
    writer.submit(sent[4:])
    deadline = time.monotonic() + 5
    while len(store.encoded) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # time to take a third batch, which it must not: one waits, one is in the store
    assert store.encoded == [4, 4] and store.batches == []  # encoded meanwhile, none inserted
    assert writer.stats()["queued"] == 12  # taken or not, nothing is written yet
    gate.set()
    assert writer.flush(timeout=5)
    assert store.inserted_ids == [s.span_id for s in sent]
    assert writer.stats()["written"] == 12 and writer.stats()["batches"] == 3
    writer.close()


def test_a_backlog_goes_in_larger_batches_up_to_the_cap() -> None:
    """While the store holds one batch, what queues behind it is taken whole (up to
    ``max_batch_spans``) once the inserter is free to take the next: fewer, larger inserts."""
    gate = threading.Event()
    store = FakeStore(gate=gate)
    writer = BatchWriter(store, batch_spans=4, max_batch_spans=10, flush_interval_s=0.01)
    sent = spans(4 + 25)
    writer.submit(sent[:4])
    assert store.entered.wait(5)  # the first batch is stuck in the store
    for i in range(4, len(sent), 5):  # the backlog arrives in small submissions
        writer.submit(sent[i : i + 5])
    gate.set()
    assert writer.flush(timeout=5)
    assert store.batches[0] == 4 and max(store.batches) == 10 and sum(store.batches) == 29
    assert len(store.batches) <= 1 + 4  # not one insert per submission
    assert store.inserted_ids == [s.span_id for s in sent]
    writer.close()


def test_a_backlog_goes_in_the_largest_inserts_the_store_declares() -> None:
    """Unless the caller says, ``max_batch_spans`` is the store's ``largest_insert_spans``
    (never below ``batch_spans``); a store that declares none keeps ``batch_spans``."""

    class Declaring(FakeStore):
        largest_insert_spans: int | None = 40

    for declared, given, expected in ((40, None, 40), (40, 12, 12), (3, None, 10), (None, None, 10)):
        store = Declaring()
        store.largest_insert_spans = declared
        writer = BatchWriter(store, batch_spans=10, max_batch_spans=given)
        assert writer.max_batch_spans == expected, (declared, given)
        writer.close()
    writer = BatchWriter(FakeStore(), batch_spans=10)
    assert writer.max_batch_spans == 10
    writer.close()


def test_max_batch_spans_below_batch_spans_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch_spans"):
        BatchWriter(FakeStore(), batch_spans=10, max_batch_spans=5)


def test_store_errors_are_counted_and_writer_goes_on(caplog: Any) -> None:
    drops: list[tuple[str, int]] = []
    store = FakeStore(fail_first=2)
    writer = BatchWriter(
        store, batch_spans=3, flush_interval_s=0.01, on_drop=lambda r, n: drops.append((r, n))
    )
    writer.submit(spans(3))
    assert writer.flush(timeout=5)
    writer.submit(spans(3))
    assert writer.flush(timeout=5)
    writer.submit(spans(2))
    assert writer.flush(timeout=5)
    stats = writer.stats()
    assert stats["dropped_store_error"] == 6 and stats["written"] == 2
    assert drops == [(DROP_STORE_ERROR, 3), (DROP_STORE_ERROR, 3)]
    assert sum("disk full" in r.getMessage() for r in caplog.records) == 1  # once a minute
    writer.close()


def test_submit_never_blocks_on_a_stuck_store() -> None:
    gate = threading.Event()
    writer = BatchWriter(FakeStore(gate=gate), max_queue_spans=100, batch_spans=10, flush_interval_s=0.01)
    start = time.perf_counter()
    for _ in range(1000):
        writer.submit(spans(1))
    assert time.perf_counter() - start < 1.0
    assert writer.stats()["dropped_queue_full"] >= 890
    gate.set()
    writer.close(timeout=5)


def test_bad_on_drop_callback_is_ignored() -> None:
    def boom(reason: str, n: int) -> None:
        raise ValueError("metrics broke")

    writer = BatchWriter(FakeStore(), max_queue_spans=1, on_drop=boom)
    assert not writer.submit(spans(2))
    writer.close()


def test_a_batch_that_cannot_be_encoded_is_dropped_and_counted() -> None:
    class BadFirstBatch(FakeStore):
        def encode_spans(self, batch: Sequence[SpanRecord]) -> list[SpanRecord]:
            if not self.encoded:
                self.encoded.append(0)
                raise ValueError("not encodable")
            return super().encode_spans(batch)

    drops: list[tuple[str, int]] = []
    store = BadFirstBatch()
    writer = BatchWriter(
        store, batch_spans=3, flush_interval_s=0.01, on_drop=lambda r, n: drops.append((r, n))
    )
    writer.submit(spans(3))
    assert writer.flush(timeout=5)
    writer.submit(spans(2))
    assert writer.flush(timeout=5)
    assert drops == [(DROP_STORE_ERROR, 3)] and store.batches == [2]
    assert writer.stats() == {**writer.stats(), "written": 2, "dropped_store_error": 3, "queued": 0}
    writer.close()


def test_batches_fill_while_the_previous_one_is_inserted() -> None:
    """The inserter's wake-ups do not make the encoder take a batch before it is full or due."""

    class SlowStore(FakeStore):
        def insert_encoded(self, batch: list[SpanRecord]) -> int:
            time.sleep(0.05)
            return super().insert_encoded(batch)

    store = SlowStore()
    writer = BatchWriter(store, batch_spans=1000, flush_interval_s=0.5)
    started = time.monotonic()
    while time.monotonic() - started < 1.2:
        writer.submit(spans(10))
        time.sleep(0.01)
    assert writer.flush(timeout=5)
    writer.close()
    # About 1.2 s of spans at one batch per 0.5 s, plus the flush's: not one per insert.
    assert len(store.batches) <= 5, store.batches


def test_a_flush_waiting_for_a_batch_in_the_store_does_not_spin_the_encoder() -> None:
    """While a flush waits for the batch in the store and nothing is queued, the encoder
    sleeps: it takes (empty) batches about once per flush interval, not in a loop."""
    gate = threading.Event()
    store = FakeStore(gate=gate)
    writer = BatchWriter(store, batch_spans=4, flush_interval_s=0.1)
    takes = 0
    take = writer._take

    def counting_take() -> list[SpanRecord]:
        nonlocal takes
        takes += 1
        return take()

    writer._take = counting_take  # type: ignore[method-assign]
    writer.submit(spans(4))
    assert store.entered.wait(5)
    flushed = threading.Thread(target=writer.flush, kwargs={"timeout": 5})
    flushed.start()
    time.sleep(0.5)
    gate.set()
    flushed.join(5)
    assert store.batches == [4]
    assert takes <= 10, takes  # ~0.5 s at one take per 0.1 s interval, not thousands
    writer.close()


def test_a_flush_under_a_steady_stream_returns_once_its_own_spans_are_in() -> None:
    """Spans keep arriving while the store takes its time over each insert, so there is
    always a batch queued or in the store: a flush still returns, with every span
    submitted before it written."""

    class SlowStore(FakeStore):
        def insert_encoded(self, batch: list[SpanRecord]) -> int:
            time.sleep(0.05)
            return super().insert_encoded(batch)

    store = SlowStore()
    writer = BatchWriter(store, batch_spans=20, max_batch_spans=400, flush_interval_s=10.0)
    submitted: list[str] = []
    stop = threading.Event()

    def produce() -> None:
        n = 0
        while not stop.is_set():
            batch = [
                SpanRecord(f"{n + i:032x}", f"{n + i:016x}", "", "s", "Internal", 0, 1, {}, {})
                for i in range(5)
            ]
            n += 5
            writer.submit(batch)
            submitted.extend(s.span_id for s in batch)
            time.sleep(0.002)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        time.sleep(0.3)
        before = list(submitted)
        started = time.monotonic()
        assert writer.flush(timeout=10)
        waited = time.monotonic() - started
        assert set(before) <= set(store.inserted_ids)
        assert writer.stats()["queued"] > 0  # the stream went on: the flush did not wait for it
        assert waited < 5, waited
    finally:
        stop.set()
        producer.join()
        writer.close()


def test_a_flush_waits_for_an_earlier_batch_when_a_later_one_fails_first() -> None:
    """Batches settle out of order when one fails to encode while the one before it is in the
    store: a flush that covers only the earlier batch still waits for it."""

    class SecondEncodeFails(FakeStore):
        def encode_spans(self, batch: Sequence[SpanRecord]) -> list[SpanRecord]:
            if len(self.encoded) == 1:
                self.encoded.append(len(batch))
                raise ValueError("unencodable")
            return super().encode_spans(batch)

    gate = threading.Event()
    store = SecondEncodeFails(gate=gate)
    writer = BatchWriter(store, batch_spans=4, flush_interval_s=10.0)
    writer.submit(spans(4))
    assert store.entered.wait(5)  # the first batch is in the store, held there
    done: list[bool] = []
    flushed = threading.Thread(target=lambda: done.append(writer.flush(timeout=10)))
    flushed.start()
    writer.submit(spans(4))  # taken at once (a flush waits), and its encoding fails
    deadline = time.monotonic() + 5
    while writer.stats()["dropped_store_error"] < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.stats()["dropped_store_error"] == 4
    time.sleep(0.2)
    assert flushed.is_alive() and not done  # the first batch is not written yet
    gate.set()
    flushed.join(5)
    assert done == [True] and store.batches == [4]
    writer.close()
