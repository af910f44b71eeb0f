"""The catalogue of diagnoses: why a turn was slow or failed, with evidence and the fix.

Each check is a pure function of a :class:`~otelkv.analysis.model.Turn` (with its
previous turn linked when known) and a small context. A diagnosis carries a stable id
(``names.DIAG_*``, documented in ``docs/diagnoses.md``), the numbers it rests on taken
straight from the trace, one sentence with those numbers, the concrete setting to change,
and an estimated cost in seconds. The cost ranks diagnoses: ``otelkv slow`` shows the
top one, ``otelkv why`` all of them.

Costs are estimates on purpose, not measurements: "recompute N tokens" is priced with
the seconds per computed token the prefill node showed on this or sibling turns. A
failed request costs the whole request (the agent has to retry it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from otelkv import names
from otelkv.analysis.model import SOURCE_SIDECAR, Continuity, History, Leg, Retention, Turn

QUEUEING_MIN_S = 0.25
"""Unexplained input processing below this is noise (HTTP, tokenization), not queueing."""
QUEUEING_MIN_SHARE = 0.5
"""Unexplained time must be at least this share of input processing to count as queueing."""
SLOW_HANDOFF_MIN_S = 1.0
"""A P->D hand-off wait below this is not worth a diagnosis on its own (it shows as
``pull_slower_than_recompute`` or not at all)."""
SLOW_HANDOFF_SHARE = 0.25
"""... and it must be at least this share of the request (arrival to last token)."""
DOMINATES_SHARE = 0.5
"""A gap phase "dominates" when it is more than this share of the turn."""
DOMINATES_MIN_S = 1.0
"""... and at least this long (sub-second turns are not worth a diagnosis)."""


@dataclass(frozen=True)
class Context:
    """What the checks need beyond the turn itself."""

    per_token_s: float | None = None
    """Seconds per computed prompt token on the prefill node (see ``per_token_compute_s``)."""


@dataclass(frozen=True)
class Diagnosis:
    id: str
    title: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""
    cost_s: float = 0.0


Check = Callable[[Turn, Context], "Diagnosis | None"]


@dataclass(frozen=True)
class Registered:
    """One diagnosis of the catalogue: its stable id, title, class and check."""

    id: str
    title: str
    failure: bool
    """A request that failed or hung: ranks above any slowness, whatever the cost, because a
    turn that failed is not explained by the tool wait before it. Otherwise the diagnosis
    is ranked by its cost in seconds."""
    check: Check
    explains: str | None = None
    """The id of a diagnosis whose cause this one names (which message, which id): when both
    apply to a turn, this one ranks right after it, whatever its own cost."""


REGISTRY: dict[str, Registered] = {}
"""The catalogue, in registration order: ties in cost rank in this order (failures first).
``docs/diagnoses.md`` documents exactly these ids (a unit test holds it to that)."""


def register(
    diag_id: str, title: str, *, failure: bool = False, explains: str | None = None
) -> Callable[[Check], Check]:
    """Add a check to the catalogue under ``diag_id`` (each id once)."""

    def add(check: Check) -> Check:
        if diag_id in REGISTRY:
            raise ValueError(f"diagnosis {diag_id!r} registered twice")
        REGISTRY[diag_id] = Registered(diag_id, title, failure, check, explains)
        return check

    return add


def title(diag_id: str) -> str:
    return REGISTRY[diag_id].title


# ------------------------------------------------------------------ helpers


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)


def _legs(turn: Turn) -> list[Leg]:
    return [leg for leg in (turn.prefill, turn.decode) if leg is not None]


def _not_first(turn: Turn) -> bool:
    return (turn.index is not None and turn.index > 0) or turn.previous is not None


def lost_tokens(turn: Turn) -> int:
    """Prompt tokens the prefill node recomputed that an earlier engine still held (or had held)."""
    leg = turn.prefill
    if leg is None or leg.pulled:
        return 0
    computed = (
        leg.computed if leg.computed is not None else max(leg.prompt_tokens - (leg.local_cache or 0), 0)
    )
    if leg.remote_reusable:
        return min(leg.remote_reusable, computed) if computed else leg.remote_reusable
    prev = turn.previous
    if prev is not None and prev.decode is not None:
        held = prev.decode.prompt_tokens + (prev.decode.output_tokens or 0)
        return max(min(held - (leg.local_cache or 0), computed), 0)
    return computed


def recompute_s(turn: Turn, tokens: int, ctx: Context) -> float:
    """Seconds to compute ``tokens`` prompt tokens on the prefill node (0 when unknown)."""
    if tokens <= 0:
        return 0.0
    if ctx.per_token_s:
        return tokens * ctx.per_token_s
    leg = turn.prefill
    if leg is not None and leg.computed:
        return leg.compute_s * min(tokens / leg.computed, 1.0)
    return 0.0


def suggest_ttl(gap_s: float) -> int:
    """A TTL that covers this gap with a margin, rounded up to a readable number."""
    want = gap_s * 1.25
    step = 5 if want <= 60 else 30 if want <= 600 else 300
    return int(math.ceil(want / step) * step)


def pull_seconds(leg: Leg) -> float | None:
    """What waiting for remote KV added to the leg's request (a prefill node's pull, a decode
    node's P->D read): the scheduler's wait for the KV, else NIXL's transfer time."""
    t = leg.transfer
    if t is not None:
        for value in (t.wait_s, t.xfer_s):
            if value:
                return value
    return leg.remote_kv_wait_s


READ_EXPIRY_MARGIN_S = 5.0
"""vLLM 0.32.0 declines a read of the decode node's blocks from this long before their deadline
(``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`` in ``nixl/pull_worker.py``)."""


@dataclass(frozen=True)
class _LateRead:
    leg: Leg
    ttl: float
    wait_s: float
    """From the turn's arrival to the declined read (the read's own wait without a turn start)."""
    before_engine_s: float | None
    """... of which before the prefill node's scheduler first saw the request."""


def in_read_margin(gap_s: float, ttl: float) -> bool:
    """The gap came within vLLM's read margin of the TTL: a read tried at arrival is declined."""
    return gap_s + READ_EXPIRY_MARGIN_S >= ttl


def _declined_expired(leg: Leg) -> bool:
    return leg.reason == names.REASON_DECLINED_EXPIRED or (
        leg.transfer is not None and leg.transfer.outcome == names.TRANSFER_DECLINED_EXPIRED
    )


def late_read(turn: Turn) -> _LateRead | None:
    """A prefill read declined as expired that the gap does not explain.

    The turn reached the fleet while the decode node's blocks were still readable (gap plus
    vLLM's margin inside the TTL), yet the read was declined: it was tried seconds after the
    turn arrived. Seen in the demo: a 1.1 s gap, TTL 15 s, and the read tried 15.1 s after
    the request arrived. Saying "the gap exceeded the TTL" there is wrong and so is its fix
    (raise the TTL to cover a 1 s gap).

    The wait runs from the turn's arrival (the sidecar's or router's span) to the end of the
    declined read, so it holds wherever the time went: a prefill scheduler that reached the
    request late (busy or stalled: the time is before the engine's span) or a KV thread that
    started the read late (inside it). Without a turn start it is the read's own wait. The
    turn's start and the engine's spans may come from two hosts: their clock offset (NTP keeps
    it to milliseconds) goes into both numbers, which is small beside the seconds this needs."""
    leg = turn.prefill
    ttl = turn.decoder_ttl_s()
    if leg is None or ttl is None or not _declined_expired(leg):
        return None
    if in_read_margin(turn.gap_s, ttl):
        return None
    t = leg.transfer
    if t is not None and turn.start_ns and t.end_ns > turn.start_ns:
        wait_s = (t.end_ns - turn.start_ns) / 1e9
        before = min((leg.start_ns - turn.start_ns) / 1e9, wait_s) if leg.start_ns >= turn.start_ns else None
        return _LateRead(leg, ttl, wait_s, before)
    wait = pull_seconds(leg)
    return _LateRead(leg, ttl, wait, None) if wait else None


