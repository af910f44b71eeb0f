"""Behind a router otelkv did not write: body copied, no header forwarded, vLLM tracing off.

The router (``tests/fleet/third_party_router.py``) is written the way public P/D examples
write one; the engines run with otelkv's connector but without ``--otlp-traces-endpoint``,
as most fleets do. The sidecar in front writes the turn's identity into the body
(``vllm_xargs``); every engine request must still land in its turn's trace with its
conversation id and its KV facts, and nothing of it may reach the client.

The same router then rebuilds the body (dropping ``vllm_xargs``) while keeping handles: its
engine requests arrive in traces of their own and must be joined to their turns by
inference, each to the turn the router's own record says. ``otelkv doctor`` must fail
exactly what each router behaviour lacks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

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

REBUILT = (
    Conversation(
        "conv-rebuilt-a",
        [
            Turn("draft the incident review for the storage outage", 96),
            Turn("add the timeline", 96, pause_s=0.4),
            Turn("and the action items", 32, pause_s=0.4),
        ],
    ),
    Conversation(
        "conv-rebuilt-b",
        [
            Turn("summarise the design review of the new scheduler in a few lines", 80),
            Turn("what did the reviewers object to", 80, pause_s=0.3),
        ],
    ),
)
"""Run at once behind the router that rebuilds bodies: the joins by inference must still pair
each turn with its own engine requests."""


PHASE_QUIET_S = 0.2
"""Nothing is sent for this long before and after each phase (so phases are twice this apart)."""
PHASE_MARGIN_NS = 100_000_000
"""A phase's window reaches this far beyond the client's clock at the phase's first request
and last answer. The sidecar dates a turn by the kernel's receive time, in jiffies
(:mod:`otelkv.sidecar.arrival`: 4 ms on a HZ=250 kernel, up to 10 ms): when a tick passes
before the proxy reads the request, the turn starts up to a jiffy before the client sent it.
A window closed on the client's clock right at the phase's edges then loses the phase's first
turn or takes the next phase's first one. Margin plus a jiffy stays well inside the quiet time."""


@dataclass
class Phase:
    """One router behaviour's conversations and the time window they ran in."""

    since_ns: int
    until_ns: int
    turns: dict[str, list[TurnResult]]


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    config = FleetConfig(
        decoder_ttl_s=TTL_S,
        sidecar=True,
        vllm_tracing=False,
        router_factory=lambda prefill, decode: ThirdPartyRouter(prefill, decode),
        # The router keeps aiohttp's pool (15 s idle), as third parties do; vLLM closes idle
        # connections after 5 s, and a request written as it does (or on a stalled engine
        # loop) fails with a 502 that is the race's, not the router's identity handling's.
        # The engines keep idle connections longer than the router, as a user would set them.
        engine_env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60"},
    )
    yield from fleet_fixture(config, request)


def _phase(fleet: Fleet, conversations: list[Conversation], **router: bool) -> Phase:
    """Run the conversations at once with the router set as given (then set back)."""
    for key, value in router.items():
        setattr(fleet.router, key, value)
    time.sleep(PHASE_QUIET_S)
    since = time.time_ns()
    try:
        runs = fleet.driver().run_sync(conversations)
    finally:
        for key in router:
            setattr(fleet.router, key, False)
    until = time.time_ns()
    time.sleep(PHASE_QUIET_S)
    phase = Phase(
        since - PHASE_MARGIN_NS,
        until + PHASE_MARGIN_NS,
        {c.conversation_id: r for c, r in zip(conversations, runs, strict=True)},
    )
    for turns in phase.turns.values():
        assert all(t.ok for t in turns), ([(t.status, t.error) for t in turns], fleet.engine_log_lines())
    return phase


@pytest.fixture(scope="module")
def phases(fleet: Fleet) -> dict[str, Phase]:
    """(a) body copied, nothing kept; the same router keeping handles; (b) keeping handles
    but rebuilding the body (so nothing of the sidecar's identity reaches the engines)."""
    return {
        "copying": _phase(fleet, [COPYING, NOT_KEPT]),
        "keeping": _phase(fleet, [KEEPING], keep_handles=True),
        "rebuilding": _phase(fleet, list(REBUILT), keep_handles=True, rebuild_body=True),
    }


