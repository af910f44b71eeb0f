"""Why a prefill node pulled the decode node's KV or recomputed it (pure logic).

vLLM 0.32.0 makes the decision in ``NixlPullConnectorScheduler.get_num_new_matched_tokens``
and only logs it at DEBUG. otelkv re-derives the *reason* from the same inputs and takes
the *decision* from what the connector actually returned; when the two disagree (a vLLM
change otelkv has not caught up with) the caller counts it as an instrumentation error
instead of publishing a wrong reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from otelkv import names

_HANDLE_KEYS = frozenset(("remote_engine_id", "remote_request_id", "remote_host", "remote_port"))


def role_of(params: Mapping[str, Any] | None) -> str:
    """P/D role of a request from its ``kv_transfer_params`` as the router sent them."""
    if params:
        if params.get("do_remote_decode"):
            return names.ROLE_PREFILL
        if params.get("do_remote_prefill"):
            return names.ROLE_DECODE
    return names.ROLE_UNIFIED


class PullDecision(NamedTuple):
    """What the prefill node's connector decided for a decode handle, and the handle's facts
    (a tuple: built on every prefill request in the scheduler loop)."""

    decision: str
    reason: str
    remote_reusable: int
    remote_num_tokens: int | None = None
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_blocks: int = 0


def decide_reverse_pull(
    params: Mapping[str, Any],
    *,
    num_prompt_tokens: int,
    local_hit: int,
    threshold: int,
    bidirectional: bool,
) -> PullDecision:
    """Reason for a prefill request (``do_remote_decode``) to pull or recompute.

    Mirrors vLLM 0.32.0 ``pull_scheduler.py`` (D->P branch). ``local_hit`` is the
    block-aligned local prefix-cache hit the scheduler passed to the connector.
    """
    block_ids = params.get("remote_block_ids")
    remote_engine = params.get("remote_engine_id")
    remote_request = params.get("remote_request_id")
    engine = str(remote_engine) if remote_engine is not None else None
    request = str(remote_request) if remote_request is not None else None
    blocks = 0
    if block_ids:
        for group in block_ids:
            if isinstance(group, (list, tuple)):
                blocks += len(group)
    else:
        return PullDecision(
            names.DECISION_RECOMPUTE, names.REASON_NO_DECODE_HANDLE, 0, None, engine, request, blocks
        )
    if not (
        params.keys() >= _HANDLE_KEYS if isinstance(params, dict) else all(k in params for k in _HANDLE_KEYS)
    ):
        return PullDecision(
            names.DECISION_RECOMPUTE, names.REASON_INVALID_HANDLE, 0, None, engine, request, blocks
        )
    try:
        remote_num_tokens = int(params.get("remote_num_tokens") or 0)
    except (TypeError, ValueError):
        return PullDecision(
            names.DECISION_RECOMPUTE, names.REASON_INVALID_HANDLE, 0, None, engine, request, blocks
        )
    count = min(remote_num_tokens, num_prompt_tokens) - local_hit
    if count <= 0:
        reason, decision, count = names.REASON_NOTHING_BEYOND_LOCAL_HIT, names.DECISION_RECOMPUTE, 0
    elif threshold > 0 and count < threshold:
        reason, decision = names.REASON_BELOW_THRESHOLD, names.DECISION_RECOMPUTE
    else:
        reason = names.REASON_PULLED if bidirectional else names.REASON_BIDIRECTIONAL_OFF
        decision = names.DECISION_PULL
    return PullDecision(decision, reason, count, remote_num_tokens, engine, request, blocks)


def agrees_with_connector(decision: PullDecision, matched: int | None) -> bool:
    """Whether the re-derived decision matches what the connector returned."""
    pulled = bool(matched)
    return pulled == (decision.decision == names.DECISION_PULL)
