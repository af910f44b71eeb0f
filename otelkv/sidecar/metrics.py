"""The sidecar's Prometheus metrics: turn phases, TTFT by turn index, and fleet-wide KV
reuse counted from the engine spans it receives.

Its own registry (not the process-global one) so several sidecars in one process (tests)
do not collide. Label values come only from closed vocabularies; the model name is the
one exception and is capped to the first :data:`MAX_MODELS` seen (then ``other``).
Conversation ids never become labels.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from otelkv import names
from otelkv.analysis.phases import Phases
from otelkv.spans import SpanRecord, attr_float, attr_str, is_prefill_request, is_retention, is_transfer

MAX_MODELS = 32


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
        self.forward_dropped = m[names.METRIC_SIDECAR_FORWARD_DROPPED]
        self.store_queue = m[names.METRIC_SIDECAR_STORE_QUEUE]
        self.continuity_errors = m[names.METRIC_SIDECAR_CONTINUITY_ERRORS]
        self._models: set[str] = set()

    def model_label(self, model: str) -> str:
        if model in self._models:
            return model
        if len(self._models) < MAX_MODELS and model:
            self._models.add(model)
            return model
        return "other"

    def observe_turn(
        self, *, model: str, phases: Phases, ttft_s: float | None, turn_index: int, ok: bool, stream: bool
    ) -> None:
        label = self.model_label(model)
        for phase, seconds in phases.as_dict().items():
            self.phase.labels(phase, label).observe(seconds)
        if ttft_s is not None:
            self.ttft.labels(names.turn_index_bucket(turn_index), label).observe(ttft_s)
        if phases.gap_source != names.GAP_SOURCE_NONE:
            self.gap.labels(phases.gap_source).observe(phases.tool_wait_s + phases.app_work_s)
        self.turns.labels(
            label, names.TURN_STATUS_OK if ok else names.TURN_STATUS_ERROR, "true" if stream else "false"
        ).inc()

    def observe_spans(self, spans: Iterable[SpanRecord]) -> None:
        """Count fleet-wide KV reuse from engine spans as they arrive (vocabulary-checked)."""
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

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
