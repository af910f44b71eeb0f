"""The sidecar in front of a real 1P1D fleet: turn traces, diagnoses, phase split, bytes.

One fleet (decoder_kv_blocks_ttl=36 s, the router's handle lifetime 30 s) with otelkv's
sidecar in front of the router: the agents talk to the sidecar, the engines and the
router export their spans to its OTLP receiver, and it keeps everything in its chDB
store. The tests read the answers the way a user would: from the store through
``otelkv.analysis.report`` (what ``otelkv why`` / ``conversation`` print) and through
the CLI against the sidecar's query API.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil
import pytest

from otelkv import names
from otelkv.analysis import report
from otelkv.analysis.sources import StoreSource
from otelkv.analysis.turn_json import iso
from otelkv.fleet.agent import AgentDriver, Conversation, Turn, TurnResult
from otelkv.fleet.fleet import Fleet, FleetConfig
from otelkv.sidecar.app import Sidecar, SidecarConfig
from otelkv.spans import SpanRecord
from otelkv.store import queries
from tests.fleet.clock import slept
from tests.fleet.conftest import fleet_fixture
from tests.fleet.spans import children, engine_request, in_trace, wait_for_turn
from tests.schema import assert_valid

pytestmark = pytest.mark.fleet

TTL_S = 36.0
"""Long enough for the turns that must pull: on a loaded 2-core machine a read of an idle
engine's KV has stalled up to 30 s (the prefill lease), and vLLM declines a read from 5 s
before the deadline (a CI run failed a 0.6 s-gap turn at TTL 14 s)."""
TOOL_PAUSE_S = 1.2
APP_PAUSE_S = 0.8

AGENT = Conversation(
    "conv-agent",
    [
        Turn("find the failing test in the build log", 64),
        Turn("test_cache fails with timeout after 30 seconds", 64, pause_s=TOOL_PAUSE_S, tool="read_log"),
        Turn("now write the fix", 48, pause_s=APP_PAUSE_S),
    ],
)
LAPSE = Conversation(
    "conv-lapse",
    [Turn("plan the release of version two", 64), Turn("tests green", 32, pause_s=TTL_S + 2.0, tool="ci")],
)
ANONYMOUS = Conversation(
    "conv-anonymous",
    [Turn("list the open pull requests", 64), Turn("three open", 48, pause_s=0.6, tool="github")],
    send_conversation_id=False,
)
STREAMED = Conversation(
    "conv-streamed",
    [Turn("explain the cache design", 64), Turn("shorter please", 48, pause_s=0.5)],
    stream=True,
)


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    config = FleetConfig(decoder_ttl_s=TTL_S, router_handle_ttl_s=TTL_S - 6.0, sidecar=True)
    yield from fleet_fixture(config, request)


@pytest.fixture(scope="module")
def results(fleet: Fleet) -> dict[str, list[TurnResult]]:
    traced = fleet.driver()
    untraced = fleet.driver(traced=False)  # sends no agent spans: the sidecar uses the messages

    async def own_client(driver: AgentDriver, conversation: Conversation) -> list[TurnResult]:
        async with aiohttp.ClientSession() as session:  # each agent its own connections
            return await driver.run(conversation, session)

    async def main() -> list[list[TurnResult]]:
        return list(
            await asyncio.gather(
                own_client(traced, AGENT), own_client(traced, LAPSE), own_client(untraced, ANONYMOUS)
            )
        )

    runs = asyncio.run(main())
    # A router whose decode leg streams (vLLM 0.32.0 then returns no kv_transfer_params).
    assert fleet.router is not None
    fleet.router.stream_decode = True
    try:
        (streamed,) = traced.run_sync([STREAMED])
    finally:
        fleet.router.stream_decode = False
    out = {c.conversation_id: r for c, r in zip([AGENT, LAPSE, ANONYMOUS], runs, strict=True)}
    out[STREAMED.conversation_id] = streamed
    for conversation, turns in out.items():
        if conversation != LAPSE.conversation_id:
            assert all(t.ok for t in turns), ([(t.status, t.error) for t in turns], fleet.engine_log_lines())
    return out


def turn_span(fleet: Fleet, trace_id: str) -> SpanRecord:
    assert fleet.sink is not None
    spans = wait_for_turn(fleet.sink, trace_id)
    (span,) = [s for s in spans if s.scope_name == names.SCOPE_SIDECAR]
    return span


def stored(fleet: Fleet) -> StoreSource:
    fleet.flush_store()
    assert fleet.sidecar is not None
    return StoreSource(fleet.sidecar.store)


def test_one_trace_per_turn_from_sidecar_to_engines(
    fleet: Fleet, results: dict[str, list[TurnResult]]
) -> None:
    turn = results["conv-agent"][1]
    assert fleet.sink is not None
    wait_for_turn(fleet.sink, turn.trace_id)
    assert fleet.sidecar is not None
    spans = queries.trace_spans(stored(fleet).store, [turn.trace_id])
    assert {s.trace_id for s in spans} == {turn.trace_id}
    (sidecar,) = [s for s in spans if s.scope_name == names.SCOPE_SIDECAR]
    (router,) = [s for s in spans if s.name == "router chat"]
    assert router.parent_span_id == sidecar.span_id
    assert sidecar.name == "chat tiny-llama"
    prefill = engine_request(spans, names.ROLE_PREFILL)
    decode = engine_request(spans, names.ROLE_DECODE)
    legs = {s.span_id: s.name for s in spans if s.parent_span_id == router.span_id}
    assert legs[prefill.parent_span_id] == "router_leg prefill"
    assert legs[decode.parent_span_id] == "router_leg decode"
    (pull,) = children(spans, prefill, "kv_transfer")
    assert pull.name == "kv_transfer D->P" and int(pull.attributes[names.TRANSFER_BYTES]) > 0
    (push,) = children(spans, decode, "kv_transfer")
    assert push.name == "kv_transfer P->D"
    a = sidecar.attributes  # read back from the store: every value is a string
    assert a[names.GEN_AI_CONVERSATION_ID] == "conv-agent"
    assert a[names.TURN_INDEX] == "1"
    assert prefill.attributes[names.GEN_AI_CONVERSATION_ID] == "conv-agent"  # X-Session-ID reached vLLM
    phases = [
        float(a[k])
        for k in (
            names.TURN_INPUT_PROCESSING_SECONDS,
            names.TURN_GENERATION_SECONDS,
            names.TURN_TOOL_WAIT_SECONDS,
            names.TURN_APP_WORK_SECONDS,
        )
    ]
    assert sum(phases) == pytest.approx(float(a[names.TURN_TOTAL_SECONDS]), abs=1e-6)


def test_gap_split_from_agent_spans_and_from_messages(
    fleet: Fleet, results: dict[str, list[TurnResult]]
) -> None:
    tool_turn, app_turn = results["conv-agent"][1], results["conv-agent"][2]
    a = turn_span(fleet, tool_turn.trace_id).attributes
    assert a[names.TURN_GAP_SOURCE] == names.GAP_SOURCE_AGENT_SPANS
    # Tool wait is what the agent's own execute_tool span measured (the sleep it wraps can
    # overrun on a busy machine, so compare with the span, not with the configured pause).
    assert fleet.sink is not None
    (tool,) = fleet.sink.spans(
        lambda s: (
            s.name == "execute_tool read_log"
            and s.attributes.get(names.GEN_AI_CONVERSATION_ID) == "conv-agent"
        )
    )
    assert tool.duration_s >= slept(TOOL_PAUSE_S)
    assert a[names.TURN_TOOL_WAIT_SECONDS] == pytest.approx(tool.duration_s, abs=0.01)
    assert a[names.TURN_APP_WORK_SECONDS] == pytest.approx(
        a[names.TURN_GAP_SECONDS] - a[names.TURN_TOOL_WAIT_SECONDS]
    )
    b = turn_span(fleet, app_turn.trace_id).attributes
    assert b[names.TURN_TOOL_WAIT_SECONDS] == 0.0
    assert b[names.TURN_APP_WORK_SECONDS] >= slept(APP_PAUSE_S)
    # Without agent spans, the tool result in the request makes the whole gap tool wait.
    c = turn_span(fleet, results["conv-anonymous"][1].trace_id).attributes
    assert c[names.TURN_GAP_SOURCE] == names.GAP_SOURCE_MESSAGES
    assert c[names.TURN_TOOL_WAIT_SECONDS] == c[names.TURN_GAP_SECONDS] >= slept(0.6)
    # The conversation waterfall shows the same split.
    waterfall = assert_valid(report.conversation(stored(fleet), "conv-agent"))
    assert [row["turn_index"] for row in waterfall["turns"]] == [0, 1, 2]
    row = waterfall["turns"][1]
    assert row["phases"][f"{names.PHASE_TOOL_WAIT}_s"] == pytest.approx(tool.duration_s, abs=0.01)


def test_why_names_the_ttl_lapse_with_gap_and_ttl(fleet: Fleet, results: dict[str, list[TurnResult]]) -> None:
    first, second = results["conv-lapse"]
    assert fleet.sink is not None
    # The first turn's retention ends (expired) before the second turn starts.
    decode = engine_request(wait_for_turn(fleet.sink, first.trace_id), names.ROLE_DECODE)
    spans = in_trace(fleet.sink.wait_for(lambda s: bool(children(s, decode, "kv_retention"))), first.trace_id)
    (retention,) = children(spans, decode, "kv_retention")
    assert retention.attributes[names.RETENTION_OUTCOME] == names.RETENTION_EXPIRED
    turn_span(fleet, second.trace_id)
    answer = assert_valid(report.why(stored(fleet), "conv-lapse#1"))["turn"]
    by_id = {d["id"]: d for d in answer["diagnoses"]}
    assert names.DIAG_TTL_LAPSED in by_id, answer["diagnoses"]
    evidence = by_id[names.DIAG_TTL_LAPSED]["evidence"]
    # The gap on the client's own clock (its kernel's last receive and next send).
    assert second.sent_kernel_unix is not None and first.done_kernel_unix is not None
    client_gap = second.sent_kernel_unix - first.done_kernel_unix
    assert client_gap >= TTL_S + 2.0
    assert evidence["gap_s"] == pytest.approx(client_gap, abs=0.1)
    assert evidence["decoder_kv_blocks_ttl_s"] == TTL_S
    assert evidence["over_by_s"] == pytest.approx(client_gap - TTL_S, abs=0.1)
    assert evidence["previous_retention_outcome"] == names.RETENTION_EXPIRED
    assert evidence["previous_retention_held_s"] == pytest.approx(TTL_S, abs=1.0)  # held its TTL, then freed
    assert evidence["router_handle"] == names.ROUTER_HANDLE_STALE  # the router's 30 s had passed too
    cached = answer["prefill"]["tokens"]["local_cache"]
    assert evidence["tokens_recomputed"] == first.prompt_tokens + first.completion_tokens - cached
    summary = by_id[names.DIAG_TTL_LAPSED]["summary"]
    assert f"decoder_kv_blocks_ttl={TTL_S:g}s" in summary and "exceeded" in summary


def test_streaming_decode_leg_is_diagnosed_as_missing_handle(
    fleet: Fleet, results: dict[str, list[TurnResult]]
) -> None:
    first, second = results["conv-streamed"]
    turn_span(fleet, first.trace_id)
    assert (
        engine_request(wait_for_turn(fleet.sink, second.trace_id), names.ROLE_PREFILL).attributes[  # type: ignore[arg-type]
            names.PULL_REASON
        ]
        == names.REASON_NO_DECODE_HANDLE
    )
    answer = assert_valid(report.why(stored(fleet), second.trace_id))["turn"]
    found = {d["id"]: d for d in answer["diagnoses"]}
    assert names.DIAG_DECODE_NO_HANDLE in found, answer["diagnoses"]
    e = found[names.DIAG_DECODE_NO_HANDLE]["evidence"]
    # What the scenario did: the router streamed the first turn's decode leg.
    assert (e["decode_streamed"], e["decode_streamed_source"]) == (True, "router")
    assert e["turn_index"] == 1 and e["router_handle"] == names.ROUTER_HANDLE_MISS
    cached = answer["prefill"]["tokens"]["local_cache"]
    assert e["tokens_recomputed"] == first.prompt_tokens + first.completion_tokens - cached


def test_request_without_conversation_id_is_fingerprinted_and_diagnosed(
    fleet: Fleet, results: dict[str, list[TurnResult]]
) -> None:
    spans = [turn_span(fleet, t.trace_id) for t in results["conv-anonymous"]]
    ids = {s.attributes[names.GEN_AI_CONVERSATION_ID] for s in spans}
    assert len(ids) == 1 and next(iter(ids)).startswith("fp-")
    assert [s.attributes[names.TURN_INDEX] for s in spans] == [0, 1]
    assert all(s.attributes[names.CONVERSATION_INFERRED] is True for s in spans)
    answer = assert_valid(report.why(stored(fleet), results["conv-anonymous"][1].trace_id))["turn"]
    found = {d["id"]: d for d in answer["diagnoses"]}
    e = found[names.DIAG_NO_CONVERSATION_ID]["evidence"]
    assert (e["conversation_inferred"], e["conversation_id_source"]) == (True, "fingerprint")
    # The sidecar passed the fingerprint on as X-Session-ID, so the router still had a key
    # for the handle: nothing was recomputed for want of an id (only the edit risk is named).
    assert e["router_handle"] == names.ROUTER_HANDLE_HIT and e["tokens_recomputed"] == 0
    assert "inferred one from the message prefix" in found[names.DIAG_NO_CONVERSATION_ID]["summary"]


def test_cli_why_and_slow_through_the_sidecar_api(fleet: Fleet, results: dict[str, list[TurnResult]]) -> None:
    assert fleet.sidecar is not None
    turn_span(fleet, results["conv-lapse"][1].trace_id)
    fleet.flush_store()
    cli = [sys.executable, "-m", "otelkv.cli.main"]
    out = subprocess.run(
        [*cli, "why", "conv-lapse#1", "--sidecar", fleet.sidecar.admin_url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    why = assert_valid(json.loads(out.stdout))
    assert names.DIAG_TTL_LAPSED in [d["id"] for d in why["turn"]["diagnoses"]]
    out = subprocess.run(
        [*cli, "slow", "--since", "1h", "--limit", "3", "--sidecar", fleet.sidecar.admin_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "conv-lapse" in out.stdout  # the 12 s tool wait makes it the slowest turn
    # Every verb's JSON through the sidecar API, as real engines left it, fits the schema.
    for verb in (["slow", "--since", "1h"], ["conversation", "conv-lapse"], ["tune", "--since", "1h"]):
        done = subprocess.run(
            [*cli, *verb, "--sidecar", fleet.sidecar.admin_url, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert assert_valid(json.loads(done.stdout))["kind"] == verb[0]


def test_sidecar_metrics_count_turns_and_kv_reuse(fleet: Fleet, results: dict[str, list[TurnResult]]) -> None:
    import urllib.request

    assert fleet.sidecar is not None
    turn_span(fleet, results["conv-agent"][2].trace_id)
    text = urllib.request.urlopen(f"{fleet.sidecar.admin_url}/metrics", timeout=10).read().decode()
    assert 'otelkv_turn_phase_seconds_count{model_name="tiny-llama",phase="tool_wait"}' in text
    assert 'otelkv_trace_pull_decisions_total{decision="pull",reason="pulled"}' in text
    assert "otelkv_trace_kv_transfer_bytes_total" in text
    assert "conv-agent" not in text  # conversation ids never become labels


# ---------------------------------------------------------------------- history and identity
#
# What agents do to their histories, played against the real fleet through the sidecar, and
# what `otelkv why` makes of what the sidecar and the engines recorded. Every check compares
# with what the scenario did: the message it rewrote, the ids it used, its own clock.

SYSTEM = {"role": "system", "content": "you are a helpful agent"}


def _text(seed: int, n: int) -> str:
    """``n`` words of the tiny model's vocabulary (one token each), different for each seed."""
    vocab = "cache block token engine prefill decode request memory answer tool plan search".split()
    return " ".join(vocab[(seed * 5 + i * (seed + 2)) % len(vocab)] for i in range(n))


