"""*Agent turns*: where agent turn time goes, time to first token by turn, slowest turns.

The turn is the sidecar's (one span and one set of histogram observations per agent
request): its time splits into four phases that add up to the turn - the gap before the
request (``tool_wait``, ``app_work``) and the request itself (``input_processing`` up to
the first token, ``generation`` after it). Prometheus panels read the sidecar's
``otelkv_turn_*`` series; the slowest-turns table reads the turn spans in the trace store
and links each to its trace (Tempo) and its conversation (the Conversation dashboard).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from otelkv import names
from otelkv.dashboards import colours, frame, vllm_metrics
from otelkv.dashboards import promql as q
from otelkv.dashboards import sql as s
from otelkv.dashboards.panels import (
    COUNT,
    PERCENT,
    REQUESTS_PER_SECOND,
    SECONDS,
    PanelBuilder,
    bargauge_panel,
    coloured,
    links,
    prom,
    stat_panel,
    table_panel,
    thresholds,
    timeseries_panel,
    unit_of,
)
from otelkv.dashboards.sources import CLICKHOUSE, PROMETHEUS, TEMPO

UID = frame.AGENT_TURNS_UID
TITLE = "otelkv / Agent turns"

PHASE = names.METRIC_TURN_PHASE_SECONDS
TTFT = names.METRIC_TURN_TTFT_SECONDS
TASK = names.METRIC_CONVERSATION_SECONDS
F = q.SIDECAR_FILTERS

TURN_TIME_LIMITS = thresholds((None, "green"), (10.0, "yellow"), (30.0, "red"))
"""An agent turn (tool wait included) over 10 s is noticeable, over 30 s painful."""
TTFT_LIMITS = thresholds((None, "green"), (1.0, "yellow"), (3.0, "red"))
"""Time to first token: what a user watching a streamed answer waits for."""
TASK_LIMITS = thresholds((None, "green"), (300.0, "yellow"), (1800.0, "red"))
"""Task time: an agent task of more than 5 minutes is felt, of more than half an hour is a
problem worth a look (most of it is usually tool wait, which this panel alone cannot tell)."""


def _turns(*matchers: str) -> str:
    return q.sel(q.counter(names.METRIC_TURNS), F, *matchers)


def _per_turn_mean(by: tuple[str, ...], *matchers: str) -> str:
    """Mean seconds per turn: every turn observes each phase once (0 when it had none)."""
    return q.ratio(
        q.sum_by(by, q.rate(q.sel(q.hist_sum(PHASE), F, *matchers))),
        q.sum_by(by, q.rate(q.sel(q.hist_count(PHASE), F, *matchers))),
    )


def turns_per_second() -> PanelBuilder:
    return stat_panel(
        2,
        "Turns per second",
        "Agent requests the sidecar proxied (all models selected).",
        REQUESTS_PER_SECOND,
        prom(q.sum_by((), q.rate(_turns()))),
        thresholds((None, "blue")),
        reducer="mean",
    )


def error_ratio() -> PanelBuilder:
    ok = q.sum_by((), q.rate(_turns(q.eq(q.STATUS, q.TURN_STATUS_OK))))
    return stat_panel(
        3,
        "Turns that failed",
        "Share of turns answered with an error status (the sidecar counts HTTP >= 400 and "
        "upstream failures). Expired-KV reads that fail the request show up here.",
        PERCENT,
        prom(f"1 - {q.ratio(ok, q.sum_by((), q.rate(_turns())))}"),
        thresholds((None, "green"), (0.01, "yellow"), (0.05, "red")),
        reducer="mean",
    )


def mean_turn_time() -> PanelBuilder:
    total = q.ratio(
        q.sum_by((), q.rate(q.sel(q.hist_sum(PHASE), F))),
        q.sum_by((), q.rate(q.sel(q.hist_count(PHASE), F, q.eq(q.PHASE, names.PHASE_INPUT_PROCESSING)))),
    )
    return stat_panel(
        4,
        "Mean turn time",
        "Gap before the request plus the request, per turn (the four phases summed).",
        SECONDS,
        prom(total),
        TURN_TIME_LIMITS,
        reducer="mean",
    )


def ttft_p95() -> PanelBuilder:
    return stat_panel(
        5,
        "TTFT p95 (streamed turns)",
        "Request arrival to the first content byte the agent received, 95th percentile. "
        "Only streamed turns have a first token the sidecar can time.",
        SECONDS,
        prom(q.quantile(0.95, q.sel(q.bucket(TTFT), F))),
        TTFT_LIMITS,
        reducer="mean",
    )


def waiting_share() -> PanelBuilder:
    waiting = q.sum_by(
        (),
        q.rate(q.sel(q.hist_sum(PHASE), F, q.one_of(q.PHASE, (names.PHASE_TOOL_WAIT, names.PHASE_APP_WORK)))),
    )
    return stat_panel(
        6,
        "Turn time spent between requests",
        "Tool wait plus app work as a share of turn time: the part no engine can speed up, "
        "and the time the decode node's KV must survive (see KV reuse: gap against TTL).",
        PERCENT,
        prom(q.ratio(waiting, q.sum_by((), q.rate(q.sel(q.hist_sum(PHASE), F))))),
        thresholds((None, "blue")),
        reducer="mean",
    )


def input_processing_mean() -> PanelBuilder:
    return stat_panel(
        7,
        "Mean input processing",
        "Request arrival to first token, per turn: prefill, KV pulls and queueing. This is "
        "the phase KV reuse shortens.",
        SECONDS,
        prom(_per_turn_mean((), q.eq(q.PHASE, names.PHASE_INPUT_PROCESSING))),
        TTFT_LIMITS,
        reducer="mean",
    )


def phase_mean_over_time() -> PanelBuilder:
    return colours.by_phase(
        timeseries_panel(
            9,
            "Turn time by phase (mean per turn)",
            "Stacked: the height is the mean turn time. Tool wait and app work are the gap "
            "before a request; input processing runs to the first token; generation after it.",
            SECONDS,
            [prom(_per_turn_mean((q.PHASE,)), "{{phase}}")],
            stack=True,
            limits=TURN_TIME_LIMITS,
        )
    )


def phase_p95_over_time() -> PanelBuilder:
    return colours.by_phase(
        timeseries_panel(
            10,
            "Turn time by phase (p95)",
            "95th percentile of each phase on its own (percentiles do not add up across phases).",
            SECONDS,
            [prom(q.quantile(0.95, q.sel(q.bucket(PHASE), F), (q.PHASE,)), "{{phase}}")],
            limits=TURN_TIME_LIMITS,
        )
    )


def model_mean_over_time() -> PanelBuilder:
    total = q.ratio(
        q.sum_by((q.MODEL,), q.rate(q.sel(q.hist_sum(PHASE), F))),
        q.sum_by(
            (q.MODEL,),
            q.rate(q.sel(q.hist_count(PHASE), F, q.eq(q.PHASE, names.PHASE_INPUT_PROCESSING))),
        ),
    )
    return timeseries_panel(
        11,
        "Mean turn time by model",
        "Turn time (all four phases) per served model.",
        SECONDS,
        [prom(total, "{{model_name}}")],
        limits=TURN_TIME_LIMITS,
    )


def model_phase_bars() -> PanelBuilder:
    by = (q.MODEL, q.PHASE)
    expr = q.ratio(
        q.sum_by(by, q.increase(q.sel(q.hist_sum(PHASE), F))),
        q.sum_by(by, q.increase(q.sel(q.hist_count(PHASE), F))),
    )
    return colours.by_phase(
        bargauge_panel(
            12,
            "Turn time by model and phase (mean over the range)",
            "Where each model's turns spend their time, averaged over the dashboard's range.",
            SECONDS,
            [prom(expr, "{{model_name}} · {{phase}}", instant=True)],
        ),
        suffix=True,
    )


def ttft_by_turn_over_time() -> PanelBuilder:
    return timeseries_panel(
        14,
        "TTFT p95 by turn index",
        "Time to first token of streamed turns, by the turn's position in its conversation "
        "(0 = first). With KV reuse working, later turns - longer prompts - stay close to "
        "turn 0; without it they grow with the history.",
        SECONDS,
        [prom(q.quantile(0.95, q.sel(q.bucket(TTFT), F), (q.TURN_INDEX,)), "turn {{turn_index}}")],
        width=6,
        limits=TTFT_LIMITS,
    )


def ttft_by_turn_bars() -> PanelBuilder:
    series = q.sel(q.bucket(TTFT), F)
    return bargauge_panel(
        15,
        "TTFT by turn index (over the range)",
        "Median and 95th percentile time to first token per turn index, whole range.",
        SECONDS,
        [
            prom(
                q.quantile(0.5, series, (q.TURN_INDEX,), q.RANGE_WINDOW),
                "p50 turn {{turn_index}}",
                "A",
                instant=True,
            ),
            prom(
                q.quantile(0.95, series, (q.TURN_INDEX,), q.RANGE_WINDOW),
                "p95 turn {{turn_index}}",
                "B",
                instant=True,
            ),
        ],
        width=6,
        limits=TTFT_LIMITS,
    )


def engine_ttft() -> PanelBuilder:
    series = q.sel(q.bucket(vllm_metrics.TIME_TO_FIRST_TOKEN), q.ENGINE_FILTERS)
    return timeseries_panel(
        16,
        "Engine TTFT p95 (vLLM)",
        "vLLM's own time to first token per engine. On a prefill node this is the prefill "
        "(the router asks it for one token); compare with the turn TTFT to see what the "
        "router, the decode hand-off and the network add.",
        SECONDS,
        [prom(q.quantile(0.95, series, (q.INSTANCE,)), "{{instance}}")],
        width=6,
        limits=TTFT_LIMITS,
    )


TASK_WINDOW = "1h"
"""Window of the task-time quantiles: long enough to hold several finished conversations."""


def task_time() -> PanelBuilder:
    series = q.sel(q.bucket(TASK), F)
    return timeseries_panel(
        19,
        "Task time p50 / p95",
        "A whole conversation's wall time, first request arrival to last response byte: the "
        "time an agent task took, next to the time to first token of its turns. A conversation "
        f"counts once no turn of it has ended for {names.CONVERSATION_IDLE_SECONDS:.0f} s, so it "
        "shows up that long after its last turn; each point covers the hour before it "
        "(conversations end far less often than turns do).",
        SECONDS,
        [
            prom(q.quantile(0.5, series, window=TASK_WINDOW), "p50", "A"),
            prom(q.quantile(0.95, series, window=TASK_WINDOW), "p95", "B"),
        ],
        width=6,
        limits=TASK_LIMITS,
    )


SLOWEST_TURNS_SQL = f"""
SELECT
    Timestamp AS time,
    TraceId AS trace_id,
    {s.attr(names.GEN_AI_CONVERSATION_ID)} AS conversation,
    {s.integer(names.TURN_INDEX)} AS turn,
    {s.attr(names.GEN_AI_REQUEST_MODEL)} AS model,
    if({s.num(names.TURN_TOTAL_SECONDS)} > 0, {s.num(names.TURN_TOTAL_SECONDS)}, Duration / 1e9) AS total_s,
    {s.num(names.TURN_INPUT_PROCESSING_SECONDS)} AS input_processing_s,
    {s.num(names.TURN_GENERATION_SECONDS)} AS generation_s,
    {s.num(names.TURN_TOOL_WAIT_SECONDS)} AS tool_wait_s,
    {s.num(names.TURN_APP_WORK_SECONDS)} AS app_work_s,
    {s.num_or_null(names.TURN_TTFT_SECONDS)} AS ttft_s,
    {s.integer(names.GEN_AI_USAGE_INPUT_TOKENS)} AS input_tokens,
    {s.integer(names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS)} AS cached_input_tokens,
    StatusCode AS status