@pytest.fixture(scope="module")
def results(phases: dict[str, Phase]) -> dict[str, list[TurnResult]]:
    return {conv: turns for phase in phases.values() for conv, turns in phase.turns.items()}


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
    # What the previous turn left on decode (its prompt and 96 generated tokens, as the
    # client's usage counted them) beyond the prefill node's cached blocks.
    first = results[NOT_KEPT.conversation_id][0]
    assert first.completion_tokens == 96
    cached = not_kept["prefill"]["tokens"]["local_cache"]
    assert evidence["previous_kv_params_returned"] is True
    assert evidence["tokens_recomputed"] == first.prompt_tokens + first.completion_tokens - cached
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
    # Nothing the sidecar wrote comes back (the decode handle vLLM returns carries otelkv's
    # continuity digest by design: it is part of the handle the router keeps).
    assert b"vllm_xargs" not in raw and b"otelkv_traceparent" not in raw
    if stream:
        assert raw.rstrip().endswith(b"data: [DONE]")
    else:
        assert json.loads(raw)["choices"]


# ------------------------------------------------------------------ a router that rebuilds the body


def _routed_ids(fleet: Fleet, conversation_id: str) -> list[str]:
    """The X-Request-Id the router used for each turn of a conversation, in order: the
    router's own record, independent of anything otelkv saw."""
    assert isinstance(fleet.router, ThirdPartyRouter)
    return [rid for key, rid in fleet.router.routed if key == conversation_id]


def _wait_for_engine_requests(fleet: Fleet, request_ids: list[str]) -> list:
    """Both legs of every routed request, arrived at the sink (they have no turn trace to wait on)."""
    assert fleet.sink is not None
    wanted = {
        (f"chatcmpl-{rid}", role) for rid in request_ids for role in (names.ROLE_PREFILL, names.ROLE_DECODE)
    }

    def ready(spans: list) -> bool:
        seen = {
            (s.attributes.get(names.GEN_AI_REQUEST_ID), s.attributes.get(names.ROLE))
            for s in spans
            if names.ROLE in s.attributes
        }
        return wanted <= seen

    spans = fleet.sink.wait_for(ready, timeout=30.0)
    return [
        s
        for s in spans
        if (s.attributes.get(names.GEN_AI_REQUEST_ID), s.attributes.get(names.ROLE)) in wanted
    ]


def test_a_router_that_rebuilds_the_body_leaves_the_engines_without_identity(
    fleet: Fleet, phases: dict[str, Phase]
) -> None:
    ids = [rid for conv in REBUILT for rid in _routed_ids(fleet, conv.conversation_id)]
    assert len(ids) == sum(len(c.turns) for c in REBUILT)
    spans = _wait_for_engine_requests(fleet, ids)
    assert len(spans) == 2 * len(ids)
    for span in spans:
        assert span.parent_span_id == ""  # a trace of its own
        assert span.attributes[names.TRACE_CONTEXT_SOURCE] == names.TRACE_CONTEXT_NONE
        assert names.GEN_AI_CONVERSATION_ID not in span.attributes


def test_engine_requests_join_their_turns_by_inference(fleet: Fleet, phases: dict[str, Phase]) -> None:
    """Each turn gets exactly the two requests the router sent for it (the router's own record),
    with the evidence named, though two conversations ran at once."""
    for conv in REBUILT:
        _wait_for_engine_requests(fleet, _routed_ids(fleet, conv.conversation_id))
    fleet.flush_store()
    assert fleet.sidecar is not None
    source = StoreSource(fleet.sidecar.store)
    seen: list[str] = []
    for conv in REBUILT:
        answer = assert_valid(report.conversation(source, conv.conversation_id))
        truth = _routed_ids(fleet, conv.conversation_id)
        assert [t["turn_index"] for t in answer["turns"]] == list(range(len(conv.turns)))
        for turn, rid in zip(answer["turns"], truth, strict=True):
            assert turn["engine_join"]["method"] == names.JOIN_INFERRED, turn["engine_join"]
            assert {names.EVIDENCE_RESPONSE_ID, names.EVIDENCE_PROMPT_TOKENS} <= set(
                turn["engine_join"]["evidence"]
            )
            for role in ("prefill", "decode"):
                leg = turn[role]
                assert leg is not None and leg["request_id"].startswith(f"chatcmpl-{rid}-"), (role, leg, rid)
                assert leg["context_source"] == names.TRACE_CONTEXT_NONE
                seen.append(leg["request_id"])
            assert turn["usage"]["input_tokens"] == turn["prefill"]["tokens"]["prompt"]
        # The router kept handles: the later turns pulled, and the turn object says so.
        assert [t["prefill"]["reason"] for t in answer["turns"][1:]] == [names.REASON_PULLED] * (
            len(conv.turns) - 1
        )
    assert len(seen) == len(set(seen))  # no engine request joined to two turns


