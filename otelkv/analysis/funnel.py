"""The reuse funnel: how often a follow-up turn could have read its KV back, and what it is worth.

Every follow-up turn (turn index 1 or more) of a window walks the same ordered steps
(:data:`otelkv.names.FUNNEL_STEPS`), the prerequisites of reverse KV reuse in the order a
turn meets them:

1. ``follow_up``: a follow-up turn (every one starts here);
2. ``conversation_id``: it carried a conversation id from the client (not a fingerprint);
3. ``decode_handle``: the previous turn's decode call handed back a handle (``kv_transfer_params``);
4. ``kv_held``: the decode node still held that KV when the turn arrived and the handle
   reached the prefill node;
5. ``above_threshold``: the reusable remainder reached ``kv_recompute_threshold``;
6. ``pulled``: the prefill node read the KV back;
7. ``faster_than_recompute``: the pull took less than recomputing (and the KV belonged to
   the prompt).

A turn is *lost* at the first step it fails, under one reason: the id of the diagnosis that
names the cause (:mod:`otelkv.analysis.diagnose`), else the prefill node's pull reason,
else one of the ``FUNNEL_LOST_*`` reasons. Evidence from later in the chain counts for the
earlier steps: a prefill request that got a handle proves the decode call returned one, even
when the previous turn's engine spans are not in the store. So every follow-up turn lands in
exactly one (step, reason) bucket or reaches the end, and the buckets add up.

What the opportunity is worth: each turn's *reusable tokens*, the prompt tokens whose KV the
decode node held beyond the prefill node's own prefix-cache hit (what was pulled, what vLLM
found reusable behind the handle, or what the previous decode request held), and the
prefill seconds recomputing them costs at the prefill node's fastest observed rate per token.

:func:`funnel_turns` is pure; :func:`funnel` reads the window from a span source.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from otelkv import names
from otelkv.analysis import turn_json
from otelkv.analysis.diagnose import Context, diagnose, in_read_margin, lost_tokens, recompute_s
from otelkv.analysis.linker import window_turns
from otelkv.analysis.model import Turn
from otelkv.analysis.report import diagnosis_context
from otelkv.analysis.sources import SpanSource

MAX_TURNS = 20_000
"""Most recent turns of a window the funnel models (the answer says how many were left out)."""

STEP_TITLES: dict[str, str] = {
    names.FUNNEL_FOLLOW_UP: "follow-up turns (turn index 1 or more)",
    names.FUNNEL_CONVERSATION_ID: "carried a conversation id from the client",
    names.FUNNEL_DECODE_HANDLE: "previous decode call returned a handle",
    names.FUNNEL_KV_HELD: "KV still held, handle reached prefill",
    names.FUNNEL_ABOVE_THRESHOLD: "reusable tokens at or above the threshold",
    names.FUNNEL_PULLED: "prefill pulled the KV",
    names.FUNNEL_FASTER: "pull faster than recomputing",
}
"""One line per step, as the CLI and the dashboard print it."""

ID_SOURCE_FINGERPRINT = "fingerprint"
"""The id source of a conversation id the sidecar inferred (:data:`otelkv.names.CONVERSATION_ID_SOURCES`)."""
_HANDLE_ABSENT = (None, names.REASON_NO_DECODE_HANDLE)
_FAILED_OUTCOMES = (
    names.OUTCOME_FAILED_KV_LOAD,
    names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV,
    names.OUTCOME_ERROR,
)

_PULL_REASONS_LOST = (
    names.REASON_DECLINED_EXPIRED,
    names.REASON_CONTINUITY_MISMATCH,
    names.REASON_INVALID_HANDLE,
    names.REASON_BIDIRECTIONAL_OFF,
)
_NOT_WORTH_IT = (names.DIAG_KV_FOR_OTHER_TOKENS, names.DIAG_PULL_SLOWER_THAN_RECOMPUTE)


@dataclass(frozen=True)
class Placement:
    """Where one follow-up turn left the funnel (``step`` None: it reached the end)."""

    step: str | None
    reason: str | None
    tokens: int | None
    """Reusable tokens at stake (None: the trace cannot say)."""
    recompute_s: float
    """Prefill seconds recomputing ``tokens`` costs (0 when unknown)."""
    pulled: bool
    """The prefill node pulled KV for this turn (true also for some turns lost early, e.g. a
    fingerprinted conversation whose router keyed the handle by the fingerprint id)."""


def is_follow_up(turn: Turn) -> bool:
    """A turn with a turn index of 1 or more (engine-only turns have none and are not counted)."""
    return turn.index is not None and turn.index >= 1


def _pulled(turn: Turn) -> bool:
    leg = turn.prefill
    if leg is None:
        return False
    said_pull = leg.reason == names.REASON_PULLED or (
        leg.reason is None and leg.decision == names.DECISION_PULL
    )
    if not said_pull or leg.pulled == 0 or leg.outcome in _FAILED_OUTCOMES:
        return False
    return leg.transfer is None or leg.transfer.outcome in (None, names.TRANSFER_OK)


def reusable_tokens(turn: Turn) -> int | None:
    """Prompt tokens of the turn whose KV the decode node held beyond the prefill node's own
    prefix-cache hit: pulled, vLLM's reusable count behind a handle, or (without a handle)
    what the previous decode request held. None when the trace cannot say."""
    leg = turn.prefill
    if leg is None:
        return None
    if leg.pulled:
        return max(leg.pulled, leg.remote_reusable or 0)
    if leg.reason not in _HANDLE_ABSENT and leg.remote_reusable is not None:
        return lost_tokens(turn)
    prev = turn.previous
    if prev is not None and prev.decode is not None:
        return lost_tokens(turn)
    return None


def _handle_reached(turn: Turn) -> bool:
    """The prefill node got a decode handle (its pull reason is about one), or the router says it sent one."""
    leg = turn.prefill
    if leg is not None and (leg.reason not in _HANDLE_ABSENT or _pulled(turn)):
        return True
    return turn.router is not None and turn.router.handle == names.ROUTER_HANDLE_HIT


def _no_client_id(turn: Turn) -> bool:
    router = turn.router
    return bool(
        turn.conversation_inferred
        or turn.conversation_id_source == ID_SOURCE_FINGERPRINT
        or not turn.conversation_id
        or (router is not None and router.handle == names.ROUTER_HANDLE_NO_CONVERSATION)
    )


def _decode_gave_none(turn: Turn) -> str | None:
    """Why the previous turn's decode call left no handle (None: it left one, or unknown)."""
    prev = turn.previous
    decode = prev.decode if prev is not None else None
    if decode is not None and decode.config.bidirectional is False:
        return names.DIAG_BIDIRECTIONAL_OFF
    streamed = prev.router.decode_streamed if prev is not None and prev.router is not None else None
    if streamed is None and decode is not None:
        streamed = decode.streamed
    if streamed is True or (decode is not None and decode.kv_params_returned is False):
        return names.DIAG_DECODE_NO_HANDLE
    return None


