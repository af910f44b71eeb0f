"""The pull-or-recompute reason must match what vLLM 0.32.0's NIXL scheduler actually does.

otelkv publishes a *reason* that it re-derives from the connector's inputs; if the
re-derivation drifts from ``NixlPullConnectorScheduler.get_num_new_matched_tokens`` the
dashboards lie. Besides pinning each branch, the parity test runs vLLM's own method on
the same inputs and checks that the two agree.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

from otelkv import names
from otelkv.engine.decision import PullDecision, agrees_with_connector, decide_reverse_pull, role_of


def handle(**overrides: Any) -> dict[str, Any]:
    """A complete decode handle as the router forwards it to the prefill node."""
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_engine_id": "decode-0",
        "remote_request_id": "req-d-1",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_num_tokens": 256,
    }
    params.update(overrides)
    return params


def decide(
    params: dict[str, Any],
    *,
    prompt: int = 300,
    local_hit: int = 0,
    threshold: int = 64,
    bidirectional: bool = True,
) -> PullDecision:
    return decide_reverse_pull(
        params,
        num_prompt_tokens=prompt,
        local_hit=local_hit,
        threshold=threshold,
        bidirectional=bidirectional,
    )


# ------------------------------------------------------------------ role_of


@pytest.mark.parametrize(
    ("params", "role"),
    [
        ({"do_remote_decode": True}, names.ROLE_PREFILL),
        ({"do_remote_prefill": True}, names.ROLE_DECODE),
        # vLLM checks do_remote_decode first (request_finished: is_p_node).
        ({"do_remote_decode": True, "do_remote_prefill": True}, names.ROLE_PREFILL),
        ({"do_remote_decode": False, "do_remote_prefill": False}, names.ROLE_UNIFIED),
        ({}, names.ROLE_UNIFIED),
        (None, names.ROLE_UNIFIED),
    ],
)
def test_role_of(params: dict[str, Any] | None, role: str) -> None:
    assert role_of(params) == role


def test_role_values_are_the_closed_vocabulary() -> None:
    assert (names.ROLE_PREFILL, names.ROLE_DECODE, names.ROLE_UNIFIED) == ("prefill", "decode", "unified")


# ------------------------------------------------------------------ branches


@pytest.mark.parametrize("block_ids", [None, [], ()])
def test_no_block_ids_is_no_decode_handle(block_ids: Any) -> None:
    d = decide(handle(remote_block_ids=block_ids))
    # Positional: decision, reason, remote_reusable, remote_num_tokens, engine, request, blocks.
    assert d == PullDecision("recompute", "no_decode_handle", 0, None, "decode-0", "req-d-1", 0)


def test_router_empty_handle_is_no_decode_handle() -> None:
    empty = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
             "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
    d = decide(empty)
    assert (d.decision, d.reason, d.remote_engine_id, d.remote_request_id) == (
        "recompute",
        "no_decode_handle",
        None,
        None,
    )


@pytest.mark.parametrize("missing", ["remote_engine_id", "remote_request_id", "remote_host", "remote_port"])
def test_missing_handle_key_is_invalid_handle(missing: str) -> None:
    params = handle()
    del params[missing]
    d = decide(params)
    assert (d.decision, d.reason, d.remote_reusable, d.remote_num_tokens, d.remote_blocks) == (
        "recompute", "invalid_handle", 0, None, 4,
    )  # fmt: skip


def test_none_valued_handle_keys_are_present_like_in_vllm() -> None:
    # vLLM tests `p in params`, so None values pass the validity check.
    d = decide(handle(remote_host=None, remote_port=None))
    assert (d.decision, d.reason, d.remote_reusable) == ("pull", "pulled", 256)


def test_unparsable_remote_num_tokens_is_invalid_handle() -> None:
    d = decide(handle(remote_num_tokens="many"))
    assert (d.decision, d.reason, d.remote_reusable) == ("recompute", "invalid_handle", 0)


@pytest.mark.parametrize(
    ("remote", "prompt", "local_hit"),
    [
        (256, 300, 256),  # decode holds exactly what is cached locally
        (128, 300, 256),  # local hit beyond what decode holds
        (0, 300, 0),
        (None, 300, 0),  # missing count is 0 in vLLM (`or 0`)
        (256, 100, 112),  # prompt shorter than the local hit
    ],
)
def test_nothing_beyond_local_hit(remote: int | None, prompt: int, local_hit: int) -> None:
    d = decide(handle(remote_num_tokens=remote), prompt=prompt, local_hit=local_hit)
    assert (d.decision, d.reason, d.remote_reusable) == ("recompute", "nothing_beyond_local_hit", 0)
    assert d.remote_num_tokens == (remote or 0)


def test_count_uses_the_smaller_of_remote_and_prompt() -> None:
    assert decide(handle(remote_num_tokens=1000), prompt=300, local_hit=16).remote_reusable == 284
    assert decide(handle(remote_num_tokens=200), prompt=300, local_hit=16).remote_reusable == 184


def test_below_threshold() -> None:
    d = decide(handle(remote_num_tokens=256), local_hit=193, threshold=64)
    assert d == PullDecision("recompute", "below_threshold", 63, 256, "decode-0", "req-d-1", 4)


def test_count_equal_to_threshold_pulls() -> None:
    d = decide(handle(remote_num_tokens=256), local_hit=192, threshold=64)
    assert (d.decision, d.reason, d.remote_reusable) == ("pull", "pulled", 64)


@pytest.mark.parametrize("threshold", [0, -1])
def test_non_positive_threshold_disables_the_check(threshold: int) -> None:
    d = decide(handle(remote_num_tokens=256), local_hit=255, threshold=threshold)
    assert (d.decision, d.reason, d.remote_reusable) == ("pull", "pulled", 1)


def test_bidirectional_off_still_pulls_in_vllm_but_says_why() -> None:
    d = decide(handle(), bidirectional=False)
    assert d == PullDecision("pull", "bidirectional_off", 256, 256, "decode-0", "req-d-1", 4)


def test_below_threshold_wins_over_bidirectional_off() -> None:
    d = decide(handle(remote_num_tokens=10), threshold=64, bidirectional=False)
    assert d.reason == names.REASON_BELOW_THRESHOLD


def test_ids_are_stringified() -> None:
    d = decide(handle(remote_engine_id=7, remote_request_id=8))
    assert (d.remote_engine_id, d.remote_request_id) == ("7", "8")


@pytest.mark.parametrize(
    ("block_ids", "blocks"),
    [
        ([[1, 2, 3], [4, 5]], 5),
        (([1], [2], [3, 4, 5, 6]), 6),
        ([[], []], 0),  # truthy list of empty groups: a handle with nothing in it
        ([[1, 2], "junk", 3], 2),  # non-list entries are not groups
    ],
)
def test_remote_blocks_counts_across_groups(block_ids: Any, blocks: int) -> None:
    d = decide(handle(remote_block_ids=block_ids))
    assert d.remote_blocks == blocks
    assert d.reason == names.REASON_PULLED


def test_reasons_are_in_the_closed_vocabulary() -> None:
    assert {
        names.REASON_PULLED,
        names.REASON_BELOW_THRESHOLD,
        names.REASON_NOTHING_BEYOND_LOCAL_HIT,
        names.REASON_NO_DECODE_HANDLE,
        names.REASON_INVALID_HANDLE,
        names.REASON_BIDIRECTIONAL_OFF,
    } <= set(names.PULL_REASONS)
    assert names.PULL_DECISIONS == ("pull", "recompute")


# ------------------------------------------------------------------ agreement


@pytest.mark.parametrize(
    ("decision", "matched", "agrees"),
    [
        (names.DECISION_PULL, 64, True),
        (names.DECISION_PULL, 0, False),
        (names.DECISION_PULL, None, False),
        (names.DECISION_RECOMPUTE, 0, True),
        (names.DECISION_RECOMPUTE, None, True),
        (names.DECISION_RECOMPUTE, 1, False),
    ],
)
def test_agrees_with_connector(decision: str, matched: int | None, agrees: bool) -> None:
    assert agrees_with_connector(PullDecision(decision, "r", 0), matched) is agrees


# ------------------------------------------------------------------ parity with vLLM


def vllm_matched(params: dict[str, Any], prompt: int, local_hit: int, threshold: int) -> tuple[int, bool]:
    """vLLM 0.32.0's own answer, from the unbound scheduler method on a minimal self."""
    scheduler = SimpleNamespace(kv_recompute_threshold=threshold)
    request = SimpleNamespace(
        request_id="req-p-1",
        kv_transfer_params=dict(params),
        num_prompt_tokens=prompt,
        prompt_token_ids=list(range(prompt)),
    )
    return NixlPullConnectorScheduler.get_num_new_matched_tokens(scheduler, request, local_hit)  # type: ignore[arg-type]


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in handle().items() if k != key}


