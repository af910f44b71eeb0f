"""Bidirectional transfer off on a real fleet: no pulls, the missing handle is on record.

The same fleet then shows a one-sided misconfiguration: a router that sends a decode
handle to a prefill node without ``bidirectional_kv_xfer``. vLLM 0.32.0 reports the
tokens as loadable but never reads them, and the request waits for remote KV forever;
otelkv reports it as stuck once ``otelkv_stuck_after_s`` has passed.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from otelkv import names
from otelkv.analysis import report
from otelkv.analysis.sources import InMemorySource
from otelkv.fleet import metrics as prom
from otelkv.fleet.agent import Conversation, Turn, TurnResult
from otelkv.fleet.fleet import Fleet, FleetConfig
from tests.fleet.conftest import fleet_fixture
from tests.fleet.spans import children, engine_request, wait_for_turn
from tests.schema import assert_valid

pytestmark = pytest.mark.fleet

STUCK_AFTER_S = 4.0
BLOCK_TOKENS = 32
"""The fleet's KV block size: the prefill node's prefix cache holds whole blocks."""

CONVERSATION = Conversation(
    "conv-off",
    [
        Turn("what is the weather in paris today", 80),
        Turn("and tomorrow", 80, pause_s=0.5),
        Turn("thanks", 32, pause_s=0.5),
    ],
)


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    config = FleetConfig(bidirectional=False, decoder_ttl_s=30.0, stuck_after_s=STUCK_AFTER_S)
    yield from fleet_fixture(config, request)


@pytest.fixture(scope="module")
def turns(fleet: Fleet) -> list[TurnResult]:
    (run,) = fleet.driver().run_sync([CONVERSATION])
    return run


def test_no_pulls_and_no_decode_handle(fleet: Fleet, turns: list[TurnResult]) -> None:
    assert [t.status for t in turns] == [200, 200, 200]
    assert fleet.sink is not None and fleet.router is not None
    for turn in turns:
        spans = wait_for_turn(fleet.sink, turn.trace_id)
        prefill = engine_request(spans, names.ROLE_PREFILL)
        decode = engine_request(spans, names.ROLE_DECODE)
        p, d = prefill.attributes, decode.attributes
        assert (p[names.PULL_DECISION], p[names.PULL_REASON]) == (
            names.DECISION_RECOMPUTE,
            names.REASON_NO_DECODE_HANDLE,
        )
        assert p[names.TOKENS_PULLED] == 0
        assert prefill.resource[names.BIDIRECTIONAL_KV_XFER] is False
        assert decode.resource[names.BIDIRECTIONAL_KV_XFER] is False
        # The decode node handed back no kv_transfer_params, so the router had nothing to keep.
        assert d[names.KV_PARAMS_RETURNED] is False
        assert children(spans, decode, "kv_retention") == []
        assert children(spans, prefill, "kv_transfer") == []
        # Ordinary P/D still works: decode read the prompt from prefill.
        (read,) = children(spans, decode, "kv_transfer")
        assert read.name == "kv_transfer P->D" and read.attributes[names.TRANSFER_BYTES] > 0
        router = next(s for s in spans if s.name.startswith("router chat"))
        assert router.attributes[names.ROUTER_HANDLE] == names.ROUTER_HANDLE_MISS
    assert fleet.router.stats.handles_stored == 0


def test_why_names_bidirectional_off_with_both_sides_and_the_recomputed_tokens(
    fleet: Fleet, turns: list[TurnResult]
) -> None:
    """What ``otelkv why`` says of the later turns: bidirectional_off, from the engines' own
    config, with the tokens the prefill node recomputed: the client's prompt (its usage) less
    the whole blocks its prefix cache held. (Without the sidecar nothing links a turn to its
    predecessor, so what the decode node held is not known here.)"""
    assert fleet.sink is not None
    for turn in turns:
        wait_for_turn(fleet.sink, turn.trace_id)
    time.sleep(0.5)  # the router's and driver's spans are exported every 0.2 s
    source = InMemorySource(fleet.sink.spans())
    for previous, turn in itertools.pairwise(turns):
        assert previous.ok
        answer = assert_valid(report.why(source, turn.trace_id))["turn"]
        found = {d["id"]: d for d in answer["diagnoses"]}
        assert names.DIAG_BIDIRECTIONAL_OFF in found, answer["diagnoses"]
        e = found[names.DIAG_BIDIRECTIONAL_OFF]["evidence"]
        assert e["prefill_bidirectional_kv_xfer"] is False and e["decode_bidirectional_kv_xfer"] is False
        assert e["pull_reason"] == names.REASON_NO_DECODE_HANDLE
        cached = answer["prefill"]["tokens"]["local_cache"]
        assert cached == previous.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
        assert e["tokens_recomputed"] == turn.prompt_tokens - cached, (turn.prompt_tokens, cached, e)
        # Not blamed on the decode node's missing handle: that is what "off" means.
        assert names.DIAG_DECODE_NO_HANDLE not in found


def test_metrics_show_no_pulls(fleet: Fleet, turns: list[TurnResult]) -> None:
    assert fleet.prefill is not None and fleet.decode is not None
    time.sleep(1.0)
    p_text = fleet.prefill.metrics_text()
    decisions = prom.by_label(p_text, "otelkv_pull_decisions_total", "reason")
    assert decisions == {names.REASON_NO_DECODE_HANDLE: len(turns) + len(fleet.warmup_turns)}
    assert prom.total(p_text, "otelkv_kv_transfer_bytes_total") == 0
    assert prom.total(fleet.decode.metrics_text(), "otelkv_kv_retentions_total", {"kind": "decode_ttl"}) == 0


def test_handle_sent_to_a_prefill_node_without_bidirectional_is_reported_stuck(fleet: Fleet) -> None:
    assert fleet.prefill is not None and fleet.sink is not None
    trace_id = "5" * 32
    handle = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "decode-0",
        "remote_request_id": "chatcmpl-made-up-12345678",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_num_tokens": 96,
    }
    body = {
        "model": "tiny-llama",
        "prompt": " ".join(["token"] * 100),
        "max_tokens": 1,
        "kv_transfer_params": handle,
    }
    request = urllib.request.Request(
        f"{fleet.prefill.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "traceparent": f"00-{trace_id}-{'6' * 16}-01",
            "X-Session-ID": "conv-misrouted",
        },
    )
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        urllib.request.urlopen(request, timeout=STUCK_AFTER_S + 4)  # never answers: vLLM waits forever

    spans = fleet.sink.wait_for(
        lambda all_: any(s.trace_id == trace_id and s.name == "kv_request prefill" for s in all_), timeout=30
    )
    prefill = engine_request([s for s in spans if s.trace_id == trace_id], names.ROLE_PREFILL)
    p = prefill.attributes
    assert (p[names.PULL_DECISION], p[names.PULL_REASON]) == (
        names.DECISION_PULL,
        names.REASON_BIDIRECTIONAL_OFF,
    )
    assert p[names.REQUEST_OUTCOME] == names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV
    assert p[names.REMOTE_KV_WAIT_SECONDS] >= STUCK_AFTER_S
    assert prefill.status_code == "Error" and "WAITING_FOR_REMOTE_KVS" in prefill.status_message
    (wait,) = children(spans, prefill, "kv_transfer")
    assert wait.attributes[names.TRANSFER_OUTCOME] == names.TRANSFER_STUCK

    # otelkv why names it, with the wait the engine reported, and ranks it first.
    answer = assert_valid(report.why(InMemorySource(spans), trace_id))["turn"]
    stuck = answer["diagnoses"][0]
    assert stuck["id"] == names.DIAG_STUCK_WAITING_FOR_REMOTE_KV, answer["diagnoses"]
    assert stuck["evidence"]["role"] == names.ROLE_PREFILL
    assert stuck["evidence"]["transfer_outcome"] == names.TRANSFER_STUCK
    # otelkv_stuck_after_s is what the scenario set; the request was still waiting then.
    assert STUCK_AFTER_S <= stuck["evidence"]["remote_kv_wait_s"] <= STUCK_AFTER_S + 2.0
    assert names.DIAG_BIDIRECTIONAL_OFF in {d["id"] for d in answer["diagnoses"]}

    # The engine keeps serving other requests.
    ok = urllib.request.Request(
        f"{fleet.prefill.url}/v1/completions",
        data=json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(ok, timeout=60) as resp:
        assert resp.status == 200
