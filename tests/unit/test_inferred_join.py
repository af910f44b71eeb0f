"""Joining engine requests that arrived without trace context to their turns (pure logic)."""

from __future__ import annotations

from otelkv import names
from otelkv.analysis.inferred_join import Orphan, TurnFacts, match
from otelkv.analysis.model import Leg

S = 1_000_000_000


def turn(
    tid: str, start_s: float, end_s: float, inp: int | None, out: int | None = None, rid: str | None = None
):
    return TurnFacts(tid, int(start_s * S), int(end_s * S), inp, out, rid)


def leg(
    tid: str, role: str, start_s: float, end_s: float, prompt: int, out: int | None = None, rid: str = ""
):
    return Orphan(
        tid,
        Leg(
            role=role,
            start_ns=int(start_s * S),
            end_ns=int(end_s * S),
            prompt_tokens=prompt,
            output_tokens=out,
            base_request_id=rid,
        ),
    )


P, D = names.ROLE_PREFILL, names.ROLE_DECODE


def pairs(outcome) -> dict[str, set[str]]:
    """Turn -> joined traces, after checking that no trace is joined twice, no turn appears in
    two joins, and no turn gets two requests of one role."""
    traces = [t for j in outcome.joins for t in j.trace_ids]
    assert len(traces) == len(set(traces)), outcome.joins
    turns = [j.turn_trace_id for j in outcome.joins]
    assert len(turns) == len(set(turns)), outcome.joins
    return {j.turn_trace_id: set(j.trace_ids) for j in outcome.joins}


def test_both_legs_of_a_routed_request_join_their_turn_with_the_evidence_named() -> None:
    out = match(
        [turn("t1", 10, 12, 200, 32, "chatcmpl-a")],
        [leg("p1", P, 10.1, 10.4, 200, 1, "chatcmpl-a"), leg("d1", D, 10.4, 11.9, 200, 32, "chatcmpl-a")],
    )
    assert pairs(out) == {"t1": {"p1", "d1"}}
    assert out.joins[0].evidence == (
        names.EVIDENCE_RESPONSE_ID,
        names.EVIDENCE_PROMPT_TOKENS,
        names.EVIDENCE_OUTPUT_TOKENS,
        names.EVIDENCE_ARRIVAL_WINDOW,
        names.EVIDENCE_SHARED_REQUEST_ID,
    )


def test_concurrent_turns_are_told_apart_by_their_token_counts() -> None:
    turns = [turn("a", 10, 14, 200), turn("b", 10.2, 14.5, 310)]
    orphans = [leg("pa", P, 10.3, 10.6, 200, rid="x"), leg("pb", P, 10.4, 10.9, 310, rid="y")]
    assert pairs(match(turns, orphans)) == {"a": {"pa"}, "b": {"pb"}}


def test_look_alike_concurrent_turns_stay_unjoined() -> None:
    """Same prompt length, overlapping windows, no response id: either pairing fits, so none is made."""
    turns = [turn("a", 10, 14, 200), turn("b", 10.2, 14.5, 200)]
    orphans = [leg("pa", P, 10.3, 10.6, 200, rid="x"), leg("pb", P, 10.4, 10.9, 200, rid="y")]
    out = match(turns, orphans)
    assert out.joins == [] and out.ambiguous == 2


def test_a_response_id_settles_what_token_counts_cannot() -> None:
    turns = [turn("a", 10, 14, 200, rid="chatcmpl-x"), turn("b", 10.2, 14.5, 200, rid="chatcmpl-y")]
    orphans = [leg("dy", D, 10.3, 13, 200, rid="chatcmpl-y"), leg("dx", D, 10.4, 13.9, 200, rid="chatcmpl-x")]
    assert pairs(match(turns, orphans)) == {"a": {"dx"}, "b": {"dy"}}


def test_never_one_request_to_two_turns_nor_two_requests_of_a_role_to_one_turn() -> None:
    # One turn, two prefill requests that both fit (a retry with a new id): neither is joined.
    out = match(
        [turn("a", 10, 14, 200)],
        [leg("p1", P, 10.1, 10.3, 200, rid="r1"), leg("p2", P, 11, 11.3, 200, rid="r2")],
    )
    assert out.joins == [] and out.ambiguous == 2


def test_the_window_alone_never_joins_and_a_known_mismatch_rules_out() -> None:
    # No usage on the turn (a stream without include_usage) and no response id: window only.
    assert match([turn("a", 10, 14, None)], [leg("p", P, 10.1, 10.3, 200)]).joins == []
    # Prompt tokens differ: not this turn's request.
    out = match([turn("a", 10, 14, 201)], [leg("p", P, 10.1, 10.3, 200)])
    assert out.joins == [] and out.unmatched == 1
    # Outside the window (beyond the tolerance): not this turn's request.
    assert match([turn("a", 10, 14, 200)], [leg("p", P, 15, 15.3, 200)]).joins == []
    # Output tokens differ on the decode leg.
    assert match([turn("a", 10, 14, 200, 32)], [leg("d", D, 10.5, 13, 200, 31)]).joins == []


def test_a_turn_taken_by_its_response_id_leaves_the_other_request_to_the_other_turn() -> None:
    turns = [turn("a", 10, 14, 200, rid="chatcmpl-x"), turn("b", 10.2, 14.5, 200)]
    orphans = [leg("dx", D, 10.3, 13, 200, rid="chatcmpl-x"), leg("dz", D, 10.4, 13.9, 200, rid="chatcmpl-z")]
    assert pairs(match(turns, orphans)) == {"a": {"dx"}, "b": {"dz"}}


def test_legs_with_their_own_ids_join_one_turn_in_one_join() -> None:
    """A router that gives each leg its own request id: each leg is matched on its own."""
    out = match(
        [turn("t1", 10, 12, 200, 32, "chatcmpl-d")],
        [leg("p1", P, 10.1, 10.4, 200, 1, "chatcmpl-p"), leg("d1", D, 10.4, 11.9, 200, 32, "chatcmpl-d")],
    )
    assert pairs(out) == {"t1": {"p1", "d1"}}
    assert names.EVIDENCE_RESPONSE_ID in out.joins[0].evidence


def test_two_requests_of_one_role_under_one_id_are_never_joined() -> None:
    """A retry under the same request id: which of the two answered cannot be told."""
    orphans = [leg("d1", D, 10.2, 11, 200, 32, "chatcmpl-a"), leg("d2", D, 11, 11.9, 200, 32, "chatcmpl-a")]
    assert match([turn("t1", 10, 12, 200, 32, "chatcmpl-a")], orphans).joins == []


def test_a_trace_with_two_orphan_requests_is_left_out() -> None:
    orphans = [leg("T", P, 10.1, 10.4, 200, rid="x"), leg("T", D, 10.4, 11.9, 200, rid="y")]
    assert match([turn("a", 10, 12, 200), turn("b", 10, 12.5, 200)], orphans).joins == []


def test_output_tokens_and_the_window_are_not_enough() -> None:
    assert match([turn("a", 10, 14, None, 32)], [leg("d", D, 10.5, 13, 200, 32, rid="other")]).joins == []
