"""Every verb's ``--json`` answer, from real chDB stores through the CLI, fits the schema file.

The stores hold two recorded runs written by hand (the compare tests' runs); the real-engine
tests validate the same verbs on what real engines recorded (``tests/fleet``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from otelkv.analysis import turn_json
from tests.schema import assert_valid
from tests.unit.test_compare_cli import stores  # noqa: F401 - the fixture
from tests.unit.test_tune_cli import run_cli


def _json(*args: str) -> dict:
    done = run_cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_every_verb_answers_with_the_schema(stores: tuple[Path, Path]) -> None:  # noqa: F811
    on, off = (str(p) for p in stores)
    slow = assert_valid(_json("slow", "--since", "1d", "--store", on))
    assert slow["kind"] == "slow" and slow["turns"]
    conv = slow["turns"][0]["conversation_id"]
    conversation = assert_valid(_json("conversation", conv, "--store", on))
    assert [t["conversation_id"] for t in conversation["turns"]] == [conv] * conversation["turn_count"]
    why = assert_valid(_json("why", f"{conv}#1", "--store", on))
    assert why["turn"]["turn_index"] == 1
    assert assert_valid(_json("tune", "--since", "1d", "--store", on))["kind"] == "tune"
    compare = assert_valid(_json("compare", on, off))
    assert compare["regressions"]["turns"], "the runs differ: some turn must have regressed"
    # One turn object: the same turn reads the same in slow, conversation and why.
    same = next(t for t in conversation["turns"] if t["turn_index"] == 1)
    assert why["turn"] == same | {"offset_s": None}


def test_the_schema_rejects_what_it_should() -> None:
    """The validator is not vacuous: a renamed field, a bare diagnosis id and a local time fail."""
    from otelkv.analysis.model import Turn

    turn = turn_json.turn_object(Turn("a" * 32, "engine", start_ns=1, end_ns=2))
    good = turn_json.document("why", ref="x", per_token_compute_s=None, turn=turn)
    assert_valid(good)
    renamed = json.loads(json.dumps(good))
    renamed["turn"]["usage"]["local_hit"] = renamed["turn"]["usage"].pop("input_tokens")
    bare = json.loads(json.dumps(good))
    bare["turn"]["diagnoses"] = ["ttl_lapsed_during_gap"]
    local = json.loads(json.dumps(good))
    local["turn"]["start"] = "1970-01-01 00:00:00"
    for bad in (renamed, bare, local):
        with pytest.raises(AssertionError):
            assert_valid(bad)


def test_compare_sides_carry_the_turn_objects_values() -> None:
    """A compared turn's fields hold what the turn object says under the same names."""
    from otelkv.analysis.compare.rows import turn_row
    from otelkv.analysis.diagnose import diagnose
    from otelkv.analysis.linker import load_turns
    from otelkv.analysis.sources import InMemorySource
    from tests.unit.test_report import lapse_conversation

    source = InMemorySource(lapse_conversation())
    for turn in load_turns(source, source.turn_spans(limit=None, slowest_first=False)):
        found = diagnose(turn)
        full, side = turn_json.turn_object(turn, found), turn_row(turn, found).as_turn()
        for key in ("trace_id", "conversation_id", "turn_index", "start_ns", "start", "outcome", "ttft_s"):
            assert side[key] == full[key], key
        assert side["diagnoses"] == full["diagnoses"]
        assert side["total_s"] == full["total_s"]
        for key in ("reason", "compute_s", "pull_s"):
            assert side["prefill"][key] == full["prefill"][key], key
        for key in ("prompt", "computed", "pulled"):
            assert side["prefill"]["tokens"][key] == full["prefill"]["tokens"][key], key
