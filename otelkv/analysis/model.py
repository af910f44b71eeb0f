"""A rich model of one agent turn, rebuilt from the spans of its trace (pure logic).

A turn's trace holds the sidecar's ``chat {model}`` span (the turn itself), the router's
span and legs, and on each engine a ``kv_request`` span with ``kv_transfer`` and
``kv_retention`` children. The decode node's retention ends when the *next* turn reads
it or its TTL lapses, but it stays in this trace, so a turn read after the fact knows
whether its KV survived the gap that followed.

The sidecar computed the phase split at turn end with what it knew then. Better
evidence often arrives later (the agent's ``execute_tool`` spans, engine spans that bound
the first token of a non-streaming response), so :func:`build_turn` recomputes the split
with :mod:`otelkv.analysis.phases` whenever it has such evidence.

Without a sidecar span the model still works: an agent's ``chat`` span carrying a turn
index (the reference fleet's driver) stands in, and failing that the engine spans alone
give a turn without phases of the agent's side.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from otelkv import names
from otelkv.analysis.phases import GapSplit, Phases, split_gap, turn_phases
from otelkv.spans import (
    SpanRecord,
    attr_float,
    attr_int,
    attr_str,
    is_agent_turn_span,
    is_engine_request,
    is_prefill_request,
    is_retention,
    is_router_span,
    is_sidecar_turn_span,
    is_tool_span,
    is_transfer,
    opt_bool,
    opt_float,
    opt_int,
    opt_str,
)
from otelkv.spans.kinds import MIN_COMPUTED_TOKENS

SOURCE_SIDECAR = "sidecar"
"""The turn came from the sidecar's turn span (the authoritative source)."""
SOURCE_AGENT = "agent"
"""The turn came from an agent's own ``chat`` span with a turn index."""
SOURCE_ENGINE = "engine"
"""Only engine (and router) spans: no agent-side phases, no turn index."""


@dataclass
class EngineConfig:
    """Configuration in force on one engine (its resource attributes)."""

    engine_id: str | None = None
    recompute_threshold: int | None = None
    decoder_ttl_s: float | None = None
    bidirectional: bool | None = None
    load_failure_policy: str | None = None
    model: str | None = None
    block_size: int | None = None
    kv_cache_dtype: str | None = None
    prefix_caching: bool | None = None
    role: str | None = None


@dataclass
class Transfer:
    """One ``kv_transfer`` span."""

    direction: str
    outcome: str | None
    bytes: int
    xfer_s: float | None
    wait_s: float | None
    post_s: float | None
    tokens: int | None
    backend: str | None
    start_ns: int
    end_ns: int


@dataclass
class Retention:
    """One ``kv_retention`` span (blocks kept for another engine to read)."""

    kind: str
    outcome: str | None
    held_s: float | None
    blocks: int
    bytes: int
    ttl_s: float | None


@dataclass(frozen=True)
class Continuity:
    """A prefill request's decode handle checked against its prompt (``otelkv.continuity.*``)."""

    digest: bool
    offered: int | None = None
    matching: int | None = None
    first_mismatch: int | None = None
    mismatch_in: str | None = None


@dataclass(frozen=True)
class History:
    """The sidecar's comparison of a chat request's messages with its conversation's previous
    request and the answer the sidecar relayed (``otelkv.turn.previous_messages`` and the
    attributes beside it; no text, digests only)."""

    previous_messages: int
    """Messages of the previous request compared with."""
    rewritten_at: int | None = None
    """The first of them this request changed or dropped (None: all came back unchanged)."""
    id_reused: bool = False
    """Nothing shared beyond an identical leading system message: one id, another conversation."""
    previous_answer: str | None = None
    """:data:`otelkv.names.PREVIOUS_ANSWER_STATES` (None: not compared)."""


