"""Engine spans leave through a real exporter process, configured by OTEL_* variables."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from otelkv import names
from otelkv.engine import telemetry
from otelkv.engine.span_export import FinishedSpan, NullWriter, ProcessWriter, build_spans
from otelkv.fleet.span_sink import SpanSink

TRACE = int("0af7651916cd43dd8448eb211c80319c", 16)
PARENT = int("b7ad6b7169203331", 16)


def record(name: str = "kv_request prefill", *, span_id: int = 0x1111, flags: int = 1) -> FinishedSpan:
    return FinishedSpan(
        name, TRACE, span_id, PARENT, True, flags, 1_000, 2_000, {names.ROLE: "prefill", "n": 3}
    )


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
    assert (
        telemetry.traces_protocol(
            None, {telemetry.PROTOCOL_ENV: "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "http"}
        )
        == "grpc"
    )


def test_no_endpoint_means_no_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    writer = telemetry.get_span_writer(
        process_kind="scheduler", engine_id="e", role="prefill", vllm_endpoint=None, enabled=True
    )
    assert isinstance(writer, NullWriter) and not writer.enabled


def test_spans_reach_the_configured_endpoint_through_the_exporter_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with SpanSink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", sink.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "my-prefill")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
        writer = telemetry.get_span_writer(
            process_kind="scheduler",
            engine_id="prefill-7",
            role="prefill",
            vllm_endpoint=None,
            enabled=True,
            resource={names.KV_CONNECTOR: "NixlPullConnector"},
        )
        assert isinstance(writer, ProcessWriter)
        assert (
            telemetry.get_span_writer(
                process_kind="scheduler",
                engine_id="prefill-7",
                role="prefill",
                vllm_endpoint=None,
                enabled=True,
            )
            is writer
        )  # one exporter process per engine
        writer.emit(record())
        writer.emit(record("kv_transfer D->P", span_id=0x2222))
        telemetry.flush()
        spans = sink.wait_for(lambda got: len(got) == 2, timeout=30)
    by_name = {s.name: s for s in spans}
    request = by_name["kv_request prefill"]
    assert (request.trace_id, request.span_id, request.parent_span_id) == (
        format(TRACE, "032x"),
        "0000000000001111",
        format(PARENT, "016x"),
    )
    assert (request.start_ns, request.end_ns) == (1_000, 2_000)
    assert request.attributes == {names.ROLE: "prefill", "n": 3}
    assert request.scope_name == names.SCOPE_ENGINE
    assert request.resource["service.name"] == "my-prefill"
    assert request.resource["deployment.environment"] == "test"
    assert request.resource[names.ENGINE_ID] == "prefill-7"
    assert request.resource[names.KV_CONNECTOR] == "NixlPullConnector"
    assert request.resource[names.RESOURCE_PROCESS_KIND] == "scheduler"


def test_default_service_name_says_the_role(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    attrs = telemetry.resource_attributes(process_kind="scheduler", engine_id="d", role="decode")
    assert attrs["service.name"] == "vllm-decode"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-operator")
    assert "service.name" not in telemetry.resource_attributes(
        process_kind="scheduler", engine_id="d", role="decode"
    )


def test_unsampled_parent_is_not_exported() -> None:
    assert build_spans([record(flags=0)], None, None) == []
    assert len(build_spans([record(flags=1)], None, None)) == 1


def test_broken_protocol_leaves_tracing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    monkeypatch.delenv(telemetry.PROTOCOL_ENV, raising=False)
    writer = telemetry.get_span_writer(
        process_kind="scheduler", engine_id="e", role="prefill", vllm_endpoint=None, enabled=True
    )
    assert isinstance(writer, NullWriter)


def test_a_dead_exporter_process_costs_drops_not_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    writer = ProcessWriter({}, capacity=100)
    os.kill(writer.pid, signal.SIGKILL)
    exporter = psutil.Process(writer.pid)
    while exporter.status() != psutil.STATUS_ZOMBIE:  # dead; close() reaps it
        time.sleep(0.01)
    started = time.monotonic()
    for i in range(1000):
        writer.emit(record(span_id=i + 1))
        if i % 100 == 0:
            writer.flush(0.05)
    assert time.monotonic() - started < 10
    writer.flush(2.0)
    assert writer.dropped >= 900
    writer.close()
