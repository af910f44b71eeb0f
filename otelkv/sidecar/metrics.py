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
from otelkv.sidecar.otlp import SpanRecord

MAX_MODELS = 32


def _num(value: object) -> float:
    if isinstance(value, bool):
        return float(value)
    try:
        if isinstance(value, int | float):
            return float(value)
        return float(str(value))
    except (ValueError, OverflowError):  # OverflowError: an int too large for a float
        return 0.0


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        buckets = names.TURN_SECONDS_BUCKETS
        self.phase = Histogram(
            names.METRIC_TURN_PHASE_SECONDS,
            "Seconds of each agent turn spent in each phase.",
            ["phase", "model"],
            buckets=buckets,
            registry=r,
        )
        self.ttft = Histogram(
            names.METRIC_TURN_TTFT_SECONDS,
            "Time to first token of agent turns, by turn index (bucketed).",
            ["turn_index", "model"],
            buckets=buckets,
            registry=r,
        )
        self.gap = Histogram(
            names.METRIC_TURN_GAP_SECONDS,
            "Gap before a turn (tool wait plus app work), by the evidence used to split it.",
            ["source"],
            buckets=buckets,
            registry=r,
        )
        self.turns = Counter(
            names.METRIC_TURNS, "Turns the sidecar proxied.", ["model", "status", "stream"], registry=r
        )
        self.prefill_tokens = Counter(
            names.METRIC_TRACE_PREFILL_TOKENS,
            "Prompt tokens on prefill nodes by where their KV came from (from engine spans).",
            ["source"],
            registry=r,
        )
        self.decisions = Counter(
            names.METRIC_TRACE_PULL_DECISIONS,
            "Pull-or-recompute decisions on prefill nodes (from engine spans).",
            ["decision", "reason"],
            registry=r,
        )
        self.transfer_bytes = Counter(
            names.METRIC_TRACE_TRANSFER_BYTES,
            "KV bytes read over NIXL (from engine transfer spans).",
            ["direction", "backend"],
            registry=r,
        )
        self.retentions = Counter(
            names.METRIC_TRACE_RETENTIONS,
            "Retentions that ended on decode nodes (from engine spans).",
            ["kind", "outcome"],
            registry=r,
        )
        self.received = Counter(
            names.METRIC_SIDECAR_SPANS_RECEIVED, "Spans accepted for the store.", ["source"], registry=r
        )
        self.dropped = Counter(
            names.METRIC_SIDECAR_SPANS_DROPPED, "Spans that did not reach the store.", ["reason"], registry=r
        )
        self.otlp_rejected = Counter(
            names.METRIC_SIDECAR_OTLP_REJECTED,
            "OTLP exports refused (malformed, too large, media type).",
            registry=r,
        )
        self.requests_refused = Counter(
            names.METRIC_SIDECAR_REQUESTS_REFUSED,
            "Client requests refused by the proxy (malformed, too large, upgrade).",
            registry=r,
        )
        self.upstream_errors = Counter(
            names.METRIC_SIDECAR_UPSTREAM_ERRORS, "Requests the upstream could not answer.", registry=r
        )
        self.forward_dropped = Counter(
            names.METRIC_SIDECAR_FORWARD_DROPPED,
            "Turn spans that did not reach the collector (OTEL_EXPORTER_OTLP_*).",
            ["reason"],
            registry=r,
        )
        self.store_queue = Gauge(
            names.METRIC_SIDECAR_STORE_QUEUE, "Spans waiting for the store writer.", registry=r
        )
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
        self.turns.labels(label, "ok" if ok else "error", "true" if stream else "false").inc()

    def observe_spans(self, spans: Iterable[SpanRecord]) -> None:
        """Count fleet-wide KV reuse from engine spans as they arrive (vocabulary-checked)."""
        for span in spans:
            a = span.attributes
            if span.name.startswith("kv_request") and a.get(names.ROLE) == names.ROLE_PREFILL:
                for source, key in (
                    (names.TOKEN_SOURCE_COMPUTED, names.TOKENS_COMPUTED),
                    (names.TOKEN_SOURCE_LOCAL_CACHE, names.TOKENS_LOCAL_CACHE_HIT),
                    (names.TOKEN_SOURCE_PULLED, names.TOKENS_PULLED),
                ):
                    value = _num(a.get(key, 0))
                    if value > 0:
                        self.prefill_tokens.labels(source).inc(value)
                decision, reason = a.get(names.PULL_DECISION), a.get(names.PULL_REASON)
                if decision in names.PULL_DECISIONS and reason in names.PULL_REASONS:
                    self.decisions.labels(decision, reason).inc()
            elif span.name.startswith("kv_transfer"):
                direction = a.get(names.TRANSFER_DIRECTION)
                backend = str(a.get(names.TRANSFER_BACKEND, "unknown"))[:16]
                if direction in names.DIRECTIONS:
                    value = _num(a.get(names.TRANSFER_BYTES, 0))
                    if value > 0:
                        self.transfer_bytes.labels(direction, backend).inc(value)
            elif span.name.startswith("kv_retention"):
                kind, outcome = a.get(names.RETENTION_KIND), a.get(names.RETENTION_OUTCOME)
                if kind in names.RETENTION_KINDS and outcome in names.RETENTION_OUTCOMES:
                    self.retentions.labels(kind, outcome).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
