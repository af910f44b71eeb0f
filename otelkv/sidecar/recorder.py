"""From a finished turn record to the turn span and the turn metrics (main process).

The proxy process hands over a :class:`~otelkv.sidecar.turn_watch.TurnRecord` per turn;
here it becomes the ``chat {model}`` span (the same span an OpenTelemetry SDK would have
made: ids chosen by the proxy, start at the request's arrival, end at its last byte) with
the four-phase split. The gap is split here rather than in the proxy because the agent's
``execute_tool`` spans, which decide tool wait vs app work, arrive at this process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from otelkv import __version__, names
from otelkv.analysis.phases import Phases, split_gap, turn_phases
from otelkv.sidecar.continuity import HistoryFacts
from otelkv.sidecar.metrics import SidecarMetrics
from otelkv.sidecar.tool_spans import ToolSpanIndex
from otelkv.sidecar.turn_watch import TurnRecord
from otelkv.spans import SpanRecord

logger = logging.getLogger("otelkv.sidecar")


def history_attributes(history: HistoryFacts) -> dict[str, Any]:
    """The turn span's attributes for the sidecar's comparison of the request's messages with
    the conversation's previous request and answer, or with a recent turn it continues."""
    out: dict[str, Any] = {}
    if history.previous_messages is not None:
        out[names.TURN_PREVIOUS_MESSAGES] = history.previous_messages
        out[names.CONVERSATION_ID_REUSED] = history.id_reused
    if history.rewritten_at is not None:
        out[names.TURN_HISTORY_REWRITTEN_AT] = history.rewritten_at
    if history.previous_answer is not None:
        out[names.TURN_PREVIOUS_ANSWER] = history.previous_answer
    resumed = history.resumed
    if resumed is not None:
        out[names.CONVERSATION_RESUMED_FROM] = resumed.conversation_id
        out[names.CONVERSATION_RESUMED_FROM_TRACE_ID] = resumed.trace_id
        out[names.CONVERSATION_RESUMED_GAP_SECONDS] = resumed.gap_s
        out[names.CONVERSATION_RESUMED_MESSAGES] = resumed.messages
        if resumed.tokens is not None:
            out[names.CONVERSATION_RESUMED_TOKENS] = resumed.tokens
    return out


