"""Tracer set-up inside vLLM processes, from the standard ``OTEL_*`` environment.

otelkv builds its own ``TracerProvider`` per process instead of touching the global one:
vLLM sets the global provider itself when ``--otlp-traces-endpoint`` is given, and two
libraries fighting over a process-wide singleton is how spans get lost. Both providers
read the same environment, so with ``--otlp-traces-endpoint`` alone (vLLM exports that
endpoint to its child processes) otelkv's spans go where vLLM's go.

Endpoint: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``.
Without either, tracing is off (spans are non-recording, metrics still flow).
Protocol: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``;
unset, otelkv uses ``grpc`` when vLLM's ``--otlp-traces-endpoint`` is set (vLLM's own
default, so one endpoint serves both) and ``http/protobuf`` (the OTLP default) otherwise.
Batching and queue bounds: the standard ``OTEL_BSP_*`` variables; a full queue drops the
oldest spans, it never blocks the engine.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

from opentelemetry import trace

from otelkv import __version__, names

logger = logging.getLogger("vllm.otelkv")

_lock = threading.Lock()
_tracers: dict[tuple[str, str, str], trace.Tracer] = {}
_providers: list[Any] = []


def traces_endpoint(environ: dict[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def traces_protocol(vllm_endpoint: str | None, environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    explicit = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if explicit:
        return explicit.strip()
    return "grpc" if vllm_endpoint else "http/protobuf"


def _exporter(protocol: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = traces_endpoint()
        return OTLPSpanExporter(endpoint=endpoint, insecure=not str(endpoint).startswith("https"))
    if protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if endpoint:
            return OTLPSpanExporter(endpoint=endpoint)
        return OTLPSpanExporter()  # derives .../v1/traces from OTEL_EXPORTER_OTLP_ENDPOINT
    raise ValueError(f"unsupported OTLP traces protocol {protocol!r} (use grpc or http/protobuf)")


def get_tracer(
    *, process_kind: str, engine_id: str, role: str, vllm_endpoint: str | None, enabled: bool
) -> trace.Tracer:
    """Return this process's otelkv tracer, creating the provider on first use.

    Never raises: a broken exporter configuration is logged once and tracing stays off.
    """
    key = (process_kind, engine_id, role)
    with _lock:
        if key in _tracers:
            return _tracers[key]
        tracer = trace.NoOpTracer()
        if enabled and traces_endpoint():
            try:
                tracer = _build_tracer(process_kind, engine_id, role, vllm_endpoint)
            except Exception:
                logger.warning("otelkv: trace export disabled, exporter set-up failed", exc_info=True)
        _tracers[key] = tracer
        return tracer


def _build_tracer(process_kind: str, engine_id: str, role: str, vllm_endpoint: str | None) -> trace.Tracer:
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = traces_protocol(vllm_endpoint)
    attrs: dict[str, Any] = {
        names.RESOURCE_PROCESS_KIND: process_kind,
        names.ENGINE_ID: engine_id,
        names.ROLE: role,
        "process.pid": os.getpid(),
    }
    operator_named = os.environ.get("OTEL_SERVICE_NAME") or (
        "service.name" in OTELResourceDetector().detect().attributes
    )
    if not operator_named:
        attrs["service.name"] = f"vllm-{role}" if role != names.ROLE_UNIFIED else "vllm"
    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME itself.
    resource = Resource.create(attrs)
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(_exporter(protocol)))
    atexit.register(provider.shutdown)
    _providers.append(provider)
    logger.info(
        "otelkv: exporting %s spans of engine %s over OTLP %s to %s",
        process_kind,
        engine_id,
        protocol,
        traces_endpoint(),
    )
    return provider.get_tracer(names.SCOPE_ENGINE, __version__)


def force_flush(timeout_ms: int = 5000) -> None:
    """Export what is queued now (engine shutdown does this too, through atexit)."""
    with _lock:
        providers = list(_providers)
    for provider in providers:
        provider.force_flush(timeout_ms)


def reset_for_tests() -> None:
    """Forget cached tracers (unit tests build several connectors in one process)."""
    with _lock:
        providers = list(_providers)
        _tracers.clear()
        _providers.clear()
    for provider in providers:
        provider.shutdown()
