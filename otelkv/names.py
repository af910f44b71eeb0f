"""Every span name, attribute key, metric name and fixed vocabulary otelkv emits.

Every layer (engine, spans, store, analysis, sidecar, dashboards, fleet, CLI) and the tests
import names from here, so a rename is one edit and a grep finds every use. Nothing here
imports anything of otelkv's.

Choices, in order of preference:

1. OpenTelemetry GenAI semantic conventions where a key exists (``gen_ai.*``). The GenAI
   conventions moved to their own repository and have no Python package; the constants
   are copied here on purpose.
2. vLLM's own vocabulary for the things vLLM names (``engine_id``, ``remote_engine_id``,
   ``kv_recompute_threshold``, ...), under the ``otelkv.`` prefix so nothing collides with
   vLLM's own span attributes.
3. ``otelkv.`` for everything else.

Conversation ids are span attributes only, never metric labels: every metric label below
takes its values from one of the closed vocabularies at the end of this module.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Final

# --------------------------------------------------------------------------------------
# Instrumentation scope
# --------------------------------------------------------------------------------------

SCOPE_ENGINE: Final = "otelkv.engine"
"""Tracer/meter scope of the instrumented connector (inside vLLM processes)."""

SCOPE_FLEET: Final = "otelkv.fleet"
"""Tracer scope of the reference fleet's router and agent driver."""

SCOPE_SIDECAR: Final = "otelkv.sidecar"
"""Tracer scope of the sidecar's turn spans (the span that defines a turn in the store)."""

# --------------------------------------------------------------------------------------
# Span names (low cardinality: the variable part is a role or a direction)
# --------------------------------------------------------------------------------------

SPAN_ENGINE_REQUEST: Final = "kv_request {role}"
"""One request's life on one engine, as the KV connector sees it (role: prefill/decode)."""

SPAN_TRANSFER: Final = "kv_transfer {direction}"
"""One KV transfer read by this engine (direction: ``D->P`` reverse pull, ``P->D``)."""

SPAN_RETENTION: Final = "kv_retention {kind}"
"""Blocks an engine keeps after a request so that another engine can read them."""

SPAN_ROUTER_TURN: Final = "router {operation}"
"""The reference router's handling of one request (operation: chat/text_completion)."""

SPAN_ROUTER_LEG: Final = "router_leg {role}"
"""One leg (prefill or decode call) of the reference router."""

SPAN_AGENT_TURN: Final = "chat {model}"
"""The agent driver's client span for one turn (GenAI inference span naming)."""

SPAN_TOOL: Final = "execute_tool {name}"
"""The agent driver's tool execution span (GenAI convention)."""


@functools.lru_cache(maxsize=64)
def engine_request_span_name(role: str) -> str:
    return SPAN_ENGINE_REQUEST.format(role=role)


@functools.lru_cache(maxsize=64)
def transfer_span_name(direction: str) -> str:
    return SPAN_TRANSFER.format(direction=direction)


@functools.lru_cache(maxsize=64)
def retention_span_name(kind: str) -> str:
    return SPAN_RETENTION.format(kind=kind)


def span_name_prefix(template: str) -> str:
    """The fixed part of a span-name template, with its space: ``kv_request {role}`` ->
    ``kv_request ``. ``router {operation}`` and ``router_leg {role}`` stay apart."""
    return template.split("{", 1)[0]


# --------------------------------------------------------------------------------------
# Operation values (``gen_ai.operation.name``, GenAI conventions)
# --------------------------------------------------------------------------------------

OPERATION_CHAT: Final = "chat"
OPERATION_TEXT_COMPLETION: Final = "text_completion"
OPERATION_EXECUTE_TOOL: Final = "execute_tool"
TURN_OPERATIONS: Final = (OPERATION_CHAT, OPERATION_TEXT_COMPLETION)
"""The operations of a turn span: the sidecar names both ``chat {model}``."""


# --------------------------------------------------------------------------------------
# GenAI semantic-convention attribute keys
# --------------------------------------------------------------------------------------

GEN_AI_CONVERSATION_ID: Final = "gen_ai.conversation.id"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
GEN_AI_REQUEST_ID: Final = "gen_ai.request.id"
"""Not in the GenAI registry: vLLM's own ``llm_request`` span uses it for the external
request id (``chatcmpl-...``). otelkv sets it to the same value - vLLM's internal id
without its 8-hex suffix, identical on the prefill and the decode node for one routed
request - so P and D spans, and vLLM-native spans, join on one key."""
ERROR_TYPE: Final = "error.type"

PROVIDER_VLLM: Final = "vllm"

# --------------------------------------------------------------------------------------
# otelkv attribute keys: identity
# --------------------------------------------------------------------------------------

ROLE: Final = "otelkv.role"
"""What this request is on this engine: ``prefill``, ``decode`` or ``unified``."""
ENGINE_ID: Final = "otelkv.engine_id"
"""vLLM ``kv_transfer_config.engine_id`` of the engine that emitted the span."""
REQUEST_ID: Final = "otelkv.request_id"
"""vLLM's internal request id (external id plus an 8-hex suffix)."""
KV_CONNECTOR: Final = "otelkv.kv_connector"
"""Class name of the wrapped (inner) connector."""

# --------------------------------------------------------------------------------------
# otelkv attribute keys: configuration in force (vLLM names)
# --------------------------------------------------------------------------------------

KV_RECOMPUTE_THRESHOLD: Final = "otelkv.kv_recompute_threshold"
DECODER_KV_BLOCKS_TTL: Final = "otelkv.decoder_kv_blocks_ttl"
BIDIRECTIONAL_KV_XFER: Final = "otelkv.bidirectional_kv_xfer"
KV_LOAD_FAILURE_POLICY: Final = "otelkv.kv_load_failure_policy"
KV_BLOCK_SIZE: Final = "otelkv.kv_cache.block_size"
"""vLLM ``cache_config.block_size``: prefill and decode must agree for a hand-off."""
KV_CACHE_DTYPE: Final = "otelkv.kv_cache.dtype"
"""The KV cache's element type in force (``cache_dtype``, or the model dtype when ``auto``)."""
PREFIX_CACHING: Final = "otelkv.prefix_caching"
"""vLLM ``cache_config.enable_prefix_caching``: the engine's own local prefix cache."""

# --------------------------------------------------------------------------------------
# otelkv attribute keys: tokens of one request
# --------------------------------------------------------------------------------------

TOKENS_LOCAL_CACHE_HIT: Final = "otelkv.tokens.local_cache_hit"
"""Prompt tokens found in this engine's own prefix cache (block aligned)."""
TOKENS_REMOTE_REUSABLE: Final = "otelkv.tokens.remote_reusable"
"""Tokens beyond the local hit that the remote engine holds and could be read."""
TOKENS_PULLED: Final = "otelkv.tokens.pulled"
"""Tokens actually loaded from the remote engine."""
TOKENS_COMPUTED: Final = "otelkv.tokens.computed"
"""Prompt tokens this engine had to compute (prompt - local hit - pulled)."""

# --------------------------------------------------------------------------------------
# otelkv attribute keys: the pull-or-recompute decision and the remote handle
# --------------------------------------------------------------------------------------