def test_why_names_the_identity_the_router_drops(fleet: Fleet, phases: dict[str, Phase]) -> None:
    conv = REBUILT[0]
    _wait_for_engine_requests(fleet, _routed_ids(fleet, conv.conversation_id))
    fleet.flush_store()
    assert fleet.sidecar is not None
    turn = assert_valid(report.why(StoreSource(fleet.sidecar.store), f"{conv.conversation_id}#1"))["turn"]
    found = {d["id"]: d for d in turn["diagnoses"]}
    assert names.DIAG_ROUTER_FORWARDS_NO_IDENTITY in found, turn["diagnoses"]
    evidence = found[names.DIAG_ROUTER_FORWARDS_NO_IDENTITY]["evidence"]
    assert evidence["join"] == names.JOIN_INFERRED
    assert sorted(evidence["engines_without_conversation_id"]) == ["decode", "prefill"]
    # Body copied: the identity arrived, so the diagnosis stays away.
    copied = assert_valid(report.why(StoreSource(fleet.sidecar.store), f"{KEEPING.conversation_id}#1"))[
        "turn"
    ]
    assert names.DIAG_ROUTER_FORWARDS_NO_IDENTITY not in {d["id"] for d in copied["diagnoses"]}


# ------------------------------------------------------------------ otelkv doctor per router


def _doctor(fleet: Fleet, phase: Phase) -> dict:
    """The sidecar's doctor API over the phase's window, the engines' /metrics read by the caller."""
    from otelkv.analysis.engine_probe import probe
    from otelkv.cli.source import SidecarClient

    assert fleet.sidecar is not None and fleet.prefill is not None and fleet.decode is not None
    _wait_for_window_turns(fleet, phase)
    client = SidecarClient(fleet.sidecar.admin_url)
    answer = client.doctor(
        since_ns=phase.since_ns,
        until_ns=phase.until_ns,
        probes=[probe(fleet.prefill.url).as_dict(), probe(fleet.decode.url).as_dict()],
        router_handle_ttl_s=None,
    )
    return assert_valid(answer)


def _wait_for_window_turns(fleet: Fleet, phase: Phase, timeout: float = 30.0) -> None:
    """Until the store's turn spans in the phase's window are every turn the client sent in the
    phase (its trace ids), and nothing else: what the doctor then counts, checked apart."""
    assert fleet.sidecar is not None
    source = StoreSource(fleet.sidecar.store)
    wanted = {t.trace_id for turns in phase.turns.values() for t in turns}
    deadline = time.monotonic() + timeout
    while True:
        fleet.flush_store()
        spans = source.turn_spans(
            since_ns=phase.since_ns, until_ns=phase.until_ns, limit=None, slowest_first=False
        )
        found = {s.trace_id for s in spans}
        if wanted <= found or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if found != wanted:
        client = {t.trace_id: (c, t.index) for c, turns in phase.turns.items() for t in turns}
        extra = [
            (s.attributes.get(names.GEN_AI_CONVERSATION_ID), s.attributes.get(names.TURN_INDEX), s.start_ns)
            for s in spans
            if s.trace_id not in wanted
        ]
        raise AssertionError(
            f"turns in the store's window [{phase.since_ns}, {phase.until_ns}) after {timeout:.0f} s: "
            f"missing {sorted(client[t] for t in wanted - found)}, not the phase's {sorted(extra, key=str)}"
        )


def _by_status(answer: dict) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for check in answer["checks"]:
        out.setdefault(check["status"], set()).add(check["id"])
    return out


