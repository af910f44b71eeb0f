"""Guard mode on a real 1P1D fleet: a decode handle whose KV belongs to other tokens is refused.

Both engines run with ``otelkv_continuity: "guard"`` (decoder_kv_blocks_ttl=36 s, threshold
64, the router forwards every handle). Two conversations, one after the other:

* ``guard-extends`` sends its history back verbatim: the handle matches, and guard must leave
  the pull exactly as vLLM makes it;
* ``guard-rewritten`` rewrites turn 0's user message under the same id (as context compaction
  or an edited message does): the handle offers KV computed for other tokens, guard refuses
  it, vLLM recomputes, and the decode node still releases the blocks.

The truths are vLLM's own: ``/tokenize`` of the two prompts for where they differ, the decode
node's log for how its blocks ended, the prefill node's ``/metrics``, and each turn-1 answer's
top logprobs against vLLM recomputing the same messages from scratch (the reference model's
seeded weights make answers depend on the KV they are computed from).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from otelkv import names
from otelkv.fleet import metrics as prom
from otelkv.fleet.fleet import Fleet, FleetConfig
from otelkv.spans import SpanRecord
from tests.fleet import logprobs
from tests.fleet.conftest import fleet_fixture

pytestmark = pytest.mark.fleet

TTL_S = 36.0
THRESHOLD = 64
SYSTEM = {"role": "system", "content": "you are a helpful agent"}


def _words(seed: int, n: int = 120) -> str:
    vocab = "cache block token engine prefill decode router handle memory answer tool plan".split()
    return " ".join(vocab[(seed * 7 + i * (seed + 3)) % len(vocab)] for i in range(n))


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())


def _chat(fleet: Fleet, messages: list[dict[str, Any]], conversation: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "tiny-llama",
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    return _post(fleet.url + "/v1/chat/completions", body, {"X-Conversation-Id": conversation})


def _two_turns(fleet: Fleet, conversation: str, first: list[dict[str, Any]], rewrite: bool) -> dict[str, Any]:
    """Turn 0, then turn 1 that extends it (or, with ``rewrite``, replaces its user message).

    Turn 0's answer is longer than the threshold: the prefill node's own prefix cache covers
    turn 0's prompt, so only the answer's KV is left to pull."""
    answer = _chat(fleet, first, conversation, THRESHOLD + 16)["choices"][0]["message"]["content"]
    history = [SYSTEM, {"role": "user", "content": _words(99)}] if rewrite else first
    second = [*history, {"role": "assistant", "content": answer}, {"role": "user", "content": "now answer"}]
    answered = logprobs.chat_logprobs(fleet.url, second, conversation_id=conversation)
    # The truth for the answer: vLLM computing the same messages from scratch.
    recomputed = logprobs.recompute(fleet.url, second)
    return {"first": first, "second": second, "answer": answered, "recomputed": recomputed}


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    config = FleetConfig(
        decoder_ttl_s=TTL_S,
        recompute_threshold=THRESHOLD,
        router_handle_ttl_s=None,
        continuity=names.CONTINUITY_MODE_GUARD,
    )
    yield from fleet_fixture(config, request)


@pytest.fixture(scope="module")
def scenario(fleet: Fleet) -> dict[str, dict[str, Any]]:
    return {
        "guard-extends": _two_turns(
            fleet, "guard-extends", [SYSTEM, {"role": "user", "content": _words(1)}], False
        ),
        "guard-rewritten": _two_turns(
            fleet, "guard-rewritten", [SYSTEM, {"role": "user", "content": _words(2)}], True
        ),
    }


def _requests(fleet: Fleet, conversation: str, role: str, count: int = 2) -> list[SpanRecord]:
    """The conversation's engine request spans of one role, oldest first (waits for ``count``)."""
    assert fleet.sink is not None
    name = names.engine_request_span_name(role)

    def mine(spans: list[SpanRecord]) -> list[SpanRecord]:
        found = [
            s
            for s in spans
            if s.name == name and s.attributes.get(names.GEN_AI_CONVERSATION_ID) == conversation
        ]
        return sorted(found, key=lambda s: s.start_ns)

    return mine(fleet.sink.wait_for(lambda spans: len(mine(spans)) >= count, timeout=30))


def _assert_recomputed(fleet: Fleet, answer: logprobs.Answer) -> None:
    """The truth really is a recompute: nothing pulled, nothing from the prefix cache."""
    assert fleet.sink is not None
    prefill = logprobs.engine_spans(fleet.sink, answer.trace_id)[names.ROLE_PREFILL].attributes
    assert (prefill[names.TOKENS_PULLED], prefill[names.TOKENS_LOCAL_CACHE_HIT]) == (0, 0)


def _retention(fleet: Fleet, decode: SpanRecord) -> SpanRecord:
    assert fleet.sink is not None

    def found(spans: list[SpanRecord]) -> list[SpanRecord]:
        return [s for s in spans if s.parent_span_id == decode.span_id and s.name.startswith("kv_retention")]

    (retention,) = found(fleet.sink.wait_for(lambda spans: bool(found(spans)), timeout=TTL_S + 30))
    return retention