PULL_DECISION: Final = "otelkv.pull.decision"
"""``pull`` or ``recompute`` (see :data:`PULL_DECISIONS`)."""
PULL_REASON: Final = "otelkv.pull.reason"
"""Why, from :data:`PULL_REASONS`; updated to the transfer's fate when a pull fails."""
REMOTE_ENGINE_ID: Final = "otelkv.remote_engine_id"
REMOTE_REQUEST_ID: Final = "otelkv.remote_request_id"
REMOTE_NUM_TOKENS: Final = "otelkv.remote_num_tokens"
REMOTE_BLOCKS: Final = "otelkv.remote_blocks"
KV_PARAMS_RETURNED: Final = "otelkv.kv_transfer_params.returned"
"""Whether this engine's finished request handed back ``kv_transfer_params`` (a handle
the next hop can read from). A decode node with bidirectional transfer off returns none."""

# --------------------------------------------------------------------------------------
# otelkv attribute keys: one transfer
# --------------------------------------------------------------------------------------

TRANSFER_DIRECTION: Final = "otelkv.transfer.direction"
TRANSFER_BYTES: Final = "otelkv.transfer.bytes"
TRANSFER_DESCRIPTORS: Final = "otelkv.transfer.descriptors"
TRANSFER_TOKENS: Final = "otelkv.transfer.tokens"
"""Tokens the connector asked to load (the transfer's size in tokens)."""
TRANSFER_HANDLES: Final = "otelkv.transfer.handles"
"""NIXL transfer handles posted for this request (one per remote rank and region)."""
TRANSFER_XFER_SECONDS: Final = "otelkv.transfer.xfer_s"
"""NIXL-measured transfer duration (``xferDuration``), summed over handles."""
TRANSFER_POST_SECONDS: Final = "otelkv.transfer.post_s"
"""NIXL-measured time to post the transfer (``postDuration``), summed over handles."""
TRANSFER_WAIT_SECONDS: Final = "otelkv.transfer.wait_s"
"""Time the scheduler waited for the KV: allocation until the load was reported done."""
TRANSFER_BACKEND: Final = "otelkv.transfer.backend"
TRANSFER_OUTCOME: Final = "otelkv.transfer.outcome"

# --------------------------------------------------------------------------------------
# otelkv attribute keys: one retention
# --------------------------------------------------------------------------------------

RETENTION_KIND: Final = "otelkv.retention.kind"
RETENTION_BLOCKS: Final = "otelkv.retention.blocks"
RETENTION_BYTES: Final = "otelkv.retention.bytes"
RETENTION_TTL_SECONDS: Final = "otelkv.retention.ttl_s"
RETENTION_DEADLINE: Final = "otelkv.retention.deadline_unix"
RETENTION_OUTCOME: Final = "otelkv.retention.outcome"
RETENTION_HELD_SECONDS: Final = "otelkv.retention.held_s"
RETENTION_BLOCK_SECONDS: Final = "otelkv.retention.block_seconds"

# --------------------------------------------------------------------------------------
# otelkv attribute keys: how the request ended
# --------------------------------------------------------------------------------------

REQUEST_OUTCOME: Final = "otelkv.request.outcome"
REQUEST_STATUS: Final = "otelkv.request.vllm_status"
REMOTE_KV_WAIT_SECONDS: Final = "otelkv.request.remote_kv_wait_s"
REQUEST_STREAMED: Final = "otelkv.request.streamed"
"""The request asked vLLM for a stream (``SamplingParams.output_kind`` DELTA). On vLLM 0.32 a
streamed response carries no ``kv_transfer_params``, whatever the engine handed back."""
CONTINUITY_DIGEST: Final = "otelkv.continuity.digest"
"""Prefill: whether the decode handle carried a continuity digest otelkv could use."""
CONTINUITY_OFFERED: Final = "otelkv.continuity.offered_tokens"
"""Prefill: prompt tokens the handle's KV would cover (``min(remote tokens, prompt)``)."""
CONTINUITY_MATCHING: Final = "otelkv.continuity.matching_tokens"
"""Prefill: offered tokens checked equal to the tokens that KV was computed for."""
CONTINUITY_FIRST_MISMATCH: Final = "otelkv.continuity.first_mismatch"
"""Prefill: token position where the first differing 32-token chunk starts (absent: none)."""
CONTINUITY_MISMATCH_IN: Final = "otelkv.continuity.mismatch_in"
"""Prefill: ``history`` (before the previous answer) or ``answer`` (inside it)."""
XARG_CONTINUITY: Final = "otelkv_continuity"
"""Key of the digest the decode node's otelkv adds to the ``kv_transfer_params`` it returns."""
TRACE_CONTEXT_SOURCE: Final = "otelkv.trace_context.source"
"""Where the request's parent came from (:data:`TRACE_CONTEXT_SOURCES`)."""

# --------------------------------------------------------------------------------------
# The request body's vllm_xargs (vLLM 0.32 hands them to the engine as
# SamplingParams.extra_args): identity that survives routers that copy the body but drop
# headers. The sidecar writes them; the engine's observer reads them.
# --------------------------------------------------------------------------------------

BODY_XARGS: Final = "vllm_xargs"
XARG_TRACEPARENT: Final = "otelkv_traceparent"
"""The turn span's W3C ``traceparent`` (``00-<trace id>-<span id>-01``)."""
XARG_SESSION_ID: Final = "session_id"
"""vLLM's own key: vLLM sets ``Request.session_id`` from it when the request carries no
``X-Session-ID`` header and no body ``session_id``."""
XARG_PREFIX: Final = "otelkv_"
"""Keys otelkv owns in ``vllm_xargs``: the sidecar replaces any a client sent."""
XARG_TRACEPARENT_MAX_CHARS: Final = 128

# --------------------------------------------------------------------------------------
# Attribute keys of the reference fleet (router and agent driver)
# --------------------------------------------------------------------------------------

TURN_INDEX: Final = "otelkv.turn.index"
ROUTER_HANDLE: Final = "otelkv.router.handle"
"""What the router knew of the conversation's decode handle (:data:`ROUTER_HANDLE_STATES`)."""
ROUTER_HANDLE_AGE_SECONDS: Final = "otelkv.router.handle_age_s"
ROUTER_HANDLE_TTL_SECONDS: Final = "otelkv.router.handle_ttl_s"
"""The router's handle TTL in seconds: it drops a decode handle older than this (absent: none).
``otelkv tune`` compares it with ``decoder_kv_blocks_ttl``."""
ROUTER_DECODE_STREAMED: Final = "otelkv.router.decode_streamed"
HTTP_STATUS: Final = "http.response.status_code"

# --------------------------------------------------------------------------------------
# Attribute keys of the sidecar's turn span (``chat {model}``, scope otelkv.sidecar)
# --------------------------------------------------------------------------------------

GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
HTTP_ROUTE: Final = "http.route"