# ------------------------------------------------------------------ failures


@register(names.DIAG_EXPIRED_READ_FAILED, "Expired KV read failed the request", failure=True)
def check_expired_read_failed(turn: Turn, ctx: Context) -> Diagnosis | None:
    for leg in _legs(turn):
        if leg.outcome != names.OUTCOME_FAILED_KV_LOAD:
            continue
        t_out = leg.transfer.outcome if leg.transfer else None
        if t_out == names.TRANSFER_FAILED and leg.reason != names.REASON_DECLINED_EXPIRED:
            continue  # a broken transfer, not an expired read: kv_transfer_failed
        ttl = turn.decoder_ttl_s()
        policy = leg.config.load_failure_policy
        evidence = {
            "role": leg.role,
            "outcome": leg.outcome,
            "reason": leg.reason,
            "transfer_outcome": t_out,
            "gap_s": _r(turn.gap_s),
            "decoder_kv_blocks_ttl_s": _r(ttl),
            "kv_load_failure_policy": policy,
            "http_status": turn.http_status,
            "request_s": _r(turn.request_s),
        }
        late = late_read(turn)
        if late is not None:
            evidence["wait_before_read_s"] = _r(late.wait_s)
            ttl_text = (
                f": it tried the read {late.wait_s:.1f}s after the turn arrived (the gap was "
                f"only {turn.gap_s:.1f}s of a {late.ttl:g}s TTL), within {READ_EXPIRY_MARGIN_S:g}s of "
                "the blocks' deadline"
            )
        elif ttl is not None:
            ttl_text = f" (gap {turn.gap_s:.1f}s vs TTL {ttl:g}s)"
        else:
            ttl_text = ""
        return Diagnosis(
            names.DIAG_EXPIRED_READ_FAILED,
            title(names.DIAG_EXPIRED_READ_FAILED),
            f"The {leg.role} node tried to read KV that had expired{ttl_text}; with "
            f"kv_load_failure_policy={policy or 'fail'} vLLM failed the request.",
            evidence,
            "Keep the router's handle TTL at least vLLM's 5s read margin below decoder_kv_blocks_ttl, "
            "so it never forwards a handle the decode node has freed or is about to decline. "
            "kv_load_failure_policy=recompute is no way out on vLLM 0.32: a declined read then leaves "
            "the request waiting for remote KV until it is aborted (tried on the reference fleet).",
            turn.request_s + recompute_s(turn, lost_tokens(turn), ctx),
        )
    return None


@register(names.DIAG_KV_FOR_OTHER_TOKENS, "KV reused for different tokens", failure=True)
def check_kv_for_other_tokens(turn: Turn, ctx: Context) -> Diagnosis | None:
    """The prefill node loaded KV from the decode node for positions whose tokens differ from
    the ones that KV was computed for (vLLM 0.32 does not compare them): the answer was
    generated over KV of another text."""
    leg = turn.prefill
    cont = leg.continuity if leg is not None else None
    if leg is None or cont is None or cont.first_mismatch is None or not leg.pulled:
        return None
    local = leg.local_cache or 0
    loaded_end = local + leg.pulled
    wrong = loaded_end - max(cont.first_mismatch, local)
    if wrong <= 0:
        return None
    if cont.mismatch_in == names.CONTINUITY_IN_ANSWER:
        cause = "the previous answer came back in this prompt as other tokens (re-rendered or re-tokenized)"
        fix = (
            "Send the previous answer back exactly as the model produced it (same text, same tool-call "
            "rendering), or let the prefill recompute (raise kv_recompute_threshold above these turns)."
        )
    else:
        cause = "the conversation's history was rewritten under the same conversation id"
        fix = (
            "Give a conversation whose history changed (compaction, an edited or dropped message) a new "
            "conversation id, so the router sends no decode handle for it."
        )
    fix += (
        f" Until then, run the prefill engines with {names.CONFIG_CONTINUITY}: "
        f"{names.CONTINUITY_MODE_GUARD}: otelkv then refuses such handles and vLLM recomputes."
    )
    return Diagnosis(
        names.DIAG_KV_FOR_OTHER_TOKENS,
        title(names.DIAG_KV_FOR_OTHER_TOKENS),
        f"The prefill node loaded {leg.pulled} tokens of KV from the decode node; from token "
        f"{cont.first_mismatch} (the start of the first 32-token chunk that differs) the prompt is not "
        f"what that KV was computed for, {wrong} loaded positions in all: {cause}. The answer was "
        "generated over KV of another text.",
        {
            "offered_tokens": cont.offered,
            "matching_tokens": cont.matching,
            "first_mismatch": cont.first_mismatch,
            "mismatch_in": cont.mismatch_in,
            "pulled_tokens": leg.pulled,
            "local_cache_tokens": local,
            "wrong_tokens": wrong,
        },
        fix,
        0.0,
    )


@register(names.DIAG_STUCK_WAITING_FOR_REMOTE_KV, "Request stuck waiting for remote KV", failure=True)
def check_stuck(turn: Turn, ctx: Context) -> Diagnosis | None:
    for leg in _legs(turn):
        t_out = leg.transfer.outcome if leg.transfer else None
        if leg.outcome != names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV and t_out != names.TRANSFER_STUCK:
            continue
        waited = leg.remote_kv_wait_s or (leg.transfer.wait_s if leg.transfer else None)
        evidence = {
            "role": leg.role,
            "outcome": leg.outcome,
            "transfer_outcome": t_out,
            "remote_kv_wait_s": _r(waited),
            "pulled_tokens": leg.transfer.tokens if leg.transfer else None,
            "engine_id": leg.engine_id,
        }
        return Diagnosis(
            names.DIAG_STUCK_WAITING_FOR_REMOTE_KV,
            title(names.DIAG_STUCK_WAITING_FOR_REMOTE_KV),
            f"The {leg.role} request waited {waited or 0:.1f}s for remote KV that never arrived "
            "(parked in WAITING_FOR_REMOTE_KVS).",
            evidence,
            "Check that the NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT) is reachable between "
            "the engines and that the remote engine is alive; set VLLM_NIXL_ABORT_REQUEST_TIMEOUT so "
            "vLLM aborts such requests instead of holding them.",
            max(waited or 0.0, turn.request_s),
        )
    return None


