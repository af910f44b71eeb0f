"""The history and identity diagnoses on hand-built traces (native and stored-string attributes):
which fires on which evidence (the sidecar's comparison, the engine's digest check, both), the
precedence with ``kv_reused_for_different_tokens``, costs, and the turn object they reach."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from otelkv import names
from otelkv.analysis.diagnose import Context, Diagnosis, diagnose
from otelkv.analysis.model import build_turn
from otelkv.analysis.turn_json import document, turn_object
from tests.schema import assert_valid
from tests.unit.test_diagnose import FORMS, linked, pair, turn_trace

PER_TOKEN_S = 0.001
CTX = Context(per_token_s=PER_TOKEN_S)


def sidecar(previous: int, *, at: int | None = None, reused: bool = False, answer: str | None = None) -> dict:
    out: dict[str, Any] = {names.TURN_PREVIOUS_MESSAGES: previous, names.CONVERSATION_ID_REUSED: reused}
    if at is not None:
        out[names.TURN_HISTORY_REWRITTEN_AT] = at
    if answer is not None:
        out[names.TURN_PREVIOUS_ANSWER] = answer
    return out


def engine(where: str | None, *, pulled: int = 112, first: int = 64, offered: int = 144) -> dict:
    """A prefill leg that got a handle with a digest: local hit 32, ``pulled`` loaded; a mismatch
    from ``first`` in ``where`` (None: every offered token matched)."""
    out: dict[str, Any] = {
        names.PULL_DECISION: names.DECISION_PULL if pulled else names.DECISION_RECOMPUTE,
        names.PULL_REASON: names.REASON_PULLED if pulled else names.REASON_BELOW_THRESHOLD,
        names.TOKENS_LOCAL_CACHE_HIT: 32,
        names.TOKENS_PULLED: pulled,
        names.TOKENS_COMPUTED: 300 - 32 - pulled,
        names.TOKENS_REMOTE_REUSABLE: offered - 32,
        names.CONTINUITY_DIGEST: True,
        names.CONTINUITY_OFFERED: offered,
        names.CONTINUITY_MATCHING: first if where else offered,
    }
    if where is not None:
        out[names.CONTINUITY_FIRST_MISMATCH] = first
        out[names.CONTINUITY_MISMATCH_IN] = where
    return out


def found(form: Any, turn_attrs: dict, prefill: dict | None = None) -> dict[str, Diagnosis]:
    prev, cur = pair(turn=turn_attrs, prefill=prefill, prefill_transfer={} if prefill else None)
    return {d.id: d for d in diagnose(linked(form(prev), form(cur)), CTX)}


def ranked(form: Any, turn_attrs: dict, prefill: dict | None = None) -> list[str]:
    prev, cur = pair(turn=turn_attrs, prefill=prefill, prefill_transfer={} if prefill else None)
    return [d.id for d in diagnose(linked(form(prev), form(cur)), CTX)]


UNCHECKED_PULL = {
    names.PULL_DECISION: names.DECISION_PULL,
    names.TOKENS_PULLED: 256,
    names.TOKENS_COMPUTED: 44,
    names.TOKENS_REMOTE_REUSABLE: 256,
    names.CONTINUITY_DIGEST: False,  # the router dropped the digest
}


# ------------------------------------------------------------------ history_rewritten


@FORMS
def test_history_rewritten_from_the_sidecar_alone_warns_of_an_unchecked_pull(form: Any) -> None:
    d = found(form, sidecar(5, at=3), UNCHECKED_PULL)[names.DIAG_HISTORY_REWRITTEN]
    assert (d.evidence["message_index"], d.evidence["previous_messages"]) == (3, 5)
    assert d.evidence["pulled_tokens"] == 256 and d.evidence["kv_loaded_for_other_tokens"] is False
    assert "Message 3 of the 5" in d.summary and "without a continuity digest" in d.summary
    assert d.cost_s == 0.0  # no engine numbers: the tokens are not known
    assert names.DIAG_KV_FOR_OTHER_TOKENS not in found(form, sidecar(5, at=3), UNCHECKED_PULL)


@FORMS
def test_kv_loaded_for_the_rewritten_history_is_one_failure_with_the_message_index_beside_it(
    form: Any,
) -> None:
    order = ranked(form, sidecar(5, at=3), engine(names.CONTINUITY_IN_HISTORY))
    assert order[0] == names.DIAG_KV_FOR_OTHER_TOKENS  # the headline: a failure ranks first
    d = found(form, sidecar(5, at=3), engine(names.CONTINUITY_IN_HISTORY))[names.DIAG_HISTORY_REWRITTEN]
    assert d.cost_s == 0.0 and d.evidence["kv_loaded_for_other_tokens"] is True  # not counted twice
    assert d.evidence["message_index"] == 3 and d.evidence["first_mismatch_token"] == 64
    assert names.DIAG_KV_FOR_OTHER_TOKENS in d.summary


@FORMS
def test_a_mismatch_not_loaded_costs_the_tokens_that_could_not_be_reused(form: Any) -> None:
    # Engine evidence alone (no sidecar comparison): below the threshold, nothing pulled.
    d = found(form, {}, engine(names.CONTINUITY_IN_HISTORY, pulled=0))[names.DIAG_HISTORY_REWRITTEN]
    assert d.evidence["message_index"] is None and d.evidence["tokens_not_reusable"] == 144 - 64
    assert d.cost_s == pytest.approx((144 - 64) * PER_TOKEN_S)
    assert "belong to the old text" in d.summary


@FORMS
def test_a_difference_the_engine_found_no_trace_of_in_the_tokens_is_no_diagnosis(form: Any) -> None:
    """Whitespace a word-level tokenizer drops; a tool call a template does not render."""
    assert not {names.DIAG_HISTORY_REWRITTEN, names.DIAG_ANSWER_RE_RENDERED} & set(
        found(form, sidecar(5, at=3), engine(None))
    )
    clean = found(form, sidecar(5, answer=names.PREVIOUS_ANSWER_TOOL_CALLS_DIFFER), engine(None))
    assert names.DIAG_ANSWER_RE_RENDERED not in clean


@FORMS
def test_messages_back_unchanged_yet_other_tokens_is_a_rendering_change(form: Any) -> None:
    d = found(form, sidecar(5, answer=names.PREVIOUS_ANSWER_VERBATIM), engine(names.CONTINUITY_IN_HISTORY))[
        names.DIAG_HISTORY_REWRITTEN
    ]
    assert d.evidence["message_index"] is None and "rendered into other tokens" in d.summary


# ------------------------------------------------------------------ conversation_id_reused


@FORMS
def test_a_reused_id_is_its_own_diagnosis_not_a_rewritten_history(form: Any) -> None:
    got = found(form, sidecar(4, reused=True), engine(names.CONTINUITY_IN_HISTORY, first=0))
    assert names.DIAG_HISTORY_REWRITTEN not in got
    assert next(iter(got)) == names.DIAG_KV_FOR_OTHER_TOKENS
    d = got[names.DIAG_ID_REUSED]
    assert d.evidence["conversation_id"] == "conv-1" and d.evidence["previous_messages"] == 4
    assert d.evidence["previous_trace_id"] == pair()[0][0].trace_id  # the id's previous turn
    assert d.cost_s == 0.0 and "reused for another conversation" in d.summary
    assert "Mint a new conversation id" in d.fix
    alone = found(form, sidecar(4, reused=True))[names.DIAG_ID_REUSED]
    assert "hands such a request the other conversation's KV" in alone.summary


# ------------------------------------------------------------------ answer_re_rendered


@FORMS
def test_a_changed_answer_says_which_part_and_what_share_of_the_pull(form: Any) -> None:
    got = found(
        form, sidecar(5, answer=names.PREVIOUS_ANSWER_CONTENT_DIFFERS), engine(names.CONTINUITY_IN_ANSWER)
    )
    d = got[names.DIAG_ANSWER_RE_RENDERED]
    wrong = 32 + 112 - 64
    assert d.evidence["mismatched_pulled_tokens"] == wrong
    assert d.evidence["share_of_pulled"] == round(wrong / 112, 3)
    assert d.evidence["answer_message_index"] == 5 and d.evidence["previous_answer_tokens"] == 40
    assert "its text differs" in d.summary and f"{wrong} of the 112" in d.summary
    assert d.cost_s == 0.0 and next(iter(got)) == names.DIAG_KV_FOR_OTHER_TOKENS
    assert names.DIAG_HISTORY_REWRITTEN not in got
    assert "exactly as the model returned it" in d.fix


@FORMS
def test_an_answer_back_word_for_word_with_other_tokens_is_not_the_agents_doing(form: Any) -> None:
    d = found(form, sidecar(5, answer=names.PREVIOUS_ANSWER_VERBATIM), engine(names.CONTINUITY_IN_ANSWER))[
        names.DIAG_ANSWER_RE_RENDERED
    ]
    assert "word for word" in d.summary and d.fix.startswith("Nothing to change in the agent")


@FORMS
def test_an_answer_changed_on_a_fleet_without_digests_comes_from_the_sidecar(form: Any) -> None:
    d = found(form, sidecar(5, answer=names.PREVIOUS_ANSWER_DROPPED), UNCHECKED_PULL)[
        names.DIAG_ANSWER_RE_RENDERED
    ]
    assert d.evidence["previous_answer"] == names.PREVIOUS_ANSWER_DROPPED
    assert "no assistant message there" in d.summary and "reach the answer" in d.summary
    assert d.evidence["share_of_pulled"] is None and d.cost_s == 0.0


# ------------------------------------------------------------------ conversation_id_changed_on_resume


def resumed_turn(form: Any, gap_s: float) -> Any:
    attrs = {
        names.CONVERSATION_RESUMED_FROM: "conv-old",
        names.CONVERSATION_RESUMED_FROM_TRACE_ID: "ab" * 16,
        names.CONVERSATION_RESUMED_GAP_SECONDS: gap_s,
        names.CONVERSATION_RESUMED_TOKENS: 140,
        names.CONVERSATION_RESUMED_MESSAGES: 3,
    }
    spans = turn_trace("conv-new", 0, turn=attrs, router={names.ROUTER_HANDLE: names.ROUTER_HANDLE_MISS})
    turn = build_turn(form(spans))
    assert turn is not None
    return turn


@FORMS
def test_a_resume_under_a_new_id_while_decode_held_the_kv(form: Any) -> None:
    turn = resumed_turn(form, 2.0)
    got = {d.id: d for d in diagnose(turn, CTX)}
    d = got[names.DIAG_ID_CHANGED_ON_RESUME]
    assert d.evidence == {
        "conversation_id": "conv-new",
        "previous_conversation_id": "conv-old",
        "previous_trace_id": "ab" * 16,
        "gap_s": 2.0,
        "decoder_kv_blocks_ttl_s": 12.0,  # the decode engine's configuration in force
        "ttl_left_s": 10.0,
        "previous_tokens": 140,
        "repeated_messages": 3,
        "pull_reason": names.REASON_NO_DECODE_HANDLE,
        "local_cache_tokens": 0,
        "tokens_recomputed": 140,
    }
    assert d.cost_s == pytest.approx(140 * PER_TOKEN_S)
    assert "'conv-old'" in d.summary and "another 10.0s" in d.summary and "Keep the conversation id" in d.fix
    assert set(got) == {names.DIAG_ID_CHANGED_ON_RESUME}  # a first turn: no lost-handle diagnosis


@FORMS
def test_a_resume_after_the_ttl_or_that_got_a_handle_lost_nothing(form: Any) -> None:
    """The decode KV had expired by the resume (the new id cost nothing), or a router keyed by
    something else than the id handed the prefill node a handle: not this diagnosis."""
    assert names.DIAG_ID_CHANGED_ON_RESUME not in {d.id for d in diagnose(resumed_turn(form, 20.0), CTX)}
    attrs = {
        names.CONVERSATION_RESUMED_FROM: "conv-old",
        names.CONVERSATION_RESUMED_GAP_SECONDS: 2.0,
        names.CONVERSATION_RESUMED_TOKENS: 140,
        names.CONVERSATION_RESUMED_MESSAGES: 3,
    }
    pulled = turn_trace("conv-new", 0, turn=attrs, prefill={names.PULL_REASON: names.REASON_PULLED})
    turn = build_turn(form(pulled))
    assert turn is not None
    assert names.DIAG_ID_CHANGED_ON_RESUME not in {d.id for d in diagnose(turn, CTX)}


# ------------------------------------------------------------------ the turn object


@FORMS
def test_the_turn_object_carries_history_and_resume_and_fits_the_schema(form: Any) -> None:
    prev, cur = pair(turn=sidecar(5, at=3), prefill=UNCHECKED_PULL, prefill_transfer={})
    turn = linked(form(prev), form(cur))
    obj = turn_object(turn, diagnose(turn, CTX))
    assert obj["history"] == {
        "previous_messages": 5,
        "rewritten_at": 3,
        "id_reused": False,
        "previous_answer": None,
    }
    assert obj["resumed_from"] is None
    assert_valid(document("why", ref="x", per_token_compute_s=None, turn=obj))
    resumed = turn_object(resumed_turn(form, 2.0))
    assert resumed["resumed_from"] == {
        "conversation_id": "conv-old",
        "trace_id": "ab" * 16,
        "gap_s": 2.0,
        "tokens": 140,
        "messages": 3,
    }
    assert resumed["history"] is None
    assert_valid(document("why", ref="x", per_token_compute_s=None, turn=resumed))


def test_the_schema_knows_every_previous_answer_state() -> None:
    schema = json.loads((Path(__file__).parents[2] / "otelkv/analysis/turn.schema.json").read_text())
    allowed = schema["$defs"]["history"]["properties"]["previous_answer"]["enum"]
    assert allowed == [*names.PREVIOUS_ANSWER_STATES, None]


@FORMS
def test_a_cause_follows_the_failure_it_explains(form: Any) -> None:
    """Ranked by cost a cause at no cost would come last, after queueing and the like; it
    follows the failure it names the cause of instead. Alone it ranks by its own cost."""
    assert ranked(form, sidecar(4, reused=True), engine(names.CONTINUITY_IN_HISTORY, first=0))[:2] == [
        names.DIAG_KV_FOR_OTHER_TOKENS,
        names.DIAG_ID_REUSED,
    ]
    answer = sidecar(5, answer=names.PREVIOUS_ANSWER_CONTENT_DIFFERS)
    assert ranked(form, answer, engine(names.CONTINUITY_IN_ANSWER))[:2] == [
        names.DIAG_KV_FOR_OTHER_TOKENS,
        names.DIAG_ANSWER_RE_RENDERED,
    ]
    # Without the failure (a pull the engine could not check) a cost-0 cause ranks by its cost.
    slow_tool = {names.TURN_TOOL_WAIT_SECONDS: 2.0}
    order = ranked(form, {**sidecar(5, at=3), **slow_tool}, UNCHECKED_PULL)
    assert order.index(names.DIAG_HISTORY_REWRITTEN) > order.index(names.DIAG_TOOL_WAIT_DOMINATES)
