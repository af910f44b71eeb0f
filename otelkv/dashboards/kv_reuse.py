"""*KV reuse*: is the decode node's KV paying off, and what does keeping it cost?

Engine panels read otelkv's series on each vLLM engine's ``/metrics`` (``otelkv_*``, with
vLLM's ``model_name`` and the scrape ``instance``): where prefill tokens came from, each
pull-or-recompute decision and its reason, the KV read over NIXL, the blocks kept for the
next turn and how those retentions ended. The gap-against-TTL panels join turn spans with
the previous turn's retention span in the trace store (the configured TTL is a span
attribute, not a metric). The failure panels count requests that did not finish, on the
engines and at the sidecar. What reuse is worth (prefill seconds saved by pulls) is the
sidecar's ``otelkv_trace_pull_prefill_seconds_total``, priced from the engine spans it
receives, shown beside what keeping the KV costs.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from otelkv import names
from otelkv.dashboards import frame, funnel_panel, vllm_metrics
from otelkv.dashboards import promql as q
from otelkv.dashboards import sql as s
from otelkv.dashboards.panels import (
    BYTES,
    BYTES_PER_SECOND,
    COUNT,
    PER_SECOND,
    PERCENT,
    SECONDS,
    TOKENS_PER_SECOND,
    PanelBuilder,
    barchart_panel,
    bargauge_panel,
    links,
    prom,
    stat_panel,
    table_panel,
    thresholds,
    timeseries_panel,
    unit_of,
)
from otelkv.dashboards.sources import CLICKHOUSE, PROMETHEUS, TEMPO

UID = frame.KV_REUSE_UID
TITLE = "otelkv / KV reuse"

E = q.ENGINE_FILTERS
PREFILL = q.eq(q.ROLE, names.ROLE_PREFILL)
DECODE_TTL = q.eq(q.KIND, names.RETENTION_DECODE_TTL)
NOT_FINISHED = (names.OUTCOME_FAILED_KV_LOAD, names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV, names.OUTCOME_ERROR)

REUSE_LIMITS = thresholds((None, "red"), (0.2, "yellow"), (0.5, "green"))
"""Share of prompt tokens not recomputed: agents resend whole conversations, so a working
fleet reuses most of each prompt after the first turn."""
TRANSFER_LIMITS = thresholds((None, "green"), (0.1, "yellow"), (0.5, "red"))
"""A KV read slower than 100 ms starts to eat what the reuse saves on small prompts."""
ANY_IS_BAD = thresholds((None, "green"), (1.0, "red"))
ANY_IS_NOTABLE = thresholds((None, "green"), (1.0, "yellow"))


def _tokens(*matchers: str) -> str:
    return q.sel(q.counter(names.METRIC_PREFILL_TOKENS), E, PREFILL, *matchers)


def _decisions(*matchers: str) -> str:
    return q.sel(q.counter(names.METRIC_PULL_DECISIONS), E, *matchers)


def _expiries() -> str:
    return q.sel(q.counter(names.METRIC_RETENTIONS), E, DECODE_TTL, q.eq(q.OUTCOME, names.RETENTION_EXPIRED))


def _not_finished() -> str:
    return q.sel(q.counter(names.METRIC_REQUESTS), E, q.one_of(q.OUTCOME, NOT_FINISHED))


# ------------------------------------------------------------------ at a glance


def reused_share() -> PanelBuilder:
    reused = q.sum_by(
        (), q.rate(_tokens(q.one_of(q.SOURCE, (names.TOKEN_SOURCE_LOCAL_CACHE, names.TOKEN_SOURCE_PULLED))))
    )
    return stat_panel(
        2,
        "Prompt tokens reused",
        "Share of prefill-node prompt tokens whose KV was not recomputed: found in the local "
        "prefix cache or pulled from the decode node.",
        PERCENT,
        prom(q.ratio(reused, q.sum_by((), q.rate(_tokens())))),
        REUSE_LIMITS,
        reducer="mean",
    )


def pulled_rate() -> PanelBuilder:
    return stat_panel(
        3,
        "Tokens pulled from decode",
        "Prompt tokens per second whose KV the prefill nodes read back from a decode node "
        "(bidirectional_kv_xfer) instead of recomputing.",
        TOKENS_PER_SECOND,
        prom(q.sum_by((), q.rate(_tokens(q.eq(q.SOURCE, names.TOKEN_SOURCE_PULLED))))),
        thresholds((None, "blue")),
        reducer="mean",
    )


def pulled_share() -> PanelBuilder:
    pulled = q.sum_by((), q.rate(_decisions(q.eq(q.REASON, names.REASON_PULLED))))
    return stat_panel(
        4,
        "Prefills that pulled",
        "Share of prefill requests that read the previous turn's KV from decode. The rest "
        "recomputed; 'Pull decisions by reason' says why.",
        PERCENT,
        prom(q.ratio(pulled, q.sum_by((), q.rate(_decisions())))),
        REUSE_LIMITS,
        reducer="mean",
    )


def ttl_expiries_total() -> PanelBuilder:
    return stat_panel(
        5,
        "TTL expiries",
        "Turns whose KV the decode node freed unread because decoder_kv_blocks_ttl ran out "
        "(over the range). Each one is a later turn that recomputes its whole prompt.",
        COUNT,
        prom(q.count_over(q.sum_by((), q.increase(_expiries())))),
        ANY_IS_NOTABLE,
        decimals=0,
    )


def retained_bytes_now() -> PanelBuilder:
    return stat_panel(
        6,
        "KV held on decode",
        "Bytes of KV the decode nodes keep right now for the next turn's prefill.",
        BYTES,
        prom(q.sum_by((), q.sel(names.METRIC_RETAINED_BYTES, E, DECODE_TTL))),
        thresholds((None, "blue")),
    )


def failed_total() -> PanelBuilder:
    return stat_panel(
        7,
        "Failed or stuck requests",
        "Engine requests that failed loading KV, got stuck waiting for remote KV, or errored "
        "(over the range).",
        COUNT,
        prom(q.count_over(q.sum_by((), q.increase(_not_finished())))),
        ANY_IS_BAD,
        decimals=0,
    )


# ------------------------------------------------------------------ where prompt KV comes from


def tokens_by_source() -> PanelBuilder:
    return timeseries_panel(
        9,
        "Prefill tokens by source",
        "Prompt tokens on prefill nodes by where their KV came from: computed, the local "
        "prefix cache, or pulled from the decode node that served the previous turn.",
        TOKENS_PER_SECOND,
        [prom(q.sum_by((q.SOURCE,), q.rate(_tokens())), "{{source}}")],
        stack=True,
    )


def decisions_by_reason() -> PanelBuilder:
    return timeseries_panel(
        10,
        "Pull decisions by reason",
        "Each prefill request's pull-or-recompute decision and why: pulled; below_threshold "
        "(fewer reusable tokens than kv_recompute_threshold); no_decode_handle (first turn, "
        "router miss, no conversation id, streaming decode leg); declined_expired (the TTL "
        "ran out); bidirectional_off; invalid_handle; transfer_failed; continuity_mismatch (guard "
        "mode refused a handle whose KV belongs to other tokens).",
        PER_SECOND,
        [prom(q.sum_by((q.DECISION, q.REASON), q.rate(_decisions())), "{{decision}}: {{reason}}")],
        stack=True,
        bars=True,
    )


def decisions_over_range() -> PanelBuilder:
    return bargauge_panel(
        11,
        "Pull decisions by reason (over the range)",
        "How many prefill requests ended with each reason, whole range.",
        COUNT,
        [prom(q.count_over(q.sum_by((q.REASON,), q.increase(_decisions()))), "{{reason}}", instant=True)],
        decimals=0,
    )


def local_hit_rate() -> PanelBuilder:
    def series(metric: str) -> str:
        return q.sum_by((q.INSTANCE,), q.rate(q.sel(q.counter(metric), E)))

    return timeseries_panel(
        12,
        "Local prefix cache hit rate (vLLM)",
        "vLLM's own prefix cache: share of looked-up prompt tokens found locally, per engine.",
        PERCENT,
        [
            prom(
                q.ratio(series(vllm_metrics.PREFIX_CACHE_HITS), series(vllm_metrics.PREFIX_CACHE_QUERIES)),
                "{{instance}}",
            )
        ],
    )


# ------------------------------------------------------------------ transfers


def transfer_bytes() -> PanelBuilder:
    return timeseries_panel(
        14,
        "KV read bytes/s by direction and backend",
        "Bytes of KV the engines read over NIXL: D->P is the prefill node pulling the previous "
        "turn back from decode, P->D the decode node reading a fresh prefill. Backend: UCX, "
        "LIBFABRIC (EFA), ...",
        BYTES_PER_SECOND,
        [
            prom(
                q.sum_by((q.DIRECTION, q.BACKEND), q.rate(q.sel(q.counter(names.METRIC_TRANSFER_BYTES), E))),
                "{{direction}} {{backend}}",
            )
        ],
    )


def transfer_latency() -> PanelBuilder:
    series = q.sel(q.bucket(names.METRIC_TRANSFER_SECONDS), E)
    return timeseries_panel(
        15,
        "KV transfer latency by direction",
        "NIXL-measured duration of successful KV reads (per request), median and 95th percentile.",
        SECONDS,
        [
            prom(q.quantile(0.5, series, (q.DIRECTION,)), "p50 {{direction}}", "A"),
            prom(q.quantile(0.95, series, (q.DIRECTION,)), "p95 {{direction}}", "B"),
        ],
        limits=TRANSFER_LIMITS,
    )


def transfer_throughput() -> PanelBuilder:
    return timeseries_panel(
        16,
        "KV transfer throughput",
        "Bytes read per second of NIXL transfer time, by direction: the link speed transfers "
        "actually got (bytes of all reads over the time of successful ones).",
        BYTES_PER_SECOND,
        [
            prom(
                q.ratio(
                    q.sum_by((q.DIRECTION,), q.rate(q.sel(q.counter(names.METRIC_TRANSFER_BYTES), E))),
                    q.sum_by((q.DIRECTION,), q.rate(q.sel(q.hist_sum(names.METRIC_TRANSFER_SECONDS), E))),
                ),
                "{{direction}}",
            )
        ],
    )


def transfers_by_outcome() -> PanelBuilder:
    return timeseries_panel(
        17,
        "KV transfers by outcome",
        "KV reads per second by direction and outcome: ok, declined_expired (the decode "
        "node's blocks were at or past their deadline), failed, stuck, abandoned.",
        PER_SECOND,
        [
            prom(
                q.sum_by((q.DIRECTION, q.OUTCOME), q.rate(q.sel(q.counter(names.METRIC_TRANSFERS), E))),
                "{{direction}} {{outcome}}",
            )
        ],
        stack=True,
        bars=True,
    )


# ------------------------------------------------------------------ retention


def retained_blocks() -> PanelBuilder:
    return timeseries_panel(
        19,
        "Retained KV blocks",
        "Blocks each engine holds right now for another engine to read: decode_ttl on decode "
        "nodes (kept for the next turn, up to decoder_kv_blocks_ttl), prefill_lease on "
        "prefill nodes (kept until decode read them).",
        COUNT,
        [
            prom(
                q.sum_by((q.INSTANCE, q.KIND), q.sel(names.METRIC_RETAINED_BLOCKS, E)),
                "{{instance}} {{kind}}",
            )
        ],
    )


def retained_memory() -> PanelBuilder:
    return timeseries_panel(
        20,
        "Retained KV memory",
        "The same retentions in bytes (all tensor-parallel ranks): memory the decode node "
        "cannot use for running requests while it waits for the next turn.",
        BYTES,
        [
            prom(
                q.sum_by((q.INSTANCE, q.KIND), q.sel(names.METRIC_RETAINED_BYTES, E)), "{{instance}} {{kind}}"
            )
        ],
    )


def kv_cache_usage() -> PanelBuilder:
    return timeseries_panel(
        21,
        "KV cache usage (vLLM)",
        "How full each engine's KV cache is; retained blocks count against it.",
        PERCENT,
        [prom(q.sum_by((q.INSTANCE,), q.sel(vllm_metrics.KV_CACHE_USAGE, E)), "{{instance}}")],
        width=6,
        limits=thresholds((None, "green"), (0.8, "yellow"), (0.95, "red")),
    )


def retentions_by_outcome() -> PanelBuilder:
    return timeseries_panel(
        22,
        "Retentions ended, by outcome",
        "consumed: the reader released the blocks before the deadline; expired: the TTL ran "
        "out unread (a TTL expiry); dropped: engine shutdown.",
        PER_SECOND,
        [
            prom(
                q.sum_by((q.KIND, q.OUTCOME), q.rate(q.sel(q.counter(names.METRIC_RETENTIONS), E))),
                "{{kind}} {{outcome}}",
            )
        ],
        width=6,
        stack=True,
        bars=True,
    )


def retention_cost() -> PanelBuilder:
    return timeseries_panel(
        23,
        "Blocks held by ended retentions",
        "Block-seconds per second of retentions that ended: the average number of blocks "
        "their retention kept busy. What a longer TTL would cost.",
        COUNT,
        [
            prom(
                q.sum_by((q.KIND,), q.rate(q.sel(q.counter(names.METRIC_RETENTION_BLOCK_SECONDS), E))),
                "{{kind}}",
            )
        ],
        width=6,
    )


def prefill_seconds_saved() -> PanelBuilder:
    series = q.sel(q.counter(names.METRIC_TRACE_PULL_PREFILL_SECONDS), q.SIDECAR_FILTERS)

    def part(name: str) -> str:
        return q.sum_by(
            (),
            q.rate(
                q.sel(
                    q.counter(names.METRIC_TRACE_PULL_PREFILL_SECONDS), q.SIDECAR_FILTERS, q.eq(q.PART, name)
                )
            ),
        )

    return timeseries_panel(
        24,
        "Prefill seconds saved by pulls",
        "What reuse is worth, beside what keeping the KV costs: prefill compute seconds per "
        "second that pulls saved (net: pulled tokens x the prefill node's measured seconds per "
        "computed token, minus the pulls' own wait for the KV), with both parts. Counted by the "
        "sidecar from the engine spans it receives (docs/telemetry.md gives the formula).",
        SECONDS,
        [
            prom(
                f"{part(names.PULL_PART_RECOMPUTE_AVOIDED)} - {part(names.PULL_PART_WAIT)}",
                "saved (net)",
                "A",
            ),
            prom(q.sum_by((q.PART,), q.rate(series)), "{{part}}", "B"),
        ],
        width=6,
    )


# ------------------------------------------------------------------ gap against TTL


def gap_cdf() -> PanelBuilder:
    gaps = names.METRIC_TURN_GAP_SECONDS
    share = q.ratio(
        q.sum_by((q.LE,), q.increase(q.sel(q.bucket(gaps), ()))),
        f"scalar({q.sum_by((), q.increase(q.sel(q.hist_count(gaps), ())))})",
    )
    return bargauge_panel(
        26,
        "Inter-turn gaps no longer than ...",
        "Share of gaps between a conversation's turns (tool wait plus app work) at most as "
        "long as each bucket bound, over the range. Read it at decoder_kv_blocks_ttl: the "
        "rest of the turns find their KV expired.",
        PERCENT,
        [prom(share, "≤ {{le}} s", instant=True)],
        width=8,
    )


GAP_JOIN = f"""
WITH
    turns AS (
        SELECT
            TraceId AS trace_id,
            {s.attr(names.GEN_AI_CONVERSATION_ID)} AS conversation,
            {s.integer(names.TURN_INDEX)} AS turn,
            {s.attr(names.TURN_PREVIOUS_TRACE_ID)} AS previous_trace,
            {s.num(names.TURN_GAP_SECONDS)} AS gap_s,
            {s.num(names.TURN_TOOL_WAIT_SECONDS)} AS tool_wait_s,
            {s.num(names.TURN_APP_WORK_SECONDS)} AS app_work_s
        FROM {s.TABLE}
        WHERE {s.TIME_FILTER}
          AND {s.TURN_SPANS}
          AND {s.var_in(s.attr(names.GEN_AI_REQUEST_MODEL), q.MODEL_VAR)}
          AND previous_trace != ''
    ),
    kept AS (
        SELECT
            TraceId AS previous_trace,
            max({s.num(names.RETENTION_TTL_SECONDS)}) AS ttl_s,
            any({s.attr(names.RETENTION_OUTCOME)}) AS retention
        FROM {s.TABLE}
        WHERE Timestamp >= $__fromTime - INTERVAL 1 DAY AND Timestamp <= $__toTime
          AND {s.RETENTION_SPANS}
          AND {s.attr(names.RETENTION_KIND)} = {s.lit(names.RETENTION_DECODE_TTL)}
        GROUP BY TraceId
    )"""
"""Each later turn with the TTL and fate of the KV its previous turn left on decode.