@dataclass(frozen=True)
class ResumedFrom:
    """A conversation's first request that opens with a recent turn of another conversation
    (its messages and answer): the conversation continued under a new id."""

    conversation_id: str
    trace_id: str
    gap_s: float
    """That turn's last byte to this request's arrival."""
    tokens: int | None
    """That turn's prompt plus completion tokens: the KV its decode node held."""
    messages: int | None
    """Messages of this request that repeat that turn (its request's and the answer)."""


@dataclass
class Leg:
    """What one engine recorded for the turn's request (a ``kv_request {role}`` span)."""

    role: str
    request_id: str = ""
    engine_id: str | None = None
    start_ns: int = 0
    end_ns: int = 0
    outcome: str | None = None
    status: str = "Unset"
    status_message: str = ""
    vllm_status: str | None = None
    prompt_tokens: int = 0
    output_tokens: int | None = None
    computed: int | None = None
    local_cache: int | None = None
    pulled: int | None = None
    remote_reusable: int | None = None
    decision: str | None = None
    reason: str | None = None
    threshold: int | None = None
    remote_kv_wait_s: float | None = None
    kv_params_returned: bool | None = None
    streamed: bool | None = None
    """The request asked vLLM for a stream (None: the engine did not say)."""
    context_source: str | None = None
    """Where the engine got the turn's trace context (:data:`otelkv.names.TRACE_CONTEXT_SOURCES`)."""
    conversation_id: str = ""
    """The conversation id the engine saw (vLLM ``session_id``; empty: none reached it)."""
    base_request_id: str = ""
    """vLLM's request id without its suffix: the same on both legs of one routed request,
    and the ``id`` of the response vLLM returns."""
    continuity: Continuity | None = None
    """The prompt against the tokens the decode handle's KV was computed for (prefill legs
    that got a handle; None: no handle, or no check recorded)."""
    transfer: Transfer | None = None
    retention: Retention | None = None
    config: EngineConfig = field(default_factory=EngineConfig)

    @property
    def duration_s(self) -> float:
        return max(self.end_ns - self.start_ns, 0) / 1e9

    @property
    def compute_s(self) -> float:
        """Engine time not spent waiting for remote KV: the best local estimate of compute."""
        wait = self.transfer.wait_s if self.transfer and self.transfer.wait_s else 0.0
        return max(self.duration_s - wait, 0.0)


@dataclass
class RouterInfo:
    """The router's view of the turn (``router {operation}`` span)."""

    handle: str | None = None
    handle_age_s: float | None = None
    handle_ttl_s: float | None = None
    decode_streamed: bool | None = None
    http_status: int | None = None
    status: str = "Unset"
    status_message: str = ""


@dataclass(frozen=True)
class EngineJoin:
    """How a turn's engine requests were tied to it.

    ``trace``: the engines continued the turn's trace (trace context reached them through
    headers or the body). ``inferred``: they arrived in traces of their own and were matched
    to the turn from what both sides saw; ``evidence`` names what matched.
    """

    method: str
    evidence: tuple[str, ...] = ()