@register(names.DIAG_TRANSFER_FAILED, "KV transfer failed", failure=True)
def check_transfer_failed(turn: Turn, ctx: Context) -> Diagnosis | None:
    for leg in _legs(turn):
        t = leg.transfer
        failed = (t is not None and t.outcome == names.TRANSFER_FAILED) or (
            leg.reason == names.REASON_TRANSFER_FAILED
        )
        if not failed:
            continue
        request_failed = leg.outcome not in (None, names.OUTCOME_FINISHED, names.OUTCOME_ABORTED)
        evidence = {
            "role": leg.role,
            "direction": t.direction if t else None,
            "transfer_outcome": t.outcome if t else None,
            "bytes": t.bytes if t else None,
            "backend": t.backend if t else None,
            "wait_s": _r(t.wait_s) if t else None,
            "request_outcome": leg.outcome,
            "kv_load_failure_policy": leg.config.load_failure_policy,
        }
        direction = t.direction if t else "KV"
        tail = "and the request failed" if request_failed else "and the engine recomputed instead"
        cost = turn.request_s if request_failed else (t.wait_s or 0.0 if t else 0.0)
        cost += recompute_s(turn, lost_tokens(turn), ctx)
        return Diagnosis(
            names.DIAG_TRANSFER_FAILED,
            title(names.DIAG_TRANSFER_FAILED),
            f"The {direction} transfer on the {leg.role} node failed {tail}.",
            evidence,
            "Check the NIXL/UCX logs of both engines (UCX_TLS, network between the nodes, remote engine "
            "restarts); set kv_load_failure_policy=recompute in --kv-transfer-config so a failed read "
            "costs a recompute rather than the request.",
            cost,
        )
    return None


# ------------------------------------------------------------------ lost reuse


@dataclass(frozen=True)
class _Lapse:
    """Whether the previous turn's decode KV outlived the gap before ``turn``.

    The two lost-reuse checks split on these facts (the KV really expired -> ttl lapse;
    still held but the router called the handle stale -> router drop), so they are read
    in one place and both evidence dicts draw on the same values.
    """

    retention: Retention | None  # the previous turn's decode retention
    expired: bool  # ... ended expired, and the gap before this turn reached its TTL
    declined: bool  # prefill's read was declined as expired
    over: bool  # the gap reached decoder_kv_blocks_ttl
    ttl: float | None
    tokens: int  # prompt tokens recomputed instead (lost_tokens)

    @classmethod
    def of(cls, turn: Turn) -> _Lapse:
        prev = turn.previous
        ret = prev.decode.retention if prev and prev.decode else None
        leg = turn.prefill
        declined = leg is not None and _declined_expired(leg)
        ttl = turn.decoder_ttl_s()
        # A retention nobody read expires in the end whatever the gap: it lapsed *during the gap*
        # only if the gap reached its TTL (the gap is one clock's, the sidecar's; the engines'
        # span times come from two hosts).
        expired = ret is not None and ret.outcome == names.RETENTION_EXPIRED
        if expired and ret is not None and ret.ttl_s:
            expired = turn.gap_s >= ret.ttl_s
        return cls(
            retention=ret,
            expired=expired,
            declined=declined,
            over=ttl is not None and turn.gap_s >= ttl > 0,
            ttl=ttl,
            tokens=lost_tokens(turn),
        )


@register(names.DIAG_TTL_LAPSED, "Decode KV expired during the gap")
def check_ttl_lapsed(turn: Turn, ctx: Context) -> Diagnosis | None:
    if not _not_first(turn):
        return None
    lapse = _Lapse.of(turn)
    stale = turn.router is not None and turn.router.handle == names.ROUTER_HANDLE_STALE
    if not (lapse.expired or lapse.declined or (stale and lapse.over)):
        return None
    if late_read(turn) is not None:
        return None  # the KV outlived the gap; the read came late: kv_read_started_late
    ret, ttl, tokens = lapse.retention, lapse.ttl, lapse.tokens
    phases = turn.phases
    evidence = {
        "gap_s": _r(turn.gap_s),
        "decoder_kv_blocks_ttl_s": _r(ttl),
        "over_by_s": _r(turn.gap_s - ttl) if ttl is not None and turn.gap_s >= ttl else None,
        "tool_wait_s": _r(phases.tool_wait_s) if phases else None,
        "app_work_s": _r(phases.app_work_s) if phases else None,
        "previous_retention_outcome": ret.outcome if ret else None,
        "previous_retention_held_s": _r(ret.held_s) if ret else None,
        "previous_retention_blocks": ret.blocks if ret else None,
        "pull_reason": turn.prefill.reason if turn.prefill else None,
        "router_handle": turn.router.handle if turn.router else None,
        "tokens_recomputed": tokens,
    }
    if ttl is not None and turn.gap_s >= ttl:
        head = f"The {turn.gap_s:.1f}s gap before this turn exceeded decoder_kv_blocks_ttl={ttl:g}s"
    elif ttl is not None and lapse.declined and in_read_margin(turn.gap_s, ttl):
        # Declined inside vLLM's margin: the blocks were still held, but too close to their end.
        head = (
            f"The {turn.gap_s:.1f}s gap before this turn came within vLLM's {READ_EXPIRY_MARGIN_S:g}s "
            f"read margin of decoder_kv_blocks_ttl={ttl:g}s, so the read was declined as expired"
        )
    elif ttl is not None:
        head = (
            f"The decode node's KV was no longer readable after the {turn.gap_s:.1f}s gap before this "
            f"turn (decoder_kv_blocks_ttl={ttl:g}s)"
        )
    else:
        head = f"The decode node's KV expired during the {turn.gap_s:.1f}s gap before this turn"
    held = f"; blocks were held {ret.held_s:.1f}s then freed unread" if ret and ret.held_s is not None else ""
    fix = (
        f"Raise decoder_kv_blocks_ttl (kv_connector_extra_config of the decode node's --kv-transfer-config) "
        f"to about {suggest_ttl(turn.gap_s + READ_EXPIRY_MARGIN_S)}s to bridge gaps like this one (vLLM "
        f"declines reads from {READ_EXPIRY_MARGIN_S:g}s before the deadline), if the memory is there "
        "(cost: blocks x seconds held; see otelkv_kv_retention_block_seconds_total); keep the router's "
        "handle TTL at or below it. Or shorten the agent's wait between turns."
    )
    return Diagnosis(
        names.DIAG_TTL_LAPSED,
        title(names.DIAG_TTL_LAPSED),
        f"{head}{held}, so prefill recomputed {tokens} tokens instead of pulling them.",
        evidence,
        fix,
        recompute_s(turn, tokens, ctx),
    )


@register(names.DIAG_KV_READ_STARTED_LATE, "Prefill node started the KV read too late")
def check_late_read(turn: Turn, ctx: Context) -> Diagnosis | None:
    """The decode node still held the previous turn's KV when this turn arrived, but the
    prefill node tried the read so late that vLLM declined it as expired."""
    late = late_read(turn)
    if late is None:
        return None
    leg, t = late.leg, late.leg.transfer
    failed = leg.outcome == names.OUTCOME_FAILED_KV_LOAD
    tokens = lost_tokens(turn)
    evidence = {
        "gap_s": _r(turn.gap_s),
        "wait_before_read_s": _r(late.wait_s),
        "before_engine_s": _r(late.before_engine_s),
        "decoder_kv_blocks_ttl_s": _r(late.ttl),
        "read_margin_s": READ_EXPIRY_MARGIN_S,
        "outcome": leg.outcome,
        "transfer_outcome": t.outcome if t else None,
        "engine_id": leg.engine_id,
        "tokens_recomputed": None if failed else tokens,
    }
    then = "the request failed" if failed else f"prefill recomputed {tokens} tokens"
    where = ""
    if late.before_engine_s is not None:
        where = f" ({late.before_engine_s:.1f}s of it before its scheduler saw the request)"
    return Diagnosis(
        names.DIAG_KV_READ_STARTED_LATE,
        title(names.DIAG_KV_READ_STARTED_LATE),
        f"The turn arrived {turn.gap_s:.1f}s after the previous one, well inside "
        f"decoder_kv_blocks_ttl={late.ttl:g}s, but the prefill node only tried the read "
        f"{late.wait_s:.1f}s later{where}, within {READ_EXPIRY_MARGIN_S:g}s of the deadline; vLLM "
        f"declined it and {then}.",
        evidence,
        "The KV was there when the turn arrived; the time went on the way to the read: before the "
        "prefill node's scheduler took the request (router or engine queue, a stalled engine) or "
        "inside it (its KV thread starved of CPU). Check the prefill "
        "node's CPU headroom and queue (vllm:num_requests_waiting, vllm:nixl_post_time_seconds); on "
        "a CPU host with several engines, give each engine's NIXL thread a core of its own (vLLM "
        "pins it to the last core of the NUMA node, the same one for every engine). A longer TTL "
        "only buys margin.",
        late.wait_s,
    )