The previous turn may have started before the range, hence the day of look-back."""


GAP_VS_TTL_SQL = f"""{GAP_JOIN}
SELECT
    multiIf(
        gap_s < 0.5 * ttl_s, '< 50% of TTL',
        gap_s < 0.75 * ttl_s, '50-75% of TTL',
        gap_s < ttl_s, '75-100% of TTL',
        '> TTL'
    ) AS gap_vs_ttl,
    count() AS turns
FROM turns
INNER JOIN kept USING previous_trace
WHERE ttl_s > 0
GROUP BY gap_vs_ttl
ORDER BY min(gap_s / ttl_s)
"""


def gap_vs_ttl() -> PanelBuilder:
    return barchart_panel(
        27,
        "Inter-turn gap against the decode TTL",
        "Turns by how long their gap was relative to the decoder_kv_blocks_ttl that held the "
        "previous turn's KV. Past about (TTL - 5 s) vLLM declines the read; past the TTL the "
        "blocks are gone.",
        COUNT,
        s.ClickHouseTarget(GAP_VS_TTL_SQL),
        "gap_vs_ttl",
        width=8,
    )


GAP_OVER_TTL_SQL = f"""{GAP_JOIN}
SELECT
    trace_id,
    conversation,
    turn,
    gap_s,
    ttl_s,
    tool_wait_s,
    app_work_s,
    retention