@dataclass
class Turn:
    """One agent turn: identity, timing and phases, and what the fleet did for it."""

    trace_id: str
    source: str
    span_id: str = ""
    conversation_id: str = ""
    conversation_inferred: bool | None = None
    conversation_id_source: str | None = None
    index: int | None = None
    model: str | None = None
    start_ns: int = 0
    end_ns: int = 0
    stream: bool | None = None
    ttft_s: float | None = None
    status: str = names.TURN_STATUS_OK
    status_message: str = ""
    http_status: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    finish_reasons: str | None = None
    response_kv_params: bool | None = None
    asked_tools: bool | None = None
    tool_results: int | None = None
    previous_trace_id: str = ""
    gap_s: float = 0.0
    phases: Phases | None = None
    router: RouterInfo | None = None
    prefill: Leg | None = None
    decode: Leg | None = None
    previous: Turn | None = field(default=None, repr=False)
    span_count: int = 0
    response_id: str | None = None
    """The ``id`` of the response the client got (``gen_ai.response.id``)."""
    join: EngineJoin | None = None
    """How the engine requests were tied to this turn (None: no engine request is)."""
    history: History | None = None
    """The sidecar's comparison with the conversation's previous request (None: not compared)."""
    resumed_from: ResumedFrom | None = None
    """The recent turn of another conversation this first request continues (None: none)."""

    @property
    def request_s(self) -> float:
        return max(self.end_ns - self.start_ns, 0) / 1e9

    @property
    def total_s(self) -> float:
        return self.phases.total_s if self.phases else self.request_s + self.gap_s

    @property
    def gap_start_ns(self) -> int:
        return self.start_ns - round(self.gap_s * 1e9)

    def configs(self) -> list[EngineConfig]:
        return [leg.config for leg in (self.prefill, self.decode) if leg is not None]

    def decoder_ttl_s(self) -> float | None:
        """The decode TTL that governed this turn's hand-off.

        The configured value first (the decode node's resource attributes: what an operator
        sets and recognises), the previous retention's measured TTL only without it (its
        deadline minus start reads a few microseconds short, e.g. 9.99975 for 10).
        """
        prev = self.previous
        if prev and prev.decode and prev.decode.config.decoder_ttl_s is not None:
            return prev.decode.config.decoder_ttl_s
        for leg in (self.decode, self.prefill):
            if leg is not None and leg.config.decoder_ttl_s is not None:
                return leg.config.decoder_ttl_s
        if prev and prev.decode and prev.decode.retention and prev.decode.retention.ttl_s is not None:
            return prev.decode.retention.ttl_s
        return None


# ------------------------------------------------------------------ building


def engine_config(resource: dict[str, Any]) -> EngineConfig:
    """An engine's configuration in force, from its resource attributes."""
    return EngineConfig(
        engine_id=opt_str(resource, names.ENGINE_ID),
        recompute_threshold=opt_int(resource, names.KV_RECOMPUTE_THRESHOLD),
        decoder_ttl_s=opt_float(resource, names.DECODER_KV_BLOCKS_TTL),
        bidirectional=opt_bool(resource, names.BIDIRECTIONAL_KV_XFER),
        load_failure_policy=opt_str(resource, names.KV_LOAD_FAILURE_POLICY),
        model=opt_str(resource, names.GEN_AI_REQUEST_MODEL),
        block_size=opt_int(resource, names.KV_BLOCK_SIZE),
        kv_cache_dtype=opt_str(resource, names.KV_CACHE_DTYPE),
        prefix_caching=opt_bool(resource, names.PREFIX_CACHING),
        role=opt_str(resource, names.ROLE),
    )


def _continuity(a: dict[str, Any]) -> Continuity | None:
    present = opt_bool(a, names.CONTINUITY_DIGEST)
    if present is None:
        return None
    return Continuity(
        digest=present,
        offered=opt_int(a, names.CONTINUITY_OFFERED),
        matching=opt_int(a, names.CONTINUITY_MATCHING),
        first_mismatch=opt_int(a, names.CONTINUITY_FIRST_MISMATCH),
        mismatch_in=opt_str(a, names.CONTINUITY_MISMATCH_IN),
    )