def _lapsed(turn: Turn) -> bool:
    """The previous turn's KV was gone (or inside vLLM's read margin) when this turn arrived."""
    prev = turn.previous
    ret = prev.decode.retention if prev is not None and prev.decode is not None else None
    if ret is not None and ret.outcome == names.RETENTION_EXPIRED and turn.gap_s >= (ret.ttl_s or 0):
        return True
    ttl = turn.decoder_ttl_s()
    return ttl is not None and ttl > 0 and in_read_margin(turn.gap_s, ttl)


def _why_no_pull(turn: Turn, ids: set[str]) -> str:
    """Why a prefill request that had a handle and enough reusable tokens did not pull: the
    diagnosis that names it, from the prefill request's own facts (a failed forward transfer
    on the decode node is not this step's loss), else its pull reason."""
    leg = turn.prefill
    assert leg is not None
    t_out = leg.transfer.outcome if leg.transfer is not None else None
    if names.DIAG_KV_READ_STARTED_LATE in ids:
        return names.DIAG_KV_READ_STARTED_LATE
    if leg.outcome == names.OUTCOME_FAILED_KV_LOAD and not (
        t_out == names.TRANSFER_FAILED and leg.reason != names.REASON_DECLINED_EXPIRED
    ):
        return names.DIAG_EXPIRED_READ_FAILED
    if leg.outcome == names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV or t_out == names.TRANSFER_STUCK:
        return names.DIAG_STUCK_WAITING_FOR_REMOTE_KV
    if t_out == names.TRANSFER_FAILED or leg.reason == names.REASON_TRANSFER_FAILED:
        return names.DIAG_TRANSFER_FAILED
    if leg.reason in _PULL_REASONS_LOST:
        return str(leg.reason)
    return names.FUNNEL_LOST_UNEXPLAINED