FROM turns
INNER JOIN kept USING previous_trace
WHERE ttl_s > 0 AND gap_s >= ttl_s
ORDER BY gap_s DESC
LIMIT 50
"""


def gaps_over_ttl() -> PanelBuilder:
    seconds = {column: unit_of(SECONDS, 1) for column in ("gap_s", "ttl_s", "tool_wait_s", "app_work_s")}
    return table_panel(
        28,
        "Turns that came back after the TTL",
        "Each turn whose gap outlived the decode TTL, with what the gap was made of: a tool "
        "wait points at the tool, app work at the agent. The previous turn's retention "
        "outcome says whether the blocks expired.",
        s.ClickHouseTarget(GAP_OVER_TTL_SQL),
        columns={
            "trace_id": [links(("Open trace in Tempo", frame.trace_url("${__value.raw}")))],
            "conversation": [
                links(("Open conversation", frame.conversation_url("${__data.fields.conversation}")))
            ],
            **seconds,
        },
        width=8,
        height=8,
    )


# ------------------------------------------------------------------ failures


def requests_not_finished() -> PanelBuilder:
    return timeseries_panel(
        30,
        "Engine requests that failed or got stuck",
        "Requests that ended failed_kv_load (e.g. an expired decode handle under "
        "kv_load_failure_policy=fail), stuck_waiting_for_remote_kv or error, by role.",
        PER_SECOND,
        [prom(q.sum_by((q.ROLE, q.OUTCOME), q.rate(_not_finished())), "{{role}} {{outcome}}")],
        width=8,
        stack=True,
        bars=True,
        limits=thresholds((None, "green"), (0.001, "red")),
    )


def sidecar_errors() -> PanelBuilder:
    turns = q.counter(names.METRIC_TURNS)
    return timeseries_panel(
        31,
        "Failed turns at the sidecar",
        "Turns answered with an error, and requests the upstream (router) could not answer "
        "at all (the agent got a 502).",
        PER_SECOND,
        [
            prom(
                q.sum_by((), q.rate(q.sel(turns, q.SIDECAR_FILTERS, q.eq(q.STATUS, q.TURN_STATUS_ERROR)))),
                "turns with an error",
                "A",
            ),
            prom(
                q.sum_by((), q.rate(q.sel(q.counter(names.METRIC_SIDECAR_UPSTREAM_ERRORS), ()))),
                "upstream unreachable",
                "B",
            ),
        ],
        width=8,
        limits=thresholds((None, "green"), (0.001, "red")),
    )


def requests_waiting() -> PanelBuilder:
    return timeseries_panel(
        32,
        "Requests waiting (vLLM)",
        "Requests queued per engine, including those waiting for remote KV: a stuck read "
        "shows up as a waiting request that does not go away.",
        COUNT,
        [prom(q.sum_by((q.INSTANCE,), q.sel(vllm_metrics.NUM_REQUESTS_WAITING, E)), "{{instance}}")],
        width=8,
    )


FAILED_REQUESTS_SQL = f"""
SELECT
    failed.time AS time,
    trace_id,
    if(turn.conversation != '', turn.conversation, failed.engine_conversation) AS conversation,
    role,
    engine,
    outcome,
    pull_reason,
    remote_kv_wait_s,
    message