def _leg(request: SpanRecord, children: Sequence[SpanRecord]) -> Leg:
    a = request.attributes
    config = engine_config(request.resource)
    leg = Leg(
        role=attr_str(a, names.ROLE),
        request_id=attr_str(a, names.REQUEST_ID),
        engine_id=config.engine_id,
        start_ns=request.start_ns,
        end_ns=request.end_ns,
        outcome=opt_str(a, names.REQUEST_OUTCOME),
        status=request.status_code or "Unset",
        status_message=request.status_message,
        vllm_status=opt_str(a, names.REQUEST_STATUS),
        prompt_tokens=attr_int(a, names.GEN_AI_USAGE_INPUT_TOKENS),
        output_tokens=opt_int(a, names.GEN_AI_USAGE_OUTPUT_TOKENS),
        computed=opt_int(a, names.TOKENS_COMPUTED),
        local_cache=opt_int(a, names.TOKENS_LOCAL_CACHE_HIT),
        pulled=opt_int(a, names.TOKENS_PULLED),
        remote_reusable=opt_int(a, names.TOKENS_REMOTE_REUSABLE),
        decision=opt_str(a, names.PULL_DECISION),
        reason=opt_str(a, names.PULL_REASON),
        threshold=opt_int(a, names.KV_RECOMPUTE_THRESHOLD),
        remote_kv_wait_s=opt_float(a, names.REMOTE_KV_WAIT_SECONDS),
        kv_params_returned=opt_bool(a, names.KV_PARAMS_RETURNED),
        streamed=opt_bool(a, names.REQUEST_STREAMED),
        context_source=opt_str(a, names.TRACE_CONTEXT_SOURCE),
        conversation_id=attr_str(a, names.GEN_AI_CONVERSATION_ID),
        base_request_id=attr_str(a, names.GEN_AI_REQUEST_ID),
        continuity=_continuity(a),
        config=config,
    )
    if leg.threshold is None:
        leg.threshold = config.recompute_threshold
    for child in sorted(children, key=lambda s: s.start_ns):
        c = child.attributes
        if is_transfer(child):
            leg.transfer = Transfer(
                direction=attr_str(c, names.TRANSFER_DIRECTION),
                outcome=opt_str(c, names.TRANSFER_OUTCOME),
                bytes=attr_int(c, names.TRANSFER_BYTES),
                xfer_s=opt_float(c, names.TRANSFER_XFER_SECONDS),
                wait_s=opt_float(c, names.TRANSFER_WAIT_SECONDS),
                post_s=opt_float(c, names.TRANSFER_POST_SECONDS),
                tokens=opt_int(c, names.TRANSFER_TOKENS),
                backend=opt_str(c, names.TRANSFER_BACKEND),
                start_ns=child.start_ns,
                end_ns=child.end_ns,
            )
        elif is_retention(child):
            leg.retention = Retention(
                kind=attr_str(c, names.RETENTION_KIND),
                outcome=opt_str(c, names.RETENTION_OUTCOME),
                held_s=opt_float(c, names.RETENTION_HELD_SECONDS),
                blocks=attr_int(c, names.RETENTION_BLOCKS),
                bytes=attr_int(c, names.RETENTION_BYTES),
                ttl_s=opt_float(c, names.RETENTION_TTL_SECONDS),
            )
    return leg


def _in_gap(
    tools: Iterable[SpanRecord], conversation_id: str, start_ns: int, end_ns: int
) -> list[tuple[int, int]]:
    """Intervals of this conversation's tool spans that overlap the gap.

    Tool spans live in the agent's own traces, so they join the turn by conversation id
    (``gen_ai.conversation.id``); a tool span without one cannot be attributed safely.
    """
    out = []
    for span in tools:
        if not is_tool_span(span) or span.end_ns <= start_ns or span.start_ns >= end_ns:
            continue
        if conversation_id and attr_str(span.attributes, names.GEN_AI_CONVERSATION_ID) == conversation_id:
            out.append((span.start_ns, span.end_ns))
    return out


def _pick_turn_span(spans: Sequence[SpanRecord]) -> SpanRecord | None:
    sidecar = [s for s in spans if is_sidecar_turn_span(s)]
    if sidecar:
        return min(sidecar, key=lambda s: s.start_ns)
    agent = [s for s in spans if is_agent_turn_span(s)]
    return min(agent, key=lambda s: s.start_ns) if agent else None