def place(turn: Turn, found: Iterable[str], ctx: Context | None = None) -> Placement:
    """The step a follow-up turn was lost at and why, given the ids of its diagnoses (``found``)."""
    ids = set(found)
    ctx = ctx or Context()
    pulled = _pulled(turn)
    tokens = reusable_tokens(turn)

    def out(step: str | None, reason: str | None) -> Placement:
        return Placement(step, reason, tokens, recompute_s(turn, tokens or 0, ctx), pulled)

    if _no_client_id(turn):
        return out(names.FUNNEL_CONVERSATION_ID, names.DIAG_NO_CONVERSATION_ID)
    leg = turn.prefill
    router = turn.router
    reached = _handle_reached(turn)
    if not reached:
        stale = router is not None and router.handle == names.ROUTER_HANDLE_STALE
        prev = turn.previous
        if not stale:  # a router that judged its handle stale had one
            none = _decode_gave_none(turn)
            if none is not None:
                return out(names.FUNNEL_DECODE_HANDLE, none)
            if prev is None or prev.decode is None:
                return out(names.FUNNEL_DECODE_HANDLE, names.FUNNEL_LOST_PREVIOUS_DECODE_UNSEEN)
        if names.DIAG_TTL_LAPSED in ids or _lapsed(turn):
            return out(names.FUNNEL_KV_HELD, names.DIAG_TTL_LAPSED)
        if leg is None:
            return out(names.FUNNEL_KV_HELD, names.FUNNEL_LOST_NO_PREFILL_REQUEST)
        if stale:
            return out(names.FUNNEL_KV_HELD, names.DIAG_ROUTER_HANDLE_EXPIRED)
        if leg.reason == names.REASON_NO_DECODE_HANDLE:
            return out(names.FUNNEL_KV_HELD, names.DIAG_ROUTER_KEPT_NO_HANDLE)
        return out(names.FUNNEL_KV_HELD, names.FUNNEL_LOST_UNEXPLAINED)
    if names.DIAG_TTL_LAPSED in ids:  # a handle came, but the KV behind it had expired
        return out(names.FUNNEL_KV_HELD, names.DIAG_TTL_LAPSED)
    if leg is None:
        return out(names.FUNNEL_KV_HELD, names.FUNNEL_LOST_NO_PREFILL_REQUEST)
    if leg.reason in (names.REASON_BELOW_THRESHOLD, names.REASON_NOTHING_BEYOND_LOCAL_HIT):
        return out(names.FUNNEL_ABOVE_THRESHOLD, leg.reason)
    if not pulled:
        return out(names.FUNNEL_PULLED, _why_no_pull(turn, ids))
    for reason in _NOT_WORTH_IT:
        if reason in ids:
            return out(names.FUNNEL_FASTER, reason)
    return out(None, None)


# ------------------------------------------------------------------ aggregation


class _Tally:
    """Turns, tokens and seconds of one bucket."""

    def __init__(self) -> None:
        self.turns = 0
        self.tokens = 0
        self.tokens_unknown = 0
        self.recompute_s = 0.0
        self.pulled = 0

    def add(self, p: Placement) -> None:
        self.turns += 1
        if p.tokens is None:
            self.tokens_unknown += 1
        else:
            self.tokens += p.tokens
        self.recompute_s += p.recompute_s
        self.pulled += int(p.pulled)

    def as_dict(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "tokens": self.tokens,
            "tokens_unknown_turns": self.tokens_unknown,
            "recompute_s": turn_json.r6(self.recompute_s),
        }


def funnel_turns(turns: Sequence[Turn], ctx: Context | None = None) -> dict[str, Any]:
    """The funnel of the follow-up turns among ``turns`` (pure): per step the turns that reached
    it, their share of the follow-up turns, the reusable tokens and recompute seconds at stake,
    and the turns lost there by reason (most turns first). ``ends`` counts the turns that
    reached the end; ``turns_lost + ends == follow_up_turns`` always holds."""
    ctx = ctx or diagnosis_context(turns)
    follow = [t for t in turns if is_follow_up(t)]
    placed = [place(t, (d.id for d in diagnose(t, ctx)), ctx) for t in follow]
    order = {step: i for i, step in enumerate(names.FUNNEL_STEPS)}
    end = len(names.FUNNEL_STEPS)
    steps = []
    for i, step in enumerate(names.FUNNEL_STEPS):
        reached = _Tally()
        lost: dict[str, _Tally] = {}
        for p in placed:
            at = order[p.step] if p.step is not None else end
            if at > i:  # lost at a later step, or reached the end
                reached.add(p)
            if p.step == step and p.reason is not None:
                lost.setdefault(p.reason, _Tally()).add(p)
        lost_rows = [
            {"reason": reason, **tally.as_dict(), "pulled_anyway": tally.pulled}
            for reason, tally in sorted(lost.items(), key=lambda kv: (-kv[1].turns, kv[0]))
        ]
        steps.append(
            {
                "id": step,
                "title": STEP_TITLES[step],
                **reached.as_dict(),
                "share": round(reached.turns / len(follow), 4) if follow else None,
                "lost_turns": sum(row["turns"] for row in lost_rows),
                "lost": lost_rows,
            }
        )
    ends = sum(1 for p in placed if p.step is None)
    return {
        "turn_count": len(turns),
        "follow_up_turns": len(follow),
        "turns_lost": len(placed) - ends,
        "ends": ends,
        "per_token_compute_s": ctx.per_token_s,
        "steps": steps,
    }


def funnel(
    source: SpanSource,
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    max_turns: int = MAX_TURNS,
) -> dict[str, Any]:
    """The funnel document of a window (``kind: funnel``), from any span source."""
    turns, total = window_turns(source, since_ns=since_ns, until_ns=until_ns, max_turns=max_turns)
    return turn_json.document(
        "funnel",
        **turn_json.window(since_ns, until_ns),
        turns_left_out=total - len(turns),
        **funnel_turns(turns),
    )
