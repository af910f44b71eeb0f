"""*Conversation*: one conversation, turn by turn, from the trace store and from Tempo.

Pick a conversation (the list holds the range's conversations, most recent first; any id
can be typed) and every panel follows its turns: the phase split, where each turn's prompt
KV came from, the pull decision and its reason, the KV transfers, the blocks the decode
node kept and whether the next turn came back in time. The trace-store panels find the
engines' spans through the turns' trace ids (so a conversation whose id the engines never
saw still shows them); the Tempo panels ask the same questions in TraceQL.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard, table, tempo
from grafana_foundation_sdk.models.dashboard import VariableRefresh, VariableSort
from grafana_foundation_sdk.models.tempo import SearchTableType

from otelkv import names
from otelkv.dashboards import colours, frame
from otelkv.dashboards import promql as q
from otelkv.dashboards import sql as s
from otelkv.dashboards import traceql as t
from otelkv.dashboards.panels import (
    BYTES,
    COUNT,
    SECONDS,
    PanelBuilder,
    barchart_panel,
    links,
    stat_panel,
    table_panel,
    thresholds,
    unit_of,
)
from otelkv.dashboards.sources import CLICKHOUSE, TEMPO

UID = frame.CONVERSATION_UID
TITLE = "otelkv / Conversation"
CONV = frame.CONVERSATION_VAR

CONVERSATIONS_SQL = f"""
SELECT conversation
FROM (
    SELECT {s.attr(names.GEN_AI_CONVERSATION_ID)} AS conversation, max(Timestamp) AS last_seen
    FROM {s.TABLE}
    WHERE {s.TIME_FILTER}
      AND {s.TURN_SPANS}
      AND {s.var_in(s.attr(names.GEN_AI_REQUEST_MODEL), q.MODEL_VAR)}
      AND conversation != ''
    GROUP BY conversation
    ORDER BY last_seen DESC
    LIMIT 500
)
"""

MODELS_SQL = f"""
SELECT DISTINCT {s.attr(names.GEN_AI_REQUEST_MODEL)} AS model
FROM {s.TABLE}
WHERE {s.TIME_FILTER} AND {s.TURN_SPANS} AND model != ''
ORDER BY model
"""

TURNS = f"""
WITH turns AS (
    SELECT TraceId AS trace_id, {s.integer(names.TURN_INDEX)} AS turn
    FROM {s.TABLE}
    WHERE {s.TIME_FILTER}
      AND {s.TURN_SPANS}
      AND {s.var_eq(s.attr(names.GEN_AI_CONVERSATION_ID), CONV)}
)"""
"""The selected conversation's turns; the other queries find engine spans by these traces."""

IN_TURNS = "TraceId IN (SELECT trace_id FROM turns)"


def model_variable() -> dashboard.QueryVariable:
    """Models seen on turn spans (narrows the conversation list)."""
    return (
        dashboard.QueryVariable(q.MODEL_VAR)
        .label("Model")
        .datasource(CLICKHOUSE.ref())
        .query(MODELS_SQL.strip())
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
    )


def conversation_variable() -> dashboard.QueryVariable:
    return (
        dashboard.QueryVariable(CONV)
        .label("Conversation")
        .description("gen_ai.conversation.id of the turns (most recent first; type any id).")
        .datasource(CLICKHOUSE.ref())
        .query(CONVERSATIONS_SQL.strip())
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.DISABLED)
        .allow_custom_value(True)
    )


def _trace_link() -> list:
    return [links(("Open trace in Tempo", frame.trace_url("${__value.raw}")))]


# ------------------------------------------------------------------ turns

