"""The reuse funnel as a ClickHouse table on the *KV reuse* dashboard.

The SQL places every follow-up turn of the range (a sidecar turn span with turn index 1 or
more) at the step of :data:`otelkv.names.FUNNEL_STEPS` it was lost at, with a reason, from
the same span attributes :func:`otelkv.analysis.funnel.place` reads (and leaves out the
conversations :mod:`otelkv.analysis.scope` leaves out, as the CLI does): the turn span, the
router's span and the prefill request (with its transfer) of the turn's trace, and the
decode request and retention of the previous turn's trace. Then one row per step: turns
that reached it, their share of the follow-up turns, turns lost there by reason, and the
reusable tokens and prefill seconds at stake.

Where the CLI (``otelkv funnel``) and this table may differ: the CLI also reads engine
requests joined to a turn by inference (routers that forward no trace context), whose
facts this SQL cannot see; its recompute cost per token comes from the turns and their
predecessors, the table's from every prefill request of the range; and the CLI reads a
late read (``kv_read_started_late``) from the turn's clock, the table from the gap alone.
On traces whose engines continued the turn's trace the two agree (a unit test holds them
to the same counts on one store).
"""

from __future__ import annotations

from grafana_foundation_sdk.models.dashboard import DynamicConfigValue

from otelkv import names
from otelkv.analysis import scope
from otelkv.analysis.diagnose import READ_EXPIRY_MARGIN_S
from otelkv.analysis.funnel import ID_SOURCE_FINGERPRINT, STEP_TITLES
from otelkv.dashboards import promql as q
from otelkv.dashboards import sql as s
from otelkv.dashboards.panels import COUNT, PERCENT, SECONDS, PanelBuilder, table_panel, unit_of
from otelkv.spans import kinds
from otelkv.spans.sql import attr, has_attr, lit, name_like

ROUTER_SPANS = f"({has_attr(names.ROUTER_HANDLE)} OR {name_like(kinds.ROUTER_PREFIX)})"
DECODE_SPANS = f"({s.ENGINE_REQUEST_SPANS} AND {attr(names.ROLE)} = {lit(names.ROLE_DECODE)})"
AROUND = "Timestamp >= $__fromTime - INTERVAL 1 DAY AND Timestamp <= $__toTime + INTERVAL 1 HOUR"
"""The spans a turn of the range needs: its previous turn's may have started a day earlier,
its own engine requests a little after the range ends."""

END = len(names.FUNNEL_STEPS)
"""The ``stop`` of a turn that reached the end."""


def _step(step: str) -> int:
    return names.FUNNEL_STEPS.index(step)


def _in(expr: str, values: tuple[str, ...]) -> str:
    return f"{expr} IN ({', '.join(lit(v) for v in values)})"


_FAILED = (names.OUTCOME_FAILED_KV_LOAD, names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV, names.OUTCOME_ERROR)
_NO_PULL_REASONS = (
    names.REASON_DECLINED_EXPIRED,
    names.REASON_CONTINUITY_MISMATCH,
    names.REASON_INVALID_HANDLE,
    names.REASON_BIDIRECTIONAL_OFF,
)
_STEPS_ARRAY = (
    "[" + ", ".join(f"({i}, {lit(STEP_TITLES[step])})" for i, step in enumerate(names.FUNNEL_STEPS)) + "]"
)