@register(names.DIAG_ROUTER_HANDLE_EXPIRED, "Router dropped the decode handle")
def check_router_dropped(turn: Turn, ctx: Context) -> Diagnosis | None:
    router = turn.router
    if router is None or router.handle != names.ROUTER_HANDLE_STALE:
        return None
    lapse = _Lapse.of(turn)
    if lapse.expired or lapse.over:
        return None  # the KV really was gone: ttl_lapsed_during_gap says so
    ret, ttl, tokens = lapse.retention, lapse.ttl, lapse.tokens
    evidence = {
        "router_handle": router.handle,
        "handle_age_s": _r(router.handle_age_s),
        "gap_s": _r(turn.gap_s),
        "decoder_kv_blocks_ttl_s": _r(ttl),
        "previous_retention_outcome": ret.outcome if ret else None,
        "tokens_recomputed": tokens,
    }
    age = router.handle_age_s if router.handle_age_s is not None else turn.gap_s
    ttl_text = f" though the decode node keeps KV for {ttl:g}s" if ttl is not None else ""
    return Diagnosis(
        names.DIAG_ROUTER_HANDLE_EXPIRED,
        title(names.DIAG_ROUTER_HANDLE_EXPIRED),
        f"The router judged the {age:.1f}s-old decode handle stale and sent none{ttl_text}; "
        f"prefill recomputed {tokens} tokens.",
        evidence,
        "Raise the router's handle TTL to match decoder_kv_blocks_ttl (not above it, or it forwards "
        "handles the decode node has already freed).",
        recompute_s(turn, tokens, ctx),
    )


@register(names.DIAG_DECODE_NO_HANDLE, "Decode returned no kv_transfer_params")
def check_decode_no_handle(turn: Turn, ctx: Context) -> Diagnosis | None:
    if not _not_first(turn) or turn.prefill is None:
        return None
    router = turn.router
    no_handle = turn.prefill.reason == names.REASON_NO_DECODE_HANDLE or (
        router is not None and router.handle == names.ROUTER_HANDLE_MISS
    )
    if not no_handle:
        return None
    prev = turn.previous
    prev_returned = prev.decode.kv_params_returned if prev and prev.decode else None
    prev_response = prev.response_kv_params if prev else None
    prev_router = prev.router if prev else None
    streamed = prev_router.decode_streamed if prev_router else (router.decode_streamed if router else None)
    streamed_source = "router" if streamed is not None else None
    if streamed is None and prev is not None and prev.decode is not None and prev.decode.streamed is not None:
        # No router span: the decode engine says whether it was asked for a stream, and
        # vLLM 0.32 drops kv_transfer_params from streamed responses.
        streamed, streamed_source = prev.decode.streamed, "decode_request"
    # The client-facing response's params are evidence only: routers usually strip them.
    if not (prev_returned is False or streamed is True):
        return None
    decode_cfg = prev.decode.config if prev and prev.decode else (turn.decode.config if turn.decode else None)
    if decode_cfg is not None and decode_cfg.bidirectional is False:
        return None  # bidirectional_off explains it
    tokens = lost_tokens(turn)
    evidence = {
        "turn_index": turn.index,
        "pull_reason": turn.prefill.reason,
        "router_handle": router.handle if router else None,
        "previous_kv_params_returned": prev_returned,
        "previous_response_kv_params": prev_response,
        "decode_streamed": streamed,
        "decode_streamed_source": streamed_source,
        "tokens_recomputed": tokens,
    }
    why = "the decode call was streamed" if streamed else "the decode node returned no kv_transfer_params"
    return Diagnosis(
        names.DIAG_DECODE_NO_HANDLE,
        title(names.DIAG_DECODE_NO_HANDLE),
        f"The previous turn left no decode handle ({why}), so prefill recomputed {tokens} tokens.",
        evidence,
        "Streamed responses of vLLM builds without kv_transfer_params in the final chunk give the router "
        "nothing to forward: have the router call the decode node non-streaming (or upgrade vLLM), keep "
        "the returned kv_transfer_params per conversation for the next prefill request, and check "
        "bidirectional_kv_xfer=true on the decode node.",
        recompute_s(turn, tokens, ctx),
    )


@register(names.DIAG_ROUTER_KEPT_NO_HANDLE, "Router kept no decode handle")
def check_router_kept_no_handle(turn: Turn, ctx: Context) -> Diagnosis | None:
    """The decode node handed back a handle for the previous turn's non-streamed decode call,
    the KV was still held, yet this turn's prefill request carried none, and no router span
    says why: the router keeps no handle between turns, or does not forward it."""
    prev = turn.previous
    if not _not_first(turn) or turn.prefill is None or prev is None or prev.decode is None:
        return None
    if (
        turn.prefill.reason != names.REASON_NO_DECODE_HANDLE
        or turn.router is not None
        or prev.router is not None
    ):
        return None
    if prev.decode.kv_params_returned is not True or prev.decode.streamed is not False:
        return None  # a streamed decode call: decode_returned_no_handle says so
    if prev.decode.config.bidirectional is False:
        return None  # bidirectional_off explains it
    lapse = _Lapse.of(turn)
    if lapse.expired or lapse.over:
        return None  # the KV was gone: a router dropping the handle did right (ttl_lapsed_during_gap)
    tokens = lost_tokens(turn)
    evidence = {
        "turn_index": turn.index,
        "pull_reason": turn.prefill.reason,
        "previous_kv_params_returned": True,
        "previous_response_kv_params": prev.response_kv_params,
        "previous_decode_streamed": False,
        "router_span": False,
        "tokens_recomputed": tokens,
    }
    return Diagnosis(
        names.DIAG_ROUTER_KEPT_NO_HANDLE,
        title(names.DIAG_ROUTER_KEPT_NO_HANDLE),
        "The decode node handed back a handle for the previous turn, but this turn's prefill request "
        f"carried none: the router kept or forwarded none. Prefill recomputed {tokens} tokens.",
        evidence,
        "Have the router keep the decode response's kv_transfer_params per conversation and send them "
        "with the conversation's next prefill request (with do_remote_decode=true); the sidecar's "
        "X-Session-ID (or vllm_xargs.session_id) is a key it can use.",
        recompute_s(turn, tokens, ctx),
    )


