"""otelkv's series must land in vLLM's ``/metrics`` with vLLM's labels, while the inner
connector's metrics keep receiving exactly the payload they would without otelkv.

Each test builds the metrics into its own ``CollectorRegistry`` (through the same
``metric_types`` indirection vLLM uses), so the exposition values are exact and tests do
not collide in the process-wide default registry.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from otelkv import names
from otelkv.engine import prom
from otelkv.engine.prom import OtelKVPromMetrics

BASE = {"model_name": "tiny", "engine": "0"}


class RecordingInner:
    """Stands in for the inner connector's prom-metrics object."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], int]] = []

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.calls.append((transfer_stats_data, engine_idx))


def metric_types(registry: CollectorRegistry) -> dict[type, type]:
    """Prometheus classes that register into ``registry`` instead of the default one."""

    class RCounter(Counter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    class RGauge(Gauge):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    class RHistogram(Histogram):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    return {Counter: RCounter, Gauge: RGauge, Histogram: RHistogram}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def inner() -> RecordingInner:
    return RecordingInner()


@pytest.fixture
def metrics(registry: CollectorRegistry, inner: RecordingInner) -> OtelKVPromMetrics:
    return OtelKVPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        metric_types(registry),
        ["model_name", "engine"],
        {0: ["tiny", "0"], 1: ["tiny", "1"]},
        inner,  # type: ignore[arg-type]
    )


INNER_DATA = {"transfer_duration": [0.01], "bytes_transferred": [4096]}
PAYLOAD: dict[str, Any] = {
    "otelkv": {
        "c": {"otelkv_pull_decisions|pull|pulled": 2},
        "h": {"otelkv_kv_transfer_seconds|D->P|UCX": [0.01, 0.02]},
        "g": {"otelkv_kv_retained_blocks|decode_ttl": 5},
    },
    "inner": INNER_DATA,
}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**BASE, **labels})


def test_every_metric_name_comes_from_names() -> None:
    sidecar = (
        "METRIC_TURN",
        "METRIC_CONVERSATION",
        "METRIC_TRACE_",
        "METRIC_SIDECAR_",
    )  # the sidecar's own /metrics
    declared = {v for k, v in vars(names).items() if k.startswith("METRIC_") and not k.startswith(sidecar)}
    assert set(prom.METRICS) == declared
    assert len(prom.METRICS) == 13


def test_metric_kinds_and_labels() -> None:
    kinds = {name: spec.kind for name, spec in prom.METRICS.items()}
    assert kinds[names.METRIC_TRANSFER_SECONDS] == "histogram"
    assert {n for n, k in kinds.items() if k == "gauge"} == {
        names.METRIC_RETAINED_BLOCKS,
        names.METRIC_RETAINED_BYTES,
    }
    assert prom.METRICS[names.METRIC_PULL_DECISIONS].labels == ("decision", "reason")
    assert prom.METRICS[names.METRIC_TRANSFERS].labels == ("direction", "backend", "outcome")
    assert prom.METRICS[names.METRIC_INSTRUMENTATION_ERRORS].labels == ("site",)


def test_observe_records_exact_values(
    metrics: OtelKVPromMetrics, registry: CollectorRegistry, inner: RecordingInner
) -> None:
    metrics.observe(PAYLOAD, 0)
    assert value(registry, "otelkv_pull_decisions_total", decision="pull", reason="pulled") == 2.0
    hist = {"direction": "D->P", "backend": "UCX"}
    assert value(registry, "otelkv_kv_transfer_seconds_count", **hist) == 2.0
    assert value(registry, "otelkv_kv_transfer_seconds_sum", **hist) == 0.03
    assert value(registry, "otelkv_kv_transfer_seconds_bucket", le="0.005", **hist) == 0.0
    assert value(registry, "otelkv_kv_transfer_seconds_bucket", le="0.01", **hist) == 1.0
    assert value(registry, "otelkv_kv_transfer_seconds_bucket", le="0.025", **hist) == 2.0
    assert value(registry, "otelkv_kv_retained_blocks", kind="decode_ttl") == 5.0
    assert inner.calls == [(INNER_DATA, 0)]
    assert inner.calls[0][0] is INNER_DATA


def test_exposition_text(metrics: OtelKVPromMetrics, registry: CollectorRegistry) -> None:
    metrics.observe(PAYLOAD, 0)
    lines = prometheus_client.generate_latest(registry).decode().splitlines()
    assert (
        'otelkv_pull_decisions_total{decision="pull",engine="0",model_name="tiny",reason="pulled"} 2.0'
        in lines
    )
    assert 'otelkv_kv_retained_blocks{engine="0",kind="decode_ttl",model_name="tiny"} 5.0' in lines
    series = 'backend="UCX",direction="D->P",engine="0"'
    assert f'otelkv_kv_transfer_seconds_count{{{series},model_name="tiny"}} 2.0' in lines
    assert f'otelkv_kv_transfer_seconds_bucket{{{series},le="0.01",model_name="tiny"}} 1.0' in lines
    assert f'otelkv_kv_transfer_seconds_bucket{{{series},le="+Inf",model_name="tiny"}} 2.0' in lines
    text = "\n".join(lines)
    assert "# TYPE otelkv_kv_transfer_seconds histogram" in text
    assert "# TYPE otelkv_kv_retained_blocks gauge" in text
    bucket_lines = [ln for ln in text.splitlines() if ln.startswith("otelkv_kv_transfer_seconds_bucket")]
    assert len(bucket_lines) == len(names.TRANSFER_SECONDS_BUCKETS) + 1  # plus +Inf