class TurnRecorder:
    def __init__(
        self,
        *,
        metrics: SidecarMetrics,
        tools: ToolSpanIndex,
        resource: dict[str, Any],
        accept: Callable[[list[SpanRecord]], None],
    ) -> None:
        self.metrics = metrics
        self.tools = tools
        self.resource = resource
        self.accept = accept

    def record(self, records: list[TurnRecord]) -> None:
        spans = []
        for rec in records:
            try:
                spans.append(self.turn_span(rec))
            except Exception:
                logger.exception("otelkv sidecar: could not build a turn span")
        if spans:
            self.accept(spans)
        self.metrics.expire_tasks()

    def gap(self, rec: TurnRecord) -> Any:
        start = rec.start
        if start is None or not start.gap_start_ns:
            return split_gap(0, 0, first_turn=True)
        conversation_id = rec.identity.conversation_id if rec.identity else ""
        call_ids = (*start.previous_tool_call_ids, *rec.request.tool_result_call_ids)
        intervals = self.tools.intervals(
            start.gap_start_ns, rec.arrival_ns, conversation_id=conversation_id, call_ids=call_ids
        )
        return split_gap(
            start.gap_start_ns,
            rec.arrival_ns,
            tool_intervals=intervals,
            previous_asked_tools=start.previous_asked_tools,
            tool_results=rec.request.tool_results,
        )

    def turn_span(self, rec: TurnRecord) -> SpanRecord:
        facts = rec.response
        request = rec.request
        identity, start = rec.identity, rec.start
        arrival_ns = rec.arrival_ns
        request_s = (rec.end_ns - arrival_ns) / 1e9
        stream_ttft = None
        if facts is not None and request.stream and facts.first_token_ns is not None:
            stream_ttft = (facts.first_token_ns - arrival_ns) / 1e9
        gap = self.gap(rec)
        phases: Phases = turn_phases(gap, request_s, stream_ttft_s=stream_ttft)
        ok = rec.error is None and 200 <= rec.status < 300
        model = request.model or "unknown"
        # Assigned one by one: no intermediate dict literals for update().
        attributes: dict[str, Any] = {
            names.GEN_AI_OPERATION_NAME: rec.operation,
            names.GEN_AI_REQUEST_MODEL: request.model,
            names.GEN_AI_PROVIDER_NAME: names.PROVIDER_VLLM,
            names.HTTP_ROUTE: rec.path,
            names.TURN_STREAM: request.stream,
            names.TURN_MESSAGES: request.messages,
            names.TURN_TOOL_RESULTS: request.tool_results,
        }
        if identity is not None and start is not None:
            attributes[names.GEN_AI_CONVERSATION_ID] = identity.conversation_id
            attributes[names.CONVERSATION_ID_SOURCE] = identity.source
            attributes[names.CONVERSATION_INFERRED] = identity.inferred
            attributes[names.TURN_INDEX] = start.index
            attributes[names.TURN_PREVIOUS_TRACE_ID] = start.previous_trace_id
        attributes[names.HTTP_STATUS] = rec.status
        attributes[names.TURN_GAP_SECONDS] = gap.tool_wait_s + gap.app_work_s
        attributes[names.TURN_GAP_SOURCE] = gap.source
        attributes[names.TURN_TOOL_WAIT_SECONDS] = phases.tool_wait_s
        attributes[names.TURN_APP_WORK_SECONDS] = phases.app_work_s
        attributes[names.TURN_INPUT_PROCESSING_SECONDS] = phases.input_processing_s
        attributes[names.TURN_GENERATION_SECONDS] = phases.generation_s
        attributes[names.TURN_TOTAL_SECONDS] = phases.total_s
        attributes[names.TURN_TTFT_SOURCE] = phases.ttft_source
        attributes[names.TURN_SOCKET_WAIT_SECONDS] = rec.socket_wait_ns / 1e9
        if facts is not None:
            if facts.model:
                attributes[names.GEN_AI_RESPONSE_MODEL] = facts.model
            if facts.response_id:
                attributes[names.GEN_AI_RESPONSE_ID] = facts.response_id
            if facts.prompt_tokens is not None:
                attributes[names.GEN_AI_USAGE_INPUT_TOKENS] = facts.prompt_tokens
            if facts.completion_tokens is not None:
                attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] = facts.completion_tokens
            if facts.cached_tokens is not None:
                attributes[names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = facts.cached_tokens
            if facts.finish_reasons:
                attributes[names.GEN_AI_RESPONSE_FINISH_REASONS] = list(facts.finish_reasons[:16])
            attributes[names.TURN_RESPONSE_KV_PARAMS] = facts.kv_transfer_params
            attributes[names.TURN_ASKED_TOOLS] = facts.asked_tools
            if stream_ttft is not None:
                attributes[names.TURN_TTFT_SECONDS] = stream_ttft
            if facts.last_token_ns is not None:
                attributes[names.TURN_LAST_TOKEN_SECONDS] = (facts.last_token_ns - rec.arrival_ns) / 1e9
        if rec.history is not None:
            attributes.update(history_attributes(rec.history))
        status_code, status_message = "Unset", ""
        if not ok:
            status_code = "Error"
            status_message = rec.error or f"upstream returned {rec.status}"
            attributes[names.ERROR_TYPE] = (
                "client_disconnected"
                if rec.error == names.CLIENT_DISCONNECTED
                else str(rec.status or "upstream")
            )
        self.metrics.observe_turn(
            model=model,
            phases=phases,
            ttft_s=stream_ttft,
            turn_index=rec.start.index if rec.start else 0,
            ok=ok,
            stream=rec.request.stream,
            conversation_id=rec.identity.conversation_id if rec.identity is not None else None,
            start_ns=rec.arrival_ns,
            end_ns=rec.end_ns,
        )
        return SpanRecord(
            trace_id=rec.trace_id,
            span_id=rec.span_id,
            parent_span_id=rec.parent.span_id if rec.parent else "",
            name=names.SPAN_AGENT_TURN.format(model=model),
            kind="Server",
            start_ns=rec.arrival_ns,
            end_ns=rec.end_ns,
            attributes=attributes,
            resource=self.resource,
            scope_name=names.SCOPE_SIDECAR,
            scope_version=__version__,
            status_code=status_code,
            status_message=status_message,
            trace_state=rec.parent.trace_state if rec.parent else "",
        )