TURNS_TABLE_SQL = f"""
SELECT
    {s.integer(names.TURN_INDEX)} AS turn,
    Timestamp AS time,
    TraceId AS trace_id,
    StatusCode AS status,
    if({s.num(names.TURN_TOTAL_SECONDS)} > 0, {s.num(names.TURN_TOTAL_SECONDS)}, Duration / 1e9) AS total_s,
    {s.num(names.TURN_TOOL_WAIT_SECONDS)} AS tool_wait_s,
    {s.num(names.TURN_APP_WORK_SECONDS)} AS app_work_s,
    {s.num(names.TURN_INPUT_PROCESSING_SECONDS)} AS input_processing_s,
    {s.num(names.TURN_GENERATION_SECONDS)} AS generation_s,
    {s.num_or_null(names.TURN_TTFT_SECONDS)} AS ttft_s,
    {s.integer(names.GEN_AI_USAGE_INPUT_TOKENS)} AS input_tokens,
    {s.integer(names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS)} AS cached_input_tokens,
    {s.integer(names.GEN_AI_USAGE_OUTPUT_TOKENS)} AS output_tokens,
    {s.attr(names.TURN_GAP_SOURCE)} AS gap_source,
    {s.attr(names.TURN_TTFT_SOURCE)} AS ttft_source,
    {s.attr(names.CONVERSATION_ID_SOURCE)} AS id_source
FROM {s.TABLE}
WHERE {s.TIME_FILTER}
  AND {s.TURN_SPANS}
  AND {s.var_eq(s.attr(names.GEN_AI_CONVERSATION_ID), CONV)}
ORDER BY turn, time
"""


def turns_table() -> PanelBuilder:
    seconds = {
        c: unit_of(SECONDS, 3)
        for c in ("total_s", "tool_wait_s", "app_work_s", "input_processing_s", "generation_s", "ttft_s")
    }
    return table_panel(
        2,
        "Turns",
        "One row per turn: the gap before it (tool wait, app work), the request (input "
        "processing to the first token, generation), usage, and how the sidecar knew "
        "(gap_source: agent spans or messages; ttft_source: stream, engine or response; "
        "id_source: where the conversation id came from).",
        s.ClickHouseTarget(TURNS_TABLE_SQL),
        columns={"trace_id": _trace_link(), **seconds},
        height=9,
    )


CONVERSATION_TURNS = f"""
FROM {s.TABLE}
WHERE {s.TIME_FILTER}
  AND {s.TURN_SPANS}
  AND {s.var_eq(s.attr(names.GEN_AI_CONVERSATION_ID), CONV)}"""

TASK_TIME_SQL = f"""
SELECT
    (max(toUnixTimestamp64Nano(Timestamp) + Duration) - min(toUnixTimestamp64Nano(Timestamp))) / 1e9
        AS task_s
{CONVERSATION_TURNS}
"""
"""The task: the conversation's first request arrival to its last turn's last byte."""

TURN_COUNT_SQL = f"""
SELECT count() AS turns
{CONVERSATION_TURNS}
"""

TTFT_SQL = f"""
SELECT quantileExact(0.5)({s.num_or_null(names.TURN_TTFT_SECONDS)}) AS ttft_s
{CONVERSATION_TURNS}
"""


def task_time() -> PanelBuilder:
    return stat_panel(
        16,
        "Task time",
        "The conversation's wall time in the range: its first request's arrival to its last "
        "turn's last response byte (tool waits and app work between turns included).",
        SECONDS,
        s.ClickHouseTarget(TASK_TIME_SQL),
        thresholds((None, "blue")),
        width=8,
        source=CLICKHOUSE,
    )


def turn_count() -> PanelBuilder:
    return stat_panel(
        17,
        "Turn count",
        "Agent requests of the conversation in the range.",
        COUNT,
        s.ClickHouseTarget(TURN_COUNT_SQL),
        thresholds((None, "blue")),
        width=8,
        decimals=0,
        source=CLICKHOUSE,
    )


def ttft_median() -> PanelBuilder:
    return stat_panel(
        18,
        "TTFT (median of streamed turns)",
        "Request arrival to the first content byte the agent received, median over the "
        "conversation's streamed turns (non-streamed turns have no first token to time).",
        SECONDS,
        s.ClickHouseTarget(TTFT_SQL),
        thresholds((None, "green"), (1.0, "yellow"), (3.0, "red")),
        width=8,
        source=CLICKHOUSE,
    )