@dataclass
class Sent:
    """One request as the client made it: its trace, answer, usage and its own clock."""

    trace_id: str
    text: str
    usage: dict[str, int]
    sent_at: float
    done_at: float


def _send(fleet: Fleet, conversation: str, messages: list[dict[str, Any]], *, stream: bool = False) -> Sent:
    """A chat request through the sidecar, with the client's own trace id (the turn's trace)."""
    import urllib.request

    trace_id = secrets.token_hex(16)
    body: dict[str, Any] = {
        "model": "tiny-llama",
        "messages": messages,
        "max_tokens": 12,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(
        fleet.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "X-Conversation-Id": conversation,
            "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01",
        },
    )
    sent_at = time.time()
    with urllib.request.urlopen(request, timeout=120) as resp:
        raw = resp.read()
    done_at = time.time()
    if not stream:
        data = json.loads(raw)
        return Sent(trace_id, data["choices"][0]["message"]["content"] or "", data["usage"], sent_at, done_at)
    parts, usage = [], {}
    for line in raw.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            chunk = json.loads(line[5:])
            parts += [(c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", [])]
            usage = chunk.get("usage") or usage
    return Sent(trace_id, "".join(parts), usage, sent_at, done_at)


@pytest.fixture(scope="module")
def agents_edit_histories(fleet: Fleet, results: dict[str, list[TurnResult]]) -> dict[str, Any]:
    """Four small scenarios, one after the other (a few seconds in all)."""
    out: dict[str, Any] = {}
    # 1. A rewritten history: the agent edits its second message (a compaction would too).
    context, task = {"role": "user", "content": _text(1, 90)}, {"role": "user", "content": _text(2, 60)}
    first = [SYSTEM, context, task]
    a0 = _send(fleet, "conv-rewrite", first)
    edited = {"role": "user", "content": _text(3, 60)}
    rewritten = [
        SYSTEM,
        context,
        edited,
        {"role": "assistant", "content": a0.text},
        {"role": "user", "content": "now"},
    ]
    out["rewrite"] = (first, rewritten, _send(fleet, "conv-rewrite", rewritten))
    # 2. A re-rendered answer: the app keeps only the first half of the (streamed) answer.
    ask = [SYSTEM, {"role": "user", "content": _text(4, 90)}]
    b0 = _send(fleet, "conv-trim", ask, stream=True)
    words = b0.text.split()
    assert len(words) >= 2, b0.text  # something to cut
    trimmed = " ".join(words[: len(words) // 2])
    follow = [*ask, {"role": "assistant", "content": trimmed}, {"role": "user", "content": _text(5, 30)}]
    out["trim"] = (ask, follow, _send(fleet, "conv-trim", follow, stream=True))
    # 3. The same conversation resumed under a new id 2 s later, decode KV still held.
    start = [SYSTEM, {"role": "user", "content": _text(6, 90)}]
    c0 = _send(fleet, "conv-resume-old", start)
    time.sleep(2.0)
    resumed = [*start, {"role": "assistant", "content": c0.text}, {"role": "user", "content": _text(7, 30)}]
    out["resume"] = (c0, resumed, _send(fleet, "conv-resume-new", resumed))
    # 4. One id reused for an unrelated conversation (the same system prompt).
    release = [SYSTEM, {"role": "user", "content": _text(8, 90)}]
    d0 = _send(fleet, "conv-reuse", release)
    unrelated = [SYSTEM, {"role": "user", "content": _text(9, 90)}]
    out["reuse"] = (d0, release, _send(fleet, "conv-reuse", unrelated))
    return out


def _why(fleet: Fleet, trace_id: str) -> dict[str, Any]:
    """``otelkv why`` of a turn once its sidecar and engine spans are all in the store."""
    turn_span(fleet, trace_id)
    return assert_valid(report.why(stored(fleet), trace_id))["turn"]  # type: ignore[no-any-return]


def test_why_names_the_rewritten_message(fleet: Fleet, agents_edit_histories: dict[str, Any]) -> None:
    first, rewritten, sent = agents_edit_histories["rewrite"]
    changed = next(i for i, (a, b) in enumerate(zip(first, rewritten, strict=False)) if a != b)
    turn = _why(fleet, sent.trace_id)
    assert turn["history"]["rewritten_at"] == changed == 2
    found = {d["id"]: d for d in turn["diagnoses"]}
    d = found[names.DIAG_HISTORY_REWRITTEN]
    assert (d["evidence"]["message_index"], d["evidence"]["previous_messages"]) == (changed, len(first))
    assert names.DIAG_ID_REUSED not in found
    # Observe mode: the prefill node loaded the old KV. One headline, the cause right after it.
    assert [x["id"] for x in turn["diagnoses"][:2]] == [names.DIAG_KV_FOR_OTHER_TOKENS, d["id"]]
    assert d["cost_s"] == 0.0 and d["evidence"]["kv_loaded_for_other_tokens"] is True
    # The engine's digest check places the mismatch in the earlier history, as the edit did.
    assert turn["prefill"]["continuity"]["mismatch_in"] == names.CONTINUITY_IN_HISTORY


def test_why_names_the_answer_sent_back_changed(fleet: Fleet, agents_edit_histories: dict[str, Any]) -> None:
    _, follow, sent = agents_edit_histories["trim"]
    turn = _why(fleet, sent.trace_id)
    d = {d["id"]: d for d in turn["diagnoses"]}[names.DIAG_ANSWER_RE_RENDERED]
    where = next(i for i, m in enumerate(follow) if m["role"] == "assistant")  # where the scenario put it
    assert d["evidence"]["answer_message_index"] == where
    assert d["evidence"]["previous_answer"] == names.PREVIOUS_ANSWER_CONTENT_DIFFERS  # it cut the text
    assert turn["prefill"]["continuity"]["mismatch_in"] == names.CONTINUITY_IN_ANSWER
    if d["evidence"]["kv_loaded_for_other_tokens"]:
        assert 0 < d["evidence"]["share_of_pulled"] <= 1 and d["cost_s"] == 0.0


def test_why_names_both_ids_of_a_conversation_resumed_under_a_new_one(
    fleet: Fleet, agents_edit_histories: dict[str, Any]
) -> None:
    old, resumed, sent = agents_edit_histories["resume"]
    turn = _why(fleet, sent.trace_id)
    d = {d["id"]: d for d in turn["diagnoses"]}[names.DIAG_ID_CHANGED_ON_RESUME]
    e = d["evidence"]
    assert (e["conversation_id"], e["previous_conversation_id"]) == ("conv-resume-new", "conv-resume-old")
    assert e["previous_trace_id"] == old.trace_id
    assert e["repeated_messages"] == len(resumed) - 1
    assert e["previous_tokens"] == old.usage["prompt_tokens"] + old.usage["completion_tokens"]
    client_gap = sent.sent_at - old.done_at  # the client's clock: at least the 2 s it waited
    # The sidecar stamps the end after its last write: a descheduled proxy makes its gap shorter.
    assert client_gap - 0.5 <= e["gap_s"] <= client_gap + 0.5, (e["gap_s"], client_gap)
    assert e["decoder_kv_blocks_ttl_s"] == TTL_S
    assert e["ttl_left_s"] == pytest.approx(TTL_S - client_gap, abs=0.5) and e["ttl_left_s"] > 0
    # The router had no handle under the new id: prefill recomputed what decode still held.
    assert turn["prefill"]["reason"] == names.REASON_NO_DECODE_HANDLE
    assert e["tokens_recomputed"] > 0 and d["cost_s"] > 0


def test_why_names_an_id_reused_for_another_conversation(
    fleet: Fleet, agents_edit_histories: dict[str, Any]
) -> None:
    first, release, sent = agents_edit_histories["reuse"]
    turn = _why(fleet, sent.trace_id)
    found = {d["id"]: d for d in turn["diagnoses"]}
    d = found[names.DIAG_ID_REUSED]
    assert d["evidence"]["conversation_id"] == "conv-reuse"
    assert d["evidence"]["previous_trace_id"] == first.trace_id
    assert d["evidence"]["previous_messages"] == len(release)
    assert names.DIAG_HISTORY_REWRITTEN not in found  # a reused id is not a rewritten history
    # Observe mode: the old conversation's KV was loaded; the cause follows the failure.
    assert [x["id"] for x in turn["diagnoses"][:2]] == [names.DIAG_KV_FOR_OTHER_TOKENS, d["id"]]


# ---------------------------------------------------------------------- byte-for-byte


class RecordingRelay:
    """A TCP relay that keeps every byte the upstream sent back (what the sidecar received)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.from_upstream = bytearray()
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, record: bool) -> None:
            while data := await src.read(65536):
                if record:
                    self.from_upstream += data
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(
            pipe(reader, up_writer, False), pipe(up_reader, writer, True), return_exceptions=True
        )


def http_body(raw: bytes) -> bytes:
    head, _, rest = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return rest
    body = bytearray()
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2 :]
    return bytes(body)


def test_streamed_bytes_reach_the_client_exactly_as_the_router_sent_them(fleet: Fleet) -> None:
    assert fleet.router is not None
    relay = RecordingRelay(fleet.router.port)
    config = SidecarConfig(upstream=f"http://127.0.0.1:{relay.port}", port=0, admin_port=0, store=False)
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "stream me a few tokens, ünïcode ✓"}],
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def fetch(url: str) -> bytes:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{url}/v1/chat/completions", json=body, headers={"X-Conversation-Id": "conv-bytes"}
            ) as resp,
        ):
            assert resp.status == 200
            return await resp.read()

    with Sidecar(config) as sidecar:
        received = asyncio.run(fetch(sidecar.url))
    assert received.startswith(b"data: ") and received.rstrip().endswith(b"data: [DONE]")
    assert received == http_body(bytes(relay.from_upstream))


def _kill_tree(pid: int) -> None:
    """SIGKILL an engine: its API server and the engine core and worker that hold the KV."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    for proc in procs:
        proc.kill()
    psutil.wait_procs(procs, timeout=15)


def test_doctor_passes_every_prerequisite_behind_the_reference_router(
    fleet: Fleet, results: dict[str, list[TurnResult]]
) -> None:
    """The reference router forwards identity and handles (digest included), calls decode
    non-streaming and keeps handles shorter than the decode TTL: every check passes. Checked
    over a window of its own (the earlier scenarios lapse and stream on purpose), through the
    CLI, which reads the engines' /metrics itself."""
    assert fleet.sidecar is not None and fleet.prefill is not None and fleet.decode is not None
    clean = Conversation(
        "conv-clean",
        [Turn("check the deploy status", 64), Turn("roll back the canary", 48, pause_s=0.5)],
    )
    # The sidecar dates a turn by the kernel's receive time, good to a jiffy (up to 10 ms), so
    # a turn may start just before the client's clock read: the window reaches 0.1 s beyond
    # this conversation's requests and the earlier scenarios' traffic ended 0.3 s before it.
    time.sleep(0.3)
    since = time.time_ns() - 100_000_000
    (run,) = fleet.driver().run_sync([clean])
    assert all(t.ok for t in run), [(t.status, t.error) for t in run]
    for turn in run:
        turn_span(fleet, turn.trace_id)
    fleet.flush_store()
    until = time.time_ns() + 100_000_000
    window = ["--since", iso(since), "--until", iso(until)]  # this conversation's alone
    cli = [sys.executable, "-m", "otelkv.cli.main", "doctor", "--sidecar", fleet.sidecar.admin_url, *window]
    cli += ["--engine", fleet.prefill.url, "--engine", fleet.decode.url]
    done = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=120)
    answer = assert_valid(json.loads(done.stdout)) if done.stdout else {"checks": []}
    assert done.returncode == 0, (
        done.stderr,
        [(c["id"], c["status"], c["summary"]) for c in answer["checks"]],
    )
    assert answer["turn_count"] == len(clean.turns), answer["turn_count"]
    status = {c["id"]: c["status"] for c in answer["checks"]}
    assert set(status.values()) == {names.CHECK_PASS}, answer["checks"]
    continuity = {c["id"]: c for c in answer["checks"]}[names.CHECK_CONTINUITY]["evidence"]
    assert continuity["handles"] == continuity["with_digest"] == 1  # turn 1's handle, digest and all
    ttl = {c["id"]: c for c in answer["checks"]}[names.CHECK_ROUTER_TTL]["evidence"]
    assert ttl == {
        "router_handle_ttl_s": TTL_S - 6.0,
        "from": "router spans",
        "decoder_kv_blocks_ttl_s": TTL_S,
    }
    text = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "verdict: pass" in text.stdout, text.stdout + text.stderr


def test_prefill_engine_killed_mid_hand_off(fleet: Fleet) -> None:
    """The prefill engine dies after answering and before the decode node reads its KV.

    The decode node's read fails; the client gets the fleet's own error through the
    sidecar (otelkv adds no failure of its own), the decode node's otelkv spans record the
    failed transfer, ``why`` names it, and the sidecar keeps relaying. Runs last in this
    module: the fleet has no prefill node afterwards.
    """
    assert fleet.router is not None and fleet.prefill is not None and fleet.sidecar is not None
    assert fleet.sink is not None and fleet.prefill.pid is not None
    router, prefill_pid = fleet.router, fleet.prefill.pid
    original = router._leg
    killed = threading.Event()

    async def leg(
        role: str, path: str, body: dict[str, Any], request_id: str, conversation_id: str | None
    ) -> Any:
        if role == names.ROLE_DECODE and not killed.is_set():
            await asyncio.to_thread(_kill_tree, prefill_pid)
            killed.set()
        return await original(role, path, body, request_id, conversation_id)

    router._leg = leg  # type: ignore[method-assign]
    try:
        conversation = Conversation("conv-killed", [Turn("this turn loses its prefill node halfway", 32)])
        (turns,) = fleet.driver(timeout_s=90.0).run_sync([conversation])
    finally:
        router._leg = original  # type: ignore[method-assign]
    (turn,) = turns
    assert killed.is_set()
    assert turn.status >= 500, (turn.status, turn.error)

    # The decode node recorded the failed read of the dead engine's KV.
    def decode_ended(spans: list[SpanRecord]) -> bool:
        return any(
            s.trace_id == turn.trace_id and s.name == names.engine_request_span_name(names.ROLE_DECODE)
            for s in spans
        )

    spans = in_trace(fleet.sink.wait_for(decode_ended, timeout=60), turn.trace_id)
    decode = engine_request(spans, names.ROLE_DECODE)
    assert decode.attributes[names.REQUEST_OUTCOME] != names.OUTCOME_FINISHED, decode.attributes
    transfers = children(spans, decode, "kv_transfer")
    assert transfers and transfers[0].attributes[names.TRANSFER_OUTCOME] != names.TRANSFER_OK, [
        t.attributes for t in transfers
    ]
    # The turn span (the prefill node's own spans may have died with it: not waited for).
    fleet.sink.wait_for(
        lambda spans: any(s.trace_id == turn.trace_id and s.scope_name == names.SCOPE_SIDECAR for s in spans),
        timeout=30,
    )
    answer = assert_valid(report.why(stored(fleet), turn.trace_id))["turn"]
    found = {d["id"]: d for d in answer["diagnoses"]}
    assert names.DIAG_TRANSFER_FAILED in found, answer["diagnoses"]
    e = found[names.DIAG_TRANSFER_FAILED]["evidence"]
    # What the scenario did: killed the prefill node before the decode node read its KV.
    assert (e["role"], e["direction"]) == (names.ROLE_DECODE, names.DIRECTION_P_TO_D)
    assert e["transfer_outcome"] == transfers[0].attributes[names.TRANSFER_OUTCOME] != names.TRANSFER_OK
    assert e["request_outcome"] != names.OUTCOME_FINISHED and e["kv_load_failure_policy"] == "fail"
    assert answer["diagnoses"][0]["id"] == names.DIAG_TRANSFER_FAILED  # a failure ranks first

    # The sidecar is unharmed: it still relays (the router's own health endpoint).
    async def health() -> int:
        async with aiohttp.ClientSession() as session, session.get(f"{fleet.url}/health") as resp:
            return resp.status

    assert asyncio.run(health()) == 200
    assert fleet.sidecar.proxy.returncode is None  # the proxy process still runs
