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

The same store then answers the queries of ``docs/queries.md`` (the ``test_cookbook_*``
tests), read from the page and run on the sidecar's own store object while it runs: each
answer is checked against what the scenarios did (the tool call that outlasted the TTL, the
stalled pull, the failed reads, the client's clocks and statuses), and the bytes read
against vLLM's own NIXL counters.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from otelkv import names
from otelkv.analysis import report
from otelkv.analysis.sources import StoreSource
from otelkv.fleet import metrics as prom
from otelkv.fleet.agent import Conversation, Turn, TurnResult
from otelkv.fleet.engines import Engine
from otelkv.fleet.fleet import Fleet, FleetConfig
from otelkv.spans import SpanRecord
from tests import cookbook
from tests.fleet.clock import slept
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
LAPSE_PAUSE_S = TTL_S + 1.5
"""A tool call that outlasts the TTL (it runs beside the other gap scenarios)."""
CLOCK_TOLERANCE_S = 0.1
"""How far the sidecar's phases may be from the client's clock, per turn. Both sides read
their kernel's times (``TCP_INFO``): what is left is a jiffy on each side (4 ms on the
reference machine) and the rare end the sidecar stamps itself (bytes still queued when the
exchange ended). Well under the 0.21 s a read-time stamp was off by on this fleet."""
STALL_TOLERANCE_S = 0.5
"""How far an engine's wait may be from the stall the scenario made, counted from the
earliest the wait could start (the engine got the request, or the engine froze): the
engine's scheduler takes it up at its next step (tens of ms on an idle fleet, more on a
2-core machine)."""
RESUME_TOLERANCE_S = 1.0
"""How much longer than the stall a read of the stalled engine's KV may take: after SIGCONT
the engine serves the read at its next NIXL progress, not at once (0.45 s seen on 2 cores)."""


@dataclass
class Stall:
    """When the scenario froze an engine and when it let it go (the test process's clock):
    ``thawing`` just before the SIGCONT, ``thawed`` just after it."""

    frozen: float = 0.0
    thawing: float = 0.0
    thawed: float = 0.0


def stall(
    engine: Engine | None, seconds: float, *, only: str | None = None
) -> tuple[Stall, Callable[[], None]]:
    """A stall to run at a scenario's chosen moment: freeze the engine now, thaw it later."""
    assert engine is not None
    record = Stall()

    def thaw() -> None:
        record.thawing = time.time()
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
    vllm_reads: tuple[float, float] | None = None
    """The NIXL reads the reading engine made during the scenario as vLLM measured them (its
    ``vllm:nixl_xfer_time_seconds`` histogram): how many, and their seconds together."""


def _xfer_totals(engine: Engine) -> tuple[float, float]:
    text = engine.metrics_text()
    return prom.total(text, "vllm:nixl_xfer_time_seconds_count"), prom.total(
        text, "vllm:nixl_xfer_time_seconds_sum"
    )


def reads_during(engine: Engine | None, run: Callable[[], None]) -> tuple[float, float]:
    """Run ``run`` and return the NIXL reads ``engine`` made meanwhile as vLLM measured them:
    (how many, their seconds together). vLLM publishes its NIXL stats with the engine's
    stats of a later step, so the count is taken once it holds still for a second, before
    (an earlier scenario's read) and after (this one's)."""
    assert engine is not None

    def settled() -> tuple[float, float]:
        deadline = time.monotonic() + 15.0
        last = _xfer_totals(engine)
        while time.monotonic() < deadline:
            time.sleep(1.0)
            now = _xfer_totals(engine)
            if now == last:
                break
            last = now
        return last

    count0, sum0 = settled()
    run()
    count, total = settled()
    return count - count0, total - sum0


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    config = FleetConfig(
        decoder_ttl_s=TTL_S,
        recompute_threshold=THRESHOLD,
        sidecar=True,
    )
    yield from fleet_fixture(config, request)


@pytest.fixture(scope="module")
def window_start(fleet: Fleet) -> int:
    """The first whole second after the fleet's warm-up: the scenarios start there, so a
    query's time range (whole seconds, as Grafana sends it) holds the gallery and nothing else."""
    now = time.time()
    start = math.ceil(now)
    time.sleep(start - now + 0.01)
    return start


@pytest.fixture(scope="module")
def gallery(fleet: Fleet, window_start: int) -> dict[str, Scenario]:
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
        # A tool call that outlasts the decode node's TTL (docs/queries.md's lapse query).
        "lapse": Conversation(
            "gal-lapse",
            [
                Turn("run the nightly suite", 48),
                Turn("suite passed", 32, pause_s=LAPSE_PAUSE_S, tool="ci_run"),
            ],
        ),
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
    reads = reads_during(
        fleet.prefill,
        lambda: alone(
            "pull_slow",
            Conversation(
                "gal-pull-slow",
                [
                    Turn("write the release notes for version two and list every change " * 8, 96),
                    Turn("more", 32, pause_s=0.5, before_send=freeze),
                ],
            ),
            record,
        ),
    )
    out["pull_slow"].vllm_reads = reads
    # The prefill node stalls right after its leg: the decode node's read of its KV waits.
    record, freeze = stall(fleet.prefill, STALL_S)

    def stall_between_legs() -> None:
        def once() -> None:
            fleet.router.between_legs = None
            freeze()

        fleet.router.between_legs = once

    reads = reads_during(
        fleet.decode,
        lambda: alone(
            "handoff",
            Conversation("gal-handoff", [Turn("list the services", 48, before_send=stall_between_legs)]),
            record,
        ),
    )
    out["handoff"].vllm_reads = reads
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


def _the_span(fleet: Fleet, turn: TurnResult, name: str) -> SpanRecord:
    """The one span named ``name`` in the turn's trace (waited for)."""
    assert fleet.sink is not None
    spans = fleet.sink.wait_for(lambda s: any(x.trace_id == turn.trace_id and x.name == name for x in s))
    (span,) = [x for x in spans if x.trace_id == turn.trace_id and x.name == name]
    return span


def leg_sent(fleet: Fleet, turn: TurnResult, role: str) -> float:
    """When the router sent the turn's request to the ``role`` engine (its ``router_leg`` span)."""
    return _the_span(fleet, turn, names.SPAN_ROUTER_LEG.format(role=role)).start_ns / 1e9


def engine_arrival(fleet: Fleet, turn: TurnResult, role: str) -> float:
    """When the ``role`` engine got the turn's request (its ``kv_request`` span's start), checked
    against the router's clock: not before the router sent it."""
    arrived = _the_span(fleet, turn, names.SPAN_ENGINE_REQUEST.format(role=role)).start_ns / 1e9
    assert arrived >= leg_sent(fleet, turn, role) - 0.01
    return arrived


def assert_read_waited_for_thaw(fleet: Fleet, scenario: Scenario, role: str, waited_s: float) -> None:
    """The scenario's last turn had the ``role`` engine read KV from the engine the scenario
    froze, and ``waited_s`` (what otelkv reported) is that engine's wait for it.

    The read's span starts after the freeze and after the engine got the request, and before
    the thaw (the read waited for the stopped engine); it ends no earlier than the SIGCONT
    (nothing is read from a stopped process) and within a resume of it. How long after the
    request's arrival the scheduler posts the read is not the scenario's to know (0.69 s on a
    loaded CI machine), so the wait's length is checked against vLLM's own measurement of
    that read (its /metrics): the scheduler's wait holds the read, and exceeds it by at most
    a scheduler step."""
    stall = scenario.stall
    assert stall is not None
    turn = scenario.turns[-1]
    direction = names.DIRECTION_D_TO_P if role == names.ROLE_PREFILL else names.DIRECTION_P_TO_D
    span = _the_span(fleet, turn, names.transfer_span_name(direction))
    start, end = span.start_ns / 1e9, span.end_ns / 1e9
    arrived = engine_arrival(fleet, turn, role)
    where = {
        "start-frozen": start - stall.frozen,
        "start-arrived": start - arrived,
        "end-thawing": end - stall.thawing,
    }
    assert max(stall.frozen, arrived) - 0.01 <= start < stall.thawing, where
    assert stall.thawing - 0.01 <= end <= stall.thawed + RESUME_TOLERANCE_S, where
    assert waited_s == pytest.approx(span.duration_s, abs=0.01)
    assert scenario.vllm_reads is not None
    count, read_s = scenario.vllm_reads
    assert count == 1, scenario.vllm_reads  # one read in the scenario, as vLLM counted
    assert read_s - 0.01 <= waited_s <= read_s + STALL_TOLERANCE_S, (waited_s, read_s)
    assert read_s <= stall.thawed - stall.frozen + RESUME_TOLERANCE_S, (read_s, stall)


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
    assert tool.duration_s >= slept(PAUSE_S)
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
    assert gap >= slept(PAUSE_S)
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
    (first, second), _ = stalled(gallery, "pull_slow")
    assert second.ok
    d, _ = diagnosis(fleet, second, names.DIAG_PULL_SLOWER_THAN_RECOMPUTE)
    e = d["evidence"]
    assert_read_waited_for_thaw(fleet, gallery["pull_slow"], names.ROLE_PREFILL, e["pull_s"])
    reads = gallery["pull_slow"].vllm_reads
    assert reads is not None and e["xfer_s"] == pytest.approx(reads[1], abs=0.01)  # NIXL's own time
    # What the decode node held: the first prompt and its answer (the client's usage).
    assert THRESHOLD <= e["pulled_tokens"] <= first.prompt_tokens + first.completion_tokens
    assert e["recompute_estimate_s"] < e["pull_s"] and d["cost_s"] > 0
    assert e["backend"] == "UCX" and e["kv_recompute_threshold"] == THRESHOLD


def test_slow_kv_handoff(fleet: Fleet, gallery: dict[str, Scenario]) -> None:
    (turn,), _ = stalled(gallery, "handoff")
    assert turn.ok
    e = diagnosis(fleet, turn, names.DIAG_SLOW_KV_HANDOFF)[0]["evidence"]
    assert_read_waited_for_thaw(fleet, gallery["handoff"], names.ROLE_DECODE, e["wait_s"])
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


# ------------------------------------------------------------------ docs/queries.md


@dataclass
class Cookbook:
    """The sidecar's store with every gallery span in it, queried in place while the sidecar
    runs (the store object is the sidecar's own, in this process: no second opener)."""

    fleet: Fleet
    start: datetime
    spans: list[SpanRecord]
    """What the sidecar received (the fleet's in-memory copy): the raw input of the queries."""

    def run(
        self, heading: str, *, start: datetime | None = None, conversation: str | None = None
    ) -> list[dict[str, Any]]:
        assert self.fleet.sidecar is not None
        end = datetime.now(timezone.utc) + timedelta(minutes=5)
        sql = cookbook.runnable(cookbook.sql(heading), start or self.start, end, conversation=conversation)
        return self.fleet.sidecar.store.query(sql)  # type: ignore[no-any-return]


DECODE_SPAN = names.engine_request_span_name(names.ROLE_DECODE)
PREFILL_SPAN = names.engine_request_span_name(names.ROLE_PREFILL)
DECODE_RETENTION = names.retention_span_name(names.RETENTION_DECODE_TTL)


@pytest.fixture(scope="module")
def cookbook_store(fleet: Fleet, gallery: dict[str, Scenario], window_start: int) -> Cookbook:
    """Every turn's spans stored, and every decode retention ended (read, or expired at its TTL)."""
    assert fleet.sink is not None
    for scenario in gallery.values():
        for turn in scenario.turns:
            wait_for_turn(fleet.sink, turn.trace_id, decode=turn.ok)

    def all_ended(spans: list[SpanRecord]) -> bool:
        handles = {
            s.span_id
            for s in spans
            if s.name == DECODE_SPAN and s.attributes.get(names.KV_PARAMS_RETURNED) in (True, "true")
        }
        return handles <= {s.parent_span_id for s in spans if s.name == DECODE_RETENTION}

    spans = fleet.sink.wait_for(all_ended, timeout=TTL_S + 30.0)
    fleet.flush_store()
    return Cookbook(fleet, datetime.fromtimestamp(window_start, timezone.utc), spans)


def all_turns(gallery: dict[str, Scenario]) -> list[TurnResult]:
    return [turn for scenario in gallery.values() for turn in scenario.turns]


def tool_span(fleet: Fleet, conversation: str) -> SpanRecord:
    """The agent's own measurement of its tool call (its ``execute_tool`` span)."""
    assert fleet.sink is not None
    (tool,) = fleet.sink.spans(
        lambda s: (
            s.name.startswith("execute_tool ")
            and s.attributes.get(names.GEN_AI_CONVERSATION_ID) == conversation
        )
    )
    return tool


def test_cookbook_slow_turns(fleet: Fleet, gallery: dict[str, Scenario], cookbook_store: Cookbook) -> None:
    rows = cookbook_store.run("Slow turns with their phases")
    assert sorted((r["conversation"], r["turn"]) for r in rows) == sorted(
        (t.conversation_id, t.index) for t in all_turns(gallery)
    )
    first, second = gallery["lapse"].turns
    top = rows[0]  # the tool call past the TTL is the gallery's longest turn
    assert (top["conversation"], top["turn"]) == ("gal-lapse", 1)
    assert top["total_s"] == pytest.approx(done(second) - done(first), abs=2 * CLOCK_TOLERANCE_S)
    assert top["tool_wait_s"] == pytest.approx(tool_span(fleet, "gal-lapse").duration_s, abs=0.01)
    # The router dropped its handle after 6 s: the prefill node got none.
    assert top["pull_reason"] == names.REASON_NO_DECODE_HANDLE and top["pulled_tokens"] == 0


SHORT_ANSWERS = {"gal-tool": 1, "gal-app": 1}
"""Later turns after a 48-token answer: the decode node holds about the threshold's worth of
tokens beyond the prefill node's cache (the prompt's last partial block and the answer), so
they pull or fall below the threshold depending on how the answer re-renders. Either is
right; the queries must then say which."""


def test_cookbook_a_conversations_turns(gallery: dict[str, Scenario], cookbook_store: Cookbook) -> None:
    first, second = gallery["pull_slow"].turns
    rows = cookbook_store.run("A conversation's turns", conversation="gal-pull-slow")
    assert [r["turn"] for r in rows] == [0, 1]
    assert rows[1]["total_s"] == pytest.approx(done(second) - done(first), abs=2 * CLOCK_TOLERANCE_S)
    # A 96-token answer and a 0.5 s gap: the second turn read the first one's KV back.
    assert rows[1]["pull_reason"] == names.REASON_PULLED
    assert THRESHOLD <= rows[1]["pulled"] <= first.prompt_tokens + first.completion_tokens
    assert rows[0]["retention"] == names.RETENTION_CONSUMED and rows[0]["held_s"] < TTL_S
    assert cookbook_store.run("A conversation's turns", conversation="gal-'none'") == []


def test_cookbook_why_a_turn_did_not_pull(gallery: dict[str, Scenario], cookbook_store: Cookbook) -> None:
    rows = {(r["conversation"], r["turn"]): r for r in cookbook_store.run("Why a turn did not pull")}
    known = {("gal-below", 1), ("gal-lapse", 1), ("gal-router-drop", 1), ("gal-expired", 1), ("gal-late", 1)}
    assert known <= set(rows) <= known | set(SHORT_ANSWERS.items())
    for key in set(rows) - known:
        assert rows[key]["pull_reason"] == names.REASON_BELOW_THRESHOLD
    below = rows["gal-below", 1]
    assert below["pull_reason"] == names.REASON_BELOW_THRESHOLD
    assert 0 < below["remote_reusable"] < below["threshold"] == THRESHOLD
    first, second = gallery["lapse"].turns
    lapse = rows["gal-lapse", 1]
    assert (lapse["pull_reason"], lapse["previous_retention"], lapse["router_handle"]) == (
        names.REASON_NO_DECODE_HANDLE,
        names.RETENTION_EXPIRED,
        names.ROUTER_HANDLE_STALE,
    )
    assert lapse["gap_s"] == pytest.approx(sent(second) - done(first), abs=CLOCK_TOLERANCE_S)
    assert lapse["gap_s"] > lapse["ttl_s"] == pytest.approx(TTL_S, abs=0.5)
    drop = rows["gal-router-drop", 1]
    assert (drop["pull_reason"], drop["router_handle"]) == (
        names.REASON_NO_DECODE_HANDLE,
        names.ROUTER_HANDLE_STALE,
    )
    assert drop["gap_s"] < drop["ttl_s"]  # the decode node still held the KV
    assert rows["gal-expired", 1]["pull_reason"] == names.REASON_DECLINED_EXPIRED


def test_cookbook_ttl_lapsed_during_a_tool_call(
    fleet: Fleet, gallery: dict[str, Scenario], cookbook_store: Cookbook
) -> None:
    # gal-expired's 9 s gap also reached vLLM's read margin, but it was app work, not a tool.
    (row,) = cookbook_store.run("Turns whose TTL lapsed during a tool call, by agent")
    first, second = gallery["lapse"].turns
    assert (row["agent"], row["lapsed_turns"]) == ("gal-lapse", 1)
    assert row["decode_ttl_s"] == pytest.approx(TTL_S, abs=0.5)
    assert row["longest_tool_wait_s"] == pytest.approx(tool_span(fleet, "gal-lapse").duration_s, abs=0.01)
    gap = sent(second) - done(first)
    assert row["most_over_ttl_s"] == pytest.approx(gap - row["decode_ttl_s"], abs=CLOCK_TOLERANCE_S)
    assert row["example_trace_id"] == second.trace_id


def test_cookbook_pulls_slower_than_recomputing(
    fleet: Fleet, gallery: dict[str, Scenario], cookbook_store: Cookbook
) -> None:
    (first, second), _ = stalled(gallery, "pull_slow")
    rows = {(r["conversation"], r["turn"]): r for r in cookbook_store.run("Pulls slower than recomputing")}
    row = rows["gal-pull-slow", 1]
    assert_read_waited_for_thaw(fleet, gallery["pull_slow"], names.ROLE_PREFILL, row["pull_s"])
    assert THRESHOLD <= row["pulled"] <= first.prompt_tokens + first.completion_tokens
    assert 0 < row["recompute_estimate_s"] < row["pull_s"] and row["backend"] == "UCX"
    assert row["trace_id"] == second.trace_id


def test_cookbook_conversations_whose_reuse_never_happened(cookbook_store: Cookbook) -> None:
    rows = {r["conversation"]: r for r in cookbook_store.run("Conversations whose reuse never happened")}
    # gal-pull-slow pulled; gal-handoff and gal-queue have one turn.
    known = {"gal-below", "gal-lapse", "gal-router-drop", "gal-expired", "gal-late"}
    assert known <= set(rows) <= known | set(SHORT_ANSWERS)
    for conversation in set(rows) - known:
        assert rows[conversation]["reasons"] == [names.REASON_BELOW_THRESHOLD]
    assert rows["gal-below"]["reasons"] == [names.REASON_BELOW_THRESHOLD]
    assert rows["gal-lapse"]["reasons"] == [names.REASON_NO_DECODE_HANDLE]
    assert rows["gal-router-drop"]["reasons"] == [names.REASON_NO_DECODE_HANDLE]
    assert all(r["turns"] == 2 for r in rows.values())


def test_cookbook_tool_wait_against_app_work(
    fleet: Fleet, gallery: dict[str, Scenario], cookbook_store: Cookbook
) -> None:
    rows = {r["agent"]: r for r in cookbook_store.run("p95 tool wait against app work, per agent")}
    later = {t.conversation_id for t in all_turns(gallery) if t.index > 0}
    assert set(rows) == later
    for conversation in ("gal-tool", "gal-lapse"):
        assert rows[conversation]["p95_tool_wait_s"] == pytest.approx(
            tool_span(fleet, conversation).duration_s, abs=0.01
        )
    first, second = gallery["app"].turns
    app = rows["gal-app"]
    assert app["p95_tool_wait_s"] == 0 and app["turns"] == 1
    assert app["p95_app_work_s"] == pytest.approx(sent(second) - done(first), abs=CLOCK_TOLERANCE_S)

    # A share is over the turn's whole time, which the client sees as one answer's end to the
    # next one's: compared with that, not with a fixed fraction (a slow machine's longer
    # request shrinks every share). Part and whole are each within the clock tolerance per
    # end, so the share is within (1 + 2) tolerances over the whole.
    def share_near(share: float, part_s: float, first: TurnResult, second: TurnResult) -> None:
        whole_s = done(second) - done(first)
        assert share == pytest.approx(part_s / whole_s, abs=3 * CLOCK_TOLERANCE_S / whole_s)

    share_near(app["app_work_share"], sent(second) - done(first), first, second)
    first, second = gallery["lapse"].turns
    share_near(rows["gal-lapse"]["tool_wait_share"], tool_span(fleet, "gal-lapse").duration_s, first, second)


def _num(span: SpanRecord, key: str) -> float:
    return float(span.attributes.get(key) or 0)


def test_cookbook_block_seconds_per_saved_prefill_second(
    fleet: Fleet, gallery: dict[str, Scenario], cookbook_store: Cookbook
) -> None:
    """Against the raw spans the sidecar received, summed here; and the scenario's anchor: the
    lapse conversation's first turn kept its KV the whole TTL for nothing."""
    (row,) = cookbook_store.run("Retained block-seconds per saved prefill second")
    start_ns = cookbook_store.start.timestamp() * 1e9
    spans = [s for s in cookbook_store.spans if s.start_ns >= start_ns]
    kept = [s for s in spans if s.name == DECODE_RETENTION]
    outcomes = Counter(s.attributes[names.RETENTION_OUTCOME] for s in kept)
    assert (row["retentions"], row["expired"]) == (len(kept), outcomes[names.RETENTION_EXPIRED])
    assert row["block_seconds"] == pytest.approx(sum(_num(s, names.RETENTION_BLOCK_SECONDS) for s in kept))
    prefills = [
        s
        for s in spans
        if s.name == PREFILL_SPAN and s.attributes.get(names.REQUEST_OUTCOME) == names.OUTCOME_FINISHED
    ]
    per_token = min(
        (s.duration_s - _num(s, names.REMOTE_KV_WAIT_SECONDS)) / _num(s, names.TOKENS_COMPUTED)
        for s in prefills
        if _num(s, names.TOKENS_COMPUTED) >= 16
    )
    pulled = sum(_num(s, names.TOKENS_PULLED) for s in prefills)
    assert row["pulled_tokens"] == pulled >= THRESHOLD  # gal-pull-slow pulled
    assert row["saved_prefill_s"] == pytest.approx(pulled * per_token)
    assert row["block_seconds_per_saved_s"] == pytest.approx(row["block_seconds"] / (pulled * per_token))
    first, _ = gallery["lapse"].turns
    (lapsed,) = [s for s in kept if s.trace_id == first.trace_id]
    assert lapsed.attributes[names.RETENTION_OUTCOME] == names.RETENTION_EXPIRED
    assert _num(lapsed, names.RETENTION_HELD_SECONDS) == pytest.approx(TTL_S, abs=1.0)


def test_cookbook_ttft_by_turn_index(gallery: dict[str, Scenario], cookbook_store: Cookbook) -> None:
    rows = {r["turn"]: r for r in cookbook_store.run("TTFT by turn index")}
    ok = [t for t in all_turns(gallery) if t.ok]
    assert {i: r["turns"] for i, r in rows.items()} == dict(Counter(t.index for t in ok))
    for index, r in rows.items():
        # The first token comes inside the request, on the client's clock.
        longest = max(done(t) - sent(t) for t in ok if t.index == index)
        assert 0 < r["p50_ttft_s"] <= r["p95_ttft_s"] <= longest + CLOCK_TOLERANCE_S
    assert rows[0]["reused_share"] < rows[1]["reused_share"]


def test_cookbook_kv_bytes_match_vllms_own_counters(fleet: Fleet, cookbook_store: Cookbook) -> None:
    """Over the fleet's whole life (warm-up included), as vLLM's counters are."""
    assert fleet.prefill is not None and fleet.decode is not None
    rows = cookbook_store.run(
        "KV bytes read, by direction and backend", start=cookbook_store.start - timedelta(hours=1)
    )
    assert {r["backend"] for r in rows} == {"UCX"}
    read = Counter[str]()
    for r in rows:
        read[r["direction"]] += r["bytes"]
    engines = {names.DIRECTION_D_TO_P: fleet.prefill, names.DIRECTION_P_TO_D: fleet.decode}
    deadline = time.monotonic() + 15.0  # vLLM publishes its NIXL stats with the engine's stats
    while True:
        vllm = {
            d: prom.total(e.metrics_text(), "vllm:nixl_bytes_transferred_sum") for d, e in engines.items()
        }
        if all(vllm[d] == read[d] for d in engines) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert dict(read) == vllm and all(v > 0 for v in vllm.values())


def test_cookbook_failed_kv_loads(gallery: dict[str, Scenario], cookbook_store: Cookbook) -> None:
    rows = cookbook_store.run("Failed KV loads")
    failed = {(t.conversation_id, t.index): t for t in all_turns(gallery) if t.status >= 500}
    assert set(failed) == {("gal-expired", 1), ("gal-late", 1)}
    assert {(r["conversation"], r["turn"]) for r in rows} == set(failed)
    for r in rows:
        assert r["http_status"] == str(failed[r["conversation"], r["turn"]].status)
        assert (r["role"], r["outcome"]) == (names.ROLE_PREFILL, names.OUTCOME_FAILED_KV_LOAD)


def test_funnel_places_each_scenario_where_it_lost_its_reuse(
    fleet: Fleet, gallery: dict[str, Scenario], cookbook_store: Cookbook, window_start: int
) -> None:
    """``otelkv funnel`` and the *KV reuse* dashboard's funnel panel on what the scenarios did:
    each second turn lost at the step its scenario made it miss, and the two counting alike."""
    from otelkv.analysis.diagnose import diagnose
    from otelkv.analysis.funnel import funnel, place
    from otelkv.analysis.linker import window_turns
    from otelkv.analysis.report import diagnosis_context
    from otelkv.dashboards import promql as q
    from otelkv.dashboards.funnel_panel import FUNNEL_SQL
    from tools import grafana_expand as expand

    assert fleet.sidecar is not None
    source = StoreSource(fleet.sidecar.store)
    since_ns = window_start * 1_000_000_000
    turns, _ = window_turns(source, since_ns=since_ns, until_ns=None)
    ctx = diagnosis_context(turns)
    placed = {
        t.conversation_id: place(t, [d.id for d in diagnose(t, ctx)], ctx) for t in turns if t.index == 1
    }
    built = {  # what each scenario did to its second turn
        "gal-below": (names.FUNNEL_ABOVE_THRESHOLD, names.REASON_BELOW_THRESHOLD),  # a 4-token answer
        "gal-lapse": (names.FUNNEL_KV_HELD, names.DIAG_TTL_LAPSED),  # a tool call past the TTL
        "gal-expired": (names.FUNNEL_KV_HELD, names.DIAG_TTL_LAPSED),  # a gap inside vLLM's read margin
        "gal-router-drop": (names.FUNNEL_KV_HELD, names.DIAG_ROUTER_HANDLE_EXPIRED),  # router TTL 1.5 s
        "gal-late": (names.FUNNEL_PULLED, names.DIAG_KV_READ_STARTED_LATE),  # scheduler frozen
        "gal-pull-slow": (names.FUNNEL_FASTER, names.DIAG_PULL_SLOWER_THAN_RECOMPUTE),  # decode frozen
    }
    assert set(placed) == set(built) | {"gal-tool", "gal-app"}
    assert {c: (p.step, p.reason) for c, p in placed.items() if c in built} == built
    # Ids sent, decode called non-streaming, 3 s gaps well inside the TTL: past the first steps.
    early = (names.FUNNEL_CONVERSATION_ID, names.FUNNEL_DECODE_HANDLE, names.FUNNEL_KV_HELD)
    for conv in ("gal-tool", "gal-app"):
        assert placed[conv].step not in early, (conv, placed[conv])
    # At stake without a handle: what the decode node held (the client's usage of the first
    # turn) less the prefill node's own prefix-cache hit.
    for name, conv in (("lapse", "gal-lapse"), ("router_drop", "gal-router-drop")):
        first = gallery[name].turns[0]
        (turn,) = [t for t in turns if t.conversation_id == conv and t.index == 1]
        assert turn.prefill is not None
        held = first.prompt_tokens + first.completion_tokens
        assert placed[conv].tokens == held - (turn.prefill.local_cache or 0), conv

    doc = assert_valid(funnel(source, since_ns=since_ns))
    assert doc["follow_up_turns"] == len(placed) == 8 and doc["turns_lost"] + doc["ends"] == 8
    lost = Counter((p.step, p.reason) for p in placed.values() if p.step is not None)
    assert Counter({(s["id"], r["reason"]): r["turns"] for s in doc["steps"] for r in s["lost"]}) == lost

    ctx_sql = expand.Context(
        variables={q.MODEL_VAR: expand.Variable(expand.ALL, options=["tiny"], all_value=".*")},
        start=datetime.fromtimestamp(window_start, timezone.utc),
        end=datetime.now(timezone.utc) + timedelta(minutes=5),
        interval_s=15.0,
    )
    rows = fleet.sidecar.store.query(expand.clickhouse(FUNNEL_SQL, ctx_sql))
    assert [r["turns"] for r in rows] == [s["turns"] for s in doc["steps"]]
    for row, step in zip(rows, doc["steps"], strict=True):
        want = ", ".join(f"{r['reason']}: {r['turns']} ({r['tokens']} tokens)" for r in step["lost"])
        assert row["lost_by_reason"] == want, step["id"]