CONVERSATION_ID_SOURCE: Final = "otelkv.conversation.id_source"
"""Where the conversation id came from (:data:`CONVERSATION_ID_SOURCES`)."""
CONVERSATION_INFERRED: Final = "otelkv.conversation.inferred"
"""True when the id is a fingerprint of the conversation prefix, not sent by the client."""
TURN_STREAM: Final = "otelkv.turn.stream"
TURN_TTFT_SECONDS: Final = "otelkv.turn.ttft_s"
"""Request arrival to the first content byte the client received (streaming only)."""
TURN_LAST_TOKEN_SECONDS: Final = "otelkv.turn.last_token_s"
TURN_RESPONSE_KV_PARAMS: Final = "otelkv.turn.response_kv_transfer_params"
"""Whether the response the client got carried ``kv_transfer_params`` (a decode handle)."""
TURN_ASKED_TOOLS: Final = "otelkv.turn.asked_tools"
"""The response asked the agent to call tools (finish reason or tool_calls)."""
TURN_TOOL_RESULTS: Final = "otelkv.turn.tool_results"
"""How many tool results this request carried after the last assistant message."""
TURN_MESSAGES: Final = "otelkv.turn.messages"
TURN_PREVIOUS_TRACE_ID: Final = "otelkv.turn.previous_trace_id"
TURN_GAP_SECONDS: Final = "otelkv.turn.gap_s"
"""From the previous turn's last byte to this request's arrival (0 on the first turn)."""
TURN_GAP_SOURCE: Final = "otelkv.turn.gap_source"
"""How the gap was split into tool wait and app work (:data:`GAP_SOURCES`)."""
TURN_TOOL_WAIT_SECONDS: Final = "otelkv.turn.tool_wait_s"
TURN_APP_WORK_SECONDS: Final = "otelkv.turn.app_work_s"
TURN_INPUT_PROCESSING_SECONDS: Final = "otelkv.turn.input_processing_s"
TURN_GENERATION_SECONDS: Final = "otelkv.turn.generation_s"
TURN_TOTAL_SECONDS: Final = "otelkv.turn.total_s"
"""Gap plus request time: the four phases above add up to it."""
TURN_SOCKET_WAIT_SECONDS: Final = "otelkv.turn.socket_wait_s"
"""How long the request's bytes sat in the sidecar's socket before it read them (kernel
receive time to read): the sidecar's own lag on a busy host. The turn starts at the kernel's
receive time, so this is part of input processing, not of the gap before it."""
TURN_TTFT_SOURCE: Final = "otelkv.turn.ttft_source"
"""How input processing was bounded (:data:`TTFT_SOURCES`)."""

# The sidecar's view of continuity (``otelkv/sidecar/continuity.py``): each chat request's
# messages against its conversation's previous request and the answer the sidecar relayed,
# and a conversation continued under a new id. Only digests are kept, never text.
TURN_PREVIOUS_MESSAGES: Final = "otelkv.turn.previous_messages"
"""Messages of the conversation's previous request this request was compared with (absent:
nothing to compare with, e.g. the first turn or a history too long to compare)."""
TURN_HISTORY_REWRITTEN_AT: Final = "otelkv.turn.history_rewritten_at"
"""0-based index of the first of the previous request's messages that this request changed
or dropped (absent: they all came back unchanged, or the id was reused)."""
TURN_PREVIOUS_ANSWER: Final = "otelkv.turn.previous_answer"
"""The message in the previous answer's position against that answer
(:data:`PREVIOUS_ANSWER_STATES`; absent: not compared)."""
CONVERSATION_ID_REUSED: Final = "otelkv.conversation.id_reused"
"""The request shares no message with its id's previous request beyond an identical leading
system message: one id, another conversation."""
CONVERSATION_RESUMED_FROM: Final = "otelkv.conversation.resumed_from"
"""First request of this id: the conversation id of a recent turn whose messages and answer
this request opens with (a conversation continued under a new id)."""
CONVERSATION_RESUMED_FROM_TRACE_ID: Final = "otelkv.conversation.resumed_from_trace_id"
CONVERSATION_RESUMED_GAP_SECONDS: Final = "otelkv.conversation.resumed_gap_s"
"""From that turn's last byte to this request's arrival."""
CONVERSATION_RESUMED_TOKENS: Final = "otelkv.conversation.resumed_tokens"
"""That turn's prompt plus completion tokens (its usage): the KV its decode node held."""
CONVERSATION_RESUMED_MESSAGES: Final = "otelkv.conversation.resumed_messages"
"""Messages of this request that repeat that turn (its request's messages and its answer)."""

PREVIOUS_ANSWER_VERBATIM: Final = "verbatim"
PREVIOUS_ANSWER_CONTENT_DIFFERS: Final = "content_differs"
PREVIOUS_ANSWER_TOOL_CALLS_DIFFER: Final = "tool_calls_differ"
PREVIOUS_ANSWER_BOTH_DIFFER: Final = "content_and_tool_calls_differ"
PREVIOUS_ANSWER_DROPPED: Final = "dropped"
"""The message in the answer's position is not an assistant message."""
PREVIOUS_ANSWER_STATES: Final = (
    PREVIOUS_ANSWER_VERBATIM,
    PREVIOUS_ANSWER_CONTENT_DIFFERS,
    PREVIOUS_ANSWER_TOOL_CALLS_DIFFER,
    PREVIOUS_ANSWER_BOTH_DIFFER,
    PREVIOUS_ANSWER_DROPPED,
)

# --------------------------------------------------------------------------------------
# Resource attributes
# --------------------------------------------------------------------------------------

RESOURCE_PROCESS_KIND: Final = "otelkv.process.kind"
"""``scheduler`` (vLLM EngineCore) or ``worker``."""

# --------------------------------------------------------------------------------------
# Closed vocabularies (metric labels take values only from these)
# --------------------------------------------------------------------------------------

JOIN_TRACE: Final = "trace"
"""The engine requests continued the turn's trace (context through headers or the body)."""
JOIN_INFERRED: Final = "inferred"
"""The engine requests arrived in traces of their own and were matched to the turn."""
JOIN_METHODS: Final = (JOIN_TRACE, JOIN_INFERRED)
EVIDENCE_RESPONSE_ID: Final = "response_id"
"""The turn's response ``id`` is the decode request's id (vLLM answers with its request id)."""
EVIDENCE_ARRIVAL_WINDOW: Final = "arrival_window"
"""The engine request ran inside the turn's request window."""
EVIDENCE_PROMPT_TOKENS: Final = "prompt_tokens"
"""The engine request's prompt tokens equal the turn's usage input tokens."""
EVIDENCE_OUTPUT_TOKENS: Final = "output_tokens"
"""The decode request's output tokens equal the turn's usage output tokens."""
EVIDENCE_SHARED_REQUEST_ID: Final = "shared_request_id"
"""The prefill request shares its request id with the decode request matched to the turn."""

CONTINUITY_IN_HISTORY: Final = "history"
CONTINUITY_IN_ANSWER: Final = "answer"
CONTINUITY_MATCH: Final = "match"
CONTINUITY_MISMATCH: Final = "mismatch"
CONTINUITY_UNVERIFIED: Final = "unverified"
CONTINUITY_REFUSED: Final = "refused"
"""Guard mode refused the handle: none of the tokens it offered were loaded."""
CONTINUITY_OUTCOMES: Final = (
    CONTINUITY_MATCH,
    CONTINUITY_MISMATCH,
    CONTINUITY_UNVERIFIED,
    CONTINUITY_REFUSED,
)

ROLE_PREFILL: Final = "prefill"
ROLE_DECODE: Final = "decode"
ROLE_UNIFIED: Final = "unified"
ROLES: Final = (ROLE_PREFILL, ROLE_DECODE, ROLE_UNIFIED)

DIRECTION_D_TO_P: Final = "D->P"
DIRECTION_P_TO_D: Final = "P->D"
DIRECTION_LOAD: Final = "load"
"""A load by a connector that is not a P/D hand-off (e.g. an offloading connector)."""
DIRECTIONS: Final = (DIRECTION_D_TO_P, DIRECTION_P_TO_D, DIRECTION_LOAD)

DECISION_PULL: Final = "pull"
DECISION_RECOMPUTE: Final = "recompute"
PULL_DECISIONS: Final = (DECISION_PULL, DECISION_RECOMPUTE)