ALWAYS_PASS = {
    names.CHECK_ENGINE_SPANS,
    names.CHECK_BIDIRECTIONAL,
    names.CHECK_ENGINES_AGREE,
    names.CHECK_TTL_VS_GAPS,
    names.CHECK_PREFIX_CACHE,
    names.CHECK_LOAD_FAILURE_POLICY,
}
"""What no router changes on this fleet: the engines' own settings and the agents' pauses."""


def test_doctor_fails_what_the_copying_router_lacks(fleet: Fleet, phases: dict[str, Phase]) -> None:
    """Router (a): body copied, no handle kept, decode streamed for streaming clients."""
    for turns in phases["copying"].turns.values():
        for turn in turns:
            _engine_requests(fleet, turn)
    answer = _doctor(fleet, phases["copying"])
    status = _by_status(answer)
    assert status.get(names.CHECK_FAIL) == {names.CHECK_HANDLE_FORWARDED, names.CHECK_DECODE_NOT_STREAMED}
    assert ALWAYS_PASS | {names.CHECK_TURNS_JOINED, names.CHECK_CONVERSATION_ID} <= status[names.CHECK_PASS]
    assert answer["verdict"] == names.CHECK_FAIL
    checks = {c["id"]: c for c in answer["checks"]}
    # What the scenario did: 3 of the 5 turns streamed; the 3 follow-ups carried no handle.
    # All 5 turns count: the client read each stream to its [DONE] (it then closes before the
    # chunked terminator this router sends apart), so none was an interrupted turn.
    assert answer["turn_count"] == 5
    assert fleet.sidecar is not None
    copied = report.conversation(StoreSource(fleet.sidecar.store), COPYING.conversation_id)["turns"]
    client = phases["copying"].turns[COPYING.conversation_id]
    assert [t["outcome"] for t in copied] == ["interrupted" if r.interrupted else "ok" for r in client]
    assert checks[names.CHECK_DECODE_NOT_STREAMED]["evidence"] == {"decode_requests": 5, "streamed": 3}
    assert checks[names.CHECK_HANDLE_FORWARDED]["evidence"] == {"follow_up_turns": 3, "with_handle": 0}
    assert all(p["otelkv_metrics"] and p["cache"].get("block_size") for p in answer["probes"])


def test_doctor_passes_the_copying_router_that_keeps_handles(fleet: Fleet, phases: dict[str, Phase]) -> None:
    for turn in phases["keeping"].turns[KEEPING.conversation_id]:
        _engine_requests(fleet, turn)
    status = _by_status(_doctor(fleet, phases["keeping"]))
    assert names.CHECK_FAIL not in status
    assert (
        ALWAYS_PASS
        | {
            names.CHECK_TURNS_JOINED,
            names.CHECK_CONVERSATION_ID,
            names.CHECK_HANDLE_FORWARDED,
            names.CHECK_DECODE_NOT_STREAMED,
        }
        <= status[names.CHECK_PASS]
    )
    # A router without otelkv's spans does not say how long it keeps a handle.
    assert status[names.CHECK_SKIP] == {names.CHECK_ROUTER_TTL}


def test_doctor_fails_what_the_rebuilding_router_lacks(fleet: Fleet, phases: dict[str, Phase]) -> None:
    """Router (b): handles kept per conversation, but neither headers nor the body's identity forwarded."""
    for conv in REBUILT:
        _wait_for_engine_requests(fleet, _routed_ids(fleet, conv.conversation_id))
    answer = _doctor(fleet, phases["rebuilding"])
    status = _by_status(answer)
    assert status.get(names.CHECK_FAIL) == {names.CHECK_CONVERSATION_ID}
    assert names.CHECK_TURNS_JOINED in status[names.CHECK_WARN]  # joined, but only by inference
    assert (
        ALWAYS_PASS | {names.CHECK_HANDLE_FORWARDED, names.CHECK_DECODE_NOT_STREAMED}
        <= status[names.CHECK_PASS]
    )
    joined = {c["id"]: c for c in answer["checks"]}[names.CHECK_TURNS_JOINED]["evidence"]
    turns = sum(len(c.turns) for c in REBUILT)
    assert joined == {"turns": turns, "joined_by_trace": 0, "joined_by_inference": turns, "unjoined": 0}
