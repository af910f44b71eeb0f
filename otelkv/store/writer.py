"""Background batching between span receivers and a trace store.

Requests must never wait for the store: :meth:`BatchWriter.submit` only appends to a
bounded in-memory queue (O(1), never blocks) and two daemon threads drain it in batches,
as a pipeline: the *encoder* takes a batch and encodes it (``store.encode_spans``: the
Arrow table for chDB, the request body for ClickHouse over HTTP) while the *inserter*
writes the previous one (``store.insert_encoded``). Encoding needs the interpreter;
the insert waits on the database with the GIL released, so together they take about
the time of the slower of the two instead of their sum (``bench/store_ingest.py``).

A batch is due when ``batch_spans`` spans are queued, ``flush_interval_s`` has passed
or a caller flushes. The encoder takes it only once the inserter has taken the previous
one, and then takes all that is queued up to ``max_batch_spans``: when the store falls
behind, the backlog goes in fewer, larger inserts. Unless the caller gives it,
``max_batch_spans`` is the largest insert the store declares, never below
``batch_spans`` (``store.largest_insert_spans``: the embedded chDB store's, where an
insert of 20,000 spans costs less per span than four of 5,000), else ``batch_spans``.
At most two batches are out of the queue at once, one being encoded or waiting, one
being inserted; batches are inserted in the order they were taken. When the queue is
full the *new* spans are dropped and counted (what is queued is older and already paid
for); when the store fails (encoding or inserting) the batch is dropped, counted, logged
at most once a minute, and the writer carries on.

The threads keep their process's CPU priority on purpose: a writer at nice 10 (tried)
made every other thread of the process - OTLP receiver, turn spans, and in the reference
fleet the router - wait behind a thread that held the GIL but could not get a CPU.
``bench/writer_priority.py`` (three busy processes on 2 cores, nice 0 vs 10 side by
side): inserts 2.0-3.2x slower, a 10 ms ticker thread of the same process late by
4.2-6x more at p99.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from otelkv.spans import SpanRecord
from otelkv.store.base import TraceStore

log = logging.getLogger(__name__)

DROP_QUEUE_FULL = "queue_full"
DROP_STORE_ERROR = "store_error"
_LOG_EVERY_S = 60.0


class BatchWriter:
    """Bounded, non-blocking span queue drained into a :class:`TraceStore` by two threads."""

    BATCH_SPANS = 5000
    """The default ``batch_spans``: a batch is due once this many spans are queued."""

    def __init__(
        self,
        store: TraceStore,
        *,
        max_queue_spans: int = 100_000,
        batch_spans: int = BATCH_SPANS,
        max_batch_spans: int | None = None,
        flush_interval_s: float = 0.5,
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        if max_queue_spans < 1 or batch_spans < 1:
            raise ValueError("max_queue_spans and batch_spans must be >= 1")
        if max_batch_spans is None:
            max_batch_spans = max(getattr(store, "largest_insert_spans", None) or 0, batch_spans)
        if max_batch_spans < batch_spans:
            raise ValueError("max_batch_spans must be >= batch_spans")
        self.store = store
        self.max_queue_spans = max_queue_spans
        self.batch_spans = batch_spans
        self.max_batch_spans = max_batch_spans
        self.flush_interval_s = flush_interval_s
        self.on_drop = on_drop
        self._queue: deque[Sequence[SpanRecord]] = deque()
        self._queued = 0
        self._in_flight = 0
        self._accepted = 0
        """Spans ever queued: the position in the stream of spans that the next one takes
        (``_accepted - _queued`` is where the next batch taken starts)."""
        self._settled = 0
        """Position before which every span is written or dropped: what :meth:`flush` waits on.
        Batches settle out of order (an encoding failure beside an insert), so it moves only
        over a run of settled batches."""
        self._unsettled: deque[int] = deque()
        """End positions of the batches taken and not yet settled, in the order taken."""
        self._settled_ends: set[int] = set()
        self._written = 0
        self._dropped_full = 0
        self._dropped_error = 0
        self._batches = 0
        self._last_error_log = -_LOG_EVERY_S
        self._cond = threading.Condition()
        self._closing = False
        self._encoded: tuple[Any, int, int] | None = None
        """The batch handed from the encoder to the inserter (encoded form, span count, end
        position)."""
        self._encoder_done = False
        self._flushing = 0
        """Callers waiting in :meth:`flush`: while any is, partial batches go out at once."""
        self._encoder = threading.Thread(target=self._encode_loop, name="otelkv-store-encoder", daemon=True)
        self._inserter = threading.Thread(target=self._insert_loop, name="otelkv-store-writer", daemon=True)
        self._encoder.start()
        self._inserter.start()

    # ------------------------------------------------------------------ producers

    def submit(self, spans: Sequence[SpanRecord]) -> bool:
        """Queue ``spans``; False (and counted as dropped) when the queue is full or closed."""
        n = len(spans)
        if n == 0:
            return True
        with self._cond:
            # The bound counts the batches out of the queue too: all of it is memory held.
            if self._closing or self._queued + self._in_flight + n > self.max_queue_spans:
                self._dropped_full += n
                accepted = False
            else:
                self._queue.append(spans)
                self._queued += n
                self._accepted += n
                accepted = True
                if self._queued >= self.batch_spans or self._flushing:
                    self._cond.notify_all()  # the encoder, not only whichever thread waits
        if not accepted:
            self._report_drop(DROP_QUEUE_FULL, n)
        return accepted

    def flush(self, timeout: float | None = 5.0) -> bool:
        """Wait until everything submitted before this call is written (or dropped); False on
        timeout. Spans submitted meanwhile are not waited for, so a flush under a steady
        stream of spans returns once its own are in (batches are written in order)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            mark = self._accepted
            try:
                while self._settled < mark:
                    if not (self._encoder.is_alive() and self._inserter.is_alive()):
                        return False
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cond.wait(remaining if remaining is None else min(remaining, 0.1))
            finally:
                self._flushing -= 1
        return True

    def close(self, timeout: float | None = 10.0) -> bool:
        """Write what is queued, then stop the threads; later submits are dropped. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in (self._encoder, self._inserter):
            thread.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return not (self._encoder.is_alive() or self._inserter.is_alive())

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "queued": self._queued + self._in_flight,
                "written": self._written,
                "dropped_queue_full": self._dropped_full,
                "dropped_store_error": self._dropped_error,
                "batches": self._batches,
            }

    # ------------------------------------------------------------------ the threads

    def _take(self) -> list[SpanRecord]:
        """Up to ``max_batch_spans`` spans off the queue (whole submissions, split if needed)."""
        batch: list[SpanRecord] = []
        while self._queue and len(batch) < self.max_batch_spans:
            head = self._queue[0]
            room = self.max_batch_spans - len(batch)
            if len(head) <= room:
                self._queue.popleft()
                batch.extend(head)
            else:
                batch.extend(head[:room])
                self._queue[0] = head[room:]
        self._queued -= len(batch)
        self._in_flight += len(batch)
        if batch:
            self._unsettled.append(self._accepted - self._queued)
        return batch

    def _settle(self, end: int, n: int) -> None:
        """The batch of ``n`` spans ending at position ``end`` is written or dropped (lock held)."""
        self._in_flight -= n
        self._settled_ends.add(end)
        while self._unsettled and self._unsettled[0] in self._settled_ends:
            self._settled = self._unsettled.popleft()
            self._settled_ends.discard(self._settled)
        self._cond.notify_all()

    def _encode_loop(self) -> None:
        """Take batches off the queue, encode each, hand it to the inserter (in order)."""
        while True:
            with self._cond:
                # A batch is taken when it is full, asked for (flush, close) or due; the
                # inserter's notifications wake this thread too, and must not cut it short.
                # A flush with nothing queued waits here too (its last batch is in flight).
                due = time.monotonic() + self.flush_interval_s
                while (
                    not self._closing
                    and not (self._flushing and self._queued)
                    and self._queued < self.batch_spans
                ):
                    remaining = due - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if self._closing and not self._queued:
                    self._encoder_done = True
                    self._cond.notify_all()
                    return
                # Take it once the inserter has the previous one: what arrives meanwhile
                # joins this batch instead of waiting behind it.
                while self._encoded is not None:
                    self._cond.wait()
                batch = self._take()
                end = self._accepted - self._queued
            if not batch:
                continue
            try:
                encoded = self.store.encode_spans(batch)
            except Exception as exc:  # noqa: BLE001 - the writer must survive any store failure
                self._failed(len(batch), end, exc)
                continue
            with self._cond:  # the slot is free: only this thread fills it
                self._encoded = (encoded, len(batch), end)
                self._cond.notify_all()

    def _insert_loop(self) -> None:
        """Insert what the encoder hands over, one batch at a time, until it is done."""
        while True:
            with self._cond:
                while self._encoded is None and not self._encoder_done:
                    self._cond.wait()
                if self._encoded is None:
                    return
                (encoded, n, end), self._encoded = self._encoded, None
                self._cond.notify_all()
            try:
                written = self.store.insert_encoded(encoded)
            except Exception as exc:  # noqa: BLE001 - the writer must survive any store failure
                self._failed(n, end, exc)
                continue
            with self._cond:
                self._written += written
                self._batches += 1
                self._settle(end, n)

    def _failed(self, n: int, end: int, exc: Exception) -> None:
        """A batch of ``n`` spans (ending at position ``end``) the store could not take:
        counted, logged once a minute."""
        with self._cond:
            self._dropped_error += n
            self._settle(end, n)
        now = time.monotonic()
        if now - self._last_error_log >= _LOG_EVERY_S:
            self._last_error_log = now
            log.warning(
                "trace store %s rejected %d spans (%s); dropping them and carrying on "
                "(logged at most once a minute)",
                _describe(self.store),
                n,
                exc,
            )
        self._report_drop(DROP_STORE_ERROR, n)

    def _report_drop(self, reason: str, n: int) -> None:
        if self.on_drop is None:
            return
        try:
            self.on_drop(reason, n)
        except Exception:  # a metrics callback must not break the writer
            log.debug("on_drop callback failed", exc_info=True)


def _describe(store: TraceStore) -> str:
    try:
        return store.describe()
    except Exception:  # noqa: BLE001
        return type(store).__name__