def build_turn(
    spans: Sequence[SpanRecord],
    *,
    tool_spans: Iterable[SpanRecord] = (),
    previous: Turn | None = None,
) -> Turn | None:
    """The turn of one trace, or None if the trace holds neither a turn nor an engine request.

    ``tool_spans`` are the agent's ``execute_tool`` spans (any trace); those of this
    conversation that fall in the gap before the turn override the sidecar's
    message-based split. ``previous`` links the previous turn (its decode retention tells
    whether the KV this turn could have read was still there).
    """
    if not spans:
        return None
    trace_id = spans[0].trace_id
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for span in spans:
        children[span.parent_span_id].append(span)
    prefills: list[Leg] = []
    decodes: list[Leg] = []
    router: RouterInfo | None = None
    for span in spans:
        if is_engine_request(span):
            leg = _leg(span, children.get(span.span_id, []))
            if leg.role == names.ROLE_DECODE:
                decodes.append(leg)
            else:
                prefills.append(leg)
        elif is_router_span(span) and router is None:
            a = span.attributes
            router = RouterInfo(
                handle=opt_str(a, names.ROUTER_HANDLE),
                handle_age_s=opt_float(a, names.ROUTER_HANDLE_AGE_SECONDS),
                handle_ttl_s=opt_float(a, names.ROUTER_HANDLE_TTL_SECONDS),
                decode_streamed=opt_bool(a, names.ROUTER_DECODE_STREAMED),
                http_status=opt_int(a, names.HTTP_STATUS),
                status=span.status_code,
                status_message=span.status_message,
            )
    turn_span = _pick_turn_span(spans)
    if turn_span is None and not prefills and not decodes:
        return None
    # Retries leave several requests per role: the last one is the one that answered.
    prefill = max(prefills, key=lambda leg: leg.start_ns) if prefills else None
    decode = max(decodes, key=lambda leg: leg.start_ns) if decodes else None
    turn = Turn(trace_id=trace_id, source=SOURCE_ENGINE, router=router, prefill=prefill, decode=decode)
    turn.previous = previous
    turn.span_count = len(spans)
    if turn_span is not None:
        _fill_from_turn_span(turn, turn_span)
    else:
        _fill_from_engines(turn, spans)
    if previous is not None and not turn.previous_trace_id:
        turn.previous_trace_id = previous.trace_id
    if prefill is not None or decode is not None:
        turn.join = EngineJoin(names.JOIN_TRACE)
    turn.phases = _phases(turn, turn_span, list(tool_spans))
    return turn


def _fill_from_turn_span(turn: Turn, span: SpanRecord) -> None:
    a = span.attributes
    turn.source = SOURCE_SIDECAR if span.scope_name == names.SCOPE_SIDECAR else SOURCE_AGENT
    turn.span_id = span.span_id
    turn.conversation_id = attr_str(a, names.GEN_AI_CONVERSATION_ID)
    turn.conversation_inferred = opt_bool(a, names.CONVERSATION_INFERRED)
    turn.conversation_id_source = opt_str(a, names.CONVERSATION_ID_SOURCE)
    turn.index = opt_int(a, names.TURN_INDEX)
    turn.model = opt_str(a, names.GEN_AI_REQUEST_MODEL)
    turn.start_ns, turn.end_ns = span.start_ns, span.end_ns
    turn.stream = opt_bool(a, names.TURN_STREAM)
    turn.ttft_s = opt_float(a, names.TURN_TTFT_SECONDS)
    turn.http_status = opt_int(a, names.HTTP_STATUS)
    failed = span.status_code == "Error" or (turn.http_status is not None and turn.http_status >= 400)
    turn.status = names.TURN_STATUS_ERROR if failed else names.TURN_STATUS_OK
    turn.status_message = span.status_message
    turn.input_tokens = opt_int(a, names.GEN_AI_USAGE_INPUT_TOKENS)
    turn.output_tokens = opt_int(a, names.GEN_AI_USAGE_OUTPUT_TOKENS)
    turn.cache_read_tokens = opt_int(a, names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS)
    turn.finish_reasons = opt_str(a, names.GEN_AI_RESPONSE_FINISH_REASONS)
    turn.response_id = opt_str(a, names.GEN_AI_RESPONSE_ID)
    turn.response_kv_params = opt_bool(a, names.TURN_RESPONSE_KV_PARAMS)
    turn.asked_tools = opt_bool(a, names.TURN_ASKED_TOOLS)
    turn.tool_results = opt_int(a, names.TURN_TOOL_RESULTS)
    turn.previous_trace_id = attr_str(a, names.TURN_PREVIOUS_TRACE_ID)
    turn.gap_s = max(attr_float(a, names.TURN_GAP_SECONDS), 0.0)
    turn.history = _history(a)
    turn.resumed_from = _resumed_from(a)


