"""Behind a router otelkv did not write: body copied, no header forwarded, vLLM tracing off.

The router (``tests/fleet/third_party_router.py``) is written the way public P/D examples
write one; the engines run with otelkv's connector but without ``--otlp-traces-endpoint``,
as most fleets do. The sidecar in front writes the turn's identity into the body
(``vllm_xargs``); every engine request must still land in its turn's trace with its
conversation id and its KV facts, and nothing of it may reach the client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from otelkv import names
from otelkv.analysis import report
from otelkv.analysis.sources import StoreSource
from otelkv.fleet import metrics as prom_text
from otelkv.fleet.agent import Conversation, Turn, TurnResult
from otelkv.fleet.fleet import Fleet, FleetConfig
from tests.fleet.conftest import fleet_fixture
from tests.fleet.spans import engine_request, in_trace, wait_for_turn
from tests.fleet.third_party_router import ThirdPartyRouter
from tests.schema import assert_valid

pytestmark = pytest.mark.fleet

TTL_S = 36.0
"""Long enough for the handle-keeping router's turns to pull (see test_sidecar.TTL_S)."""

COPYING = Conversation(
    "conv-copy",
    [
        Turn("summarise the incident report for the on-call engineer", 48),
        Turn("now list the follow-up actions", 32, pause_s=0.4),
        Turn("and who owns each one", 32, pause_s=0.4),
    ],
    stream=True,
)
NOT_KEPT = Conversation(
    "conv-notkept",
    [
        Turn("write the migration plan for the billing database", 96),
        Turn("what could go wrong", 32, pause_s=0.4),
    ],
)
KEEPING = Conversation(
    "conv-keep",
    [
        # Answers longer than the recompute threshold (64): what only the decode node holds
        # (the previous answer) is worth a pull even where prefill caches the earlier prompt.
        Turn("draft the quarterly capacity plan for the inference fleet", 96),
        Turn("add a section on decode memory", 96, pause_s=0.4),
        Turn("and one on prefill throughput", 32, pause_s=0.4),
    ],
)


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    config = FleetConfig(
        decoder_ttl_s=TTL_S,
        sidecar=True,
        vllm_tracing=False,
        router_factory=lambda prefill, decode: ThirdPartyRouter(prefill, decode),
    )
    yield from fleet_fixture(config, request)


@pytest.fixture(scope="module")
def results(fleet: Fleet) -> dict[str, list[TurnResult]]:
    driver = fleet.driver()
    copying, not_kept = driver.run_sync([COPYING, NOT_KEPT])
    fleet.router.keep_handles = True  # the same router, now keeping handles (still no headers)
    try:
        (keeping,) = driver.run_sync([KEEPING])
    finally:
        fleet.router.keep_handles = False
    out = {
        COPYING.conversation_id: copying,
        NOT_KEPT.conversation_id: not_kept,
        KEEPING.conversation_id: keeping,
    }
    for turns in out.values():
        assert all(t.ok for t in turns), ([(t.status, t.error) for t in turns], fleet.engine_log_lines())
    return out


def _engine_requests(fleet: Fleet, turn: TurnResult) -> tuple[dict, dict]:
    assert fleet.sink is not None
    spans = in_trace(wait_for_turn(fleet.sink, turn.trace_id), turn.trace_id)
    prefill = engine_request(spans, names.ROLE_PREFILL).attributes
    decode = engine_request(spans, names.ROLE_DECODE).attributes
    return prefill, decode


def test_the_router_forwards_no_identity(fleet: Fleet, results: dict[str, list[TurnResult]]) -> None:
    legs = fleet.router.legs
    assert legs and all(set(headers) == {"X-Request-Id"} for _, headers in legs)


@pytest.mark.parametrize(
    "conversation", [COPYING.conversation_id, NOT_KEPT.conversation_id, KEEPING.conversation_id]
)
def test_every_engine_request_joins_its_turn_through_the_body(
    fleet: Fleet, results: dict[str, list[TurnResult]], conversation: str
) -> None:
    for turn in results[conversation]:
        for attrs in _engine_requests(fleet, turn):
            assert attrs[names.TRACE_CONTEXT_SOURCE] == names.TRACE_CONTEXT_BODY
            assert attrs[names.GEN_AI_CONVERSATION_ID] == conversation  # vllm_xargs.session_id
        prefill, _ = _engine_requests(fleet, turn)
        assert prefill[names.GEN_AI_USAGE_INPUT_TOKENS] > 0 and prefill[names.PULL_DECISION]
    assert fleet.prefill is not None and fleet.decode is not None
    for engine in (fleet.prefill, fleet.decode):
        counted = prom_text.by_label(engine.metrics_text(), "otelkv_body_trace_context_total", "outcome")
        assert counted.get(names.BODY_CONTEXT_USED, 0) >= 6 and not counted.get(names.BODY_CONTEXT_MALFORMED)


