"""The sidecar's metrics: fleet-wide KV reuse counted from received engine spans (closed
vocabularies only), per-turn phases, a capped model label, and the documented metric names.
"""

from __future__ import annotations

import re
from typing import Any

from otelkv import names
from otelkv.analysis.phases import Phases
from otelkv.sidecar.metrics import MAX_MODELS, SidecarMetrics
from otelkv.spans import SpanRecord


def _span(name: str, **attrs: Any) -> SpanRecord:
    return SpanRecord("0" * 32, "1" * 16, "", name, "Internal", 0, 1, attrs, {"service.name": "prefill"})


def _value(m: SidecarMetrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _prefill(**attrs: Any) -> SpanRecord:
    return _span("kv_request prefill", **{names.ROLE: names.ROLE_PREFILL, **attrs})


def test_prefill_tokens_by_source_and_decisions() -> None:
    """Prefill spans add their computed / local-cache / pulled tokens and their decision."""
    m = SidecarMetrics()
    m.observe_spans(
        [
            _prefill(
                **{
                    names.TOKENS_COMPUTED: 100,
                    names.TOKENS_LOCAL_CACHE_HIT: "32",  # string numbers (JSON OTLP) count too
                    names.TOKENS_PULLED: 64.0,
                    names.PULL_DECISION: names.DECISION_PULL,
                    names.PULL_REASON: names.REASON_PULLED,
                }
            ),
            _prefill(
                **{
                    names.TOKENS_COMPUTED: 10,
                    names.PULL_DECISION: names.DECISION_RECOMPUTE,
                    names.PULL_REASON: names.REASON_BELOW_THRESHOLD,
                }
            ),
        ]
    )
    tokens = names.METRIC_TRACE_PREFILL_TOKENS + "_total"
    assert _value(m, tokens, source=names.TOKEN_SOURCE_COMPUTED) == 110
    assert _value(m, tokens, source=names.TOKEN_SOURCE_LOCAL_CACHE) == 32
    assert _value(m, tokens, source=names.TOKEN_SOURCE_PULLED) == 64
    decisions = names.METRIC_TRACE_PULL_DECISIONS + "_total"
    assert _value(m, decisions, decision="pull", reason="pulled") == 1
    assert _value(m, decisions, decision="recompute", reason="below_threshold") == 1


def test_out_of_vocabulary_and_bad_values_are_ignored() -> None:
    """Unknown decisions, reasons, directions, kinds, roles and non-numbers add nothing."""
    m = SidecarMetrics()
    m.observe_spans(
        [
            _prefill(**{names.PULL_DECISION: "yolo", names.PULL_REASON: names.REASON_PULLED}),
            _prefill(**{names.PULL_DECISION: names.DECISION_PULL, names.PULL_REASON: "because"}),
            _prefill(
                **{names.TOKENS_COMPUTED: "lots", names.TOKENS_PULLED: -5, names.TOKENS_LOCAL_CACHE_HIT: [1]}
            ),
            _span("kv_request decode", **{names.ROLE: names.ROLE_DECODE, names.TOKENS_COMPUTED: 7}),
            _span("kv_transfer", **{names.TRANSFER_DIRECTION: "sideways", names.TRANSFER_BYTES: 9}),
            _span("kv_retention", **{names.RETENTION_KIND: "forever", names.RETENTION_OUTCOME: "consumed"}),
            _span("kv_retention", **{names.RETENTION_KIND: "decode_ttl", names.RETENTION_OUTCOME: "lost"}),
            _span("something else", **{names.TOKENS_COMPUTED: 5}),
        ]
    )
    text = m.exposition().decode()
    for metric in (
        names.METRIC_TRACE_PREFILL_TOKENS,
        names.METRIC_TRACE_PULL_DECISIONS,
        names.METRIC_TRACE_TRANSFER_BYTES,
        names.METRIC_TRACE_RETENTIONS,
    ):
        samples = [
            line
            for line in text.splitlines()
            if line.startswith(metric + "_total{") and not line.endswith(" 0.0")  # zero series
        ]
        assert samples == [], samples


def test_huge_numbers_do_not_break_observation() -> None:
    """An integer too large for a float (possible from JSON OTLP) is ignored, not fatal."""
    m = SidecarMetrics()
    m.observe_spans([_prefill(**{names.TOKENS_PULLED: 10**400, names.TOKENS_COMPUTED: 3})])
    tokens = names.METRIC_TRACE_PREFILL_TOKENS + "_total"
    assert _value(m, tokens, source=names.TOKEN_SOURCE_COMPUTED) == 3


def test_transfer_bytes_and_retentions() -> None:
    """Transfer spans add bytes by direction and backend; retention spans count outcomes."""
    m = SidecarMetrics()
    m.observe_spans(
        [
            _span(
                "kv_transfer pull",
                **{
                    names.TRANSFER_DIRECTION: names.DIRECTION_D_TO_P,
                    names.TRANSFER_BYTES: 4096,
                    names.TRANSFER_BACKEND: "UCX",
                },
            ),
            _span(
                "kv_transfer", **{names.TRANSFER_DIRECTION: names.DIRECTION_P_TO_D, names.TRANSFER_BYTES: 10}
            ),
            _span(
                "kv_retention",
                **{
                    names.RETENTION_KIND: names.RETENTION_DECODE_TTL,
                    names.RETENTION_OUTCOME: names.RETENTION_EXPIRED,
                },
            ),
        ]
    )
    transfer = names.METRIC_TRACE_TRANSFER_BYTES + "_total"
    assert _value(m, transfer, direction="D->P", backend="UCX") == 4096
    assert _value(m, transfer, direction="P->D", backend="unknown") == 10
    retentions = names.METRIC_TRACE_RETENTIONS + "_total"
    assert _value(m, retentions, kind="decode_ttl", outcome="expired") == 1


def test_model_label_is_capped() -> None:
    """The first MAX_MODELS models get their own label; the rest (and empty) share ``other``."""
    m = SidecarMetrics()
    labels = [m.model_label(f"model-{i}") for i in range(MAX_MODELS + 5)]
    assert labels[:MAX_MODELS] == [f"model-{i}" for i in range(MAX_MODELS)]
    assert set(labels[MAX_MODELS:]) == {"other"}
    assert m.model_label("model-0") == "model-0"
    assert m.model_label("") == "other"


def test_observe_turn_and_exposition_names() -> None:
    """A turn feeds phase, TTFT (bucketed index), gap and turn counters; all names are exposed."""
    m = SidecarMetrics()
    phases = Phases(0.2, 1.0, 3.0, 0.5, names.GAP_SOURCE_MESSAGES, names.TTFT_SOURCE_STREAM)
    m.observe_turn(model="m", phases=phases, ttft_s=0.2, turn_index=5, ok=True, stream=True)
    first = Phases(0.1, 0.0, 0.0, 0.0, names.GAP_SOURCE_NONE, names.TTFT_SOURCE_RESPONSE)
    m.observe_turn(model="m", phases=first, ttft_s=None, turn_index=0, ok=False, stream=False)
    assert _value(m, names.METRIC_TURN_PHASE_SECONDS + "_sum", phase="tool_wait", model_name="m") == 3.0
    assert _value(m, names.METRIC_TURN_TTFT_SECONDS + "_count", turn_index="4-7", model_name="m") == 1
    assert _value(m, names.METRIC_TURN_TTFT_SECONDS + "_count", turn_index="0", model_name="m") == 0
    assert _value(m, names.METRIC_TURN_GAP_SECONDS + "_sum", source="messages") == 3.5
    assert _value(m, names.METRIC_TURN_GAP_SECONDS + "_count", source="none") == 0
    assert _value(m, names.METRIC_TURNS + "_total", model_name="m", status="ok", stream="true") == 1
    assert _value(m, names.METRIC_TURNS + "_total", model_name="m", status="error", stream="false") == 1
    m.upstream_errors.inc()
    m.otlp_rejected.labels(names.REFUSED_MALFORMED).inc()
    m.received.labels("otlp").inc()
    m.dropped.labels("queue_full").inc()
    text = m.exposition().decode()
    for metric in (
        names.METRIC_TURN_PHASE_SECONDS,
        names.METRIC_TURN_TTFT_SECONDS,
        names.METRIC_TURN_GAP_SECONDS,
        names.METRIC_TURNS,
        names.METRIC_TRACE_PREFILL_TOKENS,
        names.METRIC_TRACE_PULL_DECISIONS,
        names.METRIC_TRACE_TRANSFER_BYTES,
        names.METRIC_TRACE_RETENTIONS,
        names.METRIC_SIDECAR_SPANS_RECEIVED,
        names.METRIC_SIDECAR_SPANS_DROPPED,
        names.METRIC_SIDECAR_OTLP_REJECTED,
        names.METRIC_SIDECAR_UPSTREAM_ERRORS,
        names.METRIC_SIDECAR_STORE_QUEUE,
    ):
        assert re.search(rf"^# TYPE {metric}(_total)? ", text, re.M), metric


def test_separate_registries_do_not_collide() -> None:
    """Two sidecars in one process each get their own registry."""
    a, b = SidecarMetrics(), SidecarMetrics()
    a.upstream_errors.inc()
    assert _value(a, names.METRIC_SIDECAR_UPSTREAM_ERRORS + "_total") == 1
    assert _value(b, names.METRIC_SIDECAR_UPSTREAM_ERRORS + "_total") == 0


def test_known_series_start_at_zero() -> None:
    """Series with known label values exist at 0 before the first event (so increase() counts
    it); a model's turn counters appear at 0 when the model is first seen."""
    m = SidecarMetrics()
    assert (
        m.registry.get_sample_value(names.METRIC_SIDECAR_SPANS_DROPPED + "_total", {"reason": "store_error"})
        == 0
    )
    assert (
        m.registry.get_sample_value(
            names.METRIC_SIDECAR_REQUESTS_REFUSED + "_total", {"reason": "headers_too_large"}
        )
        == 0
    )
    assert (
        m.registry.get_sample_value(names.METRIC_SIDECAR_OTLP_REJECTED + "_total", {"reason": "media_type"})
        == 0
    )
    assert (
        m.registry.get_sample_value(
            names.METRIC_TRACE_RETENTIONS + "_total", {"kind": "decode_ttl", "outcome": "expired"}
        )
        == 0
    )
    turns = names.METRIC_TURNS + "_total"
    assert (
        m.registry.get_sample_value(turns, {"model_name": "m", "status": "error", "stream": "true"}) is None
    )
    phases = Phases(0.2, 1.0, 0.0, 0.0, names.GAP_SOURCE_NONE, names.TTFT_SOURCE_STREAM)
    m.observe_turn(model="m", phases=phases, ttft_s=0.2, turn_index=0, ok=True, stream=True)
    assert m.registry.get_sample_value(turns, {"model_name": "m", "status": "error", "stream": "true"}) == 0
    # The model's task-time histogram exists before its first conversation has finished.
    count = names.METRIC_CONVERSATION_SECONDS + "_count"
    assert m.registry.get_sample_value(count, {"model_name": "m"}) == 0


S = 1_000_000_000


def test_task_time_is_first_arrival_to_last_end_once_idle() -> None:
    """A conversation's task time is observed once it has been idle longer than the idle time:
    from its first request's arrival to its last turn's end, whatever happened in between."""
    m = SidecarMetrics()
    phases = Phases(0.1, 0.1, 0.0, 0.0, names.GAP_SOURCE_NONE, names.TTFT_SOURCE_STREAM)
    t0 = 1_000 * S
    for start, end in ((t0, t0 + 2 * S), (t0 + 30 * S, t0 + 31 * S), (t0 + 100 * S, t0 + 104 * S)):
        m.observe_turn(
            model="m",
            phases=phases,
            ttft_s=None,
            turn_index=0,
            ok=True,
            stream=False,
            conversation_id="c1",
            start_ns=start,
            end_ns=end,
        )
    count = names.METRIC_CONVERSATION_SECONDS + "_count"
    m.expire_tasks(t0 + 104 * S + int(names.CONVERSATION_IDLE_SECONDS * S))  # exactly idle: not yet
    assert _value(m, count, model_name="m") == 0
    m.expire_tasks(t0 + 105 * S + int(names.CONVERSATION_IDLE_SECONDS * S))
    assert _value(m, count, model_name="m") == 1
    assert _value(m, names.METRIC_CONVERSATION_SECONDS + "_sum", model_name="m") == 104.0
    m.expire_tasks(t0 + 10_000 * S)  # observed once
    assert _value(m, count, model_name="m") == 1


def test_a_conversation_back_after_the_idle_time_is_a_new_task() -> None:
    m = SidecarMetrics()
    phases = Phases(0.1, 0.1, 0.0, 0.0, names.GAP_SOURCE_NONE, names.TTFT_SOURCE_STREAM)
    late = int((names.CONVERSATION_IDLE_SECONDS + 60) * S)
    for start in (0, 5 * S, 5 * S + late):
        m.observe_turn(
            model="m",
            phases=phases,
            ttft_s=None,
            turn_index=0,
            ok=True,
            stream=False,
            conversation_id="c1",
            start_ns=start,
            end_ns=start + S,
        )
    assert _value(m, names.METRIC_CONVERSATION_SECONDS + "_count", model_name="m") == 1
    assert _value(m, names.METRIC_CONVERSATION_SECONDS + "_sum", model_name="m") == 6.0


def _timed_prefill(engine: str, start_s: float, end_s: float, **attrs: Any) -> SpanRecord:
    return SpanRecord(
        "0" * 32,
        "1" * 16,
        "",
        "kv_request prefill",
        "Internal",
        int(start_s * S),
        int(end_s * S),
        {
            names.ROLE: names.ROLE_PREFILL,
            names.REQUEST_OUTCOME: names.OUTCOME_FINISHED,
            names.GEN_AI_REQUEST_MODEL: "m",
            **attrs,
        },
        {names.ENGINE_ID: engine},
    )


def test_pull_seconds_price_pulled_tokens_at_the_engines_measured_compute_rate() -> None:
    """Recompute avoided = pulled tokens x the engine's fastest recent seconds per computed token
    (span time minus KV wait, over computed tokens); the pull's wait is counted beside it."""
    m = SidecarMetrics()
    m.observe_spans(
        [
            # 200 tokens in 0.4 s: 2 ms per token; 100 tokens in 0.5 s (queued): 5 ms per token.
            _timed_prefill("p1", 0.0, 0.4, **{names.TOKENS_COMPUTED: 200}),
            _timed_prefill("p1", 1.0, 1.5, **{names.TOKENS_COMPUTED: 100}),
            # Too few computed tokens to measure; on another engine with no measurement at all.
            _timed_prefill("p1", 2.0, 3.0, **{names.TOKENS_COMPUTED: 8}),
            _timed_prefill(
                "p2",
                2.0,
                2.2,
                **{
                    names.TOKENS_PULLED: 500,
                    names.PULL_DECISION: names.DECISION_PULL,
                    names.REMOTE_KV_WAIT_SECONDS: 0.1,
                },
            ),
            # A pull of 1000 tokens that waited 0.3 s for them, plus 10 computed tokens.
            _timed_prefill(
                "p1",
                4.0,
                4.5,
                **{
                    names.TOKENS_PULLED: 1000,
                    names.TOKENS_COMPUTED: 10,
                    names.PULL_DECISION: names.DECISION_PULL,
                    names.REMOTE_KV_WAIT_SECONDS: 0.3,
                },
            ),
        ]
    )
    metric = names.METRIC_TRACE_PULL_PREFILL_SECONDS + "_total"
    avoided = _value(m, metric, part=names.PULL_PART_RECOMPUTE_AVOIDED, model_name="m")
    wait = _value(m, metric, part=names.PULL_PART_WAIT, model_name="m")
    assert round(avoided, 9) == 2.0  # 1000 tokens x 2 ms; the p2 pull has no price and is left out
    assert round(wait, 9) == 0.3