PHASES_SQL = f"""
SELECT
    concat('turn ', toString({s.integer(names.TURN_INDEX)})) AS turn,
    {s.num(names.TURN_TOOL_WAIT_SECONDS)} AS {names.PHASE_TOOL_WAIT},
    {s.num(names.TURN_APP_WORK_SECONDS)} AS {names.PHASE_APP_WORK},
    {s.num(names.TURN_INPUT_PROCESSING_SECONDS)} AS {names.PHASE_INPUT_PROCESSING},
    {s.num(names.TURN_GENERATION_SECONDS)} AS {names.PHASE_GENERATION}
FROM {s.TABLE}
WHERE {s.TIME_FILTER}
  AND {s.TURN_SPANS}
  AND {s.var_eq(s.attr(names.GEN_AI_CONVERSATION_ID), CONV)}
ORDER BY {s.integer(names.TURN_INDEX)}, Timestamp
"""


def phases_per_turn() -> PanelBuilder:
    return colours.by_phase(
        barchart_panel(
            3,
            "Turn time by phase",
            "Each turn's time, stacked by phase, in conversation order.",
            SECONDS,
            s.ClickHouseTarget(PHASES_SQL),
            "turn",
        )
    )


TOKENS_SQL = f"""{TURNS}
SELECT concat('turn ', toString(turn)) AS turn_label, {names.TOKEN_SOURCE_COMPUTED}, \
{names.TOKEN_SOURCE_LOCAL_CACHE}, {names.TOKEN_SOURCE_PULLED}
FROM (
    SELECT
        TraceId AS trace_id,
        sum({s.integer(names.TOKENS_COMPUTED)}) AS {names.TOKEN_SOURCE_COMPUTED},
        sum({s.integer(names.TOKENS_LOCAL_CACHE_HIT)}) AS {names.TOKEN_SOURCE_LOCAL_CACHE},
        sum({s.integer(names.TOKENS_PULLED)}) AS {names.TOKEN_SOURCE_PULLED}
    FROM {s.TABLE}
    WHERE {s.TIME_FILTER} AND {s.PREFILL_SPANS} AND {IN_TURNS}
    GROUP BY TraceId
) AS prefill
INNER JOIN turns USING trace_id
ORDER BY turn
"""


def tokens_per_turn() -> PanelBuilder:
    return barchart_panel(
        4,
        "Prompt tokens by source",
        "Where each turn's prompt KV came from on the prefill node: computed, the local "
        "prefix cache, or pulled from the decode node that served the previous turn.",
        COUNT,
        s.ClickHouseTarget(TOKENS_SQL),
        "turn_label",
    )


# ------------------------------------------------------------------ KV reuse per turn

DECISIONS_SQL = f"""{TURNS}
SELECT turn, trace_id, decision, reason, remote_reusable, threshold, local_cache, pulled, computed,
    remote_kv_wait_s, outcome
FROM (
    SELECT
        TraceId AS trace_id,
        {s.attr(names.PULL_DECISION)} AS decision,
        {s.attr(names.PULL_REASON)} AS reason,
        {s.integer(names.TOKENS_REMOTE_REUSABLE)} AS remote_reusable,
        {s.integer(names.KV_RECOMPUTE_THRESHOLD)} AS threshold,
        {s.integer(names.TOKENS_LOCAL_CACHE_HIT)} AS local_cache,
        {s.integer(names.TOKENS_PULLED)} AS pulled,
        {s.integer(names.TOKENS_COMPUTED)} AS computed,
        {s.num(names.REMOTE_KV_WAIT_SECONDS)} AS remote_kv_wait_s,
        {s.attr(names.REQUEST_OUTCOME)} AS outcome
    FROM {s.TABLE}
    WHERE {s.TIME_FILTER} AND {s.PREFILL_SPANS} AND {IN_TURNS}
) AS prefill
INNER JOIN turns USING trace_id
ORDER BY turn
"""


