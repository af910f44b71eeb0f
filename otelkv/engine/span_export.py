"""Getting spans out of vLLM's EngineCore without spending its CPU on them.

Building an OpenTelemetry SDK span and encoding it to OTLP costs 100-300 us of Python per
span, on the process that runs vLLM's scheduler loop (the exporter thread shares its
GIL). So the engine only records: one flat tuple per span (:class:`FinishedSpan`, ids
included) goes into a bounded queue; a daemon thread writes batches into a pipe; a
separate exporter process (``python -m otelkv.engine.exporter_process``, started once per
engine) builds the SDK spans and exports them with the standard OTLP exporter and
``OTEL_*`` settings. When the exporter process falls behind or is gone, records are
dropped and counted, never waited for: the engine does not block on telemetry.

Ids come from a generator seeded from ``os.urandom`` per process: vLLM seeds Python's
global ``random`` identically in every engine, which would make ids from different
engines collide, and ``os.urandom`` per id costs a system call.

Batches cross the pipe as ``marshal`` data (records hold only str, int, float, bool and
dicts of them): about three times cheaper than pickle, on the engine's side.
"""

from __future__ import annotations

import logging
import marshal
import os
import random
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

from opentelemetry.trace import SpanKind, StatusCode

logger = logging.getLogger("vllm.otelkv")

QUEUE_CAPACITY = 16384
"""Span records kept while the exporter process catches up; beyond it the oldest go."""
BATCH_INTERVAL_S = 0.2


class FinishedSpan(NamedTuple):
    """Everything needed to rebuild one finished span in another process."""

    name: str
    trace_id: int
    span_id: int
    parent_span_id: int  # 0: a root span
    parent_remote: bool
    trace_flags: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int = StatusCode.UNSET.value
    status_message: str | None = None
    kind: int = SpanKind.INTERNAL.value


_ids = random.Random(os.urandom(32))


def new_span_id() -> int:
    return _ids.getrandbits(64) or 1


def new_trace_id() -> int:
    return _ids.getrandbits(128) or 1


# ------------------------------------------------------------------ building SDK spans


def build_spans(records: Sequence[FinishedSpan], resource: Any, scope: Any) -> list[Any]:
    """SDK ``ReadableSpan`` objects for OTLP exporters (parent-based sampling applied)."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, Status, TraceFlags

    spans = []
    for r in records:
        if not r.trace_flags & 0x01:
            continue  # the caller's trace is not sampled: neither is ours
        flags = TraceFlags(r.trace_flags)
        context = SpanContext(r.trace_id, r.span_id, is_remote=False, trace_flags=flags)
        parent = (
            SpanContext(r.trace_id, r.parent_span_id, is_remote=r.parent_remote, trace_flags=flags)
            if r.parent_span_id
            else None
        )
        spans.append(
            ReadableSpan(
                name=r.name,
                context=context,
                parent=parent,
                resource=resource,
                attributes=r.attributes,
                kind=SpanKind(r.kind),
                status=Status(StatusCode(r.status_code), r.status_message),
                start_time=r.start_ns,
                end_time=r.end_ns,
                instrumentation_scope=scope,
            )
        )
    return spans


class InProcessWriter:
    """Exports records from the calling process (tests, tools); not for engines."""

    enabled = True

    def __init__(self, exporter: Any, resource: Any = None, scope: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self._exporter = exporter
        self._resource = resource or Resource.create({})
        self._scope = scope or InstrumentationScope("otelkv.engine")
        self.dropped = 0

    def emit(self, record: FinishedSpan) -> None:
        self._exporter.export(build_spans([record], self._resource, self._scope))


class NullWriter:
    """Tracing off: the observer skips building span records altogether."""

    enabled = False
    dropped = 0

    def emit(self, record: FinishedSpan) -> None:
        return


# ------------------------------------------------------------------ engine side


class ProcessWriter:
    """Queues records and ships them, in marshalled batches, to the exporter process."""

    enabled = True

    def __init__(self, resource_attributes: dict[str, Any], capacity: int = QUEUE_CAPACITY) -> None:
        self._queue: deque[FinishedSpan] = deque()
        self._capacity = capacity
        self._wake = threading.Event()
        self.dropped = 0
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "otelkv.engine.exporter_process"],
            stdin=subprocess.PIPE,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=False,
            close_fds=True,
        )
        assert self._proc.stdin is not None
        self._pipe = self._proc.stdin
        self._send(marshal.dumps(("resource", _plain(resource_attributes))))
        self._thread = threading.Thread(target=self._run, name="otelkv-span-shipper", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int:
        """The exporter process."""
        return self._proc.pid

    def emit(self, record: FinishedSpan) -> None:
        if len(self._queue) >= self._capacity:
            self.dropped += 1
            return
        self._queue.append(record)

    def _send(self, payload: bytes) -> None:
        self._pipe.write(len(payload).to_bytes(4, "big") + payload)
        self._pipe.flush()

    def _run(self) -> None:
        while True:
            self._wake.wait(BATCH_INTERVAL_S)
            self._wake.clear()
            if not self._queue:
                continue
            batch = []
            while self._queue and len(batch) < 2048:
                batch.append(tuple(self._queue.popleft()))
            try:
                self._send(marshal.dumps(("spans", batch)))
            except (BrokenPipeError, OSError, ValueError):
                self.dropped += len(batch) + len(self._queue)
                self._queue.clear()
                self._capacity = 0  # the exporter is gone: count, never queue again
                logger.warning("otelkv: span exporter process exited; spans are dropped from now on")
                return

    def flush(self, timeout_s: float = 5.0) -> None:
        """Hand everything queued to the exporter process (tests, shutdown)."""
        import time

        deadline = time.monotonic() + timeout_s
        while self._queue and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.01)

    def close(self) -> None:
        """Flush, then end the exporter process's input; it exports what it has and exits
        (waited for up to 2 s, so no zombie is left; it dies with its parent anyway)."""
        self.flush()
        try:
            self._pipe.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass


def _plain(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attribute values marshal can carry (str, int, float, bool; anything else as str)."""
    return {str(k): v if isinstance(v, (str, int, float, bool)) else str(v) for k, v in attributes.items()}