def test_guard_leaves_a_handle_that_matches_the_prompt_to_vllm(
    fleet: Fleet, scenario: dict[str, dict[str, Any]]
) -> None:
    """The history sent back verbatim: the digest matches everything the handle offers, and the
    prefill node loads what vLLM's rule says (``min(remote, prompt) - local hit``)."""
    _, turn1 = _requests(fleet, "guard-extends", names.ROLE_PREFILL)
    a = turn1.attributes
    assert turn1.resource[names.CONTINUITY_VERIFY] == names.CONTINUITY_MODE_GUARD
    assert (a[names.PULL_DECISION], a[names.PULL_REASON]) == (names.DECISION_PULL, names.REASON_PULLED)
    assert a[names.CONTINUITY_DIGEST] is True and names.CONTINUITY_FIRST_MISMATCH not in a
    assert a[names.CONTINUITY_MATCHING] == a[names.CONTINUITY_OFFERED] > THRESHOLD
    assert a[names.TOKENS_PULLED] == a[names.CONTINUITY_OFFERED] - a[names.TOKENS_LOCAL_CACHE_HIT] > 0
    run = scenario["guard-extends"]
    assert turn1.trace_id == run["answer"].trace_id
    _assert_recomputed(fleet, run["recomputed"])
    # The pulled KV is the right KV: the answer equals vLLM's recompute of the same messages.
    assert logprobs.max_difference(run["answer"], run["recomputed"]) <= logprobs.LOGPROB_TOLERANCE


def test_guard_refuses_kv_of_other_tokens_recomputes_and_releases_the_decode_blocks(
    fleet: Fleet, scenario: dict[str, dict[str, Any]]
) -> None:
    assert fleet.prefill is not None and fleet.decode is not None
    messages = scenario["guard-rewritten"]
    tokens = [
        _post(fleet.prefill.url + "/tokenize", {"model": "tiny-llama", "messages": messages[k]})["tokens"]
        for k in ("first", "second")
    ]
    shared = next(i for i, (x, y) in enumerate(zip(*tokens, strict=False)) if x != y)
    _, turn1 = _requests(fleet, "guard-rewritten", names.ROLE_PREFILL)
    a = turn1.attributes
    assert (a[names.PULL_DECISION], a[names.PULL_REASON]) == (
        names.DECISION_RECOMPUTE,
        names.REASON_CONTINUITY_MISMATCH,
    )
    assert a[names.TOKENS_PULLED] == 0
    assert a[names.TOKENS_COMPUTED] == len(tokens[1]) - a[names.TOKENS_LOCAL_CACHE_HIT]
    assert a[names.CONTINUITY_FIRST_MISMATCH] == shared // 32 * 32
    assert a[names.CONTINUITY_MISMATCH_IN] == names.CONTINUITY_IN_HISTORY
    assert a[names.TOKENS_REMOTE_REUSABLE] >= THRESHOLD  # vLLM alone would have pulled
    # Guard gives the recompute answer (in observe mode the same request's answer differs:
    # test_bidirectional shows it).
    assert turn1.trace_id == messages["answer"].trace_id
    _assert_recomputed(fleet, messages["recomputed"])
    assert logprobs.max_difference(messages["answer"], messages["recomputed"]) <= logprobs.LOGPROB_TOLERANCE

    # The decode node's blocks for turn 0 are released (as for a full local prefix hit):
    # consumed before the TTL, not after it, and not before turn 1 reached the prefill node.
    decode0, _ = _requests(fleet, "guard-rewritten", names.ROLE_DECODE)
    retention = _retention(fleet, decode0)
    r = retention.attributes
    assert r[names.RETENTION_OUTCOME] == names.RETENTION_CONSUMED, r
    assert r[names.RETENTION_HELD_SECONDS] < TTL_S
    assert retention.end_ns >= turn1.start_ns
    request_id = r[names.REQUEST_ID]
    assert f"Releasing expired KV blocks for request {request_id}" not in fleet.decode.log_path.read_text()

    # The prefill node's /metrics say it: one refusal in this fleet, and no otelkv error.
    where = {"decision": names.DECISION_RECOMPUTE, "reason": names.REASON_CONTINUITY_MISMATCH}
    deadline = time.monotonic() + 20
    while True:
        text = fleet.prefill.metrics_text()
        refused = prom.total(text, "otelkv_pull_decisions_total", where)
        if refused or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert refused == 1
    assert prom.total(text, "otelkv_instrumentation_errors_total") == 0


def test_why_says_history_rewritten_and_no_wrong_reuse_when_guard_refused(
    fleet: Fleet, scenario: dict[str, dict[str, Any]]
) -> None:
    """Guard kept wrong KV out: the turn's diagnoses name the rewritten history (from the engine's
    digest alone: no sidecar here) and never say KV of other tokens was used."""
    from otelkv.analysis import report
    from otelkv.analysis.sources import InMemorySource

    assert fleet.sink is not None
    _, turn1 = _requests(fleet, "guard-rewritten", names.ROLE_PREFILL)
    why = report.why(InMemorySource(fleet.sink.spans()), turn1.trace_id)["turn"]
    found = {d["id"]: d for d in why["diagnoses"]}
    assert names.DIAG_KV_FOR_OTHER_TOKENS not in found, list(found)
    rewritten = found[names.DIAG_HISTORY_REWRITTEN]["evidence"]
    assert rewritten["guard_refused"] is True and rewritten["kv_loaded_for_other_tokens"] is False
    assert rewritten["first_mismatch_token"] == turn1.attributes[names.CONTINUITY_FIRST_MISMATCH]
    assert rewritten["pulled_tokens"] == 0
