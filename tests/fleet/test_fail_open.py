"""Fail open, on a real fleet: otelkv raising at every one of its sites changes nothing.

Both engines run with ``OTELKV_FAULT_INJECT=all``: every guarded observer call raises.
The conversation must behave exactly as with vLLM's plain connector - reverse pulls
included, as vLLM's own counters show - while each error site is counted in
``otelkv_instrumentation_errors_total`` and logged once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from otelkv import names
from otelkv.fleet import metrics as prom
from otelkv.fleet.agent import Conversation, Turn
from otelkv.fleet.fleet import Fleet, FleetConfig
from tests.fleet.conftest import fleet_fixture

pytestmark = pytest.mark.fleet


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    config = FleetConfig(decoder_ttl_s=60.0, engine_env={names.ENV_FAULT_INJECT: "all"})
    yield from fleet_fixture(config, request)


def test_requests_and_pulls_go_on_while_every_observer_raises(fleet: Fleet) -> None:
    assert fleet.prefill is not None and fleet.decode is not None and fleet.sink is not None
    pulled_before = prom.total(fleet.prefill.metrics_text(), "vllm:nixl_bytes_transferred_sum")
    conversation = Conversation(
        "conv-faults",
        [
            Turn("what is the weather in paris today", 80),
            Turn("and tomorrow", 80, pause_s=0.5),
            Turn("thanks", 16),
        ],
    )
    (turns,) = fleet.driver().run_sync([conversation])
    assert [t.status for t in turns] == [200, 200, 200], [t.error for t in turns]
    assert all(t.completion_tokens == n for t, n in zip(turns, (80, 80, 16), strict=True))

    time.sleep(2.0)
    p_text, d_text = fleet.prefill.metrics_text(), fleet.decode.metrics_text()
    # vLLM itself still reverse-pulled: its own counters saw this conversation's D->P reads.
    assert prom.total(p_text, "vllm:nixl_bytes_transferred_sum") > pulled_before

    # Every failure was counted, per site, in vLLM's /metrics.
    p_errors = prom.by_label(p_text, "otelkv_instrumentation_errors_total", "site")
    d_errors = prom.by_label(d_text, "otelkv_instrumentation_errors_total", "site")
    for site in ("on_new_request", "get_num_new_matched_tokens", "request_finished", "build_connector_meta"):
        assert p_errors.get(site, 0) >= 3, p_errors
        assert d_errors.get(site, 0) >= 3, d_errors
    assert p_errors.get("worker.start_load_kv", 0) >= 1  # the worker side counts too

    # No otelkv span was exported (all recording failed), vLLM's own spans were.
    spans = fleet.sink.spans()
    assert not [s for s in spans if s.name.startswith(("kv_request", "kv_transfer", "kv_retention"))]
    assert [s for s in spans if s.name == "llm_request"]

    # Each site logged once, not once per call.
    log = fleet.prefill.log_path.read_text()
    logged = re.findall(r"otelkv: instrumentation error at (\S+);", log)
    assert logged and len(logged) == len(set(logged))
