"""Scheduler-side observations (vLLM EngineCore process): requests, decisions, retention.

The scheduler-side connector is the one place that sees a request from arrival to the
release of its blocks, with its trace context (``request.trace_headers``) and
conversation id (``request.session_id``). All engine spans are recorded here - as flat
tuples, built and exported by otelkv's exporter process (:mod:`otelkv.engine.span_export`)
- while the worker side only measures transfers and sends the numbers up
(``OtelKVWorkerMeta``).

Per request at most three spans: ``kv_request {role}`` (arrival to finish),
``kv_transfer {direction}`` (waiting for remote KV until the load is reported) and
``kv_retention {kind}`` (finish until another engine released the blocks, or the TTL
expired). Per step the work is proportional to the requests that changed, plus one look
at the oldest request waiting for remote KV (stuck detection).

Every public method is wrapped by :func:`~otelkv.engine.guard.guarded`.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import StatusCode

from otelkv import names
from otelkv.engine import continuity
from otelkv.engine.config import EngineSettings
from otelkv.engine.decision import PullDecision, agrees_with_connector, decide_reverse_pull, role_of
from otelkv.engine.guard import ErrorLedger, guarded
from otelkv.engine.messages import OtelKVWorkerMeta, TransferRecord, series_key
from otelkv.engine.span_export import FinishedSpan, new_span_id, new_trace_id

logger = logging.getLogger("vllm.otelkv")

# vLLM RequestStatus names (compared by name: the enum's values are not an API).
_FINISHED_OK = {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"}
_FINISHED_ABORTED = {"FINISHED_ABORTED"}
_DEADLINE_TOLERANCE_S = 0.05
_PENDING_FINISH_GRACE_S = 5.0
"""How long a finished request may wait for its KV load's outcome before the transfer is
reported as abandoned (an abort while the read is in flight reports it later, if ever)."""


_HEX = frozenset("0123456789abcdef")
_UNSET = StatusCode.UNSET.value
_ERROR = StatusCode.ERROR.value


@functools.lru_cache(maxsize=4096)
def _series(*key: str) -> str:
    """The payload's key of a series (label values are few: the cache holds them all)."""
    return series_key(*key)


def base_request_id(request_id: str) -> str:
    """Strip vLLM's ``-xxxxxxxx`` internal suffix (vLLM ``nixl/utils.get_base_request_id``)."""
    head, sep, tail = request_id.rpartition("-")
    if sep and len(tail) == 8 and _HEX.issuperset(tail):
        return head
    return request_id


@dataclass(slots=True)
class _TransferSpan:
    """A finished KV load, turned into a span when its request's span is built."""

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: str | None


@dataclass(slots=True)
class _Retention:
    kind: str
    start_ns: int
    blocks: int
    bytes: int
    ttl_s: float
    start_perf: float
    deadline_perf: float
    expired_flag: bool = False


@dataclass(slots=True)
class _Finish:
    status: str
    output_tokens: int
    block_ids: Any
    delay_free: bool
    params: dict[str, Any] | None


@dataclass(slots=True)
class _Request:
    request_id: str
    role: str
    trace_id: int
    span_id: int
    parent_span_id: int
    trace_flags: int
    start_ns: int
    attributes: dict[str, Any]
    prompt_tokens: int
    local_hit: int = 0
    matched: int | None = None
    decision: PullDecision | None = None
    reason: str | None = None
    pulled: int = 0
    allocated: bool = False
    wait_start_ns: int | None = None
    wait_start_perf: float | None = None
    load_outcome: str | None = None
    remote_kv_wait_s: float | None = None
    ended: bool = False
    retention: _Retention | None = None
    pending_finish: _Finish | None = None
    transfer: _TransferSpan | None = None
    continuity_checked: bool = False
    continuity: continuity.Check | None = None
    refused: bool = False
    """Guard mode refused the decode handle (its KV belongs to other tokens)."""