@register(names.DIAG_ROUTER_FORWARDS_NO_IDENTITY, "Router forwards no identity to the engines")
def check_router_forwards_no_identity(turn: Turn, ctx: Context) -> Diagnosis | None:
    """The engines served the turn without its trace context (their requests were joined to
    it by inference) or without its conversation id: the router rebuilt the body, dropping
    the ``vllm_xargs`` the sidecar wrote, and forwarded no ``traceparent``/``X-Session-ID``."""
    legs = _legs(turn)
    if turn.source != SOURCE_SIDECAR or not legs or turn.join is None:
        return None
    inferred = turn.join.method == names.JOIN_INFERRED
    # Only engines that say where their context came from (otelkv's observer) vouch that no
    # id reached them; a span without that attribute may come from a recorder that never kept it.
    no_id = [
        leg.role
        for leg in legs
        if turn.conversation_id and leg.context_source is not None and not leg.conversation_id
    ]
    if not inferred and not no_id:
        return None
    if inferred and no_id:
        summary = (
            "The engines received neither the turn's trace context nor its conversation id: no "
            "vllm_xargs in the body, no traceparent or X-Session-ID header reached them. otelkv joined "
            f"their requests to this turn by inference ({', '.join(turn.join.evidence)})."
        )
    elif inferred:
        summary = (
            "The engines did not receive the turn's trace context (no vllm_xargs in the body, no "
            "traceparent with vLLM tracing on); otelkv joined their requests to this turn by inference "
            f"({', '.join(turn.join.evidence)})."
        )
    else:
        summary = (
            f"The {' and '.join(no_id)} request(s) joined this turn's trace but did not receive its "
            f"conversation id {turn.conversation_id!r} (no X-Session-ID header, no vllm_xargs.session_id)."
        )
    return Diagnosis(
        names.DIAG_ROUTER_FORWARDS_NO_IDENTITY,
        title(names.DIAG_ROUTER_FORWARDS_NO_IDENTITY),
        summary,
        {
            "join": turn.join.method,
            "join_evidence": list(turn.join.evidence),
            "trace_context_source": {leg.role: leg.context_source for leg in legs},
            "engines_without_conversation_id": no_id,
        },
        "Keep the request body's vllm_xargs when the router rebuilds the body (the sidecar writes the turn's "
        "traceparent and session_id there), or forward traceparent and X-Session-ID to both legs with "
        "vLLM's --otlp-traces-endpoint on. Inferred joins fail when concurrent turns look alike.",
        0.0,
    )


@register(names.DIAG_BIDIRECTIONAL_OFF, "Bidirectional KV transfer off")
def check_bidirectional_off(turn: Turn, ctx: Context) -> Diagnosis | None:
    leg = turn.prefill
    reason_off = leg is not None and leg.reason == names.REASON_BIDIRECTIONAL_OFF
    p_cfg = turn.prefill.config.bidirectional if turn.prefill else None
    d_leg = turn.decode or (turn.previous.decode if turn.previous else None)
    d_cfg = d_leg.config.bidirectional if d_leg else None
    config_off = p_cfg is False or d_cfg is False
    pulled = bool(leg and leg.pulled)
    if not (reason_off or (config_off and _not_first(turn) and not pulled)):
        return None
    sides = [side for side, value in (("prefill", p_cfg), ("decode", d_cfg)) if value is False]
    side_text = " and ".join(sides) if sides else "one side"
    tokens = lost_tokens(turn)
    evidence = {
        "pull_reason": leg.reason if leg else None,
        "prefill_bidirectional_kv_xfer": p_cfg,
        "decode_bidirectional_kv_xfer": d_cfg,
        "tokens_recomputed": tokens,
    }
    return Diagnosis(
        names.DIAG_BIDIRECTIONAL_OFF,
        title(names.DIAG_BIDIRECTIONAL_OFF),
        f"bidirectional_kv_xfer is off on the {side_text} node, so the decode node's KV is never read "
        f"back; prefill recomputed {tokens} tokens.",
        evidence,
        "Set kv_connector_extra_config.bidirectional_kv_xfer=true in --kv-transfer-config on both the "
        "prefill and the decode node (and restart them).",
        recompute_s(turn, tokens, ctx),
    )


@register(names.DIAG_NO_CONVERSATION_ID, "No conversation id from the client")
def check_no_conversation_id(turn: Turn, ctx: Context) -> Diagnosis | None:
    router = turn.router
    router_none = router is not None and router.handle == names.ROUTER_HANDLE_NO_CONVERSATION
    if not (turn.conversation_inferred or router_none):
        return None
    tokens = lost_tokens(turn) if router_none and _not_first(turn) else 0
    evidence = {
        "conversation_inferred": turn.conversation_inferred,
        "conversation_id_source": turn.conversation_id_source,
        "router_handle": router.handle if router else None,
        "tokens_recomputed": tokens,
    }
    if router_none:
        summary = (
            "The router got no conversation id, so it could not hand over a decode handle "
            f"({tokens} tokens recomputed)."
        )
    else:
        summary = (
            "The client sent no conversation id; the sidecar inferred one from the message prefix, "
            "which breaks when the agent edits or truncates its history."
        )
    return Diagnosis(
        names.DIAG_NO_CONVERSATION_ID,
        title(names.DIAG_NO_CONVERSATION_ID),
        summary,
        evidence,
        "Send the conversation id on every request: header X-Conversation-Id (or X-Session-ID, or body "
        "conversation_id / session_id).",
        recompute_s(turn, tokens, ctx),
    )


# ------------------------------------------------------------------ history and identity
#
# The sidecar compares each chat request's messages with its conversation's previous request
# and answer (``Turn.history``) and recognises a conversation continued under a new id
# (``Turn.resumed_from``); the prefill engine checks the tokens against the decode handle's
# digest (``Leg.continuity``). One fact, one headline: when the prefill node actually loaded
# KV computed for other tokens, ``kv_reused_for_different_tokens`` (a failure) is it, and the
# diagnoses below say only what it does not (which message, which id), at no cost of their own.
# When the engine checked every token it was offered and found them equal, a difference the
# sidecar saw did not change the tokens (e.g. whitespace a tokenizer drops): nothing fires.


@dataclass(frozen=True)
class _Divergence:
    """The continuity evidence of one turn, read the same way by each check below."""

    history: History | None
    engine: Continuity | None
    """The prefill leg's digest check when it found a mismatch (else None)."""
    engine_clear: bool
    """The engine checked the handle's digest and every offered token matched."""
    loaded_other: Diagnosis | None
    """``kv_reused_for_different_tokens`` when it applies: other tokens' KV was loaded."""
    pulled: int
    refused: bool
    """Guard mode refused the handle (reason ``continuity_mismatch``): nothing wrong was loaded."""

    @classmethod
    def of(cls, turn: Turn, ctx: Context) -> _Divergence:
        leg = turn.prefill
        cont = leg.continuity if leg is not None else None
        mismatch = cont if cont is not None and cont.first_mismatch is not None else None
        clear = (
            cont is not None
            and cont.digest
            and cont.first_mismatch is None
            and bool(cont.matching)
            and (cont.offered or 0) <= (cont.matching or 0)
        )
        return cls(
            history=turn.history,
            engine=mismatch,
            engine_clear=clear,
            loaded_other=check_kv_for_other_tokens(turn, ctx),
            pulled=(leg.pulled or 0) if leg is not None else 0,
            refused=leg is not None and leg.reason == names.REASON_CONTINUITY_MISMATCH,
        )

    def refused_note(self) -> str:
        return (
            "guard mode refused the decode handle and the prefill node recomputed; " if self.refused else ""
        )

    def not_reusable(self) -> int | None:
        """Tokens of the decode node's KV from the first mismatch on (engine evidence only)."""
        e = self.engine
        if e is None or e.offered is None or e.first_mismatch is None:
            return None
        return max(e.offered - max(e.first_mismatch, e.matching or 0), 0)

    def cost(self, turn: Turn, ctx: Context) -> float:
        """Recomputing what could not be reused; nothing when it was loaded anyway (the failure
        diagnosis carries that)."""
        if self.loaded_other is not None:
            return 0.0
        return recompute_s(turn, self.not_reusable() or 0, ctx)

    def evidence(self) -> dict[str, Any]:
        e = self.engine
        return {
            "first_mismatch_token": e.first_mismatch if e else None,
            "matching_tokens": e.matching if e else None,
            "offered_tokens": e.offered if e else None,
            "tokens_not_reusable": self.not_reusable(),
            "pulled_tokens": self.pulled,
            "kv_loaded_for_other_tokens": self.loaded_other is not None,
            "guard_refused": self.refused,
        }

    def unchecked_pull(self, what: str = "the changed message") -> str:
        """A sentence for a pull no digest checked (engines without otelkv's digest)."""
        if self.engine is not None or self.loaded_other is not None or not self.pulled:
            return ""
        return (
            f" The prefill node pulled {self.pulled} tokens of the decode node's KV without a continuity "
            "digest to check them (the decode node runs no otelkv, or the router dropped the handle's "
            f"otelkv_continuity): if they reach {what}, this answer was generated over KV of the old text."
        )


