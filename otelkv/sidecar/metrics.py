"""The sidecar's Prometheus metrics: turn phases, TTFT by turn index, task time, and
fleet-wide KV reuse counted from the engine spans it receives.

Its own registry (not the process-global one) so several sidecars in one process (tests)
do not collide. Label values come only from closed vocabularies; the model name is the
one exception and is capped to the first :data:`MAX_MODELS` seen (then ``other``).
Conversation ids never become labels.

Every counter whose label values are known up front starts at 0 for each of them, and a
model's counters and histograms (task time, phases) start at 0 when the model is first seen:
``increase()`` needs a sample before the first event to count it, or the first expiry, drop,
refusal or finished conversation after a start is invisible.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from otelkv import names
from otelkv.analysis.model import request_compute_rate
from otelkv.analysis.phases import Phases
from otelkv.sidecar.tasks import FinishedTask, TaskClock
from otelkv.spans import SpanRecord, attr_float, attr_str, is_prefill_request, is_retention, is_transfer

MAX_MODELS = 32
MAX_ENGINES = 256
"""Engines whose compute rate is remembered (the rest share one entry)."""
RATE_WINDOW = 64
"""Recent prefill requests per engine whose seconds per computed token are kept."""


def _create(spec: names.Metric, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    labels = list(spec.labels)
    if spec.kind == names.COUNTER:
        return Counter(spec.name, spec.help, labels, registry=registry)
    if spec.kind == names.GAUGE:
        return Gauge(spec.name, spec.help, labels, registry=registry)
    return Histogram(spec.name, spec.help, labels, buckets=spec.buckets, registry=registry)


class SidecarMetrics:
    """The metrics of :data:`otelkv.names.SIDECAR_METRICS`, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        m = {spec.name: _create(spec, self.registry) for spec in names.SIDECAR_METRICS}
        self.phase = m[names.METRIC_TURN_PHASE_SECONDS]
        self.ttft = m[names.METRIC_TURN_TTFT_SECONDS]
        self.gap = m[names.METRIC_TURN_GAP_SECONDS]
        self.turns = m[names.METRIC_TURNS]
        self.prefill_tokens = m[names.METRIC_TRACE_PREFILL_TOKENS]
        self.decisions = m[names.METRIC_TRACE_PULL_DECISIONS]
        self.transfer_bytes = m[names.METRIC_TRACE_TRANSFER_BYTES]
        self.retentions = m[names.METRIC_TRACE_RETENTIONS]
        self.received = m[names.METRIC_SIDECAR_SPANS_RECEIVED]
        self.dropped = m[names.METRIC_SIDECAR_SPANS_DROPPED]
        self.otlp_rejected = m[names.METRIC_SIDECAR_OTLP_REJECTED]
        self.requests_refused = m[names.METRIC_SIDECAR_REQUESTS_REFUSED]
        self.upstream_errors = m[names.METRIC_SIDECAR_UPSTREAM_ERRORS]
        self.upstream_retries = m[names.METRIC_SIDECAR_UPSTREAM_RETRIES]
        self.forward_dropped = m[names.METRIC_SIDECAR_FORWARD_DROPPED]
        self.store_queue = m[names.METRIC_SIDECAR_STORE_QUEUE]
        self.continuity_errors = m[names.METRIC_SIDECAR_CONTINUITY_ERRORS]
        self.conversation = m[names.METRIC_CONVERSATION_SECONDS]
        self.pull_seconds = m[names.METRIC_TRACE_PULL_PREFILL_SECONDS]
        self.tasks = TaskClock()
        self._models: set[str] = set()
        self._rates: dict[str, deque[float]] = {}
        self._rates_lock = threading.Lock()
        """Spans arrive on the OTLP receiver's thread and the proxy channel's."""
        self._turn_series: dict[str, _TurnSeries] = {}
        self._gap_children: dict[str, Any] = {}
        self._initialise()

    def _initialise(self) -> None:
        """Every series with known label values, at 0 (see the module docstring)."""
        for source in names.TOKEN_SOURCES:
            self.prefill_tokens.labels(source)
        for decision, reason in names.PULL_DECISION_REASONS:
            self.decisions.labels(decision, reason)
        for kind in names.RETENTION_KINDS:
            for outcome in names.RETENTION_OUTCOMES:
                self.retentions.labels(kind, outcome)
        for source in names.SPAN_SOURCES:
            self.received.labels(source)
        for reason in names.STORE_DROP_REASONS:
            self.dropped.labels(reason)
        for reason in names.FORWARD_DROP_REASONS:
            self.forward_dropped.labels(reason)
        for reason in names.OTLP_REJECTED_REASONS:
            self.otlp_rejected.labels(reason)
        for reason in names.REQUEST_REFUSED_REASONS:
            self.requests_refused.labels(reason)

    def model_label(self, model: str) -> str:
        if model in self._models:
            return model
        if len(self._models) < MAX_MODELS and model:
            self._models.add(model)
            self._initialise_model(model)
            return model
        if "other" not in self._models:
            self._models.add("other")
            self._initialise_model("other")
        return "other"

    def _initialise_model(self, label: str) -> None:
        for status in names.TURN_STATUSES:
            for stream in ("true", "false"):
                self.turns.labels(label, status, stream)
        for part in names.PULL_PARTS:
            self.pull_seconds.labels(part, label)
        for phase in names.PHASES:
            self.phase.labels(phase, label)
        self.conversation.labels(label)  # conversations end long after their model's first turn

    def observe_turn(
        self,
        *,
        model: str,
        phases: Phases,
        ttft_s: float | None,
        turn_index: int,
        ok: bool,
        stream: bool,
        conversation_id: str | None = None,
        start_ns: int = 0,
        end_ns: int = 0,
    ) -> None:
        """One finished turn; with a conversation id it also extends that conversation's task.

        Every turn observes six to eight series: their children are looked up once per label
        values and kept (``labels()`` validates and locks on every call; the children live as
        long as the registry)."""
        label = self.model_label(model)
        if conversation_id:
            self._observe_tasks(self.tasks.turn(conversation_id, label, start_ns, end_ns))
        series = self._turn_series.get(label)
        if series is None:
            series = self._turn_series[label] = _TurnSeries(self, label)
        input_processing, generation, tool_wait, app_work = series.phases
        input_processing.observe(phases.input_processing_s)
        generation.observe(phases.generation_s)
        tool_wait.observe(phases.tool_wait_s)
        app_work.observe(phases.app_work_s)
        if ttft_s is not None:
            series.ttft(turn_index).observe(ttft_s)
        gap_source = phases.gap_source
        if gap_source != names.GAP_SOURCE_NONE:
            gap = self._gap_children.get(gap_source)
            if gap is None:
                gap = self._gap_children[gap_source] = self.gap.labels(gap_source)
            gap.observe(phases.tool_wait_s + phases.app_work_s)
        series.turns[bool(ok), bool(stream)].inc()

    def expire_tasks(self, now_ns: int | None = None) -> None:
        """Observe the task time of conversations idle longer than the task clock's idle time."""
        self._observe_tasks(self.tasks.expire(time.time_ns() if now_ns is None else now_ns))

    def _observe_tasks(self, finished: list[FinishedTask]) -> None:
        for task in finished:
            self.conversation.labels(task.model).observe(task.seconds)

    def observe_spans(self, spans: Iterable[SpanRecord]) -> None:
        """Count fleet-wide KV reuse from engine spans as they arrive (vocabulary-checked)."""
        spans = list(spans)
        prefills = [span for span in spans if is_prefill_request(span)]
        for span in prefills:  # this batch's compute rates first: they price its pulls
            self._measure_compute(span)
        for span in prefills:
            self._price_pull(span)
        for span in spans:
            a = span.attributes
            if is_prefill_request(span):
                for source, key in (
                    (names.TOKEN_SOURCE_COMPUTED, names.TOKENS_COMPUTED),
                    (names.TOKEN_SOURCE_LOCAL_CACHE, names.TOKENS_LOCAL_CACHE_HIT),
                    (names.TOKEN_SOURCE_PULLED, names.TOKENS_PULLED),
                ):
                    value = attr_float(a, key)
                    if value > 0:
                        self.prefill_tokens.labels(source).inc(value)
                decision, reason = attr_str(a, names.PULL_DECISION), attr_str(a, names.PULL_REASON)
                if decision in names.PULL_DECISIONS and reason in names.PULL_REASONS:
                    self.decisions.labels(decision, reason).inc()
            elif is_transfer(span):
                direction = attr_str(a, names.TRANSFER_DIRECTION)
                backend = attr_str(a, names.TRANSFER_BACKEND, "unknown")[:16]
                if direction in names.DIRECTIONS:
                    value = attr_float(a, names.TRANSFER_BYTES)
                    if value > 0:
                        self.transfer_bytes.labels(direction, backend).inc(value)
            elif is_retention(span):
                kind, outcome = attr_str(a, names.RETENTION_KIND), attr_str(a, names.RETENTION_OUTCOME)
                if kind in names.RETENTION_KINDS and outcome in names.RETENTION_OUTCOMES:
                    self.retentions.labels(kind, outcome).inc()

    def _measure_compute(self, span: SpanRecord) -> None:
        """Seconds per computed prompt token of one finished prefill request: its span's
        duration minus its wait for remote KV, over the tokens it computed."""
        rate = request_compute_rate(span)
        if rate is None:
            return
        engine = _engine(span)
        with self._rates_lock:
            rates = self._rates.get(engine)
            if rates is None:
                if len(self._rates) >= MAX_ENGINES:
                    engine = ""
                rates = self._rates.setdefault(engine, deque(maxlen=RATE_WINDOW))
            rates.append(rate)

    def _price_pull(self, span: SpanRecord) -> None:
        """A finished pull's two parts: the recompute it avoided (pulled tokens times the
        engine's fastest recent seconds per computed token) and its own wait for the KV."""
        a = span.attributes
        pulled = attr_float(a, names.TOKENS_PULLED)
        if (
            pulled <= 0
            or attr_str(a, names.PULL_DECISION) != names.DECISION_PULL
            or attr_str(a, names.REQUEST_OUTCOME) != names.OUTCOME_FINISHED
        ):
            return
        engine = _engine(span)
        with self._rates_lock:
            rates = self._rates.get(engine if engine in self._rates else "")
            rate = min(rates) if rates else None
        if rate is None:
            return  # no measured prefill on this engine yet: no honest price
        label = self.model_label(attr_str(a, names.GEN_AI_REQUEST_MODEL) or "unknown")
        self.pull_seconds.labels(names.PULL_PART_RECOMPUTE_AVOIDED, label).inc(pulled * rate)
        wait = max(attr_float(a, names.REMOTE_KV_WAIT_SECONDS), 0.0)
        if wait > 0:
            self.pull_seconds.labels(names.PULL_PART_WAIT, label).inc(wait)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _TurnSeries:
    """One model label's turn series (children of :class:`SidecarMetrics`' metrics), in the
    order :meth:`SidecarMetrics.observe_turn` observes them."""

    __slots__ = ("_label", "_metrics", "_ttft", "phases", "turns")

    def __init__(self, metrics: SidecarMetrics, label: str) -> None:
        self._metrics = metrics
        self._label = label
        self.phases = tuple(metrics.phase.labels(phase, label) for phase in names.PHASES)
        self.turns = {
            (ok, stream): metrics.turns.labels(
                label, names.TURN_STATUS_OK if ok else names.TURN_STATUS_ERROR, "true" if stream else "false"
            )
            for ok in (True, False)
            for stream in (True, False)
        }
        self._ttft: dict[str, Any] = {}

    def ttft(self, turn_index: int) -> Any:
        bucket = names.turn_index_bucket(turn_index)
        child = self._ttft.get(bucket)
        if child is None:
            child = self._ttft[bucket] = self._metrics.ttft.labels(bucket, self._label)
        return child


def _engine(span: SpanRecord) -> str:
    return str(span.resource.get(names.ENGINE_ID, "") or "")
