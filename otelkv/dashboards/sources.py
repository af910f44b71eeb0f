"""The datasources the dashboards read, and the variables that choose them.

Every panel names its datasource through a dashboard variable (``${datasource}``,
``${clickhouse}``, ``${tempo}``), never a fixed uid, so the same JSON works on a Grafana
whose datasources were created by hand under other names. The uids below are the ones
otelkv's provisioning file and ``otelkv dashboards push`` create; a fresh Grafana then
needs no variable to be changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableOption


@dataclass(frozen=True)
class Datasource:
    """One datasource as provisioned: Grafana plugin type, uid, display name, variable."""

    key: str
    """How the command line names it (``--datasource KEY=URL``)."""
    type: str
    uid: str
    name: str
    variable: str
    label: str

    def ref(self) -> DataSourceRef:
        """A panel's datasource: the variable, so users can point it elsewhere."""
        return DataSourceRef(type_val=self.type, uid=f"${{{self.variable}}}")

    def as_json(self) -> dict[str, str]:
        """The same reference as plain JSON (for targets built without the SDK)."""
        return {"type": self.type, "uid": f"${{{self.variable}}}"}

    def variable_builder(self) -> dashboard.DatasourceVariable:
        """A datasource picker preselecting the provisioned datasource."""
        return (
            dashboard.DatasourceVariable(self.variable)
            .label(self.label)
            .type(self.type)
            .current(VariableOption(selected=True, text=self.name, value=self.uid))
        )


PROMETHEUS = Datasource(
    key="prometheus",
    type="prometheus",
    uid="otelkv-prometheus",
    name="otelkv Prometheus",
    variable="datasource",
    label="Prometheus",
)
"""Scrapes every vLLM engine's ``/metrics`` and the sidecar's admin ``/metrics``."""

CLICKHOUSE = Datasource(
    key="clickhouse",
    type="grafana-clickhouse-datasource",
    uid="otelkv-clickhouse",
    name="otelkv ClickHouse",
    variable="clickhouse",
    label="Trace store (ClickHouse)",
)
"""The ``otel_traces`` table: the collector's ClickHouse exporter, or a sidecar-fed ClickHouse."""

TEMPO = Datasource(
    key="tempo",
    type="tempo",
    uid="otelkv-tempo",
    name="otelkv Tempo",
    variable="tempo",
    label="Tempo",
)
"""The same spans in Tempo (the collector exports to both)."""

ALL = (PROMETHEUS, CLICKHOUSE, TEMPO)
BY_KEY = {source.key: source for source in ALL}

TRACES_DATABASE = "otel"
"""The collector ClickHouse exporter's default database (the sidecar's store uses it too)."""