@register(names.DIAG_ID_CHANGED_ON_RESUME, "Conversation resumed under a new id")
def check_id_changed_on_resume(turn: Turn, ctx: Context) -> Diagnosis | None:
    """The first request of this id opens with a recent turn of another conversation (its
    messages and answer) whose decode KV was still held: the router keys the decode handle by
    id, so it sent none. Silent when a handle reached the prefill node anyway (a router keyed
    otherwise) or the KV had expired by then (the new id cost nothing)."""
    resumed = turn.resumed_from
    if resumed is None:
        return None
    ttl = turn.decoder_ttl_s()
    left = ttl - resumed.gap_s if ttl is not None else None
    leg = turn.prefill
    if (left is not None and left <= 0) or (
        leg is not None and leg.reason is not None and leg.reason != names.REASON_NO_DECODE_HANDLE
    ):
        return None
    tokens = 0  # what the decode node held beyond the prefill node's own prefix-cache hit
    if resumed.tokens and leg is not None and not leg.pulled:
        local = leg.local_cache or 0
        tokens = max(min(resumed.tokens, leg.prompt_tokens or resumed.tokens) - local, 0)
        if leg.computed is not None:
            tokens = min(tokens, leg.computed)
    evidence = {
        "conversation_id": turn.conversation_id,
        "previous_conversation_id": resumed.conversation_id,
        "previous_trace_id": resumed.trace_id,
        "gap_s": _r(resumed.gap_s),
        "decoder_kv_blocks_ttl_s": _r(ttl),
        "ttl_left_s": _r(left),
        "previous_tokens": resumed.tokens,
        "repeated_messages": resumed.messages,
        "pull_reason": leg.reason if leg else None,
        "local_cache_tokens": leg.local_cache if leg else None,
        "tokens_recomputed": tokens,
    }
    held_tokens = f"{resumed.tokens} tokens" if resumed.tokens is not None else "the KV"
    still = f" for another {left:.1f}s" if left is not None else ""
    then = (
        f"The decode node still held that turn's {held_tokens}{still}, but the router keys its handle "
        f"by conversation id and sent none: prefill recomputed the {tokens} of them its own prefix "
        "cache did not hold."
    )
    return Diagnosis(
        names.DIAG_ID_CHANGED_ON_RESUME,
        title(names.DIAG_ID_CHANGED_ON_RESUME),
        f"This request continues conversation {resumed.conversation_id!r} under the new id "
        f"{turn.conversation_id!r}: it opens with that conversation's turn (trace {resumed.trace_id}), "
        f"{resumed.messages} messages with its answer, {resumed.gap_s:.1f}s after that turn ended. {then}",
        evidence,
        "Keep the conversation id when the agent resumes a conversation (after a restart, a reconnect, a "
        "hand-off to another worker): send the same X-Conversation-Id / X-Session-ID. If the application "
        "must mint a new id, have the router look the decode handle up under the previous id for the "
        "new id's first request (the sidecar names it on the turn span: otelkv.conversation.resumed_from).",
        recompute_s(turn, tokens, ctx),
    )


@register(
    names.DIAG_ID_REUSED,
    "Conversation id reused for another conversation",
    explains=names.DIAG_KV_FOR_OTHER_TOKENS,
)
def check_id_reused(turn: Turn, ctx: Context) -> Diagnosis | None:
    """The request shares no message with its id's previous request beyond an identical leading
    system message: a different conversation under the same id. The router hands it the other
    conversation's decode handle."""
    history = turn.history
    if history is None or not history.id_reused:
        return None
    div = _Divergence.of(turn, ctx)
    evidence = {
        "conversation_id": turn.conversation_id,
        "previous_trace_id": turn.previous_trace_id or None,
        "previous_messages": history.previous_messages,
        **div.evidence(),
    }
    if div.loaded_other is not None:
        then = (
            f"The router handed it that conversation's decode handle and the prefill node loaded its KV "
            f"({div.pulled} tokens; see {names.DIAG_KV_FOR_OTHER_TOKENS})."
        )
    elif div.engine is not None:
        then = (
            "The router handed it that conversation's decode handle; the prefill node's digest check "
            f"shows the KV is another text's from token {div.engine.first_mismatch} on."
        )
    else:
        then = (
            "A router that keys decode handles by conversation id hands such a request the other "
            "conversation's KV." + div.unchecked_pull()
        )
    return Diagnosis(
        names.DIAG_ID_REUSED,
        title(names.DIAG_ID_REUSED),
        f"The conversation id {turn.conversation_id!r} was reused for another conversation, or the whole "
        "history after the system prompt was replaced (a compaction into one summary): this request "
        f"shares no message with the id's previous request ({history.previous_messages} messages) beyond "
        f"an identical leading system message. {then}",
        evidence,
        "Mint a new conversation id for every new conversation (unique per conversation, not per user, "
        "session or worker), and keep it for that conversation's later turns. If the agent replaced its "
        "history on purpose, give the rewritten conversation a new id too: the router then sends no "
        "decode handle for KV of the old text.",
        div.cost(turn, ctx),
    )


@register(
    names.DIAG_HISTORY_REWRITTEN,
    "History rewritten under the same conversation id",
    explains=names.DIAG_KV_FOR_OTHER_TOKENS,
)
def check_history_rewritten(turn: Turn, ctx: Context) -> Diagnosis | None:
    """Earlier messages changed under the same id (compaction, an edited or dropped message, a
    trimmed window): the decode node's KV from that point on belongs to the old text."""
    div = _Divergence.of(turn, ctx)
    history = div.history
    if history is not None and history.id_reused:
        return None  # conversation_id_reused says it
    sidecar_k = history.rewritten_at if history is not None else None
    engine_history = div.engine is not None and div.engine.mismatch_in == names.CONTINUITY_IN_HISTORY
    if not engine_history and (sidecar_k is None or div.engine_clear):
        return None
    evidence = {
        "message_index": sidecar_k,
        "previous_messages": history.previous_messages if history is not None else None,
        **div.evidence(),
    }
    if sidecar_k is not None and history is not None:
        where = (
            f"Message {sidecar_k} of the {history.previous_messages} the previous request sent came back "
            "changed or not at all"
        )
    elif history is not None:
        where = (
            "The previous request's messages all came back unchanged, yet their tokens differ: the same "
            "messages were rendered into other tokens (a chat template or tokenizer that changed)"
        )
    else:
        where = "The earlier history changed"
    e = div.engine
    if div.loaded_other is not None:
        then = (
            f"; the prefill node loaded the decode node's KV for it anyway ({names.DIAG_KV_FOR_OTHER_TOKENS} "
            "above: the failure is there)."
        )
    elif e is not None:
        then = (
            f"; {div.refused_note()}from token {e.first_mismatch} on, {div.not_reusable()} tokens of the "
            "decode node's KV belong to the old text and could not be reused."
        )
    else:
        then = "." + div.unchecked_pull()
    return Diagnosis(
        names.DIAG_HISTORY_REWRITTEN,
        title(names.DIAG_HISTORY_REWRITTEN),
        f"{where} under conversation id {turn.conversation_id!r}{then}",
        evidence,
        "If the agent rewrites its history on purpose (compaction, a trimmed window, an edited message), "
        "give the rewritten conversation a new conversation id: the router then sends no decode handle, "
        "and the unchanged prefix still hits the prefill node's prefix cache. If it should not change, "
        "send earlier messages back exactly as before (same text, same order).",
        div.cost(turn, ctx),
    )