FUNNEL_SQL = f"""
WITH
    turns AS (
        SELECT
            TraceId AS trace_id,
            any({attr(names.TURN_PREVIOUS_TRACE_ID)}) AS previous_trace,
            any({s.num(names.TURN_GAP_SECONDS)}) AS gap_s,
            any(
                {attr(names.CONVERSATION_INFERRED)} = 'true'
                OR {attr(names.CONVERSATION_ID_SOURCE)} = {lit(ID_SOURCE_FINGERPRINT)}
                OR {attr(names.GEN_AI_CONVERSATION_ID)} = ''
            ) AS no_id
        FROM {s.TABLE}
        WHERE {s.TIME_FILTER}
          AND {s.TURN_SPANS}
          AND {s.integer(names.TURN_INDEX)} >= 1
          AND {_in(attr(names.GEN_AI_CONVERSATION_ID), tuple(sorted(scope.LEFT_OUT_CONVERSATIONS)))} = 0
          AND {s.var_in(attr(names.GEN_AI_REQUEST_MODEL), q.MODEL_VAR)}
        GROUP BY TraceId
    ),
    routers AS (
        SELECT
            TraceId AS trace_id,
            any({attr(names.ROUTER_HANDLE)}) AS handle,
            any({attr(names.ROUTER_DECODE_STREAMED)}) AS decode_streamed
        FROM {s.TABLE}
        WHERE {AROUND} AND {ROUTER_SPANS}
        GROUP BY TraceId
    ),
    prefill_spans AS (
        SELECT
            TraceId AS trace_id,
            SpanId AS span_id,
            Timestamp AS started,
            Duration / 1e9 AS duration_s,
            {attr(names.PULL_REASON)} AS reason,
            {attr(names.PULL_DECISION)} AS decision,
            {attr(names.TOKENS_PULLED)} AS pulled_text,
            {s.num(names.TOKENS_PULLED)} AS pulled,
            {s.num_or_null(names.TOKENS_REMOTE_REUSABLE)} AS reusable,
            {s.num_or_null(names.TOKENS_COMPUTED)} AS computed_raw,
            {s.num(names.TOKENS_LOCAL_CACHE_HIT)} AS local,
            {s.num(names.GEN_AI_USAGE_INPUT_TOKENS)} AS prompt,
            {attr(names.REQUEST_OUTCOME)} AS outcome,
            {s.num(names.REMOTE_KV_WAIT_SECONDS)} AS remote_kv_wait_s,
            {s.num_or_null(names.CONTINUITY_FIRST_MISMATCH)} AS first_mismatch,
            toFloat64OrZero({s.resource(names.DECODER_KV_BLOCKS_TTL)}) AS ttl_conf
        FROM {s.TABLE}
        WHERE {AROUND} AND {s.PREFILL_SPANS}
    ),
    transfers AS (
        SELECT
            ParentSpanId AS span_id,
            any({attr(names.TRANSFER_OUTCOME)}) AS t_outcome,
            any({s.num(names.TRANSFER_WAIT_SECONDS)}) AS t_wait_s,
            any({s.num(names.TRANSFER_XFER_SECONDS)}) AS t_xfer_s
        FROM {s.TABLE}
        WHERE {AROUND} AND {s.TRANSFER_SPANS}
        GROUP BY ParentSpanId
    ),
    prefills_all AS (
        SELECT
            p.*,
            t.t_outcome AS t_outcome,
            t.t_wait_s AS t_wait_s,
            t.t_xfer_s AS t_xfer_s,
            if(p.computed_raw IS NULL, greatest(p.prompt - p.local, 0), p.computed_raw) AS computed
        FROM prefill_spans AS p
        LEFT JOIN transfers AS t ON t.span_id = p.span_id
    ),
    prefills AS (
        -- Retries leave several prefill requests in a trace: the last one answered.
        SELECT * FROM prefills_all ORDER BY started DESC LIMIT 1 BY trace_id
    ),
    cost AS (
        -- The prefill node's fastest rate per computed token (queueing only ever adds).
        SELECT min(greatest(duration_s - t_wait_s, 0) / computed_raw) AS per_token_s
        FROM prefills_all
        WHERE {s.TIME_FILTER.replace("Timestamp", "started")}
          AND computed_raw >= 16
          AND outcome IN ('', {lit(names.OUTCOME_FINISHED)})
    ),
    decodes AS (
        SELECT
            TraceId AS trace_id,
            argMax({attr(names.KV_PARAMS_RETURNED)}, Timestamp) AS returned,
            argMax({attr(names.REQUEST_STREAMED)}, Timestamp) AS streamed,
            argMax({s.resource(names.BIDIRECTIONAL_KV_XFER)}, Timestamp) AS bidirectional,
            argMax(toFloat64OrZero({s.resource(names.DECODER_KV_BLOCKS_TTL)}), Timestamp) AS ttl_conf,
            argMax(
                {s.num(names.GEN_AI_USAGE_INPUT_TOKENS)} + {s.num(names.GEN_AI_USAGE_OUTPUT_TOKENS)},
                Timestamp
            ) AS held
        FROM {s.TABLE}
        WHERE {AROUND} AND {DECODE_SPANS}
        GROUP BY TraceId
    ),
    kept AS (
        SELECT
            TraceId AS trace_id,
            any({attr(names.RETENTION_OUTCOME)}) AS outcome,
            max({s.num(names.RETENTION_TTL_SECONDS)}) AS ttl_s
        FROM {s.TABLE}
        WHERE {AROUND}
          AND {s.RETENTION_SPANS}
          AND {attr(names.RETENTION_KIND)} = {lit(names.RETENTION_DECODE_TTL)}
        GROUP BY TraceId
    ),
    facts AS (
        SELECT
            turns.no_id AS no_id,
            turns.gap_s AS gap_s,
            prefills.trace_id != '' AS has_prefill,
            prefills.reason AS reason,
            prefills.decision AS decision,
            prefills.pulled_text AS pulled_text,
            prefills.pulled AS pulled,
            prefills.reusable AS reusable,
            prefills.computed AS computed,
            prefills.local AS local,
            prefills.outcome AS outcome,
            prefills.first_mismatch AS first_mismatch,
            prefills.t_outcome AS t_outcome,
            multiIf(
                prefills.t_wait_s > 0, prefills.t_wait_s,
                prefills.t_xfer_s > 0, prefills.t_xfer_s,
                prefills.remote_kv_wait_s
            ) AS pull_s,
            routers.handle AS handle,
            prev_router.decode_streamed AS prev_streamed_router,
            decodes.trace_id != '' AS has_prev_decode,
            decodes.returned AS prev_returned,
            decodes.streamed AS prev_streamed,
            decodes.bidirectional AS prev_bidirectional,
            decodes.held AS prev_held,
            kept.outcome AS kept_outcome,
            kept.ttl_s AS kept_ttl_s,
            multiIf(
                decodes.ttl_conf > 0, decodes.ttl_conf,
                prefills.ttl_conf > 0, prefills.ttl_conf,
                kept.ttl_s
            ) AS ttl_s,
            (SELECT per_token_s FROM cost) AS per_token_s
        FROM turns
        LEFT JOIN prefills ON prefills.trace_id = turns.trace_id
        LEFT JOIN routers ON routers.trace_id = turns.trace_id
        LEFT JOIN routers AS prev_router ON prev_router.trace_id = turns.previous_trace
        LEFT JOIN decodes ON decodes.trace_id = turns.previous_trace
        LEFT JOIN kept ON kept.trace_id = turns.previous_trace
    ),
    derived AS (
        SELECT
            *,
            has_prefill
                AND (
                    reason = {lit(names.REASON_PULLED)}
                    OR (reason = '' AND decision = {lit(names.DECISION_PULL)})
                )
                AND pulled_text != '0'
                AND NOT {_in("outcome", _FAILED)}
                AND t_outcome IN ('', {lit(names.TRANSFER_OK)}) AS pulled_ok,
            (has_prefill AND reason NOT IN ('', {lit(names.REASON_NO_DECODE_HANDLE)}))
                OR pulled_ok OR handle = {lit(names.ROUTER_HANDLE_HIT)} AS reached,
            ttl_s > 0 AND gap_s + {READ_EXPIRY_MARGIN_S} >= ttl_s AS in_margin,
            (kept_outcome = {lit(names.RETENTION_EXPIRED)} AND gap_s >= kept_ttl_s) AS expired,
            reason = {lit(names.REASON_DECLINED_EXPIRED)}
                OR t_outcome = {lit(names.TRANSFER_DECLINED_EXPIRED)} AS declined,
            multiIf(
                prev_bidirectional = 'false', {lit(names.DIAG_BIDIRECTIONAL_OFF)},
                prev_streamed_router = 'true' OR (prev_streamed_router = '' AND prev_streamed = 'true')
                    OR prev_returned = 'false', {lit(names.DIAG_DECODE_NO_HANDLE)},
                ''
            ) AS decode_none,
            if(computed > 0, computed, 0) AS computed_n,
            multiIf(
                pulled > 0, 0,
                reusable > 0, if(computed_n > 0, least(reusable, computed_n), reusable),
                has_prev_decode, greatest(least(prev_held - local, computed_n), 0),
                computed_n
            ) AS lost_tokens,
            multiIf(
                NOT has_prefill, NULL,
                pulled > 0, greatest(pulled, ifNull(reusable, 0)),
                reason NOT IN ('', {lit(names.REASON_NO_DECODE_HANDLE)}) AND reusable IS NOT NULL,
                    lost_tokens,
                has_prev_decode, lost_tokens,
                NULL
            ) AS tokens
        FROM facts
    ),
    placed AS (
        SELECT
            tokens,
            ifNull(tokens, 0) * ifNull(per_token_s, 0) AS recompute_s,
            multiIf(
                no_id OR handle = {lit(names.ROUTER_HANDLE_NO_CONVERSATION)},
                    ({_step(names.FUNNEL_CONVERSATION_ID)}, {lit(names.DIAG_NO_CONVERSATION_ID)}),
                NOT reached AND handle != {lit(names.ROUTER_HANDLE_STALE)} AND decode_none != '',
                    ({_step(names.FUNNEL_DECODE_HANDLE)}, decode_none),
                NOT reached AND handle != {lit(names.ROUTER_HANDLE_STALE)} AND NOT has_prev_decode,
                    ({_step(names.FUNNEL_DECODE_HANDLE)}, {lit(names.FUNNEL_LOST_PREVIOUS_DECODE_UNSEEN)}),
                NOT reached AND (expired OR in_margin),
                    ({_step(names.FUNNEL_KV_HELD)}, {lit(names.DIAG_TTL_LAPSED)}),
                NOT has_prefill,
                    ({_step(names.FUNNEL_KV_HELD)}, {lit(names.FUNNEL_LOST_NO_PREFILL_REQUEST)}),
                NOT reached AND handle = {lit(names.ROUTER_HANDLE_STALE)},
                    ({_step(names.FUNNEL_KV_HELD)}, {lit(names.DIAG_ROUTER_HANDLE_EXPIRED)}),
                NOT reached AND reason = {lit(names.REASON_NO_DECODE_HANDLE)},
                    ({_step(names.FUNNEL_KV_HELD)}, {lit(names.DIAG_ROUTER_KEPT_NO_HANDLE)}),
                NOT reached,
                    ({_step(names.FUNNEL_KV_HELD)}, {lit(names.FUNNEL_LOST_UNEXPLAINED)}),
                expired OR (declined AND (ttl_s <= 0 OR in_margin)),
                    ({_step(names.FUNNEL_KV_HELD)}, {lit(names.DIAG_TTL_LAPSED)}),
                {_in("reason", (names.REASON_BELOW_THRESHOLD, names.REASON_NOTHING_BEYOND_LOCAL_HIT))},
                    ({_step(names.FUNNEL_ABOVE_THRESHOLD)}, reason),
                NOT pulled_ok AND declined,
                    ({_step(names.FUNNEL_PULLED)}, {lit(names.DIAG_KV_READ_STARTED_LATE)}),
                NOT pulled_ok AND outcome = {lit(names.OUTCOME_FAILED_KV_LOAD)}
                    AND NOT (t_outcome = {lit(names.TRANSFER_FAILED)}
                             AND reason != {lit(names.REASON_DECLINED_EXPIRED)}),
                    ({_step(names.FUNNEL_PULLED)}, {lit(names.DIAG_EXPIRED_READ_FAILED)}),
                NOT pulled_ok AND (outcome = {lit(names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV)}
                                   OR t_outcome = {lit(names.TRANSFER_STUCK)}),
                    ({_step(names.FUNNEL_PULLED)}, {lit(names.DIAG_STUCK_WAITING_FOR_REMOTE_KV)}),
                NOT pulled_ok AND (t_outcome = {lit(names.TRANSFER_FAILED)}
                                   OR reason = {lit(names.REASON_TRANSFER_FAILED)}),
                    ({_step(names.FUNNEL_PULLED)}, {lit(names.DIAG_TRANSFER_FAILED)}),
                NOT pulled_ok AND {_in("reason", _NO_PULL_REASONS)},
                    ({_step(names.FUNNEL_PULLED)}, reason),
                NOT pulled_ok,
                    ({_step(names.FUNNEL_PULLED)}, {lit(names.FUNNEL_LOST_UNEXPLAINED)}),
                first_mismatch IS NOT NULL AND pulled > 0
                    AND local + pulled - greatest(first_mismatch, local) > 0,
                    ({_step(names.FUNNEL_FASTER)}, {lit(names.DIAG_KV_FOR_OTHER_TOKENS)}),
                decision = {lit(names.DECISION_PULL)} AND pulled > 0 AND pull_s > 0 AND per_token_s > 0
                    AND pull_s > pulled * per_token_s,
                    ({_step(names.FUNNEL_FASTER)}, {lit(names.DIAG_PULL_SLOWER_THAN_RECOMPUTE)}),
                ({END}, '')
            ) AS stop_reason,
            stop_reason.1 AS stop,
            stop_reason.2 AS lost_reason
        FROM derived
    ),
    steps AS (
        SELECT arrayJoin({_STEPS_ARRAY}) AS entry, entry.1 AS step_no, entry.2 AS title
    ),
    reached AS (
        SELECT
            steps.step_no AS step_no,
            countIf(placed.stop > steps.step_no) AS turns,
            sumIf(ifNull(placed.tokens, 0), placed.stop > steps.step_no) AS tokens,
            sumIf(placed.recompute_s, placed.stop > steps.step_no) AS recompute_s
        FROM steps CROSS JOIN placed
        GROUP BY steps.step_no
    ),
    lost_by AS (
        SELECT stop AS step_no, lost_reason, count() AS n, sum(ifNull(tokens, 0)) AS lost_tokens
        FROM placed
        WHERE stop < {END}
        GROUP BY stop, lost_reason
    ),
    lost AS (
        SELECT
            step_no,
            sum(n) AS lost,
            arrayStringConcat(
                arrayMap(
                    x -> concat(x.1, ': ', toString(x.2), ' (', toString(x.3), ' tokens)'),
                    arraySort(x -> (-x.2, x.1), groupArray((lost_reason, n, lost_tokens)))
                ),
                ', '
            ) AS lost_by_reason
        FROM lost_by
        GROUP BY step_no
    )
SELECT
    steps.title AS step,
    reached.turns AS turns,
    if((SELECT count() FROM placed) = 0, NULL, reached.turns / (SELECT count() FROM placed)) AS share,
    lost.lost AS lost,
    lost.lost_by_reason AS lost_by_reason,
    reached.tokens AS tokens,
    reached.recompute_s AS recompute_s
FROM steps
LEFT JOIN reached ON reached.step_no = steps.step_no
LEFT JOIN lost ON lost.step_no = steps.step_no
ORDER BY steps.step_no
"""
"""One row per funnel step, in order (a range without follow-up turns gives zero turns)."""