# (params, prompt tokens, local hit, threshold, reason when bidirectional transfer is on)
PARITY_CASES: list[tuple[dict[str, Any], int, int, int, str]] = [
    (handle(), 300, 0, 64, "pulled"),
    (handle(), 300, 192, 64, "pulled"),
    (handle(), 300, 193, 64, "below_threshold"),
    (handle(), 300, 255, 0, "pulled"),
    (handle(), 300, 256, 64, "nothing_beyond_local_hit"),
    (handle(remote_num_tokens=1000), 300, 16, 64, "pulled"),
    (handle(remote_num_tokens=None), 300, 0, 64, "nothing_beyond_local_hit"),
    (handle(remote_block_ids=None), 300, 0, 64, "no_decode_handle"),
    (handle(remote_block_ids=[]), 300, 0, 64, "no_decode_handle"),
    (handle(remote_block_ids=[[], []]), 300, 0, 0, "pulled"),
    (handle(remote_host=None), 300, 0, 64, "pulled"),
    (without("remote_port"), 300, 0, 64, "invalid_handle"),
    (without("remote_engine_id"), 300, 0, 64, "invalid_handle"),
]


@pytest.mark.parametrize(("params", "prompt", "local_hit", "threshold", "reason"), PARITY_CASES)
@pytest.mark.parametrize("bidirectional", [True, False])
def test_decision_agrees_with_vllm(
    params: dict[str, Any], prompt: int, local_hit: int, threshold: int, reason: str, bidirectional: bool
) -> None:
    count, is_async = vllm_matched(params, prompt, local_hit, threshold)
    d = decide(params, prompt=prompt, local_hit=local_hit, threshold=threshold, bidirectional=bidirectional)
    if reason == names.REASON_PULLED and not bidirectional:
        reason = names.REASON_BIDIRECTIONAL_OFF
    assert d.reason == reason
    pulled = d.decision == names.DECISION_PULL
    assert (count, is_async) == ((d.remote_reusable, True) if pulled else (0, False))
    assert agrees_with_connector(d, count) is True