FROM (
    SELECT
        Timestamp AS time,
        TraceId AS trace_id,
        {s.attr(names.GEN_AI_CONVERSATION_ID)} AS engine_conversation,
        {s.attr(names.GEN_AI_REQUEST_MODEL)} AS engine_model,
        {s.attr(names.ROLE)} AS role,
        {s.resource(names.ENGINE_ID)} AS engine,
        {s.attr(names.REQUEST_OUTCOME)} AS outcome,
        {s.attr(names.PULL_REASON)} AS pull_reason,
        {s.num(names.REMOTE_KV_WAIT_SECONDS)} AS remote_kv_wait_s,
        StatusMessage AS message
    FROM {s.TABLE}
    WHERE {s.TIME_FILTER}
      AND {s.ENGINE_REQUEST_SPANS}
      AND {s.attr(names.REQUEST_OUTCOME)} IN ({", ".join(s.lit(o) for o in NOT_FINISHED)})
) AS failed
LEFT JOIN (
    SELECT
        TraceId AS trace_id,
        any({s.attr(names.GEN_AI_CONVERSATION_ID)}) AS conversation,
        any({s.attr(names.GEN_AI_REQUEST_MODEL)}) AS model
    FROM {s.TABLE}
    WHERE {s.TIME_FILTER} AND {s.TURN_SPANS}
    GROUP BY TraceId
) AS turn USING trace_id
WHERE {s.var_in("if(turn.model != '', turn.model, failed.engine_model)", q.MODEL_VAR)}
ORDER BY time DESC
LIMIT 100
"""


def failed_requests() -> PanelBuilder:
    return table_panel(
        33,
        "Failed or stuck requests, one by one",
        "Each engine request that did not finish, with its conversation, the pull decision "
        "it had made and vLLM's message. `otelkv why TRACE_ID` names the cause and the fix.",
        s.ClickHouseTarget(FAILED_REQUESTS_SQL),
        columns={
            "trace_id": [links(("Open trace in Tempo", frame.trace_url("${__value.raw}")))],
            "conversation": [
                links(("Open conversation", frame.conversation_url("${__data.fields.conversation}")))
            ],
            "remote_kv_wait_s": unit_of(SECONDS, 2),
        },
        height=8,
    )


# ------------------------------------------------------------------ continuity


def continuity_tokens() -> PanelBuilder:
    series = q.sel(q.counter(names.METRIC_CONTINUITY_TOKENS), E)
    return timeseries_panel(
        38,
        "Offered KV by continuity",
        "Prompt tokens that decode handles offered prefill nodes, by whether the KV belongs to the "
        "prompt (the decode node's digest against the new prompt's tokens): match (loaded, "
        "verified), mismatch (loaded, but computed for other tokens: answers may be wrong), "
        "unverified (loaded, a partial chunk), refused (guard mode recomputed instead).",
        TOKENS_PER_SECOND,
        [prom(q.sum_by((q.OUTCOME,), q.rate(series)), "{{outcome}}")],
        stack=True,
    )


def guard_refusals() -> PanelBuilder:
    refused = _decisions(q.eq(q.REASON, names.REASON_CONTINUITY_MISMATCH))
    return timeseries_panel(
        39,
        "Guard refusals",
        "Prefill requests whose decode handle guard mode refused (otelkv_continuity: guard; reason "
        "continuity_mismatch): the history was rewritten or the previous answer re-rendered, so "
        "the decode node's KV did not belong to the prompt and vLLM recomputed.",
        PER_SECOND,
        [prom(q.sum_by((), q.rate(refused)), "refused handles")],
        bars=True,
    )


# ------------------------------------------------------------------ sidecar


def spans_received() -> PanelBuilder:
    return timeseries_panel(
        35,
        "Spans into the trace store",
        "Spans the sidecar accepted for its store per second: its own turn spans and what "
        "engines and agents sent over OTLP.",
        PER_SECOND,
        [
            prom(
                q.sum_by((q.SOURCE,), q.rate(q.sel(q.counter(names.METRIC_SIDECAR_SPANS_RECEIVED), ()))),
                "{{source}}",
            )
        ],
    )


def store_queue() -> PanelBuilder:
    return timeseries_panel(
        36,
        "Store queue",
        "Spans waiting for the store writer. A queue that keeps growing ends in dropped spans "
        "(the sidecar never slows requests down to store them).",
        COUNT,
        [prom(q.sum_by((), q.sel(names.METRIC_SIDECAR_STORE_QUEUE, ())), "queued spans")],
        limits=thresholds((None, "green"), (10000.0, "yellow")),
    )


def build() -> dashboard.Dashboard:
    return (
        frame.new_dashboard(
            UID,
            TITLE,
            "Whether the decode node's KV pays off for agent traffic: prompt tokens by source, "
            "pull decisions and their reasons, whether reused KV belongs to the prompt, NIXL "
            "transfers, the blocks kept for the next "
            "turn, TTL expiries against the gaps between turns, and requests that failed.",
            (PROMETHEUS, CLICKHOUSE, TEMPO),
        )
        .with_variable(frame.model_variable())
        .with_variable(frame.engine_variable())
        .with_row(frame.row(1, "At a glance"))
        .with_panel(reused_share())
        .with_panel(pulled_rate())
        .with_panel(pulled_share())
        .with_panel(ttl_expiries_total())
        .with_panel(retained_bytes_now())
        .with_panel(failed_total())
        .with_row(frame.row(70, "Reuse funnel: how often the opportunity occurs, and what it is worth"))
        .with_panel(funnel_panel.reuse_funnel(71))
        .with_row(frame.row(8, "Where prompt KV comes from"))
        .with_panel(tokens_by_source())
        .with_panel(decisions_by_reason())
        .with_panel(decisions_over_range())
        .with_panel(local_hit_rate())
        .with_row(frame.row(37, "Continuity: does reused KV belong to the prompt?"))
        .with_panel(continuity_tokens())
        .with_panel(guard_refusals())
        .with_row(frame.row(13, "KV transfers"))
        .with_panel(transfer_bytes())
        .with_panel(transfer_latency())
        .with_panel(transfer_throughput())
        .with_panel(transfers_by_outcome())
        .with_row(frame.row(18, "Retention on decode"))
        .with_panel(retained_blocks())
        .with_panel(retained_memory())
        .with_panel(kv_cache_usage())
        .with_panel(retentions_by_outcome())
        .with_panel(retention_cost())
        .with_panel(prefill_seconds_saved())
        .with_row(frame.row(25, "Inter-turn gap against the TTL"))
        .with_panel(gap_cdf())
        .with_panel(gap_vs_ttl())
        .with_panel(gaps_over_ttl())
        .with_row(frame.row(29, "Failed or stuck requests"))
        .with_panel(requests_not_finished())
        .with_panel(sidecar_errors())
        .with_panel(requests_waiting())
        .with_panel(failed_requests())
        .with_row(frame.row(34, "Sidecar"))
        .with_panel(spans_received())
        .with_panel(store_queue())
    )