_ANSWER_PART = {
    names.PREVIOUS_ANSWER_CONTENT_DIFFERS: "its text differs",
    names.PREVIOUS_ANSWER_TOOL_CALLS_DIFFER: "its tool calls differ",
    names.PREVIOUS_ANSWER_BOTH_DIFFER: "its text and its tool calls differ",
    names.PREVIOUS_ANSWER_DROPPED: "it is missing (no assistant message there)",
}


@register(
    names.DIAG_ANSWER_RE_RENDERED,
    "Previous answer sent back changed",
    explains=names.DIAG_KV_FOR_OTHER_TOKENS,
)
def check_answer_re_rendered(turn: Turn, ctx: Context) -> Diagnosis | None:
    """The previous answer came back in this prompt other than the model produced it (edited,
    trimmed, re-serialized tool calls, dropped) or as other tokens: the decode node's KV for
    the answer belongs to the answer as generated."""
    div = _Divergence.of(turn, ctx)
    history = div.history
    state = history.previous_answer if history is not None else None
    sidecar_differs = state in _ANSWER_PART
    engine_answer = div.engine is not None and div.engine.mismatch_in == names.CONTINUITY_IN_ANSWER
    if not engine_answer and (not sidecar_differs or div.engine_clear):
        return None
    e = div.engine
    leg = turn.prefill
    wrong = None
    if engine_answer and e is not None and e.first_mismatch is not None and leg is not None and leg.pulled:
        local = leg.local_cache or 0
        wrong = max(local + leg.pulled - max(e.first_mismatch, local), 0)
    share = wrong / div.pulled if wrong is not None and div.pulled else None
    prev = turn.previous
    evidence = {
        "answer_message_index": history.previous_messages if history is not None else None,
        "previous_answer": state,
        "previous_answer_tokens": prev.output_tokens if prev is not None else None,
        "mismatched_pulled_tokens": wrong,
        "share_of_pulled": _r(share),
        **div.evidence(),
    }
    if sidecar_differs and history is not None and state is not None:
        head = (
            f"The previous answer came back in message {history.previous_messages} changed from what the "
            f"sidecar relayed: {_ANSWER_PART[state]}"
        )
    elif state == names.PREVIOUS_ANSWER_VERBATIM:
        head = (
            "The previous answer came back word for word, yet its tokens differ from those the model "
            "generated (turning the generated tokens into text and back does not give them again, e.g. "
            "special tokens left out of the text)"
        )
    else:
        head = "The previous answer came back in this prompt as other tokens"
    if share is not None:
        tail = (
            f"; {wrong} of the {div.pulled} tokens the prefill node pulled ({share:.0%}) are KV of the "
            f"answer as generated, not as sent back (see {names.DIAG_KV_FOR_OTHER_TOKENS})."
        )
    elif e is not None:
        tail = (
            f"; {div.refused_note()}from token {e.first_mismatch} on the decode node's KV could not be "
            "reused."
        )
    else:
        tail = "." + div.unchecked_pull("the answer")
    if state == names.PREVIOUS_ANSWER_VERBATIM and not sidecar_differs:
        fix = (
            "Nothing to change in the agent: it sent the answer back unchanged. The model's tokens do not "
            "survive vLLM's detokenize/re-tokenize round trip (special tokens skipped in the text, merges "
            "that tokenize differently); only the answer's KV is affected, and it is correct only if the "
            "prefill node recomputes it."
        )
    else:
        fix = (
            "Send the previous answer back exactly as the model returned it: the same text (no trimming, "
            "reformatting or summarizing) and the same tool calls (name and arguments as returned; do not "
            "add, drop or rewrite them). If the agent must change it, recomputing is the price: nothing "
            "is wrong with the fleet."
        )
    return Diagnosis(
        names.DIAG_ANSWER_RE_RENDERED,
        title(names.DIAG_ANSWER_RE_RENDERED),
        f"{head}{tail}",
        evidence,
        fix,
        div.cost(turn, ctx),
    )


@register(names.DIAG_BELOW_THRESHOLD, "Reusable KV below the recompute threshold")
def check_below_threshold(turn: Turn, ctx: Context) -> Diagnosis | None:
    leg = turn.prefill
    if leg is None or leg.reason != names.REASON_BELOW_THRESHOLD:
        return None
    reusable = leg.remote_reusable or 0
    evidence = {
        "remote_reusable_tokens": reusable,
        "kv_recompute_threshold": leg.threshold,
        "tokens_computed": leg.computed,
        "per_token_compute_s": _r(ctx.per_token_s, 6),
    }
    return Diagnosis(
        names.DIAG_BELOW_THRESHOLD,
        title(names.DIAG_BELOW_THRESHOLD),
        f"Only {reusable} reusable tokens were on the decode node, below kv_recompute_threshold="
        f"{leg.threshold}; prefill recomputed them.",
        evidence,
        f"If pulling {reusable} tokens is faster than recomputing them on this link, lower "
        "kv_recompute_threshold (kv_connector_extra_config) below that; otherwise this is the threshold "
        "doing its job.",
        recompute_s(turn, reusable, ctx),
    )


@register(names.DIAG_PULL_SLOWER_THAN_RECOMPUTE, "Pull slower than recomputing")
def check_pull_slower(turn: Turn, ctx: Context) -> Diagnosis | None:
    leg = turn.prefill
    if leg is None or leg.decision != names.DECISION_PULL or not leg.pulled:
        return None
    if leg.transfer is not None and leg.transfer.outcome not in (None, names.TRANSFER_OK):
        return None
    pull = pull_seconds(leg)
    if pull is None or not ctx.per_token_s:
        return None
    estimate = leg.pulled * ctx.per_token_s
    if pull <= estimate:
        return None
    t = leg.transfer
    evidence = {
        "pulled_tokens": leg.pulled,
        "pull_s": _r(pull, 4),
        "xfer_s": _r(t.xfer_s, 4) if t else None,
        "bytes": t.bytes if t else None,
        "backend": t.backend if t else None,
        "per_token_compute_s": _r(ctx.per_token_s, 6),
        "recompute_estimate_s": _r(estimate, 4),
        "kv_recompute_threshold": leg.threshold,
    }
    return Diagnosis(
        names.DIAG_PULL_SLOWER_THAN_RECOMPUTE,
        title(names.DIAG_PULL_SLOWER_THAN_RECOMPUTE),
        f"Pulling {leg.pulled} tokens took {pull:.3f}s; recomputing them would have taken about "
        f"{estimate:.3f}s.",
        evidence,
        f"Raise kv_recompute_threshold above {leg.pulled} tokens so requests this size recompute, or "
        f"speed up the link (NIXL backend {t.backend if t and t.backend else '?'}: check UCX_TLS uses "
        "RDMA/shared memory rather than TCP).",
        pull - estimate,
    )