def decisions() -> PanelBuilder:
    return table_panel(
        6,
        "Pull decisions",
        "The prefill node's decision per turn: how many tokens the decode node could give "
        "back beyond the local cache (remote_reusable), the threshold, and what happened.",
        s.ClickHouseTarget(DECISIONS_SQL),
        columns={"trace_id": _trace_link(), "remote_kv_wait_s": unit_of(SECONDS, 3)},
        width=12,
        height=9,
    )


TRANSFERS_SQL = f"""{TURNS}
SELECT turn, direction, bytes, tokens, xfer_s, post_s, wait_s, descriptors, backend, outcome, engine,
    remote_engine, trace_id
FROM (
    SELECT
        TraceId AS trace_id,
        {s.attr(names.TRANSFER_DIRECTION)} AS direction,
        {s.integer(names.TRANSFER_BYTES)} AS bytes,
        {s.integer(names.TRANSFER_TOKENS)} AS tokens,
        {s.num(names.TRANSFER_XFER_SECONDS)} AS xfer_s,
        {s.num(names.TRANSFER_POST_SECONDS)} AS post_s,
        {s.num(names.TRANSFER_WAIT_SECONDS)} AS wait_s,
        {s.integer(names.TRANSFER_DESCRIPTORS)} AS descriptors,
        {s.attr(names.TRANSFER_BACKEND)} AS backend,
        {s.attr(names.TRANSFER_OUTCOME)} AS outcome,
        {s.resource(names.ENGINE_ID)} AS engine,
        {s.attr(names.REMOTE_ENGINE_ID)} AS remote_engine
    FROM {s.TABLE}
    WHERE {s.TIME_FILTER} AND {s.TRANSFER_SPANS} AND {IN_TURNS}
) AS transfer
INNER JOIN turns USING trace_id
ORDER BY turn, direction
"""


def transfers() -> PanelBuilder:
    seconds = {c: unit_of(SECONDS, 4) for c in ("xfer_s", "post_s", "wait_s")}
    return table_panel(
        7,
        "KV transfers",
        "Every KV read in the conversation: D->P the prefill node pulling the previous turn, "
        "P->D the decode node reading the prefill. xfer_s and post_s are NIXL's own "
        "measurements; wait_s is what the scheduler waited (handshakes and steps included).",
        s.ClickHouseTarget(TRANSFERS_SQL),
        columns={"trace_id": _trace_link(), "bytes": unit_of(BYTES), **seconds},
        width=12,
        height=9,
    )


RETENTIONS_SQL = f"""{TURNS}
SELECT turn, kind, engine, blocks, bytes, ttl_s, held_s, block_seconds, outcome, trace_id
FROM (
    SELECT
        TraceId AS trace_id,
        {s.attr(names.RETENTION_KIND)} AS kind,
        {s.resource(names.ENGINE_ID)} AS engine,
        {s.integer(names.RETENTION_BLOCKS)} AS blocks,
        {s.integer(names.RETENTION_BYTES)} AS bytes,
        {s.num(names.RETENTION_TTL_SECONDS)} AS ttl_s,
        {s.num(names.RETENTION_HELD_SECONDS)} AS held_s,
        {s.num(names.RETENTION_BLOCK_SECONDS)} AS block_seconds,
        {s.attr(names.RETENTION_OUTCOME)} AS outcome
    FROM {s.TABLE}
    WHERE {s.TIME_FILTER} AND {s.RETENTION_SPANS} AND {IN_TURNS}
) AS retention
INNER JOIN turns USING trace_id
ORDER BY turn, kind
"""


