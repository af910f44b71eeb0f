"""Where every span the sidecar sees goes: metrics, the tool-span index, the store.

Two inputs feed it - the sidecar's own turn spans (built from the proxy process's turn
records) and spans received over OTLP from engines and agents. The store writer's queue
is bounded; a full queue or a failing store drops spans and counts them, and never slows
a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from otelkv.sidecar.metrics import SidecarMetrics
from otelkv.sidecar.tool_spans import ToolSpanIndex
from otelkv.spans import SpanRecord

logger = logging.getLogger("otelkv.sidecar")


class SpanPipeline:
    def __init__(self, metrics: SidecarMetrics, tools: ToolSpanIndex, writer: Any | None) -> None:
        self.metrics = metrics
        self.tools = tools
        self.writer = writer
        """An ``otelkv.store.writer.BatchWriter`` or None (no store: metrics only)."""
        self.taps: list[Callable[[Sequence[SpanRecord]], Any]] = []
        """Extra consumers of every accepted batch (the reference fleet's in-memory sink)."""

    def accept(self, spans: Sequence[SpanRecord], source: str) -> None:
        if not spans:
            return
        try:
            self.metrics.observe_spans(spans)
            self.tools.add(spans)
        except Exception:  # observation must not lose the spans
            logger.exception("otelkv sidecar: could not observe spans")
        if self.writer is not None:
            if self.writer.submit(spans):
                self.metrics.received.labels(source).inc(len(spans))
            else:
                self.metrics.dropped.labels("queue_full").inc(len(spans))
        # Taps last: a span a tap has seen is already in the writer's queue, so a flush after
        # it finds it (the reference fleet's tests wait on the tap, then flush and query).
        try:
            for tap in self.taps:
                tap(spans)
        except Exception:
            logger.exception("otelkv sidecar: a span tap failed")