def _history(a: dict[str, Any]) -> History | None:
    previous = opt_int(a, names.TURN_PREVIOUS_MESSAGES)
    if previous is None:
        return None
    answer = opt_str(a, names.TURN_PREVIOUS_ANSWER)
    return History(
        previous_messages=previous,
        rewritten_at=opt_int(a, names.TURN_HISTORY_REWRITTEN_AT),
        id_reused=opt_bool(a, names.CONVERSATION_ID_REUSED) is True,
        # A value from another writer (or a later version) is not one the analysis knows.
        previous_answer=answer if answer in names.PREVIOUS_ANSWER_STATES else None,
    )


def _resumed_from(a: dict[str, Any]) -> ResumedFrom | None:
    conversation_id = opt_str(a, names.CONVERSATION_RESUMED_FROM)
    if not conversation_id:
        return None
    return ResumedFrom(
        conversation_id=conversation_id,
        trace_id=attr_str(a, names.CONVERSATION_RESUMED_FROM_TRACE_ID),
        gap_s=max(attr_float(a, names.CONVERSATION_RESUMED_GAP_SECONDS), 0.0),
        tokens=opt_int(a, names.CONVERSATION_RESUMED_TOKENS),
        messages=opt_int(a, names.CONVERSATION_RESUMED_MESSAGES),
    )


def _fill_from_engines(turn: Turn, spans: Sequence[SpanRecord]) -> None:
    legs = [leg for leg in (turn.prefill, turn.decode) if leg is not None]
    engine_spans = [s for s in spans if is_engine_request(s) or is_router_span(s)]
    turn.start_ns = min(s.start_ns for s in engine_spans)
    turn.end_ns = max(s.end_ns for s in engine_spans)
    turn.span_id = min(engine_spans, key=lambda s: s.start_ns).span_id
    for span in engine_spans:
        cid = attr_str(span.attributes, names.GEN_AI_CONVERSATION_ID)
        if cid:
            turn.conversation_id = cid
            break
    failed = any(leg.status == "Error" for leg in legs) or any(s.status_code == "Error" for s in engine_spans)
    turn.status = names.TURN_STATUS_ERROR if failed else names.TURN_STATUS_OK
    if turn.prefill:
        turn.input_tokens = turn.prefill.prompt_tokens
    if turn.decode:
        turn.output_tokens = turn.decode.output_tokens