REASON_PULLED: Final = "pulled"
REASON_BELOW_THRESHOLD: Final = "below_threshold"
REASON_NOTHING_BEYOND_LOCAL_HIT: Final = "nothing_beyond_local_hit"
REASON_NO_DECODE_HANDLE: Final = "no_decode_handle"
REASON_INVALID_HANDLE: Final = "invalid_handle"
REASON_BIDIRECTIONAL_OFF: Final = "bidirectional_off"
"""The router sent a decode handle but this prefill engine has bidirectional transfer off:
vLLM 0.32.0 then reports the tokens as loadable but never reads them."""
REASON_DECLINED_EXPIRED: Final = "declined_expired"
REASON_TRANSFER_FAILED: Final = "transfer_failed"
REASON_CONTINUITY_MISMATCH: Final = "continuity_mismatch"
"""Guard mode refused the decode handle: its digest shows KV computed for other tokens than
this prompt's. vLLM recomputes; the decode node's blocks are released as for a full local hit."""
PULL_REASONS: Final = (
    REASON_PULLED,
    REASON_BELOW_THRESHOLD,
    REASON_NOTHING_BEYOND_LOCAL_HIT,
    REASON_NO_DECODE_HANDLE,
    REASON_INVALID_HANDLE,
    REASON_BIDIRECTIONAL_OFF,
    REASON_DECLINED_EXPIRED,
    REASON_TRANSFER_FAILED,
    REASON_CONTINUITY_MISMATCH,
)
PULL_DECISION_REASONS: Final = (
    (DECISION_PULL, REASON_PULLED),
    (DECISION_PULL, REASON_BIDIRECTIONAL_OFF),
    (DECISION_PULL, REASON_DECLINED_EXPIRED),
    (DECISION_PULL, REASON_TRANSFER_FAILED),
    (DECISION_RECOMPUTE, REASON_BELOW_THRESHOLD),
    (DECISION_RECOMPUTE, REASON_NOTHING_BEYOND_LOCAL_HIT),
    (DECISION_RECOMPUTE, REASON_NO_DECODE_HANDLE),
    (DECISION_RECOMPUTE, REASON_INVALID_HANDLE),
    (DECISION_RECOMPUTE, REASON_CONTINUITY_MISMATCH),
)
"""The (decision, reason) pairs an engine can report: a pull whose read then failed keeps
``pull`` with the read's fate as its reason; guard mode turns a pull into a recompute."""

TRANSFER_OK: Final = "ok"
TRANSFER_DECLINED_EXPIRED: Final = "declined_expired"
TRANSFER_FAILED: Final = "failed"
TRANSFER_STUCK: Final = "stuck"
TRANSFER_ABANDONED: Final = "abandoned"
"""The request ended (aborted, preempted away) before its load was reported."""
TRANSFER_OUTCOMES: Final = (
    TRANSFER_OK,
    TRANSFER_DECLINED_EXPIRED,
    TRANSFER_FAILED,
    TRANSFER_STUCK,
    TRANSFER_ABANDONED,
)

RETENTION_DECODE_TTL: Final = "decode_ttl"
"""Decode node keeps a finished turn for the next turn's prefill (bidirectional)."""
RETENTION_PREFILL_LEASE: Final = "prefill_lease"
"""Prefill node keeps a prompt's KV until the decode node has read it."""
RETENTION_KINDS: Final = (RETENTION_DECODE_TTL, RETENTION_PREFILL_LEASE)

RETENTION_CONSUMED: Final = "consumed"
"""The reader released the blocks before the deadline. Whether it read them or decided
to recompute is on the reader's ``kv_request`` span (``otelkv.pull.reason``): NIXL sends
the same notification for both."""
RETENTION_EXPIRED: Final = "expired"
"""The deadline passed without a reader; the engine freed the blocks unread."""
RETENTION_DROPPED: Final = "dropped"
"""The engine stopped tracking the blocks for another reason (shutdown, reset)."""
RETENTION_OUTCOMES: Final = (RETENTION_CONSUMED, RETENTION_EXPIRED, RETENTION_DROPPED)

OUTCOME_FINISHED: Final = "finished"
OUTCOME_ABORTED: Final = "aborted"
OUTCOME_FAILED_KV_LOAD: Final = "failed_kv_load"
OUTCOME_STUCK_WAITING_FOR_REMOTE_KV: Final = "stuck_waiting_for_remote_kv"
OUTCOME_ERROR: Final = "error"
REQUEST_OUTCOMES: Final = (
    OUTCOME_FINISHED,
    OUTCOME_ABORTED,
    OUTCOME_FAILED_KV_LOAD,
    OUTCOME_STUCK_WAITING_FOR_REMOTE_KV,
    OUTCOME_ERROR,
)

TRACE_CONTEXT_HEADERS: Final = "headers"
"""vLLM's ``trace_headers`` (the request's ``traceparent``; needs ``--otlp-traces-endpoint``)."""
TRACE_CONTEXT_BODY: Final = "body"
"""``vllm_xargs.otelkv_traceparent``, written by the sidecar."""
TRACE_CONTEXT_NONE: Final = "none"
"""Neither: the engine request starts a trace of its own."""
TRACE_CONTEXT_SOURCES: Final = (TRACE_CONTEXT_HEADERS, TRACE_CONTEXT_BODY, TRACE_CONTEXT_NONE)

BODY_CONTEXT_USED: Final = "used"
BODY_CONTEXT_MALFORMED: Final = "malformed"
"""Present but not a traceparent otelkv writes (wrong type, too long, invalid): ignored."""
BODY_CONTEXT_OUTCOMES: Final = (BODY_CONTEXT_USED, BODY_CONTEXT_MALFORMED)

TOKEN_SOURCE_COMPUTED: Final = "computed"
TOKEN_SOURCE_LOCAL_CACHE: Final = "local_cache"
TOKEN_SOURCE_PULLED: Final = "pulled"
TOKEN_SOURCES: Final = (TOKEN_SOURCE_COMPUTED, TOKEN_SOURCE_LOCAL_CACHE, TOKEN_SOURCE_PULLED)

TURN_STATUS_OK: Final = "ok"
TURN_STATUS_ERROR: Final = "error"
"""The span had status Error or an HTTP status of 400 or more."""
TURN_STATUSES: Final = (TURN_STATUS_OK, TURN_STATUS_ERROR)

ROUTER_HANDLE_HIT: Final = "hit"
ROUTER_HANDLE_MISS: Final = "miss"
ROUTER_HANDLE_STALE: Final = "stale"
ROUTER_HANDLE_NO_CONVERSATION: Final = "no_conversation_id"
ROUTER_HANDLE_STATES: Final = (
    ROUTER_HANDLE_HIT,
    ROUTER_HANDLE_MISS,
    ROUTER_HANDLE_STALE,
    ROUTER_HANDLE_NO_CONVERSATION,
)

PHASE_INPUT_PROCESSING: Final = "input_processing"
PHASE_GENERATION: Final = "generation"
PHASE_TOOL_WAIT: Final = "tool_wait"
PHASE_APP_WORK: Final = "app_work"
PHASES: Final = (PHASE_INPUT_PROCESSING, PHASE_GENERATION, PHASE_TOOL_WAIT, PHASE_APP_WORK)

GAP_SOURCE_AGENT_SPANS: Final = "agent_spans"
GAP_SOURCE_MESSAGES: Final = "messages"
GAP_SOURCE_NONE: Final = "none"
"""First turn of a conversation: there is no gap to split."""
GAP_SOURCES: Final = (GAP_SOURCE_AGENT_SPANS, GAP_SOURCE_MESSAGES, GAP_SOURCE_NONE)

