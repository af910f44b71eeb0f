"""Every query a dashboard sends, found by walking its JSON the way Grafana reads it.

Panels (also those nested in collapsed rows) and query variables are both queries: a
variable whose query fails leaves every panel that uses it empty. The kind follows the
datasource type of the target (or of its panel, which is what Grafana falls back to).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from otelkv.dashboards.sources import CLICKHOUSE, PROMETHEUS, TEMPO

Kind = Literal["promql", "sql", "traceql", "label_values"]


@dataclass(frozen=True)
class Query:
    """One query text of one dashboard."""

    dashboard: str
    """The dashboard's uid."""
    where: str
    """``panel 9 "Turn time by phase" A`` or ``variable model``: for failure messages."""
    kind: Kind
    text: str
    panel_id: int | None = None
    instant: bool = False

    def __str__(self) -> str:
        return f"{self.dashboard} {self.where}"


def _panels(panels: list[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])


def _kind_of(datasource_type: str | None) -> Kind | None:
    return {PROMETHEUS.type: "promql", CLICKHOUSE.type: "sql", TEMPO.type: "traceql"}.get(
        datasource_type or ""
    )


def queries(board: Mapping[str, Any]) -> list[Query]:
    """All queries of one dashboard, variables first, then panels in layout order."""
    uid = str(board.get("uid", ""))
    out: list[Query] = []
    for variable in (board.get("templating") or {}).get("list") or []:
        if variable.get("type") != "query":
            continue
        kind = _kind_of((variable.get("datasource") or {}).get("type"))
        text = variable.get("query")
        if isinstance(text, Mapping):  # the object form some datasources store
            text = text.get("query") or text.get("rawSql")
        if kind is None or not text:
            raise ValueError(f"{uid}: variable {variable.get('name')} has no query this module understands")
        out.append(
            Query(
                uid, f"variable {variable['name']}", "label_values" if kind == "promql" else kind, str(text)
            )
        )
    for panel in _panels(board.get("panels") or []):
        panel_type = (panel.get("datasource") or {}).get("type")
        for target in panel.get("targets") or []:
            kind = _kind_of((target.get("datasource") or {}).get("type") or panel_type)
            field = {"promql": "expr", "sql": "rawSql", "traceql": "query"}.get(kind or "")
            if field is None or not target.get(field):
                raise ValueError(f"{uid}: panel {panel.get('id')} target {target.get('refId')} has no query")
            out.append(
                Query(
                    uid,
                    f'panel {panel.get("id")} "{panel.get("title")}" {target.get("refId")}',
                    kind,  # type: ignore[arg-type]
                    str(target[field]),
                    panel_id=panel.get("id"),
                    instant=bool(target.get("instant")),
                )
            )
    return out


def all_queries(boards: Mapping[str, Mapping[str, Any]]) -> list[Query]:
    """The queries of every dashboard in ``boards`` (file name -> JSON)."""
    return [query for board in boards.values() for query in queries(board)]


def of_kind(found: list[Query], *kinds: Kind) -> list[Query]:
    return [query for query in found if query.kind in kinds]