@register(names.DIAG_SLOW_KV_HANDOFF, "Decode waited long for the prefill node's KV")
def check_slow_handoff(turn: Turn, ctx: Context) -> Diagnosis | None:
    """The forward hand-off (decode reading the prefill node's KV) took seconds.

    A P->D read of a few blocks takes milliseconds on any link; seconds mean the read
    waited for something: the prefill node's NIXL agent (with a two-sided transport an
    idle engine progresses a read only at its next step or lease reaping) or a process
    starved of CPU (two engines' NIXL threads pinned to one core: posting the read then
    blocks until the prefill lease is reaped).
    """
    d = turn.decode
    if d is None or d.transfer is None:
        return None
    t = d.transfer
    if t.outcome not in (None, names.TRANSFER_OK):
        return None  # failures are kv_transfer_failed's
    wait = pull_seconds(d)
    if not wait or wait < SLOW_HANDOFF_MIN_S or wait < SLOW_HANDOFF_SHARE * max(turn.request_s, wait):
        return None
    posted = t.post_s is not None and t.post_s >= 0.5 * wait
    evidence = {
        "direction": t.direction,
        "wait_s": _r(t.wait_s, 4),
        "xfer_s": _r(t.xfer_s, 4),
        "post_s": _r(t.post_s, 4),
        "bytes": t.bytes,
        "backend": t.backend,
        "request_s": _r(turn.request_s),
    }
    size = f"{t.bytes / 1024:.0f} KiB" if t.bytes else "the KV"
    post_text = f"; posting the read alone took {t.post_s:.2f}s" if posted and t.post_s is not None else ""
    return Diagnosis(
        names.DIAG_SLOW_KV_HANDOFF,
        title(names.DIAG_SLOW_KV_HANDOFF),
        f"The decode node waited {wait:.2f}s for {size} from the prefill node "
        f"({t.direction} over {t.backend or 'NIXL'}){post_text}.",
        evidence,
        "A read that blocks for seconds waits on the remote NIXL agent or a starved process, not "
        "the wire: check both nodes' CPU headroom (their engine and KV threads must run; on a CPU "
        "host with several engines vLLM pins every engine's NIXL thread to the same core), prefer "
        "one-sided transports (UCX_TLS with rc/cuda_ipc on GPU fleets, not tcp alone), and compare "
        "with vllm:nixl_post_time_seconds / vllm:nixl_xfer_time_seconds on the decode node.",
        wait,
    )


# ------------------------------------------------------------------ where the time went


@register(names.DIAG_QUEUEING, "Queueing before the engines")
def check_queueing(turn: Turn, ctx: Context) -> Diagnosis | None:
    phases = turn.phases
    if phases is None or (turn.prefill is None and turn.decode is None):
        return None
    inp = phases.input_processing_s
    prefill_s = turn.prefill.duration_s if turn.prefill else 0.0
    d = turn.decode
    transfer_s = d.transfer.wait_s if d and d.transfer and d.transfer.wait_s else 0.0
    explained = prefill_s + transfer_s
    unexplained = inp - explained
    if unexplained < QUEUEING_MIN_S or unexplained < QUEUEING_MIN_SHARE * inp:
        return None
    evidence = {
        "input_processing_s": _r(inp),
        "prefill_engine_s": _r(prefill_s),
        "p_to_d_wait_s": _r(transfer_s),
        "unexplained_s": _r(unexplained),
        "ttft_source": phases.ttft_source,
    }
    return Diagnosis(
        names.DIAG_QUEUEING,
        title(names.DIAG_QUEUEING),
        f"Input processing took {inp:.2f}s but the engines account for {explained:.2f}s; "
        f"{unexplained:.2f}s went to queueing before them.",
        evidence,
        "Look at the router's and the vLLM API servers' queues: router concurrency limits, vLLM "
        "--max-num-seqs and --api-server-count, and the prefill node's load.",
        unexplained,
    )


def _dominates(turn: Turn, phase: str) -> tuple[float, float] | None:
    phases = turn.phases
    if phases is None:
        return None
    value = phases.as_dict()[phase]
    total = phases.total_s
    if total <= 0 or value < DOMINATES_MIN_S or value <= DOMINATES_SHARE * total:
        return None
    return value, total


@register(names.DIAG_TOOL_WAIT_DOMINATES, "Tool wait dominates the turn")
def check_tool_wait(turn: Turn, ctx: Context) -> Diagnosis | None:
    found = _dominates(turn, names.PHASE_TOOL_WAIT)
    if found is None or turn.phases is None:
        return None
    value, total = found
    ttl = turn.decoder_ttl_s()
    evidence = {
        "tool_wait_s": _r(value),
        "total_s": _r(total),
        "share": _r(value / total),
        "gap_source": turn.phases.gap_source,
        "decoder_kv_blocks_ttl_s": _r(ttl),
    }
    return Diagnosis(
        names.DIAG_TOOL_WAIT_DOMINATES,
        title(names.DIAG_TOOL_WAIT_DOMINATES),
        f"The agent waited {value:.1f}s for tools, {value / total:.0%} of the {total:.1f}s turn.",
        evidence,
        "Not the fleet: speed up, cache or parallelize the agent's tools. If tool waits exceed "
        "decoder_kv_blocks_ttl the KV is lost as well (see ttl_lapsed_during_gap).",
        value,
    )


@register(names.DIAG_APP_WORK_DOMINATES, "Agent's own work dominates the turn")
def check_app_work(turn: Turn, ctx: Context) -> Diagnosis | None:
    found = _dominates(turn, names.PHASE_APP_WORK)
    if found is None or turn.phases is None:
        return None
    value, total = found
    evidence = {
        "app_work_s": _r(value),
        "total_s": _r(total),
        "share": _r(value / total),
        "gap_source": turn.phases.gap_source,
    }
    return Diagnosis(
        names.DIAG_APP_WORK_DOMINATES,
        title(names.DIAG_APP_WORK_DOMINATES),
        f"The agent spent {value:.1f}s on its own work between turns, {value / total:.0%} of the "
        f"{total:.1f}s turn.",
        evidence,
        "Not the fleet: the agent's own time (planning, retries, a person reading). If it sends "
        "execute_tool spans, tool time is separated out; otherwise instrument the agent to see more.",
        value,
    )


def diagnose(turn: Turn, ctx: Context | None = None) -> list[Diagnosis]:
    """Every diagnosis that applies to the turn: failures first, then costliest first.

    Ties keep catalogue order (:data:`REGISTRY`). A diagnosis that names the cause of another
    one found (:attr:`Registered.explains`) follows it directly.
    """
    ctx = ctx or Context()
    order = {diag_id: i for i, diag_id in enumerate(REGISTRY)}
    found = []
    for entry in REGISTRY.values():
        d = entry.check(turn, ctx)
        if d is not None:  # the registry is the authority on id and title
            found.append(replace(d, id=entry.id, title=entry.title))
    found.sort(key=lambda d: (not REGISTRY[d.id].failure, -d.cost_s, order[d.id]))
    present = {d.id for d in found}
    causes = [d for d in found if REGISTRY[d.id].explains in present]
    if not causes:
        return found
    ranked = [d for d in found if d not in causes]
    for cause in reversed(causes):  # each right after what it explains, in rank order
        at = next(i for i, d in enumerate(ranked) if d.id == REGISTRY[cause.id].explains)
        ranked.insert(at + 1, cause)
    return ranked