SPAN_SOURCE_OTLP: Final = "otlp"
SPAN_SOURCE_SIDECAR: Final = "sidecar"
SPAN_SOURCES: Final = (SPAN_SOURCE_OTLP, SPAN_SOURCE_SIDECAR)
"""``source`` of ``otelkv_sidecar_spans_received``: exported to the receiver, or the sidecar's own."""

DROP_QUEUE_FULL: Final = "queue_full"
DROP_STORE_ERROR: Final = "store_error"
DROP_PROXY_CHANNEL_FULL: Final = "proxy_channel_full"
"""The proxy process dropped finished turns: the main process had stopped reading them."""
DROP_EXPORT_FAILED: Final = "export_failed"
DROP_SHUTDOWN: Final = "shutdown"
STORE_DROP_REASONS: Final = (DROP_QUEUE_FULL, DROP_STORE_ERROR, DROP_PROXY_CHANNEL_FULL)
"""``reason`` of ``otelkv_sidecar_spans_dropped``."""
FORWARD_DROP_REASONS: Final = (DROP_QUEUE_FULL, DROP_EXPORT_FAILED, DROP_SHUTDOWN)
"""``reason`` of ``otelkv_sidecar_forward_dropped``."""

REFUSED_MALFORMED: Final = "malformed"
"""Not valid HTTP (proxy, 400) or not a valid OTLP export (receiver, 400)."""
REFUSED_TOO_LARGE: Final = "too_large"
"""A body over the limit (413)."""
REFUSED_HEADERS_TOO_LARGE: Final = "headers_too_large"
"""Request line and headers over the proxy's limit (431)."""
REFUSED_UPGRADE: Final = "upgrade"
"""A protocol upgrade or CONNECT, which the proxy does not relay (501)."""
REFUSED_HTTP_VERSION: Final = "http_version"
"""An HTTP version other than 1.0 and 1.1 (505)."""
REFUSED_MEDIA_TYPE: Final = "media_type"
"""An OTLP export in a content type or encoding the receiver does not read (415)."""
REQUEST_REFUSED_REASONS: Final = (
    REFUSED_MALFORMED,
    REFUSED_TOO_LARGE,
    REFUSED_HEADERS_TOO_LARGE,
    REFUSED_UPGRADE,
    REFUSED_HTTP_VERSION,
)
"""``reason`` of ``otelkv_sidecar_requests_refused``."""
OTLP_REJECTED_REASONS: Final = (REFUSED_MALFORMED, REFUSED_TOO_LARGE, REFUSED_MEDIA_TYPE)
"""``reason`` of ``otelkv_sidecar_otlp_rejected`` (HTTP 400, 413, 415)."""

PULL_PART_RECOMPUTE_AVOIDED: Final = "recompute_avoided"
"""Pulled tokens times the prefill node's measured compute seconds per token."""
PULL_PART_WAIT: Final = "pull_wait"
"""The pull's own time: the prefill node's wait for the remote KV."""
PULL_PARTS: Final = (PULL_PART_RECOMPUTE_AVOIDED, PULL_PART_WAIT)
"""``part`` of ``otelkv_trace_pull_prefill_seconds``: saved = recompute_avoided - pull_wait."""

TTFT_SOURCE_STREAM: Final = "stream"
"""First content chunk the sidecar forwarded."""
TTFT_SOURCE_ENGINE: Final = "engine"
"""Non-streaming: the prefill node's request span end (known once engine spans arrived)."""
TTFT_SOURCE_RESPONSE: Final = "response"
"""Non-streaming, no engine spans: the whole response counts as input processing."""
TTFT_SOURCES: Final = (TTFT_SOURCE_STREAM, TTFT_SOURCE_ENGINE, TTFT_SOURCE_RESPONSE)

CONVERSATION_ID_SOURCES: Final = (
    "header_conversation_id",
    "header_session_id",
    "body_conversation_id",
    "body_session_id",
    "baggage",
    "fingerprint",
)

# Diagnoses (stable ids: documented in docs/diagnoses.md, used by ``otelkv why``).
DIAG_TTL_LAPSED: Final = "ttl_lapsed_during_gap"
DIAG_BELOW_THRESHOLD: Final = "below_threshold"
DIAG_NO_CONVERSATION_ID: Final = "no_conversation_id"
DIAG_DECODE_NO_HANDLE: Final = "decode_returned_no_handle"
DIAG_ROUTER_KEPT_NO_HANDLE: Final = "router_kept_no_handle"
DIAG_ROUTER_FORWARDS_NO_IDENTITY: Final = "router_forwards_no_identity"
DIAG_KV_FOR_OTHER_TOKENS: Final = "kv_reused_for_different_tokens"
DIAG_BIDIRECTIONAL_OFF: Final = "bidirectional_off"
DIAG_PULL_SLOWER_THAN_RECOMPUTE: Final = "pull_slower_than_recompute"
DIAG_EXPIRED_READ_FAILED: Final = "expired_read_failed_request"
DIAG_STUCK_WAITING_FOR_REMOTE_KV: Final = "stuck_waiting_for_remote_kv"
DIAG_TRANSFER_FAILED: Final = "kv_transfer_failed"
DIAG_ROUTER_HANDLE_EXPIRED: Final = "router_dropped_handle"
DIAG_SLOW_KV_HANDOFF: Final = "slow_kv_handoff"
DIAG_KV_READ_STARTED_LATE: Final = "kv_read_started_late"
DIAG_QUEUEING: Final = "queueing"
DIAG_TOOL_WAIT_DOMINATES: Final = "tool_wait_dominates"
DIAG_APP_WORK_DOMINATES: Final = "app_work_dominates"
DIAG_ID_CHANGED_ON_RESUME: Final = "conversation_id_changed_on_resume"
DIAG_ID_REUSED: Final = "conversation_id_reused"
DIAG_HISTORY_REWRITTEN: Final = "history_rewritten"
DIAG_ANSWER_RE_RENDERED: Final = "answer_re_rendered"

# ``otelkv funnel``: the steps a follow-up turn passes on its way to a pull that paid off
# (docs/funnel.md). A turn lost at a step carries a diagnosis id or pull reason above, or
# one of the FUNNEL_LOST_* reasons when the trace cannot say more.
FUNNEL_FOLLOW_UP: Final = "follow_up"
FUNNEL_CONVERSATION_ID: Final = "conversation_id"
FUNNEL_DECODE_HANDLE: Final = "decode_handle"
FUNNEL_KV_HELD: Final = "kv_held"
FUNNEL_ABOVE_THRESHOLD: Final = "above_threshold"
FUNNEL_PULLED: Final = "pulled"
FUNNEL_FASTER: Final = "faster_than_recompute"
FUNNEL_STEPS: Final = (
    FUNNEL_FOLLOW_UP,
    FUNNEL_CONVERSATION_ID,
    FUNNEL_DECODE_HANDLE,
    FUNNEL_KV_HELD,
    FUNNEL_ABOVE_THRESHOLD,
    FUNNEL_PULLED,
    FUNNEL_FASTER,
)
FUNNEL_LOST_PREVIOUS_DECODE_UNSEEN: Final = "previous_decode_unseen"
"""No decode request of the previous turn in the store, and nothing in this turn shows a handle."""
FUNNEL_LOST_NO_PREFILL_REQUEST: Final = "no_prefill_request"
"""The turn has no prefill request in the store (engine spans missing, or it failed before one)."""
FUNNEL_LOST_UNEXPLAINED: Final = "unexplained"
"""The step failed and neither a diagnosis nor a pull reason says why."""

