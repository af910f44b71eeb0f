"""What every otelkv dashboard shares: identity, time settings, links and variables.

Variables: a datasource picker per datasource the dashboard reads, ``model`` (the served
model, multi-select, "All" = any) and ``engine`` (a Prometheus scrape target, i.e. one vLLM
server). "All" is ``.*`` so a selector stays one short regular expression however many
engines a fleet has.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from urllib.parse import quote

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

from otelkv.dashboards import promql, vllm_metrics
from otelkv.dashboards.sources import PROMETHEUS, Datasource

TAG = "otelkv"
ALL_VALUE = ".*"


def new_dashboard(
    uid: str, title: str, description: str, sources: Sequence[Datasource]
) -> dashboard.Dashboard:
    """A dashboard shell: tags, default range, refresh, links to its siblings, datasource pickers."""
    board = (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags([TAG])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .links(
            [
                dashboard.DashboardLink("otelkv dashboards")
                .type(DashboardLinkType.DASHBOARDS)
                .tags([TAG])
                .as_dropdown(True)
                .include_vars(True)
                .keep_time(True)
            ]
        )
    )
    for source in sources:
        board = board.with_variable(source.variable_builder())
    return board


def _all() -> VariableOption:
    return VariableOption(selected=True, text="All", value="$__all")


def model_variable() -> dashboard.QueryVariable:
    """Served models, from a gauge every vLLM engine exports."""
    return (
        dashboard.QueryVariable(promql.MODEL_VAR)
        .label("Model")
        .datasource(PROMETHEUS.ref())
        .query(promql.label_values(vllm_metrics.NUM_REQUESTS_RUNNING, promql.MODEL_NAME))
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(ALL_VALUE)
        .current(_all())
    )


def engine_variable() -> dashboard.QueryVariable:
    """vLLM servers (scrape targets) serving the selected models."""
    selector = promql.sel(
        vllm_metrics.NUM_REQUESTS_RUNNING, (), f'{promql.MODEL_NAME}=~"${promql.MODEL_VAR}"'
    )
    return (
        dashboard.QueryVariable(promql.ENGINE_VAR)
        .label("Engine")
        .description("A vLLM server, as Prometheus scrapes it (its instance label).")
        .datasource(PROMETHEUS.ref())
        .query(promql.label_values(selector, promql.INSTANCE))
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(ALL_VALUE)
        .current(_all())
    )


def row(panel_id: int, title: str) -> dashboard.Row:
    return dashboard.Row(title).id(panel_id)


AGENT_TURNS_UID = "otelkv-agent-turns"
KV_REUSE_UID = "otelkv-kv-reuse"
CONVERSATION_UID = "otelkv-conversation"
CONVERSATION_VAR = "conversation"


def percentencoded(expression: str) -> str:
    """A Grafana link variable (``${__value.raw}``, ``${__data.fields.x}``, ``${tempo}``) in its
    percent-encoded form (``${__value.raw:percentencode}``): a conversation id may hold ``&``,
    ``#``, ``%`` or spaces, which would otherwise cut or change the link."""
    match = _LINK_VARIABLE.fullmatch(expression)
    if match is None:
        raise ValueError(f"not a Grafana link variable: {expression!r}")
    return f"${{{match.group(1)}:percentencode}}"


_LINK_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_.]*)\}")
TIME_RANGE = "${__url_time_range}"
"""Grafana's own ``from=...&to=...`` for the dashboard's range (already URL-encoded)."""


def conversation_url(conversation: str) -> str:
    """The Conversation dashboard for one conversation, keeping the time range and sources.

    ``conversation`` is a data-link expression such as ``${__value.raw}``; it goes into the
    URL percent-encoded, as do the datasource variables.
    """
    return (
        f"/d/{CONVERSATION_UID}/otelkv-conversation?var-{CONVERSATION_VAR}={percentencoded(conversation)}"
        f"&{TIME_RANGE}&var-clickhouse={percentencoded('${clickhouse}')}"
        f"&var-tempo={percentencoded('${tempo}')}"
    )


def trace_url(trace_id: str) -> str:
    """Tempo in Explore, opened on one trace (``trace_id`` is a data-link expression).

    The ``panes`` parameter is JSON, percent-encoded as Grafana encodes it itself; the
    variables inside it are percent-encoded by Grafana when it fills them in.
    """
    slots = {"TEMPOUID": "${tempo}", "TRACEID": trace_id}
    pane = json.dumps(
        {
            "trace": {
                "datasource": "TEMPOUID",
                "queries": [
                    {
                        "refId": "A",
                        "datasource": {"type": "tempo", "uid": "TEMPOUID"},
                        "queryType": "traceql",
                        "query": "TRACEID",
                    }
                ],
                "range": {"from": "FROMMS", "to": "TOMS"},
            }
        },
        separators=(",", ":"),
    )
    encoded = quote(pane, safe="")
    for slot, variable in slots.items():
        encoded = encoded.replace(slot, percentencoded(variable))
    encoded = encoded.replace("FROMMS", "${__from}").replace("TOMS", "${__to}")
    return f"/explore?schemaVersion=1&panes={encoded}"