def retentions() -> PanelBuilder:
    return table_panel(
        8,
        "Retentions",
        "Blocks kept after each turn: decode_ttl on the decode node for the next turn (until "
        "read or the TTL), prefill_lease on the prefill node until decode read the prompt. "
        "outcome consumed = released by the reader, expired = the TTL ran out unread.",
        s.ClickHouseTarget(RETENTIONS_SQL),
        columns={
            "trace_id": _trace_link(),
            "bytes": unit_of(BYTES),
            "ttl_s": unit_of(SECONDS, 1),
            "held_s": unit_of(SECONDS, 2),
        },
        width=12,
        height=9,
    )


GAP_SQL = f"""
WITH
    turns AS (
        SELECT
            TraceId AS trace_id,
            {s.integer(names.TURN_INDEX)} AS turn,
            {s.attr(names.TURN_PREVIOUS_TRACE_ID)} AS previous_trace,
            {s.num(names.TURN_GAP_SECONDS)} AS gap_s,
            {s.num(names.TURN_TOOL_WAIT_SECONDS)} AS tool_wait_s,
            {s.num(names.TURN_APP_WORK_SECONDS)} AS app_work_s,
            {s.attr(names.TURN_GAP_SOURCE)} AS gap_source
        FROM {s.TABLE}
        WHERE {s.TIME_FILTER}
          AND {s.TURN_SPANS}
          AND {s.var_eq(s.attr(names.GEN_AI_CONVERSATION_ID), CONV)}
          AND previous_trace != ''
    ),
    kept AS (
        SELECT
            TraceId AS previous_trace,
            max({s.num(names.RETENTION_TTL_SECONDS)}) AS ttl_s,
            any({s.attr(names.RETENTION_OUTCOME)}) AS previous_retention
        FROM {s.TABLE}
        WHERE Timestamp >= $__fromTime - INTERVAL 1 DAY AND Timestamp <= $__toTime
          AND {s.RETENTION_SPANS}
          AND {s.attr(names.RETENTION_KIND)} = {s.lit(names.RETENTION_DECODE_TTL)}
          AND TraceId IN (SELECT previous_trace FROM turns)
        GROUP BY TraceId
    ),
    prefill AS (
        SELECT TraceId AS trace_id, any({s.attr(names.PULL_REASON)}) AS pull_reason
        FROM {s.TABLE}
        WHERE {s.TIME_FILTER} AND {s.PREFILL_SPANS} AND TraceId IN (SELECT trace_id FROM turns)
        GROUP BY TraceId
    )
SELECT
    turn,
    gap_s,
    tool_wait_s,
    app_work_s,
    gap_source,
    ttl_s,
    if(ttl_s > 0, gap_s / ttl_s, NULL) AS gap_over_ttl,
    previous_retention,
    pull_reason
FROM turns
LEFT JOIN kept USING previous_trace
LEFT JOIN prefill USING trace_id
ORDER BY turn
"""


def gap_against_ttl() -> PanelBuilder:
    return table_panel(
        9,
        "Gap against the TTL",
        "For each later turn: the gap before it, the decoder_kv_blocks_ttl that held the "
        "previous turn's KV, how that retention ended, and the pull reason that followed. "
        "gap_over_ttl >= 1 means the KV was gone; from about (TTL - 5 s) vLLM declines the read.",
        s.ClickHouseTarget(GAP_SQL),
        columns={
            **{c: unit_of(SECONDS, 2) for c in ("gap_s", "tool_wait_s", "app_work_s", "ttl_s")},
            "gap_over_ttl": unit_of("percentunit", 0),
        },
        width=12,
        height=9,
    )


# ------------------------------------------------------------------ Tempo

IN_CONVERSATION = f"{t.span(names.GEN_AI_CONVERSATION_ID)} = {t.string_var(CONV)}"


def _tempo(panel_id: int, title: str, description: str, query: str, *, width: int = 12) -> PanelBuilder:
    return (
        table.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(TEMPO.ref())
        .span(width)
        .height(8)
        .with_target(
            tempo.TempoQuery()
            .ref_id("A")
            .datasource(TEMPO.ref())
            .query_type("traceql")
            .query(query)
            .limit(50)
            .spss(20)
            .table_type(SearchTableType.SPANS)
        )
    )