# ``otelkv doctor``: the prerequisites of reverse reuse, each checked from traffic, the
# engines' resource attributes and their /metrics.
CHECK_PASS: Final = "pass"
CHECK_WARN: Final = "warn"
CHECK_FAIL: Final = "fail"
CHECK_SKIP: Final = "skip"
"""Not enough evidence in the window to say (no follow-up turn, one engine seen, ...)."""
CHECK_STATUSES: Final = (CHECK_PASS, CHECK_WARN, CHECK_FAIL, CHECK_SKIP)
CHECK_ENGINE_SPANS: Final = "engines_export_spans"
CHECK_TURNS_JOINED: Final = "engine_requests_join_turns"
CHECK_CONVERSATION_ID: Final = "conversation_id_reaches_engines"
CHECK_HANDLE_FORWARDED: Final = "router_forwards_handle"
CHECK_DECODE_NOT_STREAMED: Final = "decode_not_streamed"
CHECK_BIDIRECTIONAL: Final = "bidirectional_on_both_nodes"
CHECK_ENGINES_AGREE: Final = "engines_agree"
CHECK_ROUTER_TTL: Final = "router_ttl_within_decode_ttl"
CHECK_TTL_VS_GAPS: Final = "ttl_covers_gaps"
CHECK_PREFIX_CACHE: Final = "prefill_prefix_cache_on"
CHECK_LOAD_FAILURE_POLICY: Final = "kv_load_failure_policy"
CHECK_CONTINUITY: Final = "continuity_verified"
CHECKS: Final = (
    CHECK_ENGINE_SPANS,
    CHECK_TURNS_JOINED,
    CHECK_CONVERSATION_ID,
    CHECK_HANDLE_FORWARDED,
    CHECK_DECODE_NOT_STREAMED,
    CHECK_BIDIRECTIONAL,
    CHECK_ENGINES_AGREE,
    CHECK_ROUTER_TTL,
    CHECK_TTL_VS_GAPS,
    CHECK_PREFIX_CACHE,
    CHECK_LOAD_FAILURE_POLICY,
    CHECK_CONTINUITY,
)
CONTINUITY_VERIFY: Final = "otelkv.continuity.verify"
"""Resource attribute: how the engine checks that KV it reads belongs to the prompt
(:data:`CONTINUITY_MODES`; absent: it does not, as vLLM 0.32 trusts the handle)."""
CONTINUITY_MODE_OBSERVE: Final = "observe"
"""Handles are checked against the prompt and mismatches recorded; vLLM still loads them."""
CONTINUITY_MODE_GUARD: Final = "guard"
"""As observe, and a handle whose digest contradicts the prompt is not used
(:data:`REASON_CONTINUITY_MISMATCH`)."""
CONTINUITY_MODES: Final = (CONTINUITY_MODE_OBSERVE, CONTINUITY_MODE_GUARD)

# Flags of ``otelkv tune`` (stable ids: settings that are clearly wrong, documented in docs/tune.md).
TUNE_ROUTER_TTL_ABOVE_DECODE_TTL: Final = "router_ttl_above_decode_ttl"
TUNE_TTL_BELOW_COMMON_GAP: Final = "ttl_below_common_gap"
TUNE_THRESHOLD_BELOW_BREAK_EVEN: Final = "threshold_below_break_even"
TUNE_THRESHOLD_ABOVE_BREAK_EVEN: Final = "threshold_above_break_even"
TUNE_PULL_NEVER_FASTER: Final = "pull_never_faster"
TUNE_CONFIG_MIXED: Final = "config_mixed"

# --------------------------------------------------------------------------------------
# Engine metrics (exported through vLLM's own /metrics, beside vllm:nixl_*).
# vLLM adds its ``model_name`` and ``engine`` labels to every one of them.
# --------------------------------------------------------------------------------------

METRIC_PULL_DECISIONS: Final = "otelkv_pull_decisions"
"""Counter, labels decision, reason: one per prefill request that carried a handle or
could have (P role), by the final reason."""
METRIC_PREFILL_TOKENS: Final = "otelkv_prefill_tokens"
"""Counter, labels role, source: prompt tokens by where their KV came from."""
METRIC_TRANSFERS: Final = "otelkv_kv_transfers"
"""Counter, labels direction, backend, outcome."""
METRIC_TRANSFER_BYTES: Final = "otelkv_kv_transfer_bytes"
"""Counter (bytes), labels direction, backend: bytes read over NIXL by this engine."""
METRIC_TRANSFER_SECONDS: Final = "otelkv_kv_transfer_seconds"
"""Histogram, labels direction, backend: NIXL-measured duration of successful reads."""
METRIC_RETENTIONS: Final = "otelkv_kv_retentions"
"""Counter, labels kind, outcome: retentions that ended."""
METRIC_RETENTION_BLOCK_SECONDS: Final = "otelkv_kv_retention_block_seconds"
"""Counter, label kind: blocks times seconds held by retentions that ended (memory cost)."""
METRIC_RETAINED_BLOCKS: Final = "otelkv_kv_retained_blocks"
"""Gauge, label kind: blocks held right now for another engine to read."""
METRIC_RETAINED_BYTES: Final = "otelkv_kv_retained_bytes"
"""Gauge, label kind: bytes held right now for another engine to read."""
METRIC_REQUESTS: Final = "otelkv_requests"
"""Counter, labels role, outcome: requests that ended on this engine."""
METRIC_BODY_TRACE_CONTEXT: Final = "otelkv_body_trace_context"
"""Counter, label outcome: trace contexts read from the body (``vllm_xargs``), used or ignored."""
METRIC_INSTRUMENTATION_ERRORS: Final = "otelkv_instrumentation_errors"
"""Counter, label site: exceptions otelkv caught inside its own code (fail-open)."""
METRIC_CONTINUITY_TOKENS: Final = "otelkv_continuity_tokens"
"""Counter, label outcome: tokens a decode handle offered a prefill request, by whether they
match the prompt, or were refused by guard mode (:data:`CONTINUITY_OUTCOMES`)."""

TRANSFER_SECONDS_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
"""Buckets for transfer durations: vLLM's NIXL buckets with more resolution below 10 ms
(CPU/UCX transfers of small models land there)."""

# --------------------------------------------------------------------------------------
# Configuration keys (kv_connector_extra_config) and environment variables
# --------------------------------------------------------------------------------------

CONFIG_PREFIX: Final = "otelkv_"
CONFIG_ENABLED: Final = "otelkv_enabled"
CONFIG_INNER_CONNECTOR: Final = "otelkv_inner_connector"
CONFIG_INNER_MODULE_PATH: Final = "otelkv_inner_module_path"
CONFIG_STUCK_AFTER_SECONDS: Final = "otelkv_stuck_after_s"
CONFIG_TRACES: Final = "otelkv_traces"
CONFIG_CONTINUITY: Final = "otelkv_continuity"
"""``observe`` (default) or ``guard``: what the prefill node does with a handle whose KV
belongs to other tokens (:data:`CONTINUITY_MODES`)."""

ENV_ENABLED: Final = "OTELKV_ENABLED"
ENV_STUCK_AFTER_SECONDS: Final = "OTELKV_STUCK_AFTER_S"
ENV_TRACES: Final = "OTELKV_TRACES"
ENV_CONTINUITY: Final = "OTELKV_CONTINUITY"
ENV_FAULT_INJECT: Final = "OTELKV_FAULT_INJECT"
"""Comma-separated observer sites (or ``all``) at which otelkv raises on purpose. For
fail-open tests and drills only: serving must go on unchanged while it is set."""