def reuse_funnel(panel_id: int) -> PanelBuilder:
    """The funnel table: share as a bar in its cell, so the rows read as a funnel."""
    gauge = [
        DynamicConfigValue(id_val="custom.cellOptions", value={"type": "gauge", "mode": "basic"}),
        DynamicConfigValue(id_val="min", value=0),
        DynamicConfigValue(id_val="max", value=1),
    ]
    return table_panel(
        panel_id,
        "Reuse funnel: follow-up turns",
        "Every follow-up turn (turn index 1 or more) through the steps of reverse KV reuse: a "
        "conversation id from the client, a decode handle from the previous turn, the KV still "
        "held when the turn arrived, enough reusable tokens for kv_recompute_threshold, a pull, "
        "and a pull faster than recomputing. Each row: the turns that reached the step, their "
        "share, the turns lost there by reason (diagnosis ids, docs/diagnoses.md), and the "
        "reusable tokens and prefill seconds at stake. `otelkv funnel` prints the same.",
        s.ClickHouseTarget(FUNNEL_SQL),
        columns={
            "share": unit_of(PERCENT, 0) + gauge,
            "turns": unit_of(COUNT, 0),
            "lost": unit_of(COUNT, 0),
            "tokens": unit_of(COUNT, 0),
            "recompute_s": unit_of(SECONDS, 3),
        },
        height=9,
    )
