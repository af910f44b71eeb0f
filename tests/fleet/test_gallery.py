"""The diagnosis gallery: real engines produce each diagnosis, and ``otelkv why`` names it
with the numbers the scenario knows.

One fleet with otelkv's sidecar in front (decoder_kv_blocks_ttl 12 s, kv_recompute_threshold
64) runs one scenario per diagnosis. What makes the engines misbehave is real: pauses the
agent takes, the router's handle TTL, and engines stalled with SIGSTOP at the point a
scenario needs (:meth:`~otelkv.fleet.engines.Engine.freeze`: the whole engine, or only its
EngineCore so the API server keeps accepting). Each test checks the evidence against what
the scenario did, on the scenario's clocks: the client's own timestamps (its kernel's send
and receive times of each request) and the test process's clock when it froze and thawed
an engine.

The other diagnoses are proven on real engines where their fleets already run:
``ttl_lapsed_during_gap``, ``decode_returned_no_handle``, ``no_conversation_id``,
``kv_transfer_failed`` and the continuity ones in ``test_sidecar``;
``kv_reused_for_different_tokens`` in ``test_bidirectional``; ``router_kept_no_handle`` and
``router_forwards_no_identity`` in ``test_third_party_router``; ``bidirectional_off`` and
``stuck_waiting_for_remote_kv`` in ``test_bidirectional_off`` (``tests/unit/test_docs.py``
holds every registered diagnosis to a real-fleet test).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from otelkv import names
from otelkv.analysis import report
from otelkv.analysis.sources import StoreSource
from otelkv.fleet.agent import Conversation, Turn, TurnResult
from otelkv.fleet.engines import Engine
from otelkv.fleet.fleet import Fleet, FleetConfig
from tests.fleet.conftest import fleet_fixture
from tests.fleet.spans import wait_for_turn
from tests.schema import assert_valid

pytestmark = pytest.mark.fleet

TTL_S = 12.0
"""decoder_kv_blocks_ttl: short, so the expiry scenarios take seconds, not minutes."""
THRESHOLD = 64
"""kv_recompute_threshold (the fleet's default)."""
BLOCK_TOKENS = 32
MARGIN_S = 5.0
"""vLLM declines a read of the decode node's blocks from this long before their deadline."""
PAUSE_S = 3.0
STALL_S = 2.0
PULL_STALL_S = 4.0
CLOCK_TOLERANCE_S = 0.1
"""How far the sidecar's phases may be from the client's clock, per turn. Both sides read
their kernel's times (``TCP_INFO``): what is left is a jiffy on each side (4 ms on the
reference machine) and the rare end the sidecar stamps itself (bytes still queued when the
exchange ended). Well under the 0.21 s a read-time stamp was off by on this fleet."""
STALL_TOLERANCE_S = 0.5
"""How far an engine's wait may be from the stall the scenario made: the request has to
travel sidecar -> router -> engine before the wait starts (tens of ms on an idle fleet,
more on a 2-core machine)."""
RESUME_TOLERANCE_S = 1.0
"""How much longer than the stall a read of the stalled engine's KV may take: after SIGCONT
the engine serves the read at its next NIXL progress, not at once (0.45 s seen on 2 cores)."""


@dataclass
class Stall:
    """When the scenario froze an engine and when it let it go (the test process's clock)."""

    frozen: float = 0.0
    thawed: float = 0.0


def stall(
    engine: Engine | None, seconds: float, *, only: str | None = None
) -> tuple[Stall, Callable[[], None]]:
    """A stall to run at a scenario's chosen moment: freeze the engine now, thaw it later."""
    assert engine is not None
    record = Stall()

    def thaw() -> None:
        engine.thaw()
        record.thawed = time.time()

    def freeze() -> None:
        assert engine.freeze(only=only) > 0, f"no process of {engine.spec.engine_id} matched {only!r}"
        record.frozen = time.time()
        timer = threading.Timer(seconds, thaw)
        timer.daemon = True
        timer.start()

    return record, freeze


def sent(turn: TurnResult) -> float:
    """When the request left the client (its kernel's clock where it said)."""
    return turn.sent_kernel_unix or turn.started_unix


def done(turn: TurnResult) -> float:
    """When the response's last byte reached the client."""
    return turn.done_kernel_unix or turn.done_unix


@dataclass
class Scenario:
    turns: list[TurnResult]
    stall: Stall | None = None


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    config = FleetConfig(
        decoder_ttl_s=TTL_S,
        recompute_threshold=THRESHOLD,
        sidecar=True,
        # A frozen API server closes its idle keep-alive connections on waking once vLLM's 5 s
        # have passed, under the request the router just wrote on one (a 502): the stalls here
        # are about the KV, so the engines keep idle connections for a minute.
        engine_env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60"},
    )
    yield from fleet_fixture(config, request)


@pytest.fixture(scope="module")
def gallery(fleet: Fleet) -> dict[str, Scenario]:
    assert fleet.router is not None
    driver = fleet.driver()
    out: dict[str, Scenario] = {}

    # Gap phases and a short answer, side by side (they do not disturb each other).
    together = {
        "tool": Conversation(
            "gal-tool",
            [
                Turn("find the flaky test", 48),
                Turn("test_x flaked twice", 32, pause_s=PAUSE_S, tool="ci_logs"),
            ],
        ),
        "app": Conversation(
            "gal-app", [Turn("summarize the incident", 48), Turn("shorter", 32, pause_s=PAUSE_S)]
        ),
        # A 4-token answer leaves the decode node fewer new tokens than the threshold.
        "below": Conversation("gal-below", [Turn("hi there " * 20, 4), Turn("ok", 4, pause_s=0.3)]),
    }

    for name, turns in zip(together, driver.run_sync(list(together.values())), strict=True):
        out[name] = Scenario(turns)

    def alone(name: str, conversation: Conversation, record: Stall | None = None) -> None:
        (turns,) = driver.run_sync([conversation])
        out[name] = Scenario(turns, record)

    # The decode node stalls as the next turn arrives: the prefill node's pull waits for it.
    # The first prompt is long: recomputing is priced from its prefill (per token, overhead
    # included), and a short one on a busy machine priced it at 37 ms a token, more than the
    # stalled pull.
    record, freeze = stall(fleet.decode, PULL_STALL_S)
    alone(
        "pull_slow",
        Conversation(
            "gal-pull-slow",
            [
                Turn("write the release notes for version two and list every change " * 8, 96),
                Turn("more", 32, pause_s=0.5, before_send=freeze),
            ],
        ),
        record,
    )
    # The prefill node stalls right after its leg: the decode node's read of its KV waits.
    record, freeze = stall(fleet.prefill, STALL_S)

    def stall_between_legs() -> None:
        def once() -> None:
            fleet.router.between_legs = None
            freeze()

        fleet.router.between_legs = once

    alone(
        "handoff",
        Conversation("gal-handoff", [Turn("list the services", 48, before_send=stall_between_legs)]),
        record,
    )
    # The prefill node is stalled when the request arrives: it waits in front of the engine.
    record, freeze = stall(fleet.prefill, STALL_S)
    alone("queue", Conversation("gal-queue", [Turn("check the disks", 32, before_send=freeze)]), record)
    handle_ttl = fleet.router.handles.ttl_s
    try:
        # A router that drops handles after 1.5 s, in front of a decode node that keeps KV 12 s.
        fleet.router.handles.ttl_s = 1.5
        alone(
            "router_drop",
            Conversation("gal-router-drop", [Turn("draft the email", 96), Turn("send", 32, pause_s=PAUSE_S)]),
        )
        # A router that never drops a handle: the gap reaches vLLM's read margin before the TTL.
        fleet.router.handles.ttl_s = None
        alone(
            "expired",
            Conversation("gal-expired", [Turn("plan the upgrade", 96), Turn("go", 32, pause_s=TTL_S - 3.0)]),
        )
        # A short gap, but the prefill node's EngineCore stalls past the read margin before it
        # reads: the API server took the request, the scheduler reached it late.
        record, freeze = stall(fleet.prefill, TTL_S - MARGIN_S + 1.5, only="EngineCore")
        alone(
            "late",
            Conversation(
                "gal-late", [Turn("plan the change", 96), Turn("go", 32, pause_s=0.5, before_send=freeze)]
            ),
            record,
        )
    finally:
        fleet.router.handles.ttl_s = handle_ttl
    return out


def why(fleet: Fleet, turn: TurnResult) -> dict[str, Any]:
    """The turn as ``otelkv why`` reports it, from the sidecar's store."""
    assert fleet.sink is not None and fleet.sidecar is not None
    wait_for_turn(fleet.sink, turn.trace_id, decode=turn.ok)
    fleet.flush_store()
    return assert_valid(report.why(StoreSource(fleet.sidecar.store), turn.trace_id))["turn"]  # type: ignore[no-any-return]


def stalled(gallery: dict[str, Scenario], name: str) -> tuple[list[TurnResult], Stall]:
    """A stall scenario's turns, and when its engine was frozen and thawed."""
    scenario = gallery[name]
    assert scenario.stall is not None and scenario.stall.thawed > scenario.stall.frozen > 0
    return scenario.turns, scenario.stall


def leg_sent(fleet: Fleet, turn: TurnResult, role: str) -> float:
    """When the router sent the turn's request to the ``role`` engine (its ``router_leg`` span)."""
    assert fleet.sink is not None
    name = names.SPAN_ROUTER_LEG.format(role=role)
    spans = fleet.sink.wait_for(lambda s: any(x.trace_id == turn.trace_id and x.name == name for x in s))
    (leg,) = [x for x in spans if x.trace_id == turn.trace_id and x.name == name]
    return leg.start_ns / 1e9


def diagnosis(fleet: Fleet, turn: TurnResult, diag_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    answer = why(fleet, turn)
    found = {d["id"]: d for d in answer["diagnoses"]}
    assert diag_id in found, (diag_id, answer["diagnoses"], fleet.engine_log_lines())
    return found[diag_id], answer


def test_tool_wait_dominates(fleet: Fleet, gallery: dict[str, Scenario]) -> None:
    first, second = gallery["tool"].turns
    assert second.ok
    d, _ = diagnosis(fleet, second, names.DIAG_TOOL_WAIT_DOMINATES)
    e = d["evidence"]
    # The agent's own execute_tool span measured the tool (the sidecar takes it from there).
    assert fleet.sink is not None
    (tool,) = fleet.sink.spans(
        lambda s: (
            s.name == "execute_tool ci_logs" and s.attributes.get(names.GEN_AI_CONVERSATION_ID) == "gal-tool"
        )
    )
    assert tool.duration_s >= PAUSE_S
    assert e["tool_wait_s"] == pytest.approx(tool.duration_s, abs=0.01)
    client_total = done(second) - done(first)  # the gap and the request, on the client's clock
    assert e["total_s"] == pytest.approx(client_total, abs=2 * CLOCK_TOLERANCE_S)
    assert e["share"] > 0.5
    assert e["gap_source"] == names.GAP_SOURCE_AGENT_SPANS
    assert e["decoder_kv_blocks_ttl_s"] == TTL_S


def test_app_work_dominates(fleet: Fleet, gallery: dict[str, Scenario]) -> None:
    first, second = gallery["app"].turns
    d, _ = diagnosis(fleet, second, names.DIAG_APP_WORK_DOMINATES)
    e = d["evidence"]
    gap = sent(second) - done(first)  # the client's clock: at least the pause it slept
    assert gap >= PAUSE_S
    assert e["app_work_s"] == pytest.approx(gap, abs=CLOCK_TOLERANCE_S)
    assert e["share"] > 0.5 and e["gap_source"] == names.GAP_SOURCE_MESSAGES


def test_below_threshold(fleet: Fleet, gallery: dict[str, Scenario]) -> None:
    first, second = gallery["below"].turns
    d, answer = diagnosis(fleet, second, names.DIAG_BELOW_THRESHOLD)
    e = d["evidence"]
    assert e["kv_recompute_threshold"] == THRESHOLD
    # The decode node held the first prompt and its 4-token answer; the prefill node had the
    # prompt's whole blocks cached. What is left to reuse is under one block plus the answer.
    held = first.prompt_tokens + first.completion_tokens
    assert first.completion_tokens == 4
    cached = answer["prefill"]["tokens"]["local_cache"]
    assert cached == first.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
    assert 0 < e["remote_reusable_tokens"] <= held - cached < THRESHOLD
    assert answer["prefill"]["tokens"]["pulled"] in (0, None)
    assert e["tokens_computed"] == second.prompt_tokens - cached


def test_pull_slower_than_recompute(fleet: Fleet, gallery: dict[str, Scenario]) -> None:
    (first, second), frozen = stalled(gallery, "pull_slow")
    assert second.ok
    d, _ = diagnosis(fleet, second, names.DIAG_PULL_SLOWER_THAN_RECOMPUTE)
    e = d["evidence"]
    # The pull waited for the frozen decode node: from when the router sent the prefill leg
    # (its own span: the way there took up to 1.1 s on a loaded CI machine) to the thaw.
    stalled_for = frozen.thawed - leg_sent(fleet, second, names.ROLE_PREFILL)
    assert stalled_for - STALL_TOLERANCE_S <= e["pull_s"] <= stalled_for + RESUME_TOLERANCE_S, (
        e["pull_s"],
        stalled_for,
    )
    # What the decode node held: the first prompt and its answer (the client's usage).
    assert THRESHOLD <= e["pulled_tokens"] <= first.prompt_tokens + first.completion_tokens
    assert e["recompute_estimate_s"] < e["pull_s"] and d["cost_s"] > 0
    assert e["backend"] == "UCX" and e["kv_recompute_threshold"] == THRESHOLD


def test_slow_kv_handoff(fleet: Fleet, gallery: dict[str, Scenario]) -> None:
    (turn,), frozen = stalled(gallery, "handoff")
    assert turn.ok
    e = diagnosis(fleet, turn, names.DIAG_SLOW_KV_HANDOFF)[0]["evidence"]
    stalled_for = frozen.thawed - frozen.frozen
    assert stalled_for - STALL_TOLERANCE_S <= e["wait_s"] <= stalled_for + RESUME_TOLERANCE_S, (
        e["wait_s"],
        stalled_for,
    )
    assert e["direction"] == names.DIRECTION_P_TO_D and e["backend"] == "UCX" and e["bytes"] > 0
    assert e["request_s"] == pytest.approx(done(turn) - sent(turn), abs=CLOCK_TOLERANCE_S)


def test_queueing(fleet: Fleet, gallery: dict[str, Scenario]) -> None:
    (turn,), frozen = stalled(gallery, "queue")
    assert turn.ok
    e = diagnosis(fleet, turn, names.DIAG_QUEUEING)[0]["evidence"]
    # The request waited in front of the frozen prefill node from its send to the thaw.
    queued = frozen.thawed - sent(turn)
    assert queued - 0.2 <= e["unexplained_s"] <= queued + RESUME_TOLERANCE_S, (e, queued)
    assert e["prefill_engine_s"] < STALL_TOLERANCE_S  # the engine's own time excludes the stall


def test_router_dropped_handle(fleet: Fleet, gallery: dict[str, Scenario]) -> None:
    first, second = gallery["router_drop"].turns
    d, answer = diagnosis(fleet, second, names.DIAG_ROUTER_HANDLE_EXPIRED)
    e = d["evidence"]
    gap = sent(second) - done(first)
    assert e["router_handle"] == names.ROUTER_HANDLE_STALE
    assert e["gap_s"] == pytest.approx(gap, abs=CLOCK_TOLERANCE_S)
    # The router stored the handle before the client had the answer and looked it up after
    # the next request left the client: at least the gap, within the two requests' span.
    assert max(1.5, gap - CLOCK_TOLERANCE_S) <= e["handle_age_s"] <= done(second) - sent(first)
    assert e["decoder_kv_blocks_ttl_s"] == TTL_S > gap
    cached = answer["prefill"]["tokens"]["local_cache"]
    assert e["tokens_recomputed"] == first.prompt_tokens + first.completion_tokens - cached
    assert names.DIAG_TTL_LAPSED not in {x["id"] for x in answer["diagnoses"]}


def test_expired_read_failed_request(fleet: Fleet, gallery: dict[str, Scenario]) -> None:
    first, second = gallery["expired"].turns
    assert second.status == 500, (second.status, second.error)
    d, answer = diagnosis(fleet, second, names.DIAG_EXPIRED_READ_FAILED)
    assert answer["diagnoses"][0]["id"] == names.DIAG_EXPIRED_READ_FAILED  # a failure ranks first
    e = d["evidence"]
    gap = sent(second) - done(first)
    assert TTL_S - MARGIN_S <= gap < TTL_S  # the scenario: inside vLLM's read margin, not past the TTL
    assert e["gap_s"] == pytest.approx(gap, abs=CLOCK_TOLERANCE_S)
    assert e["decoder_kv_blocks_ttl_s"] == TTL_S and e["kv_load_failure_policy"] == "fail"
    assert (e["reason"], e["transfer_outcome"]) == (
        names.REASON_DECLINED_EXPIRED,
        names.TRANSFER_DECLINED_EXPIRED,
    )
    assert e["http_status"] == second.status and "wait_before_read_s" not in e
    # The gap, not a late read: and the summary does not claim the gap exceeded the TTL.
    lapsed = {x["id"]: x for x in answer["diagnoses"]}[names.DIAG_TTL_LAPSED]
    assert "within vLLM's 5s read margin" in lapsed["summary"] and "exceeded" not in lapsed["summary"]
    assert names.DIAG_KV_READ_STARTED_LATE not in {x["id"] for x in answer["diagnoses"]}


def test_kv_read_started_late(fleet: Fleet, gallery: dict[str, Scenario]) -> None:
    (first, second), frozen = stalled(gallery, "late")
    assert second.status >= 500
    d, answer = diagnosis(fleet, second, names.DIAG_KV_READ_STARTED_LATE)
    e = d["evidence"]
    gap = sent(second) - done(first)
    assert gap + MARGIN_S < TTL_S
    assert e["gap_s"] == pytest.approx(gap, abs=CLOCK_TOLERANCE_S)
    # The scheduler reached the request when its EngineCore was thawed; the read came then.
    waited = frozen.thawed - sent(second)
    assert waited - 0.2 <= e["wait_before_read_s"] <= waited + RESUME_TOLERANCE_S, (e, waited)
    assert waited - 0.2 <= e["before_engine_s"] <= e["wait_before_read_s"]
    assert e["decoder_kv_blocks_ttl_s"] == TTL_S and e["outcome"] == names.OUTCOME_FAILED_KV_LOAD
    ids = [x["id"] for x in answer["diagnoses"]]
    assert ids[0] == names.DIAG_EXPIRED_READ_FAILED and names.DIAG_TTL_LAPSED not in ids


def test_phases_match_the_clients_clock(fleet: Fleet, gallery: dict[str, Scenario]) -> None:
    """Per turn, the sidecar's request phases (input processing + generation) against the
    client's send-to-last-byte, and its gap phases (tool wait + app work) against the client's
    last byte to next send, both on the client's kernel clock."""
    request_errors: list[tuple[float, str]] = []
    gap_errors: list[tuple[float, str]] = []
    for scenario in gallery.values():
        previous = None
        for turn in scenario.turns:
            phases = why(fleet, turn)["phases"]
            assert turn.sent_kernel_unix is not None and turn.done_kernel_unix is not None
            where = f"{turn.conversation_id}#{turn.index}"
            request = phases[f"{names.PHASE_INPUT_PROCESSING}_s"] + phases[f"{names.PHASE_GENERATION}_s"]
            request_errors.append((request - (done(turn) - sent(turn)), where))
            if previous is not None:
                gap = phases[f"{names.PHASE_TOOL_WAIT}_s"] + phases[f"{names.PHASE_APP_WORK}_s"]
                gap_errors.append((gap - (sent(turn) - done(previous)), where))
            previous = turn
    for label, errors in (("request", request_errors), ("gap", gap_errors)):
        size = sorted(abs(x) for x, _ in errors)
        print(
            f"\n{label} phases vs the client's clock, {len(errors)} turns: median |error| "
            f"{statistics.median(size) * 1000:.1f} ms, max {size[-1] * 1000:.1f} ms"
        )
        over = [(round(x, 4), where) for x, where in errors if abs(x) > CLOCK_TOLERANCE_S]
        assert not over, (label, over)