# --------------------------------------------------------------------------------------
# Sidecar metrics (the sidecar's own /metrics). Conversation ids never become labels;
# the turn index is bucketed (:func:`turn_index_bucket`).
# --------------------------------------------------------------------------------------

METRIC_TURN_PHASE_SECONDS: Final = "otelkv_turn_phase_seconds"
"""Histogram, labels phase, model_name: seconds of each agent turn spent in each phase."""
METRIC_TURN_TTFT_SECONDS: Final = "otelkv_turn_ttft_seconds"
"""Histogram, labels turn_index (bucketed), model_name: time to first token by turn index."""
METRIC_CONVERSATION_SECONDS: Final = "otelkv_conversation_seconds"
"""Histogram, label model_name: task time, a finished conversation's first request arrival to
its last response byte. A conversation counts as finished once no turn of it ended for
:data:`CONVERSATION_IDLE_SECONDS`, or when the sidecar had to forget it (bounded state)."""
METRIC_TURN_GAP_SECONDS: Final = "otelkv_turn_gap_seconds"
"""Histogram, label source: the gap before a turn (tool wait plus app work)."""
METRIC_TURNS: Final = "otelkv_turns"
"""Counter, labels model_name, status (ok/error), stream: turns the sidecar proxied."""
METRIC_TRACE_PREFILL_TOKENS: Final = "otelkv_trace_prefill_tokens"
"""Counter, label source: prompt tokens by source, from engine spans the sidecar received."""
METRIC_TRACE_PULL_DECISIONS: Final = "otelkv_trace_pull_decisions"
"""Counter, labels decision, reason: from prefill spans the sidecar received."""
METRIC_TRACE_TRANSFER_BYTES: Final = "otelkv_trace_kv_transfer_bytes"
"""Counter (bytes), labels direction, backend: from transfer spans the sidecar received."""
METRIC_TRACE_RETENTIONS: Final = "otelkv_trace_kv_retentions"
"""Counter, labels kind, outcome: from retention spans the sidecar received."""
METRIC_TRACE_PULL_PREFILL_SECONDS: Final = "otelkv_trace_pull_prefill_seconds"
"""Counter (seconds), labels part, model_name: what pulls saved on prefill nodes, as two
monotonic parts (:data:`PULL_PARTS`); seconds saved = ``recompute_avoided - pull_wait``."""
METRIC_SIDECAR_SPANS_RECEIVED: Final = "otelkv_sidecar_spans_received"
"""Counter, label source (otlp/sidecar): spans accepted for the store."""
METRIC_SIDECAR_SPANS_DROPPED: Final = "otelkv_sidecar_spans_dropped"
"""Counter, label reason (queue_full/store_error): spans that did not reach the store."""
METRIC_SIDECAR_OTLP_REJECTED: Final = "otelkv_sidecar_otlp_rejected"
"""Counter, label reason (:data:`OTLP_REJECTED_REASONS`): OTLP exports refused (malformed 400,
too large 413, unsupported media type 415)."""
METRIC_SIDECAR_REQUESTS_REFUSED: Final = "otelkv_sidecar_requests_refused"
"""Counter, label reason (:data:`REQUEST_REFUSED_REASONS`): client requests the proxy answered
itself with a 4xx/5xx (malformed HTTP, body or headers too large, protocol upgrade, HTTP
version) instead of forwarding them."""
METRIC_SIDECAR_UPSTREAM_ERRORS: Final = "otelkv_sidecar_upstream_errors"
"""Counter: requests the upstream could not answer (the client got a 502)."""
METRIC_SIDECAR_UPSTREAM_RETRIES: Final = "otelkv_sidecar_upstream_retries"
"""Counter: requests sent again, once, on a new connection after a pooled one closed on
them unanswered (an upstream closing an idle keep-alive connection as the request arrived,
or one that died before answering)."""
METRIC_SIDECAR_STORE_QUEUE: Final = "otelkv_sidecar_store_queue_spans"
"""Gauge: spans waiting for the store writer."""
METRIC_SIDECAR_FORWARD_DROPPED: Final = "otelkv_sidecar_forward_dropped"
"""Counter, label reason (queue_full/export_failed/shutdown): turn spans that did not reach
the collector named by ``OTEL_EXPORTER_OTLP_*``."""
METRIC_SIDECAR_CONTINUITY_ERRORS: Final = "otelkv_sidecar_continuity_errors"
"""Counter: errors inside the sidecar's history comparison (the request went on untouched,
without the comparison)."""

TURN_SECONDS_BUCKETS: Final = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    900.0,
)
"""Buckets for turn phases and gaps: milliseconds of prefill up to many-minute tool waits."""

CONVERSATION_SECONDS_BUCKETS: Final = (
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
    3600.0,
    7200.0,
    14400.0,
)
"""Buckets for task time: a one-turn question up to agent tasks of hours."""

CONVERSATION_IDLE_SECONDS: Final = 900.0
"""A conversation with no request for this long is finished (its task time is observed). Longer
than vLLM's default ``decoder_kv_blocks_ttl`` (480 s): an agent that comes back after that has
lost its decode KV anyway, and a tool wait of several minutes stays inside one task."""

TURN_INDEX_BUCKETS: Final = ("0", "1", "2", "3", "4-7", "8-15", "16-31", "32+")


def turn_index_bucket(index: int) -> str:
    """A turn index as a bounded label value (long conversations share a bucket)."""
    if index < 4:
        return str(max(index, 0))
    if index < 8:
        return "4-7"
    if index < 16:
        return "8-15"
    if index < 32:
        return "16-31"
    return "32+"


# --------------------------------------------------------------------------------------
# The metric table: every metric otelkv exports, with its type, labels and help. The
# engine's Prometheus metrics (``otelkv.engine.prom``), the sidecar's (``otelkv.sidecar.
# metrics``) and the dashboards' PromQL label sets are derived from it.
# --------------------------------------------------------------------------------------

LABEL_DECISION: Final = "decision"
LABEL_REASON: Final = "reason"
LABEL_ROLE: Final = "role"
LABEL_SOURCE: Final = "source"
LABEL_DIRECTION: Final = "direction"
LABEL_BACKEND: Final = "backend"
LABEL_OUTCOME: Final = "outcome"
LABEL_KIND: Final = "kind"
LABEL_SITE: Final = "site"
LABEL_PHASE: Final = "phase"
LABEL_MODEL: Final = "model_name"
"""The model label: vLLM's own name, which it puts on every engine series (otelkv's included,
beside ``engine``). The sidecar's series use it too, for the requested model (capped, then
``other``), so one selector filters both."""
LABEL_PART: Final = "part"
LABEL_TURN_INDEX: Final = "turn_index"
LABEL_STATUS: Final = "status"
LABEL_STREAM: Final = "stream"

COUNTER: Final = "counter"
GAUGE: Final = "gauge"
HISTOGRAM: Final = "histogram"


@dataclass(frozen=True)
class Metric:
    """One exported metric. ``labels`` are otelkv's own; vLLM adds ``model_name`` and
    ``engine`` in front of an engine metric's."""

    name: str
    kind: str
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()


