"""Engine trace export follows the standard OTEL_* environment, next to vLLM's tracer."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from otelkv import names
from otelkv.engine import telemetry
from otelkv.fleet.span_sink import SpanSink


def test_endpoint_and_protocol_resolution() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert telemetry.traces_endpoint(env) == "http://collector:4318"
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://traces:4318/v1/traces"
    assert telemetry.traces_endpoint(env) == "http://traces:4318/v1/traces"
    assert telemetry.traces_endpoint({}) is None
    # Unset protocol: follow vLLM (grpc) when its --otlp-traces-endpoint is on, else OTLP's default.
    assert telemetry.traces_protocol("http://collector:4317", {}) == "grpc"
    assert telemetry.traces_protocol(None, {}) == "http/protobuf"
    assert telemetry.traces_protocol("x", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    assert telemetry.traces_protocol(None, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}) == "grpc"


def test_no_endpoint_means_no_op_tracer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    tracer = telemetry.get_tracer(
        process_kind="scheduler", engine_id="e", role="prefill", vllm_endpoint=None, enabled=True
    )
    assert isinstance(tracer, trace.NoOpTracer)


def test_spans_reach_the_configured_otlp_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    with SpanSink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", sink.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "my-prefill")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
        tracer = telemetry.get_tracer(
            process_kind="scheduler", engine_id="prefill-7", role="prefill", vllm_endpoint=None, enabled=True
        )
        assert (
            telemetry.get_tracer(
                process_kind="scheduler",
                engine_id="prefill-7",
                role="prefill",
                vllm_endpoint=None,
                enabled=True,
            )
            is tracer
        )  # one provider per process and role
        tracer.start_span("kv_request prefill").end()
        telemetry.force_flush()
        (span,) = sink.wait_for(lambda spans: len(spans) == 1, timeout=10)
    assert span.name == "kv_request prefill"
    assert span.scope_name == names.SCOPE_ENGINE
    assert span.resource["service.name"] == "my-prefill"
    assert span.resource["deployment.environment"] == "test"
    assert span.resource[names.ENGINE_ID] == "prefill-7"
    assert span.resource[names.RESOURCE_PROCESS_KIND] == "scheduler"


def test_default_service_name_says_the_role(monkeypatch: pytest.MonkeyPatch) -> None:
    with SpanSink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", sink.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
        tracer = telemetry.get_tracer(
            process_kind="worker", engine_id="d", role="decode", vllm_endpoint=None, enabled=True
        )
        tracer.start_span("x").end()
        telemetry.force_flush()
        (span,) = sink.wait_for(lambda spans: len(spans) == 1, timeout=10)
    assert span.resource["service.name"] == "vllm-decode"


def test_broken_exporter_configuration_leaves_tracing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    tracer = telemetry.get_tracer(
        process_kind="scheduler", engine_id="e", role="prefill", vllm_endpoint=None, enabled=True
    )
    assert isinstance(tracer, trace.NoOpTracer)
