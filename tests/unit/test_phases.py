"""Turn phases: the gap splits into tool wait and app work on the best evidence available, the
request splits at the first token, and the four phases always add up to the turn.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otelkv import names
from otelkv.analysis.phases import GapSplit, Phases, split_gap, split_request, turn_phases

S = 1_000_000_000  # one second in ns


def test_agent_tool_intervals_inside_the_gap() -> None:
    """Time covered by tool spans is tool wait; the rest of the gap is app work."""
    gap = split_gap(0, 10 * S, tool_intervals=[(1 * S, 3 * S), (5 * S, 6 * S)])
    assert gap == GapSplit(3.0, 7.0, names.GAP_SOURCE_AGENT_SPANS)


def test_overlapping_intervals_count_once() -> None:
    """Parallel tool calls overlap: their union counts, not their sum."""
    gap = split_gap(
        0, 10 * S, tool_intervals=[(1 * S, 5 * S), (2 * S, 3 * S), (4 * S, 7 * S), (7 * S, 8 * S)]
    )
    assert gap.tool_wait_s == pytest.approx(7.0)
    assert gap.app_work_s == pytest.approx(3.0)


def test_intervals_partly_outside_the_gap_are_clipped() -> None:
    """Tool time before the gap or after the request arrived does not count."""
    gap = split_gap(10 * S, 20 * S, tool_intervals=[(5 * S, 12 * S), (18 * S, 30 * S), (0, 1 * S)])
    assert gap.tool_wait_s == pytest.approx(4.0)
    assert gap.app_work_s == pytest.approx(6.0)
    assert gap.source == names.GAP_SOURCE_AGENT_SPANS
    whole = split_gap(10 * S, 20 * S, tool_intervals=[(0, 100 * S)])
    assert (whole.tool_wait_s, whole.app_work_s) == (10.0, 0.0)


def test_agent_spans_beat_message_evidence() -> None:
    """With tool spans, messages saying "tools ran" do not turn the whole gap into tool wait."""
    gap = split_gap(0, 10 * S, tool_intervals=[(0, 2 * S)], previous_asked_tools=True, tool_results=2)
    assert gap == GapSplit(2.0, 8.0, names.GAP_SOURCE_AGENT_SPANS)


@pytest.mark.parametrize(("asked", "results"), [(True, 0), (False, 1), (True, 3)])
def test_message_evidence_of_tools_makes_all_tool_wait(asked: bool, results: int) -> None:
    """Previous response asked for tools, or this request carries tool results: all tool wait."""
    gap = split_gap(2 * S, 7 * S, previous_asked_tools=asked, tool_results=results)
    assert gap == GapSplit(5.0, 0.0, names.GAP_SOURCE_MESSAGES)


def test_no_tool_evidence_is_all_app_work() -> None:
    """Without any sign of tools the gap is the agent's own work."""
    assert split_gap(2 * S, 7 * S) == GapSplit(0.0, 5.0, names.GAP_SOURCE_MESSAGES)


def test_first_turn_and_empty_gap() -> None:
    """A first turn has no gap source; a zero or negative gap is zero either way."""
    assert split_gap(0, 0, first_turn=True) == GapSplit(0.0, 0.0, names.GAP_SOURCE_NONE)
    assert split_gap(5 * S, 5 * S, previous_asked_tools=True) == GapSplit(0.0, 0.0, names.GAP_SOURCE_MESSAGES)
    assert split_gap(9 * S, 5 * S, tool_intervals=[(0, 10 * S)]).tool_wait_s == 0.0


def test_split_request_sources() -> None:
    """Stream beats engine beats the whole response; each names its source."""
    assert split_request(2.0, stream_ttft_s=0.5, engine_ttft_s=0.1) == (0.5, 1.5, names.TTFT_SOURCE_STREAM)
    assert split_request(2.0, engine_ttft_s=0.25) == (0.25, 1.75, names.TTFT_SOURCE_ENGINE)
    assert split_request(2.0) == (2.0, 0.0, names.TTFT_SOURCE_RESPONSE)


def test_split_request_clamps() -> None:
    """A first token before the request or after its end is clamped; negative request is 0."""
    assert split_request(1.0, stream_ttft_s=-0.5) == (0.0, 1.0, names.TTFT_SOURCE_STREAM)
    assert split_request(1.0, engine_ttft_s=3.0) == (1.0, 0.0, names.TTFT_SOURCE_ENGINE)
    assert split_request(-1.0, stream_ttft_s=0.2) == (0.0, 0.0, names.TTFT_SOURCE_STREAM)


def test_turn_phases_and_dominant() -> None:
    """turn_phases() combines both splits; dominant() names the longest phase."""
    phases = turn_phases(GapSplit(3.0, 1.0, names.GAP_SOURCE_MESSAGES), 2.0, stream_ttft_s=0.5)
    assert phases == Phases(0.5, 1.5, 3.0, 1.0, names.GAP_SOURCE_MESSAGES, names.TTFT_SOURCE_STREAM)
    assert phases.total_s == pytest.approx(6.0)
    assert phases.dominant() == names.PHASE_TOOL_WAIT
    assert list(phases.as_dict()) == list(names.PHASES)
    tie = Phases(1.0, 1.0, 1.0, 1.0, names.GAP_SOURCE_NONE, names.TTFT_SOURCE_RESPONSE)
    assert tie.dominant() == names.PHASE_INPUT_PROCESSING


_ns = st.integers(min_value=0, max_value=10**12)
_opt_s = st.none() | st.floats(min_value=-1e4, max_value=1e4, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(
    start=_ns,
    length=st.integers(min_value=-(10**10), max_value=10**11),
    intervals=st.lists(st.tuples(_ns, _ns), max_size=8),
    asked=st.booleans(),
    results=st.integers(min_value=0, max_value=4),
    first=st.booleans(),
    request_s=st.floats(min_value=0, max_value=1e4, allow_nan=False),
    stream=_opt_s,
    engine=_opt_s,
)
def test_four_phases_always_sum_to_gap_plus_request(
    start: int,
    length: int,
    intervals: list[tuple[int, int]],
    asked: bool,
    results: int,
    first: bool,
    request_s: float,
    stream: float | None,
    engine: float | None,
) -> None:
    """Whatever the evidence, no phase is negative and the four add up to gap + request."""
    end = start + length
    gap = split_gap(
        start,
        end,
        tool_intervals=intervals,
        previous_asked_tools=asked,
        tool_results=results,
        first_turn=first,
    )
    gap_s = max(length, 0) / 1e9
    assert gap.source in names.GAP_SOURCES
    assert gap.tool_wait_s >= 0 and gap.app_work_s >= 0
    assert gap.tool_wait_s + gap.app_work_s == pytest.approx(gap_s, abs=1e-9)
    phases = turn_phases(gap, request_s, stream_ttft_s=stream, engine_ttft_s=engine)
    assert all(v >= 0 for v in phases.as_dict().values())
    assert phases.ttft_source in names.TTFT_SOURCES
    assert phases.total_s == pytest.approx(gap_s + request_s, abs=1e-9, rel=1e-12)