def _phases(turn: Turn, turn_span: SpanRecord | None, tools: list[SpanRecord]) -> Phases:
    """The four-phase split, recomputed when the trace holds better evidence than the sidecar had."""
    a = turn_span.attributes if turn_span is not None else {}
    prev = turn.previous
    first = turn.index == 0 if turn.index is not None else prev is None
    if turn.source != SOURCE_SIDECAR and prev is not None and turn.start_ns > prev.end_ns:
        turn.gap_s = (turn.start_ns - prev.end_ns) / 1e9
    gap_start, gap_end = turn.gap_start_ns, turn.start_ns
    intervals = _in_gap(tools, turn.conversation_id, gap_start, gap_end) if turn.gap_s > 0 else []
    if intervals:
        gap = split_gap(gap_start, gap_end, tool_intervals=intervals)
    elif turn.source == SOURCE_SIDECAR and opt_str(a, names.TURN_GAP_SOURCE) is not None:
        tool_wait = max(attr_float(a, names.TURN_TOOL_WAIT_SECONDS), 0.0)
        app_work = max(attr_float(a, names.TURN_APP_WORK_SECONDS), 0.0)
        if abs(tool_wait + app_work - turn.gap_s) > 1e-3:  # keep the sum exact
            app_work = max(turn.gap_s - tool_wait, 0.0)
        gap = GapSplit(tool_wait, app_work, attr_str(a, names.TURN_GAP_SOURCE))
    else:
        gap = split_gap(
            gap_start,
            gap_end,
            previous_asked_tools=bool(prev and prev.asked_tools),
            tool_results=turn.tool_results or 0,
            first_turn=first and turn.gap_s == 0,
        )
    stream_ttft = turn.ttft_s if (turn.stream and turn.ttft_s is not None) else None
    engine_ttft = None
    if stream_ttft is None and turn.prefill is not None and turn.prefill.end_ns > turn.start_ns:
        # The client's first token is the decode node's, produced once the prefill node's
        # KV has arrived there: the hand-off wait is input processing, not generation.
        first_token_ns = turn.prefill.end_ns
        handoff = turn.decode.transfer if turn.decode is not None else None
        if handoff is not None and handoff.end_ns > first_token_ns:
            first_token_ns = handoff.end_ns
        engine_ttft = (first_token_ns - turn.start_ns) / 1e9
    phases = turn_phases(gap, turn.request_s, stream_ttft_s=stream_ttft, engine_ttft_s=engine_ttft)
    if turn.ttft_s is None and phases.ttft_source != names.TTFT_SOURCE_RESPONSE:
        turn.ttft_s = phases.input_processing_s
    return phases


def request_compute_rate(span: SpanRecord) -> float | None:
    """Seconds per computed prompt token of one prefill request span: its duration less its
    wait for remote KV, over the tokens it computed. None when it does not measure compute:
    not a finished prefill request, fewer than :data:`MIN_COMPUTED_TOKENS` computed, a token
    count or wait that is NaN or infinite, or a wait that covered the whole span. The one
    rule behind every recompute price (``why``, the sidecar's
    ``otelkv_trace_pull_prefill_seconds_total``); a store applies it in SQL as
    :data:`otelkv.spans.sql.COMPUTE_RATE_S` over :data:`otelkv.spans.sql.COMPUTE_MEASURING_SPANS`
    (the tests hold the two together)."""
    if not is_prefill_request(span):
        return None
    a = span.attributes
    computed = attr_float(a, names.TOKENS_COMPUTED)
    wait_s = attr_float(a, names.REMOTE_KV_WAIT_SECONDS)
    if not (math.isfinite(computed) and math.isfinite(wait_s)):
        return None  # NaN or an infinity measures nothing (and an infinite count would price 0)
    if computed < MIN_COMPUTED_TOKENS or attr_str(a, names.REQUEST_OUTCOME) != names.OUTCOME_FINISHED:
        return None
    compute_s = span.duration_s - max(wait_s, 0.0)
    return compute_s / computed if compute_s > 0 else None


def per_token_compute_s(turns: Iterable[Turn], *, min_tokens: int = MIN_COMPUTED_TOKENS) -> float | None:
    """Seconds per computed prompt token on the prefill node: the fastest of the given turns.

    A prefill span's duration minus its KV wait, divided by the tokens it computed,
    bounds the cost of recomputing one token on that engine from above. Requests that
    computed fewer than ``min_tokens`` are skipped (fixed per-request overhead dominates),
    and so are those whose KV wait took the whole span (no compute measured).
    """
    rates = []
    for turn in turns:
        leg = turn.prefill
        if (
            leg is None
            or not leg.computed
            or leg.computed < min_tokens
            or leg.outcome
            not in (
                None,
                names.OUTCOME_FINISHED,
            )
        ):
            continue
        if leg.compute_s <= 0.0:
            # The KV wait covered the whole span (its clock and the worker's differ): this
            # request measured no compute at all, and a rate of 0 would win the min() below.
            continue
        rates.append(leg.compute_s / leg.computed)
    if not rates:
        return None
    # Queueing inside the engine only ever adds to a span, so the fastest observed rate is
    # the closest to pure compute (one queued turn would pull a median far up).
    return min(rates)