def test_what_each_router_does_with_the_handle_is_recorded(
    fleet: Fleet, results: dict[str, list[TurnResult]]
) -> None:
    # Without handles every later turn recomputes; with them (non-streamed decode) it pulls.
    copying = [_engine_requests(fleet, t)[0][names.PULL_REASON] for t in results[COPYING.conversation_id]]
    assert copying[1:] == [names.REASON_NO_DECODE_HANDLE] * 2
    keeping = [_engine_requests(fleet, t)[0] for t in results[KEEPING.conversation_id]]
    assert [a[names.PULL_REASON] for a in keeping[1:]] == [names.REASON_PULLED] * 2
    assert all(a[names.TOKENS_PULLED] > 0 for a in keeping[1:])


def test_why_shows_the_engine_facts_of_a_turn(fleet: Fleet, results: dict[str, list[TurnResult]]) -> None:
    for turn in results[KEEPING.conversation_id]:
        _engine_requests(fleet, turn)
    fleet.flush_store()
    assert fleet.sidecar is not None
    answer = assert_valid(report.why(StoreSource(fleet.sidecar.store), f"{KEEPING.conversation_id}#1"))[
        "turn"
    ]
    assert answer["prefill"]["reason"] == names.REASON_PULLED
    assert answer["prefill"]["tokens"]["pulled"] > 0 and answer["decode"] is not None
    assert answer["usage"]["input_tokens"] == answer["prefill"]["tokens"]["prompt"]


def test_why_names_the_missing_handle_from_engine_and_sidecar_evidence(
    fleet: Fleet, results: dict[str, list[TurnResult]]
) -> None:
    """No router span: the decode engines handed back handles, the next prefill requests got
    none. Decode streamed: vLLM 0.32 gave the router none; not streamed: the router kept none."""
    for conversation in (COPYING, NOT_KEPT):
        for turn in results[conversation.conversation_id]:
            _, decode = _engine_requests(fleet, turn)
            assert decode[names.KV_PARAMS_RETURNED] is True
            assert decode[names.REQUEST_STREAMED] is conversation.stream
    fleet.flush_store()
    assert fleet.sidecar is not None
    source = StoreSource(fleet.sidecar.store)
    streamed = assert_valid(report.why(source, f"{COPYING.conversation_id}#1"))["turn"]
    found = {d["id"]: d for d in streamed["diagnoses"]}
    assert names.DIAG_DECODE_NO_HANDLE in found, streamed["diagnoses"]
    assert found[names.DIAG_DECODE_NO_HANDLE]["evidence"]["decode_streamed_source"] == "decode_request"
    assert names.DIAG_ROUTER_KEPT_NO_HANDLE not in found
    not_kept = assert_valid(report.why(source, f"{NOT_KEPT.conversation_id}#1"))["turn"]
    found = {d["id"]: d for d in not_kept["diagnoses"]}
    assert names.DIAG_ROUTER_KEPT_NO_HANDLE in found, not_kept["diagnoses"]
    evidence = found[names.DIAG_ROUTER_KEPT_NO_HANDLE]["evidence"]
    # What the previous turn left on decode: its 96 generated tokens at least.
    assert evidence["previous_kv_params_returned"] is True and evidence["tokens_recomputed"] >= 96
    assert names.DIAG_DECODE_NO_HANDLE not in found


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_vllm_takes_the_body_context_and_the_client_never_sees_it(
    fleet: Fleet, path: str, stream: bool
) -> None:
    body: dict = {"model": "tiny-llama", "max_tokens": 8, "stream": stream}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": f"say hi {path} {stream}"}]
    else:
        body["prompt"] = f"say hi {path} {stream}"

    async def fetch() -> bytes:
        async with (
            aiohttp.ClientSession() as session,
            session.post(fleet.url + path, json=body, headers={"X-Conversation-Id": "conv-raw"}) as resp,
        ):
            raw = await resp.read()
            assert resp.status == 200, raw
            return raw

    raw = asyncio.run(fetch())
    assert b"otelkv" not in raw and b"vllm_xargs" not in raw
    if stream:
        assert raw.rstrip().endswith(b"data: [DONE]")
    else:
        assert json.loads(raw)["choices"]