FROM {s.TABLE}
WHERE {s.TIME_FILTER}
  AND {s.TURN_SPANS}
  AND {s.var_in(s.attr(names.GEN_AI_REQUEST_MODEL), q.MODEL_VAR)}
ORDER BY total_s DESC
LIMIT 50
"""


def slowest_turns() -> PanelBuilder:
    open_conversation = ("Open conversation", frame.conversation_url("${__data.fields.conversation}"))
    seconds = {
        column: unit_of(SECONDS, 3)
        for column in ("total_s", "input_processing_s", "generation_s", "tool_wait_s", "app_work_s", "ttft_s")
    }
    return table_panel(
        18,
        "Slowest turns",
        "The slowest agent turns of the range (gap plus request), with the phase split and "
        "the prompt tokens the engines reused. Click a trace id for the trace in Tempo, a "
        "conversation for its turn-by-turn drill-down; `otelkv why TRACE_ID` explains one.",
        s.ClickHouseTarget(SLOWEST_TURNS_SQL),
        columns={
            "trace_id": [
                links(("Open trace in Tempo", frame.trace_url("${__value.raw}")), open_conversation)
            ],
            "conversation": [links(open_conversation)],
            "input_tokens": unit_of(COUNT),
            "cached_input_tokens": unit_of(COUNT),
            **seconds,
            "total_s": [*unit_of(SECONDS, 3), *coloured(TURN_TIME_LIMITS)],
        },
        sort_by="total_s",
        height=12,
    )


def build() -> dashboard.Dashboard:
    return (
        frame.new_dashboard(
            UID,
            TITLE,
            "Where agent turn time goes (tool wait, app work, input processing, generation), "
            "time to first token by turn index, and the slowest turns with links to their traces.",
            (PROMETHEUS, CLICKHOUSE, TEMPO),
        )
        .with_variable(frame.model_variable())
        .with_variable(frame.engine_variable())
        .with_row(frame.row(1, "Overview"))
        .with_panel(turns_per_second())
        .with_panel(error_ratio())
        .with_panel(mean_turn_time())
        .with_panel(ttft_p95())
        .with_panel(waiting_share())
        .with_panel(input_processing_mean())
        .with_row(frame.row(8, "Where turn time goes"))
        .with_panel(phase_mean_over_time())
        .with_panel(phase_p95_over_time())
        .with_panel(model_mean_over_time())
        .with_panel(model_phase_bars())
        .with_row(frame.row(13, "Time to first token and task time"))
        .with_panel(ttft_by_turn_over_time())
        .with_panel(ttft_by_turn_bars())
        .with_panel(engine_ttft())
        .with_panel(task_time())
        .with_row(frame.row(17, "Slow turns"))
        .with_panel(slowest_turns())
    )
