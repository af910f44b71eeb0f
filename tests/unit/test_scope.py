"""The one rule of which turns count (:mod:`otelkv.analysis.scope`): the reference fleet's
warm-up conversation counts in no view over a window, and every verb counts the same turns."""

from __future__ import annotations

from typing import Any

import pytest

from otelkv import names
from otelkv.analysis import scope
from otelkv.analysis.compare.rows import load_run
from otelkv.analysis.doctor import doctor
from otelkv.analysis.report import conversation, slow, why
from otelkv.analysis.sources import InMemorySource
from otelkv.analysis.tune.window import tune
from otelkv.spans import SpanRecord
from tests.unit.test_diagnose import stored, turn_trace
from tests.unit.test_report import lapse_conversation, quick_conversation

WARMUP = names.FLEET_WARMUP_CONVERSATION
AGENT_TURNS = 5
"""conv-lapse (3 turns) and conv-quick (2): the turns the agents sent."""


def warmup_conversation() -> list[SpanRecord]:
    """The fleet's two warm-up turns, each slower (30 s) than any agent turn (21 s at most)."""
    t0 = turn_trace(WARMUP, 0, start_s=10.0, request_s=30.0)
    t1 = turn_trace(WARMUP, 1, start_s=41.0, gap_s=1.0, request_s=30.0, prev_trace=t0[0].trace_id)
    return t0 + t1


def test_the_rule() -> None:
    assert not scope.counted(WARMUP)
    assert scope.counted("conv-1") and scope.counted("") and scope.counted(None)


@pytest.mark.parametrize("form", [lambda s: s, stored], ids=["native", "stored"])
def test_every_verb_counts_the_same_turns(form: Any) -> None:
    source = InMemorySource(form(warmup_conversation() + lapse_conversation() + quick_conversation()))
    # The warm-up turns are the slowest: `slow` must still fill its limit with agent turns.
    top = slow(source, limit=2)["turns"]
    assert [(t["conversation_id"], t["turn_index"]) for t in top] == [("conv-lapse", 1), ("conv-lapse", 2)]
    assert len(slow(source, limit=50)["turns"]) == AGENT_TURNS
    assert tune(source, since_ns=None, until_ns=None)["window"]["turns"] == AGENT_TURNS
    assert doctor(source, since_ns=None, until_ns=None)["turn_count"] == AGENT_TURNS
    run = load_run(source, label="A", where="memory").summary()
    assert run["turns"] == AGENT_TURNS and run["warmup_turns_left_out"] == 2
    # Asked for by name, the warm-up still answers.
    assert conversation(source, WARMUP)["turn_count"] == 2
    assert why(source, f"{WARMUP}#1")["turn"]["conversation_id"] == WARMUP