def test_counters_accumulate_and_gauges_replace(
    metrics: OtelKVPromMetrics, registry: CollectorRegistry
) -> None:
    metrics.observe(PAYLOAD, 0)
    metrics.observe({"otelkv": {"c": {"otelkv_pull_decisions|pull|pulled": 3}, "g": {}}, "inner": None}, 0)
    metrics.observe({"otelkv": {"g": {"otelkv_kv_retained_blocks|decode_ttl": 1}}}, 0)
    assert value(registry, "otelkv_pull_decisions_total", decision="pull", reason="pulled") == 5.0
    assert value(registry, "otelkv_kv_retained_blocks", kind="decode_ttl") == 1.0


def test_engine_index_selects_label_values(metrics: OtelKVPromMetrics, registry: CollectorRegistry) -> None:
    metrics.observe({"otelkv": {"c": {"otelkv_requests|decode|finished": 4}}}, 1)
    labels = {"model_name": "tiny", "engine": "1", "role": "decode", "outcome": "finished"}
    assert registry.get_sample_value("otelkv_requests_total", labels) == 4.0
    assert registry.get_sample_value("otelkv_requests_total", {**labels, "engine": "0"}) == 0.0


def test_payload_without_otelkv_key_goes_to_inner_as_is(
    metrics: OtelKVPromMetrics, registry: CollectorRegistry, inner: RecordingInner
) -> None:
    foreign = {"transfer_duration": [0.5], "bytes_transferred": [1]}
    metrics.observe(foreign, 1)
    assert inner.calls == [(foreign, 1)]
    assert inner.calls[0][0] is foreign
    assert value(registry, "otelkv_pull_decisions_total", decision="pull", reason="pulled") == 0.0


@pytest.mark.parametrize("inner_data", [None, {}])
def test_empty_inner_part_is_not_forwarded(
    metrics: OtelKVPromMetrics, inner: RecordingInner, inner_data: dict[str, Any] | None
) -> None:
    metrics.observe({"otelkv": {"c": {}, "h": {}, "g": {}}, "inner": inner_data}, 0)
    assert inner.calls == []


def test_no_inner_metrics_object(registry: CollectorRegistry) -> None:
    metrics = OtelKVPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        metric_types(registry),
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
        None,
    )
    metrics.observe({"transfer_duration": [0.5]}, 0)
    metrics.observe(PAYLOAD, 0)
    assert value(registry, "otelkv_kv_retained_blocks", kind="decode_ttl") == 5.0


def test_unknown_metric_names_are_ignored(metrics: OtelKVPromMetrics, registry: CollectorRegistry) -> None:
    metrics.observe(
        {
            "otelkv": {
                "c": {"otelkv_future_counter|x": 1, "otelkv_pull_decisions|recompute|below_threshold": 1},
                "h": {"otelkv_future_hist|x": [1.0]},
                "g": {"otelkv_future_gauge": 3},
            }
        },
        0,
    )
    assert (
        value(registry, "otelkv_pull_decisions_total", decision="recompute", reason="below_threshold") == 1.0
    )
    text = prometheus_client.generate_latest(registry).decode()
    assert "otelkv_future" not in text


def test_malformed_series_is_logged_not_raised(
    metrics: OtelKVPromMetrics, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.otelkv"):
        # One label value where the metric declares two.
        metrics.observe({"otelkv": {"c": {"otelkv_pull_decisions|pull": 1}}}, 0)
    messages = [r.getMessage() for r in caplog.records if r.name == "vllm.otelkv"]
    assert messages == ["otelkv: could not record a metrics payload (logged once)"]
    assert value(registry, "otelkv_pull_decisions_total", decision="pull", reason="pulled") == 0.0


def test_known_series_start_at_zero_on_every_engine(registry: CollectorRegistry) -> None:
    """Before any event, each engine already exposes 0 for the series an expiry, a failed read
    or a failed request will increment, so increase() counts the first one after a start."""
    OtelKVPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        metric_types(registry),
        ["model_name", "engine"],
        {0: ["tiny", "0"], 1: ["tiny", "1"]},
        None,
        backend="UCX",
    )
    for engine in ("0", "1"):
        base = {"model_name": "tiny", "engine": engine}
        assert (
            registry.get_sample_value(
                "otelkv_kv_retentions_total", {**base, "kind": "decode_ttl", "outcome": "expired"}
            )
            == 0.0
        )
        assert (
            registry.get_sample_value(
                "otelkv_requests_total", {**base, "role": "prefill", "outcome": "failed_kv_load"}
            )
            == 0.0
        )
        assert (
            registry.get_sample_value(
                "otelkv_kv_transfers_total",
                {**base, "direction": "D->P", "backend": "UCX", "outcome": "declined_expired"},
            )
            == 0.0
        )
        assert (
            registry.get_sample_value(
                "otelkv_pull_decisions_total", {**base, "decision": "recompute", "reason": "below_threshold"}
            )
            == 0.0
        )
    text = prometheus_client.generate_latest(registry).decode()
    # Only reported pairs: a recompute is never "pulled", and no backend but the configured one.
    assert 'decision="recompute",engine="0",model_name="tiny",reason="pulled"' not in text
    assert 'backend="LIBFABRIC"' not in text
    totals = [ln for ln in text.splitlines() if ln.startswith("otelkv_") and "_created{" not in ln]
    assert totals and all(ln.endswith(" 0.0") for ln in totals)