ENGINE_METRICS: Final = (
    Metric(
        METRIC_PULL_DECISIONS,
        COUNTER,
        (LABEL_DECISION, LABEL_REASON),
        "Prefill-node pull-or-recompute decisions for the decode node's KV, by final reason.",
    ),
    Metric(
        METRIC_PREFILL_TOKENS,
        COUNTER,
        (LABEL_ROLE, LABEL_SOURCE),
        "Prompt tokens by where their KV came from (computed, local prefix cache, pulled).",
    ),
    Metric(
        METRIC_TRANSFERS,
        COUNTER,
        (LABEL_DIRECTION, LABEL_BACKEND, LABEL_OUTCOME),
        "KV reads by this engine, by direction, NIXL backend and outcome.",
    ),
    Metric(
        METRIC_TRANSFER_BYTES,
        COUNTER,
        (LABEL_DIRECTION, LABEL_BACKEND),
        "Bytes of KV read over NIXL by this engine, by direction and backend.",
    ),
    Metric(
        METRIC_TRANSFER_SECONDS,
        HISTOGRAM,
        (LABEL_DIRECTION, LABEL_BACKEND),
        "NIXL-measured duration of successful KV reads, per request.",
        TRANSFER_SECONDS_BUCKETS,
    ),
    Metric(
        METRIC_RETENTIONS,
        COUNTER,
        (LABEL_KIND, LABEL_OUTCOME),
        "Ended retentions of KV blocks kept for another engine, by kind and outcome.",
    ),
    Metric(
        METRIC_RETENTION_BLOCK_SECONDS,
        COUNTER,
        (LABEL_KIND,),
        "Blocks x seconds held by ended retentions (the memory cost of keeping KV).",
    ),
    Metric(
        METRIC_RETAINED_BLOCKS,
        GAUGE,
        (LABEL_KIND,),
        "KV blocks held right now for another engine to read.",
    ),
    Metric(
        METRIC_RETAINED_BYTES,
        GAUGE,
        (LABEL_KIND,),
        "Bytes of KV held right now for another engine to read (all TP ranks).",
    ),
    Metric(
        METRIC_REQUESTS,
        COUNTER,
        (LABEL_ROLE, LABEL_OUTCOME),
        "Requests that ended on this engine, by P/D role and outcome.",
    ),
    Metric(
        METRIC_BODY_TRACE_CONTEXT,
        COUNTER,
        (LABEL_OUTCOME,),
        "Trace contexts read from the request body (vllm_xargs) when the headers had none, used or ignored.",
    ),
    Metric(
        METRIC_CONTINUITY_TOKENS,
        COUNTER,
        (LABEL_OUTCOME,),
        "Tokens a decode handle offered a prefill request: matching the prompt, not matching, unverified, "
        "or refused by guard mode.",
    ),
    Metric(
        METRIC_INSTRUMENTATION_ERRORS,
        COUNTER,
        (LABEL_SITE,),
        "Exceptions caught inside otelkv (serving was not affected), by site.",
    ),
)
"""Exported through vLLM's own ``/metrics`` (beside ``vllm:nixl_*``)."""

SIDECAR_METRICS: Final = (
    Metric(
        METRIC_TURN_PHASE_SECONDS,
        HISTOGRAM,
        (LABEL_PHASE, LABEL_MODEL),
        "Seconds of each agent turn spent in each phase.",
        TURN_SECONDS_BUCKETS,
    ),
    Metric(
        METRIC_TURN_TTFT_SECONDS,
        HISTOGRAM,
        (LABEL_TURN_INDEX, LABEL_MODEL),
        "Time to first token of agent turns, by turn index (bucketed).",
        TURN_SECONDS_BUCKETS,
    ),
    Metric(
        METRIC_CONVERSATION_SECONDS,
        HISTOGRAM,
        (LABEL_MODEL,),
        "Task time: a finished conversation's first request arrival to its last response byte.",
        CONVERSATION_SECONDS_BUCKETS,
    ),
    Metric(
        METRIC_TURN_GAP_SECONDS,
        HISTOGRAM,
        (LABEL_SOURCE,),
        "Gap before a turn (tool wait plus app work), by the evidence used to split it.",
        TURN_SECONDS_BUCKETS,
    ),
    Metric(METRIC_TURNS, COUNTER, (LABEL_MODEL, LABEL_STATUS, LABEL_STREAM), "Turns the sidecar proxied."),
    Metric(
        METRIC_TRACE_PREFILL_TOKENS,
        COUNTER,
        (LABEL_SOURCE,),
        "Prompt tokens on prefill nodes by where their KV came from (from engine spans).",
    ),
    Metric(
        METRIC_TRACE_PULL_DECISIONS,
        COUNTER,
        (LABEL_DECISION, LABEL_REASON),
        "Pull-or-recompute decisions on prefill nodes (from engine spans).",
    ),
    Metric(
        METRIC_TRACE_TRANSFER_BYTES,
        COUNTER,
        (LABEL_DIRECTION, LABEL_BACKEND),
        "KV bytes read over NIXL (from engine transfer spans).",
    ),
    Metric(
        METRIC_TRACE_RETENTIONS,
        COUNTER,
        (LABEL_KIND, LABEL_OUTCOME),
        "Retentions that ended on decode nodes (from engine spans).",
    ),
    Metric(
        METRIC_TRACE_PULL_PREFILL_SECONDS,
        COUNTER,
        (LABEL_PART, LABEL_MODEL),
        "Prefill seconds of pulls: recompute avoided (pulled tokens x measured seconds per computed "
        "token) and the pulls' own wait; saved = recompute_avoided - pull_wait.",
    ),
    Metric(METRIC_SIDECAR_SPANS_RECEIVED, COUNTER, (LABEL_SOURCE,), "Spans accepted for the store."),
    Metric(METRIC_SIDECAR_SPANS_DROPPED, COUNTER, (LABEL_REASON,), "Spans that did not reach the store."),
    Metric(
        METRIC_SIDECAR_OTLP_REJECTED,
        COUNTER,
        (LABEL_REASON,),
        "OTLP exports refused, by reason (malformed, too large, media type).",
    ),
    Metric(
        METRIC_SIDECAR_REQUESTS_REFUSED,
        COUNTER,
        (LABEL_REASON,),
        "Client requests refused by the proxy, by reason (malformed, too large, upgrade, version).",
    ),
    Metric(METRIC_SIDECAR_UPSTREAM_ERRORS, COUNTER, (), "Requests the upstream could not answer."),
    Metric(
        METRIC_SIDECAR_UPSTREAM_RETRIES,
        COUNTER,
        (),
        "Requests sent again after a pooled upstream connection closed on them unanswered.",
    ),
    Metric(
        METRIC_SIDECAR_FORWARD_DROPPED,
        COUNTER,
        (LABEL_REASON,),
        "Turn spans that did not reach the collector (OTEL_EXPORTER_OTLP_*).",
    ),
    Metric(METRIC_SIDECAR_STORE_QUEUE, GAUGE, (), "Spans waiting for the store writer."),
    Metric(
        METRIC_SIDECAR_CONTINUITY_ERRORS,
        COUNTER,
        (),
        "Errors inside the sidecar's history comparison (requests went on without it).",
    ),
)
"""The sidecar's own ``/metrics``."""


ENV_SIDECAR_TOKEN: Final = "OTELKV_TOKEN"
"""Bearer token the sidecar's query API and OTLP receiver require when set."""

# --------------------------------------------------------------------------------------
# Recorded runs (``otelkv fleet record``, ``otelkv compare``)
# --------------------------------------------------------------------------------------

FLEET_WARMUP_CONVERSATION: Final = "otelkv-fleet-warmup"
"""Conversation id of the reference fleet's warm-up turns (left out of comparisons)."""

RUN_MANIFEST_FILE: Final = "otelkv-run.json"
"""A recorded run's settings and scenarios, written into its store directory."""

CLIENT_DISCONNECTED: Final = "client disconnected"
"""Status message of a sidecar turn span whose client hung up before the response ended."""
