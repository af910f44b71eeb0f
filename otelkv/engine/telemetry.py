"""Where engine spans go, from the standard ``OTEL_*`` environment.

otelkv never touches the global tracer provider (vLLM sets it when
``--otlp-traces-endpoint`` is given); its spans leave through a separate exporter process
(:mod:`otelkv.engine.span_export`) that reads the same environment. With
``--otlp-traces-endpoint`` alone (vLLM exports that endpoint to its child processes)
otelkv's spans therefore go where vLLM's go.

Endpoint: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``.
Without either, tracing is off (no exporter process; metrics still flow).
Protocol: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``;
unset, otelkv uses ``grpc`` when vLLM's ``--otlp-traces-endpoint`` is set (vLLM's own
default, so one endpoint serves both) and ``http/protobuf`` (the OTLP default) otherwise.
Headers, timeouts, certificates: the exporters read their usual ``OTEL_EXPORTER_OTLP_*``
variables themselves.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from otelkv import __version__, names

logger = logging.getLogger("vllm.otelkv")

PROTOCOL_ENV = "OTELKV_EXPORT_PROTOCOL"
"""Set by the engine for its exporter process: the protocol it resolved."""

_lock = threading.Lock()
_writers: dict[tuple[str, str], Any] = {}


def traces_endpoint(environ: dict[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def traces_protocol(vllm_endpoint: str | None, environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    explicit = (
        env.get(PROTOCOL_ENV)
        or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    )
    if explicit:
        return explicit.strip()
    return "grpc" if vllm_endpoint else "http/protobuf"


def make_exporter(protocol: str | None = None) -> Any:
    """An OTLP span exporter for the configured endpoint and protocol."""
    protocol = protocol or traces_protocol(None)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = traces_endpoint()
        return OTLPSpanExporter(endpoint=endpoint, insecure=not str(endpoint).startswith("https"))
    if protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if endpoint:
            return HttpExporter(endpoint=endpoint)
        return HttpExporter()  # derives .../v1/traces from OTEL_EXPORTER_OTLP_ENDPOINT
    raise ValueError(f"unsupported OTLP traces protocol {protocol!r} (use grpc or http/protobuf)")


def resource_attributes(
    *, process_kind: str, engine_id: str, role: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Resource of the engine's spans; ``OTEL_SERVICE_NAME``/``OTEL_RESOURCE_ATTRIBUTES``
    are merged in by the SDK and win over the defaults here."""
    from opentelemetry.sdk.resources import OTELResourceDetector

    attrs: dict[str, Any] = {
        **(extra or {}),
        names.RESOURCE_PROCESS_KIND: process_kind,
        names.ENGINE_ID: engine_id,
        names.ROLE: role,
        "process.pid": os.getpid(),
        "telemetry.sdk.name": "otelkv",
        "telemetry.sdk.version": __version__,
    }
    operator_named = os.environ.get("OTEL_SERVICE_NAME") or (
        "service.name" in OTELResourceDetector().detect().attributes
    )
    if not operator_named:
        attrs["service.name"] = f"vllm-{role}" if role != names.ROLE_UNIFIED else "vllm"
    return attrs


def get_span_writer(
    *,
    process_kind: str,
    engine_id: str,
    role: str,
    vllm_endpoint: str | None,
    enabled: bool,
    resource: dict[str, Any] | None = None,
) -> Any:
    """This process's span writer (one exporter process per engine). Never raises."""
    from otelkv.engine.span_export import NullWriter, ProcessWriter

    key = (process_kind, engine_id)
    with _lock:
        if key in _writers:
            return _writers[key]
        writer: Any = NullWriter()
        endpoint = traces_endpoint()
        if enabled and endpoint:
            try:
                protocol = traces_protocol(vllm_endpoint)
                if protocol not in ("grpc", "http/protobuf", "http"):
                    raise ValueError(f"unsupported OTLP traces protocol {protocol!r}")
                os.environ[PROTOCOL_ENV] = protocol  # read by the exporter process
                attrs = resource_attributes(
                    process_kind=process_kind, engine_id=engine_id, role=role, extra=resource
                )
                writer = ProcessWriter(attrs)
                logger.info(
                    "otelkv: exporting spans of engine %s over OTLP %s to %s", engine_id, protocol, endpoint
                )
            except Exception:
                logger.warning("otelkv: trace export disabled, exporter set-up failed", exc_info=True)
                writer = NullWriter()
        _writers[key] = writer
        return writer


def flush(timeout_s: float = 5.0) -> None:
    """Hand every queued span to the exporter process(es)."""
    with _lock:
        writers = list(_writers.values())
    for writer in writers:
        flush_writer = getattr(writer, "flush", None)
        if flush_writer is not None:
            flush_writer(timeout_s)


def reset_for_tests() -> None:
    """Close and forget writers (unit tests build several connectors in one process)."""
    with _lock:
        writers = list(_writers.values())
        _writers.clear()
    for writer in writers:
        close = getattr(writer, "close", None)
        if close is not None:
            close()
