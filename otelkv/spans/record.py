"""The span record every layer reads: one span flattened with its resource and scope.

Its fields are the columns of the OpenTelemetry Collector ClickHouse exporter's
``otel_traces`` table, so a span decoded from OTLP, one read back from the store and one
built in a test are the same object. Attribute values are native in memory and strings
once stored; read them with :mod:`otelkv.spans.attrs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpanRecord:
    """One span, flattened with its resource and scope (the shape of ``otel_traces``)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope_name: str = ""
    scope_version: str = ""
    status_code: str = "Unset"
    status_message: str = ""
    trace_state: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)

    @property
    def service_name(self) -> str:
        return str(self.resource.get("service.name", ""))

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9
