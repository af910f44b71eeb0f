"""The named fleet scenarios: the same conversations on every run, pauses where the docs say."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from otelkv.fleet.model import VOCAB_WORDS
from otelkv.fleet.scenarios import SCENARIOS, ScenarioParams, build, parse_names

ROOT = Path(__file__).resolve().parents[2]
P = ScenarioParams(ttl_s=20.0)  # hand-off window 14 s, short pause 2 s, long pause 23 s


def _all(params: ScenarioParams = P) -> dict[str, list]:
    return dict(build(list(SCENARIOS), params))


def test_registry_names_and_docs() -> None:
    assert list(SCENARIOS) == [
        "agent-short-tools",
        "pause-beyond-ttl",
        "resumed",
        "no-reuse",
        "interrupted",
        "concurrent",
    ]
    for scenario in SCENARIOS.values():
        assert len(scenario.summary) > 20 and scenario.build.__doc__.count("\n") >= 3


def test_deterministic_and_ids_stable_across_processes() -> None:
    assert _all() == _all()
    # Another process with another hash salt builds the very same text and ids.
    code = (
        "from otelkv.fleet.scenarios import SCENARIOS, ScenarioParams, build;"
        "print(repr(build(list(SCENARIOS), ScenarioParams(ttl_s=20.0))))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == repr(build(list(SCENARIOS), P))
    # Another seed changes the text, not the ids or the shape.
    other = _all(ScenarioParams(ttl_s=20.0, seed=7))
    for name, convs in _all().items():
        assert [c.conversation_id for c in convs] == [c.conversation_id for c in other[name]]
        assert [len(c.turns) for c in convs] == [len(c.turns) for c in other[name]]
    assert other != _all()


def test_ids_unique_and_text_in_the_model_vocabulary() -> None:
    ids = [c.conversation_id for convs in _all().values() for c in convs]
    assert len(ids) == len(set(ids)) == 15
    vocab = set(VOCAB_WORDS)
    for convs in _all().values():
        for conv in convs:
            assert set(conv.system.split()) <= vocab
            for turn in conv.turns:
                assert turn.user and set(turn.user.split()) <= vocab


def test_params_derive_the_pauses() -> None:
    assert (P.window_s, P.short_pause_s, P.long_pause_s) == (14.0, 2.0, 23.0)
    small = ScenarioParams(ttl_s=8.0)
    assert (small.window_s, small.short_pause_s, small.long_pause_s) == (2.0, 0.5, 11.0)
    assert ScenarioParams(ttl_s=30.0, router_ttl_s=4.0).window_s == 4.0
    assert ScenarioParams(ttl_s=3.0).window_s == 1.0  # never below a second


def test_agent_short_tools() -> None:
    convs = _all()["agent-short-tools"]
    assert [c.conversation_id for c in convs] == ["agent-short-tools-0", "agent-short-tools-1"]
    for conv in convs:
        assert len(conv.turns) == 8 and conv.turns[0].pause_s == 0 and conv.turns[0].tool is None
        for turn in conv.turns[1:]:
            assert turn.tool and 1.0 <= turn.pause_s <= 2.0 < P.window_s
    tiny = build(["agent-short-tools"], ScenarioParams(ttl_s=8.0, scale=0.5))[0][1]
    assert len(tiny) == 1 and len(tiny[0].turns) == 4
    assert all(0.25 <= t.pause_s <= 0.5 for t in tiny[0].turns[1:])


def test_pause_beyond_ttl() -> None:
    for conv in _all()["pause-beyond-ttl"]:
        pauses = [t.pause_s for t in conv.turns]
        assert pauses[0] == 0 and pauses[1] <= 2.0 and pauses[2] == 23.0 and pauses[3] <= 2.0
        assert conv.turns[2].tool and conv.turns[3].tool is None  # the last gap is app work


def test_resumed() -> None:
    main, other = _all()["resumed"]
    assert (main.conversation_id, other.conversation_id) == ("resumed-0", "resumed-0-other")
    assert main.turns[2].pause_s == pytest.approx(0.6 * 14.0) and main.turns[2].tool is None
    assert other.turns[0].pause_s == pytest.approx(4.5)  # two short pauses + 0.5 s
    assert len(main.turns) == 4 and len(other.turns) == 3


def test_no_reuse() -> None:
    convs = _all()["no-reuse"]
    assert len(convs) == 4 and all(len(c.turns) == 1 for c in convs)
    assert [c.turns[0].pause_s for c in convs] == [0.0, 0.5, 1.0, 1.5]
    assert len({c.system for c in convs}) == 4


def test_interrupted() -> None:
    (conv,) = _all()["interrupted"]
    assert conv.stream and [t.interrupt_after for t in conv.turns] == [None, 1, None, None]


def test_concurrent_and_scale() -> None:
    assert [c.turns[0].pause_s for c in _all()["concurrent"]] == [0.0, 0.2, 0.4, 0.6]
    assert len(build(["concurrent"], ScenarioParams(scale=0.1))[0][1]) == 2
    assert len(build(["no-reuse"], ScenarioParams(scale=2))[0][1]) == 8


def test_parse_names() -> None:
    assert parse_names("resumed, no-reuse,resumed") == ["resumed", "no-reuse"]
    with pytest.raises(ValueError, match="unknown scenario nope; known: agent-short-tools"):
        parse_names("resumed,nope")
    with pytest.raises(ValueError, match="unknown scenario"):
        parse_names(" , ")