class SchedulerObserver:
    """Turns scheduler hooks into spans and metric observations for one engine."""

    def __init__(
        self,
        settings: EngineSettings,
        errors: ErrorLedger,
        writer: Any,
        *,
        connector_name: str,
        bytes_per_block: int,
    ) -> None:
        self.settings = settings
        self.errors = errors
        self._writer = writer
        self._connector_name = connector_name
        self._bytes_per_block = bytes_per_block
        self._reqs: dict[str, _Request] = {}
        self._waiting: dict[str, float] = {}  # insertion-ordered: oldest first
        self._pending_finish: dict[str, float] = {}  # likewise
        self._retained_blocks: dict[str, int] = {k: 0 for k in names.RETENTION_KINDS}
        # This step's observations, keyed by (metric, *labels): joined into the payload's
        # string keys once per step (take_payload), not once per observation.
        self._counts: dict[tuple[str, ...], float] = {}
        self._observed: dict[tuple[str, ...], list[float]] = {}
        self._gauge_kinds: set[str] = set()
        # Engine-wide facts (connector, configuration in force) are resource attributes
        # (see resource_attributes); spans carry what varies by request.
        self._static_attrs: dict[str, Any] = {names.GEN_AI_REQUEST_MODEL: settings.model}
        self._hashing: continuity.Hashing | None = None
        self._warned_hashing = False

    # ------------------------------------------------------------------ metrics

    def _count(self, *key: str, value: float = 1) -> None:
        """Add ``value`` to the counter ``key`` = (metric, *label values)."""
        counts = self._counts
        counts[key] = counts.get(key, 0) + value

    def _observe(self, value: float, *key: str) -> None:
        """One histogram observation of ``key`` = (metric, *label values)."""
        found = self._observed.get(key)
        if found is None:
            self._observed[key] = [value]
        else:
            found.append(value)

    def take_payload(self) -> dict[str, dict[str, Any]] | None:
        """This step's metric observations (and caught errors), or None if there are none."""
        errors = self.errors.drain()
        for site, n in errors.items():
            self._count(names.METRIC_INSTRUMENTATION_ERRORS, site, value=n)
        if not (self._counts or self._observed or self._gauge_kinds):
            return None
        gauges = {}
        for kind in self._gauge_kinds:
            blocks = self._retained_blocks[kind]
            gauges[_series(names.METRIC_RETAINED_BLOCKS, kind)] = blocks
            gauges[_series(names.METRIC_RETAINED_BYTES, kind)] = blocks * self._bytes_per_block
        payload = {
            "c": {_series(*key): value for key, value in self._counts.items()},
            "h": {_series(*key): values for key, values in self._observed.items()},
            "g": gauges,
        }
        self._counts, self._observed = {}, {}
        self._gauge_kinds.clear()
        return payload

    # ------------------------------------------------------------------ hooks

    @guarded("on_new_request")
    def on_new_request(self, request: Any) -> None:
        request_id = request.request_id
        role = role_of(request.kv_transfer_params)
        parent = _parse_traceparent(request.trace_headers)
        source = names.TRACE_CONTEXT_HEADERS
        if parent is None:
            parent, source = self._body_parent(request)
        base = base_request_id(request_id)
        attrs = dict(self._static_attrs)
        attrs[names.ROLE] = role
        attrs[names.TRACE_CONTEXT_SOURCE] = source
        kind = getattr(getattr(getattr(request, "sampling_params", None), "output_kind", None), "name", None)
        if kind in ("DELTA", "FINAL_ONLY", "CUMULATIVE"):
            attrs[names.REQUEST_STREAMED] = kind == "DELTA"
        attrs[names.REQUEST_ID] = request_id
        attrs[names.GEN_AI_REQUEST_ID] = base
        if request.session_id:
            attrs[names.GEN_AI_CONVERSATION_ID] = str(request.session_id)
        # The spans are built once, with all their attributes, when the request ends:
        # one attribute-set construction per span is most of what a span costs.
        trace_id, parent_span_id, flags = parent or (new_trace_id(), 0, 0x01)
        self._reqs[request_id] = _Request(
            request_id=request_id,
            role=role,
            trace_id=trace_id,
            span_id=new_span_id(),
            parent_span_id=parent_span_id,
            trace_flags=flags,
            start_ns=time.time_ns(),
            attributes=attrs,
            prompt_tokens=int(request.num_prompt_tokens or 0),
        )

    def _body_parent(self, request: Any) -> tuple[tuple[int, int, int] | None, str]:
        """The parent the sidecar wrote into the body (``vllm_xargs``) when the headers had none.

        vLLM passes ``trace_headers`` only with ``--otlp-traces-endpoint`` on and only if the
        router forwarded them; the body survives routers that copy it. A value that is not a
        traceparent as the sidecar writes it is ignored and counted.
        """
        params = getattr(request, "sampling_params", None)
        xargs = getattr(params, "extra_args", None)
        value = xargs.get(names.XARG_TRACEPARENT) if isinstance(xargs, dict) else None
        if value is None:
            return None, names.TRACE_CONTEXT_NONE
        parent = None
        if isinstance(value, str) and len(value) <= names.XARG_TRACEPARENT_MAX_CHARS:
            parent = _parse_traceparent({"traceparent": value})
        outcome = names.BODY_CONTEXT_USED if parent else names.BODY_CONTEXT_MALFORMED
        self._count(names.METRIC_BODY_TRACE_CONTEXT, outcome)
        return parent, (names.TRACE_CONTEXT_BODY if parent else names.TRACE_CONTEXT_NONE)

    @guarded("get_num_new_matched_tokens")
    def on_matched(
        self,
        request: Any,
        num_computed_tokens: int,
        result: tuple[int | None, bool],
        *,
        refused: bool = False,
    ) -> None:
        """vLLM asked the connector what it can load (possibly again, until the request is
        allocated); ``refused``: guard mode turned the inner connector's answer into "nothing"
        this time."""
        state = self._reqs.get(request.request_id)
        if state is None or state.allocated:
            return
        state.local_hit = int(num_computed_tokens)
        state.matched = result[0]
        state.refused = refused
        if state.role == names.ROLE_PREFILL:
            state.decision = decide_reverse_pull(
                request.kv_transfer_params or {},
                num_prompt_tokens=state.prompt_tokens,
                local_hit=state.local_hit,
                threshold=self.settings.recompute_threshold,
                bidirectional=self.settings.bidirectional,
            )
            if state.refused and state.decision.decision == names.DECISION_PULL:
                state.decision = state.decision._replace(
                    decision=names.DECISION_RECOMPUTE, reason=names.REASON_CONTINUITY_MISMATCH
                )
            if not state.continuity_checked:  # after the decision: a failure here loses only itself
                self._check_continuity(state, request)

    @property
    def guarding(self) -> bool:
        """Guard mode: a handle whose digest contradicts the prompt is refused."""
        return self.settings.continuity == names.CONTINUITY_MODE_GUARD

    @guarded("continuity_guard")
    def refuses(self, request: Any) -> bool:
        """Guard mode's verdict on a prefill request the connector would load KV for: True
        when the handle's digest shows KV computed for other tokens than this prompt's.

        Only a proven mismatch refuses: a handle without a digest (an engine without otelkv
        wrote it) or tokens beyond it are loaded as vLLM would. Fails open: an error here
        returns None (the wrapper then lets vLLM load) and is counted.
        """
        state = self._reqs.get(request.request_id)
        if state is None or state.role != names.ROLE_PREFILL:
            return False
        if not state.continuity_checked:
            self._check_continuity(state, request)
        check = state.continuity
        return check is not None and check.first_mismatch is not None

    def _check_continuity(self, state: _Request, request: Any) -> None:
        """The prompt against the digest in the decode handle, once per request."""
        params = request.kv_transfer_params
        if (
            not isinstance(params, dict)
            or not params.get("do_remote_decode")
            or not params.get("remote_block_ids")
        ):
            return
        state.continuity_checked = True
        found = continuity.check(
            params.get(names.XARG_CONTINUITY),
            getattr(request, "block_hashes", None) or (),
            # all_token_ids: what vLLM hashed (prompt embeds appear there as zeros)
            getattr(request, "all_token_ids", None) or getattr(request, "prompt_token_ids", None) or (),
            params.get("remote_num_tokens") or 0,
            self._block_hashing(),
        )
        if found is not None and not found.comparable and not self._warned_hashing:
            self._warned_hashing = True
            logger.warning(
                "otelkv: this engine (hash block size %s, prefix_caching_hash_algo %s) cannot compare "
                "the block hashes in decode handles: the decode node hashes with another block "
                "size, algorithm or PYTHONHASHSEED, or this engine's hashes must stay inside it; "
                "the KV they offer is counted unverified",
                self.settings.hash_block_size or self.settings.block_size,
                self.settings.prefix_hash_algo,
            )
        state.continuity = found

    def _block_hashing(self) -> continuity.Hashing | None:
        """This engine's block hashing, read once vLLM has set it up (after this observer)."""
        if self._hashing is None:
            self._hashing = continuity.vllm_hashing(
                self.settings.hash_block_size or self.settings.block_size, self.settings.prefix_hash_algo
            )
        return self._hashing

    def _record_continuity(
        self, attrs: dict[str, Any], check: continuity.Check | None, *, refused: bool
    ) -> None:
        """Span attributes, and the offered tokens counted by outcome: ``refused`` (guard mode
        loaded none of them) or ``match``/``mismatch``/``unverified`` (vLLM loaded them)."""
        _continuity_attrs(attrs, check)
        if check is None:
            return
        if refused:
            if check.offered:
                self._count(names.METRIC_CONTINUITY_TOKENS, names.CONTINUITY_REFUSED, value=check.offered)
            return
        mismatched = check.offered - check.matching - check.unverified
        for outcome, value in (
            (names.CONTINUITY_MATCH, check.matching),
            (names.CONTINUITY_MISMATCH, mismatched),
            (names.CONTINUITY_UNVERIFIED, check.unverified),
        ):
            if value:
                self._count(names.METRIC_CONTINUITY_TOKENS, outcome, value=value)

    @guarded("update_state_after_alloc")
    def on_alloc(self, request: Any, num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is None or state.allocated:
            return  # vLLM calls this a second time once an async load completed
        state.allocated = True
        state.pulled = int(num_external_tokens)
        decision = state.decision
        if decision is not None:
            state.reason = decision.reason
            if not agrees_with_connector(decision, state.matched):
                # Never publish a reason that contradicts what the connector did.
                state.reason = None
                self.errors.record(
                    "decision_mismatch",
                    RuntimeError(
                        f"otelkv derived {decision.decision}/{decision.reason} but the "
                        f"connector matched {state.matched} tokens"
                    ),
                )
        if num_external_tokens > 0 and state.matched:
            state.wait_start_ns = time.time_ns()
            state.wait_start_perf = time.perf_counter()
            self._waiting[state.request_id] = state.wait_start_perf

    @guarded("build_connector_meta")
    def on_step(self) -> None:
        """Once per engine step: report requests waiting for remote KV too long."""
        if self._pending_finish:
            now = time.perf_counter()
            for request_id, since in list(self._pending_finish.items()):
                if now - since < _PENDING_FINISH_GRACE_S:
                    break
                state = self._reqs.get(request_id)
                if state is None:
                    del self._pending_finish[request_id]
                else:
                    self._complete_pending(state)
        if not self._waiting:
            return
        now = time.perf_counter()
        limit = self.settings.stuck_after_s
        for request_id, since in list(self._waiting.items()):
            if now - since < limit:
                break  # oldest first: nobody after this one is older
            del self._waiting[request_id]
            state = self._reqs.get(request_id)
            if state is not None:
                self._report_stuck(state, now - since)

    def _complete_pending(self, state: _Request) -> None:
        finish, state.pending_finish = state.pending_finish, None
        self._pending_finish.pop(state.request_id, None)
        if state.wait_start_ns is not None:
            self._end_transfer(state, None, names.TRANSFER_ABANDONED)
        if finish is not None:
            self._finish(state, finish)

    def _report_stuck(self, state: _Request, waited_s: float) -> None:
        state.load_outcome = names.TRANSFER_STUCK
        state.remote_kv_wait_s = waited_s
        self._end_transfer(state, None, names.TRANSFER_STUCK)
        message = (
            f"waiting for remote KV for {waited_s:.1f}s (> {self.settings.stuck_after_s:g}s, "
            "otelkv_stuck_after_s); the request is still parked in WAITING_FOR_REMOTE_KVS"
        )
        self._end_request(state, names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV, message)

    @guarded("update_connector_output")
    def on_output(self, output: Any, meta: OtelKVWorkerMeta | None) -> None:
        transfers = meta.transfers if meta is not None else {}
        if meta is not None:
            for request_id in meta.expired_sends:
                state = self._reqs.get(request_id)
                if state is not None and state.retention is not None:
                    state.retention.expired_flag = True
        failed = output.failed_recving or ()
        for request_id in output.finished_recving or ():
            state = self._reqs.get(request_id)
            if state is None:
                continue
            self._waiting.pop(request_id, None)
            record = transfers.get(request_id)
            outcome = record.outcome if record is not None else names.TRANSFER_OK
            if request_id in failed and outcome == names.TRANSFER_OK:
                outcome = names.TRANSFER_FAILED
            if state.load_outcome != names.TRANSFER_STUCK:  # stuck: its span already ended
                self._end_transfer(state, record, outcome)
            if state.pending_finish is not None:
                self._complete_pending(state)
        for request_id in output.finished_sending or ():
            state = self._reqs.get(request_id)
            if state is not None and state.retention is not None:
                self._end_retention(state)

    def _direction(self, role: str) -> str:
        if role == names.ROLE_PREFILL:
            return names.DIRECTION_D_TO_P
        if role == names.ROLE_DECODE:
            return names.DIRECTION_P_TO_D
        return names.DIRECTION_LOAD

    def _end_transfer(self, state: _Request, record: TransferRecord | None, outcome: str) -> None:
        if state.wait_start_ns is None:
            return
        start_ns, start_perf = state.wait_start_ns, state.wait_start_perf or time.perf_counter()
        state.wait_start_ns = None
        waited = time.perf_counter() - start_perf
        state.remote_kv_wait_s = waited
        state.load_outcome = outcome
        direction = self._direction(state.role)
        backend = self.settings.backend_label
        if outcome != names.TRANSFER_OK:
            state.pulled = 0
            if state.reason is not None and outcome in (
                names.TRANSFER_DECLINED_EXPIRED,
                names.TRANSFER_FAILED,
            ):
                state.reason = (
                    names.REASON_DECLINED_EXPIRED
                    if outcome == names.TRANSFER_DECLINED_EXPIRED
                    else names.REASON_TRANSFER_FAILED
                )
        self._count(names.METRIC_TRANSFERS, direction, backend, outcome)
        if record is not None and record.bytes:
            self._count(names.METRIC_TRANSFER_BYTES, direction, backend, value=record.bytes)
        if record is not None and outcome == names.TRANSFER_OK and record.handles:
            self._observe(record.xfer_s, names.METRIC_TRANSFER_SECONDS, direction, backend)

        decision = state.decision
        attrs: dict[str, Any] = {
            names.TRANSFER_DIRECTION: direction,
            names.TRANSFER_BACKEND: backend,
            names.TRANSFER_OUTCOME: outcome,
            names.TRANSFER_WAIT_SECONDS: waited,
            names.TRANSFER_TOKENS: int(state.matched or 0),
        }
        if record is not None:
            attrs[names.TRANSFER_BYTES] = record.bytes
            attrs[names.TRANSFER_DESCRIPTORS] = record.descriptors
            attrs[names.TRANSFER_HANDLES] = record.handles
            attrs[names.TRANSFER_XFER_SECONDS] = record.xfer_s
            attrs[names.TRANSFER_POST_SECONDS] = record.post_s
            if record.remote_engine_id:
                attrs[names.REMOTE_ENGINE_ID] = record.remote_engine_id
        if decision is not None and decision.remote_engine_id:
            attrs[names.REMOTE_ENGINE_ID] = decision.remote_engine_id
        error = None
        if outcome != names.TRANSFER_OK:
            attrs[names.ERROR_TYPE] = outcome
            error = _transfer_message(outcome, state)
        state.transfer = _TransferSpan(
            names.transfer_span_name(direction), start_ns, time.time_ns(), attrs, error
        )
        if state.ended:  # the request span exists already: emit the transfer now
            self._emit_transfer(state)

    @guarded("request_finished")
    def on_finished(self, request: Any, block_ids: Any, result: tuple[bool, dict[str, Any] | None]) -> None:
        state = self._reqs.get(request.request_id)
        if state is None:
            return
        self._waiting.pop(state.request_id, None)
        status = getattr(request.status, "name", None)
        if status is None:
            status = str(request.status)
        params = result[1]
        if (
            state.role == names.ROLE_DECODE
            and isinstance(params, dict)
            and params.get("do_remote_decode")
            and params.get("remote_block_ids")
        ):
            # The handle this decode request hands back names KV for these token ids.
            hashing = self._block_hashing()
            found = None
            if hashing is not None:
                try:  # a failure here loses the digest only, not the request's span
                    found = continuity.digest(
                        getattr(request, "block_hashes", None) or (),
                        getattr(request, "all_token_ids", None) or (),
                        getattr(request, "num_computed_tokens", 0) or 0,
                        request.num_prompt_tokens,
                        hashing,
                    )
                except Exception as exc:  # noqa: BLE001 - fail open, counted
                    self.errors.record("continuity_digest", exc)
            if found is not None:
                params[names.XARG_CONTINUITY] = found
        finish = _Finish(
            status=status,
            output_tokens=int(getattr(request, "num_output_tokens", 0) or 0),
            block_ids=block_ids,
            delay_free=bool(result[0]),
            params=result[1],
        )
        if state.wait_start_ns is not None:
            # vLLM fails a request whose KV load failed *before* it reports the load
            # (same step, just after): finish once the load's outcome is known.
            state.pending_finish = finish
            self._pending_finish[state.request_id] = time.perf_counter()
            return
        self._finish(state, finish)

    def _finish(self, state: _Request, finish: _Finish) -> None:
        status = finish.status
        if status in _FINISHED_OK:
            outcome, message = names.OUTCOME_FINISHED, None
        elif status in _FINISHED_ABORTED:
            outcome, message = names.OUTCOME_ABORTED, None
        elif state.load_outcome in (names.TRANSFER_DECLINED_EXPIRED, names.TRANSFER_FAILED):
            outcome = names.OUTCOME_FAILED_KV_LOAD
            message = (
                f"KV load failed ({state.load_outcome}); kv_load_failure_policy="
                f"{self.settings.load_failure_policy} failed the request"
            )
        else:
            outcome, message = names.OUTCOME_ERROR, f"vLLM finished the request with {status}"

        attrs = state.attributes
        attrs[names.REQUEST_STATUS] = status
        attrs[names.GEN_AI_USAGE_OUTPUT_TOKENS] = finish.output_tokens
        attrs[names.KV_PARAMS_RETURNED] = finish.params is not None
        self._end_request(state, outcome, message)
        if finish.delay_free:
            self._start_retention(state, finish.block_ids, finish.params)
        if state.retention is None:
            self._reqs.pop(state.request_id, None)

    def _end_request(self, state: _Request, outcome: str, message: str | None) -> None:
        if state.ended:
            return
        state.ended = True
        role = state.role
        pulled = state.pulled if state.load_outcome in (None, names.TRANSFER_OK) else 0
        computed = max(state.prompt_tokens - state.local_hit - pulled, 0) if state.allocated else 0
        self._count(names.METRIC_REQUESTS, role, outcome)
        if state.allocated:
            self._count(names.METRIC_PREFILL_TOKENS, role, names.TOKEN_SOURCE_COMPUTED, value=computed)
            self._count(
                names.METRIC_PREFILL_TOKENS, role, names.TOKEN_SOURCE_LOCAL_CACHE, value=state.local_hit
            )
            self._count(names.METRIC_PREFILL_TOKENS, role, names.TOKEN_SOURCE_PULLED, value=pulled)
        decision = state.decision
        if decision is not None and state.reason is not None:
            self._count(names.METRIC_PULL_DECISIONS, decision.decision, state.reason)

        attrs = state.attributes
        attrs[names.REQUEST_OUTCOME] = outcome
        attrs[names.GEN_AI_USAGE_INPUT_TOKENS] = state.prompt_tokens
        if state.allocated:
            attrs[names.TOKENS_LOCAL_CACHE_HIT] = state.local_hit
            attrs[names.TOKENS_PULLED] = pulled
            attrs[names.TOKENS_COMPUTED] = computed
            attrs[names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = state.local_hit + pulled
        if state.remote_kv_wait_s is not None:
            attrs[names.REMOTE_KV_WAIT_SECONDS] = state.remote_kv_wait_s
        if state.continuity_checked:
            self._record_continuity(attrs, state.continuity, refused=state.refused)
        if decision is not None:
            attrs[names.PULL_DECISION] = decision.decision
            if state.reason is not None:
                attrs[names.PULL_REASON] = state.reason
            attrs[names.KV_RECOMPUTE_THRESHOLD] = self.settings.recompute_threshold
            attrs[names.TOKENS_REMOTE_REUSABLE] = decision.remote_reusable
            attrs[names.REMOTE_BLOCKS] = decision.remote_blocks
            if decision.remote_num_tokens is not None:
                attrs[names.REMOTE_NUM_TOKENS] = decision.remote_num_tokens
            if decision.remote_engine_id:
                attrs[names.REMOTE_ENGINE_ID] = decision.remote_engine_id
            if decision.remote_request_id:
                attrs[names.REMOTE_REQUEST_ID] = decision.remote_request_id
        elif role == names.ROLE_DECODE and state.matched:
            attrs[names.TOKENS_REMOTE_REUSABLE] = int(state.matched)
        failed = message is not None and outcome not in (names.OUTCOME_FINISHED, names.OUTCOME_ABORTED)
        if failed:
            attrs[names.ERROR_TYPE] = outcome

        if self._writer.enabled:
            self._writer.emit(
                FinishedSpan(
                    names.engine_request_span_name(role),
                    state.trace_id,
                    state.span_id,
                    state.parent_span_id,
                    True,
                    state.trace_flags,
                    state.start_ns,
                    time.time_ns(),
                    attrs,
                    _ERROR if failed else _UNSET,
                    message if failed else None,
                )
            )
        self._emit_transfer(state)

    def _emit_transfer(self, state: _Request) -> None:
        transfer, state.transfer = state.transfer, None
        if transfer is None or not self._writer.enabled:
            return
        self._writer.emit(
            FinishedSpan(
                transfer.name,
                state.trace_id,
                new_span_id(),
                state.span_id,
                False,
                state.trace_flags,
                transfer.start_ns,
                transfer.end_ns,
                transfer.attributes,
                _ERROR if transfer.error else _UNSET,
                transfer.error,
            )
        )

    # ------------------------------------------------------------------ retention

    def _start_retention(self, state: _Request, block_ids: Any, params: dict[str, Any] | None) -> None:
        blocks = _count_blocks(block_ids)
        now = time.perf_counter()
        if state.role == names.ROLE_DECODE:
            kind, ttl = names.RETENTION_DECODE_TTL, self.settings.decoder_ttl_s
        else:
            kind, ttl = names.RETENTION_PREFILL_LEASE, self.settings.lease_s
        deadline = now + ttl
        expiry = (params or {}).get("remote_blocks_expiry_time")
        if isinstance(expiry, (int, float)):
            deadline = float(expiry)  # same process, same perf_counter clock
            ttl = max(deadline - now, 0.0)
        nbytes = blocks * self._bytes_per_block
        state.retention = _Retention(kind, time.time_ns(), blocks, nbytes, ttl, now, deadline)
        self._retained_blocks[kind] += blocks
        self._gauge_kinds.add(kind)

    def _end_retention(self, state: _Request, outcome: str | None = None) -> None:
        retention = state.retention
        if retention is None:
            return
        state.retention = None
        now = time.perf_counter()
        if outcome is None:
            expired = retention.expired_flag or (
                retention.kind == names.RETENTION_DECODE_TTL
                and now >= retention.deadline_perf - _DEADLINE_TOLERANCE_S
            )
            outcome = names.RETENTION_EXPIRED if expired else names.RETENTION_CONSUMED
        held = max(now - retention.start_perf, 0.0)
        block_seconds = retention.blocks * held
        self._count(names.METRIC_RETENTIONS, retention.kind, outcome)
        self._count(names.METRIC_RETENTION_BLOCK_SECONDS, retention.kind, value=block_seconds)
        self._retained_blocks[retention.kind] -= retention.blocks
        self._gauge_kinds.add(retention.kind)
        if self._writer.enabled:
            self._writer.emit(
                FinishedSpan(
                    names.retention_span_name(retention.kind),
                    state.trace_id,
                    new_span_id(),
                    state.span_id,
                    False,
                    state.trace_flags,
                    retention.start_ns,
                    time.time_ns(),
                    {
                        names.RETENTION_KIND: retention.kind,
                        names.RETENTION_BLOCKS: retention.blocks,
                        names.RETENTION_BYTES: retention.bytes,
                        names.RETENTION_TTL_SECONDS: retention.ttl_s,
                        names.RETENTION_DEADLINE: retention.start_ns / 1e9
                        + (retention.deadline_perf - retention.start_perf),
                        names.RETENTION_OUTCOME: outcome,
                        names.RETENTION_HELD_SECONDS: held,
                        names.RETENTION_BLOCK_SECONDS: block_seconds,
                        names.REQUEST_ID: state.request_id,
                    },
                )
            )
        if state.ended:
            self._reqs.pop(state.request_id, None)

    @guarded("shutdown")
    def shutdown(self) -> None:
        """End what is still open so nothing is silently lost at engine shutdown."""
        for state in list(self._reqs.values()):
            if state.retention is not None:
                self._end_retention(state, names.RETENTION_DROPPED)
        self._reqs.clear()
        self._waiting.clear()


def _parse_traceparent(headers: Any) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a W3C ``traceparent``, or None if absent/invalid."""
    if not headers:
        return None
    value = headers.get("traceparent") or headers.get("Traceparent")
    if not isinstance(value, str):
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, flags


def _continuity_attrs(attrs: dict[str, Any], check: continuity.Check | None) -> None:
    attrs[names.CONTINUITY_DIGEST] = check is not None
    if check is None:
        return
    attrs[names.CONTINUITY_OFFERED] = check.offered
    attrs[names.CONTINUITY_MATCHING] = check.matching
    if check.first_mismatch is not None:
        attrs[names.CONTINUITY_FIRST_MISMATCH] = check.first_mismatch
        attrs[names.CONTINUITY_MISMATCH_IN] = check.mismatch_in


def engine_resource_attributes(settings: EngineSettings, connector_name: str) -> dict[str, Any]:
    """What is the same for every request of an engine: stated once, on the resource."""
    attrs: dict[str, Any] = {
        names.KV_CONNECTOR: connector_name,
        names.GEN_AI_PROVIDER_NAME: names.PROVIDER_VLLM,
        names.BIDIRECTIONAL_KV_XFER: settings.bidirectional,
        names.KV_RECOMPUTE_THRESHOLD: settings.recompute_threshold,
        names.DECODER_KV_BLOCKS_TTL: settings.decoder_ttl_s,
        names.KV_LOAD_FAILURE_POLICY: settings.load_failure_policy,
        names.GEN_AI_REQUEST_MODEL: settings.model,
        names.CONTINUITY_VERIFY: settings.continuity,
    }
    if settings.kv_cache_dtype:
        attrs[names.KV_CACHE_DTYPE] = settings.kv_cache_dtype
    if settings.block_size is not None:
        attrs[names.KV_BLOCK_SIZE] = settings.block_size
    if settings.prefix_caching is not None:
        attrs[names.PREFIX_CACHING] = settings.prefix_caching
    return attrs


def _count_blocks(block_ids: Any) -> int:
    if not block_ids:
        return 0
    first = block_ids[0]
    if isinstance(first, (list, tuple)):
        return sum(len(group) for group in block_ids)
    return len(block_ids)


def _transfer_message(outcome: str, state: _Request) -> str:
    if outcome == names.TRANSFER_DECLINED_EXPIRED:
        return "remote KV blocks had expired (decoder_kv_blocks_ttl lapsed): the read was declined"
    if outcome == names.TRANSFER_STUCK:
        return "no load completion reported; the request is stuck waiting for remote KV"
    if outcome == names.TRANSFER_ABANDONED:
        return "the request ended before its KV load was reported"
    return f"KV transfer failed for {state.request_id}"