TEMPO_TURNS = t.select(
    t.spanset(IN_CONVERSATION, f"{t.span(names.TURN_TOTAL_SECONDS)} >= 0"),
    (
        names.TURN_INDEX,
        names.TURN_TOTAL_SECONDS,
        names.TURN_TOOL_WAIT_SECONDS,
        names.TURN_INPUT_PROCESSING_SECONDS,
        names.TURN_GAP_SOURCE,
    ),
)
TEMPO_RECOMPUTED = t.select(
    t.spanset(IN_CONVERSATION, f"{t.span(names.PULL_DECISION)} = {t.string(names.DECISION_RECOMPUTE)}"),
    (names.PULL_REASON, names.TOKENS_REMOTE_REUSABLE, names.TOKENS_COMPUTED),
)
TEMPO_TRANSFERS = t.select(
    t.child(t.spanset(IN_CONVERSATION), t.spanset(f"{t.span(names.TRANSFER_BYTES)} > 0")),
    (names.TRANSFER_DIRECTION, names.TRANSFER_BYTES, names.TRANSFER_XFER_SECONDS, names.TRANSFER_OUTCOME),
)
TEMPO_EXPIRED = t.select(
    t.child(
        t.spanset(IN_CONVERSATION),
        t.spanset(f"{t.span(names.RETENTION_OUTCOME)} = {t.string(names.RETENTION_EXPIRED)}"),
    ),
    (names.RETENTION_KIND, names.RETENTION_TTL_SECONDS, names.RETENTION_HELD_SECONDS),
)
TEMPO_ERRORS = t.select(
    t.spanset(IN_CONVERSATION, "status = error"), (names.REQUEST_OUTCOME, names.ERROR_TYPE)
)


def tempo_panels() -> list[PanelBuilder]:
    return [
        _tempo(
            11,
            "Turns (Tempo)",
            "The conversation's turn spans with their phase split.",
            TEMPO_TURNS,
            width=24,
        ),
        _tempo(
            12,
            "Prefills that recomputed (Tempo)",
            "Prefill requests of this conversation that did not pull, with the reason.",
            TEMPO_RECOMPUTED,
        ),
        _tempo(
            13, "KV transfers (Tempo)", "KV reads under this conversation's engine requests.", TEMPO_TRANSFERS
        ),
        _tempo(
            14,
            "Expired retentions (Tempo)",
            "Decode-node KV of this conversation that the TTL freed unread.",
            TEMPO_EXPIRED,
        ),
        _tempo(15, "Errors (Tempo)", "Spans of this conversation that ended in error.", TEMPO_ERRORS),
    ]


def build() -> dashboard.Dashboard:
    board = (
        frame.new_dashboard(
            UID,
            TITLE,
            "One agent conversation turn by turn: phases, prompt tokens by source, pull "
            "decisions, KV transfers, retentions and the gap against the TTL, from the trace "
            "store (ClickHouse SQL) and from Tempo (TraceQL).",
            (CLICKHOUSE, TEMPO),
        )
        .with_variable(model_variable())
        .with_variable(conversation_variable())
        .with_row(frame.row(1, "Turns of the conversation"))
        .with_panel(task_time())
        .with_panel(turn_count())
        .with_panel(ttft_median())
        .with_panel(turns_table())
        .with_panel(phases_per_turn())
        .with_panel(tokens_per_turn())
        .with_row(frame.row(5, "KV reuse, turn by turn"))
        .with_panel(decisions())
        .with_panel(transfers())
        .with_panel(retentions())
        .with_panel(gap_against_ttl())
        .with_row(frame.row(10, "The same conversation in Tempo"))
    )
    for panel in tempo_panels():
        board = board.with_panel(panel)
    return board
