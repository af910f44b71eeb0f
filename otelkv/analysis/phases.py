"""Split an agent turn into input processing, generation, tool wait and app work (pure logic).

A turn, as the agent lives it, starts when the previous response ended and ends with the
last byte of this response. The gap in between is the agent's own time: tools running
(tool wait) or anything else (app work: planning, a person reading, retries). The
request itself splits at the first token: before it everything the fleet does to get
there (router, queueing, cache lookup, KV pull, prefill, P->D transfer), after it
generation. The four parts always add up to the measured turn time, so a dashboard
can stack them.

The sidecar uses these functions at turn end with what it knows then; the analysis
re-runs them when better evidence arrived later (agent ``execute_tool`` spans exported
after the turn, engine spans that bound the first token of a non-streaming response).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from otelkv import names


@dataclass(frozen=True)
class GapSplit:
    """How the gap before a turn divides into tool wait and app work, and on what evidence."""

    tool_wait_s: float
    app_work_s: float
    source: str
    """One of :data:`otelkv.names.GAP_SOURCES`."""


@dataclass(frozen=True)
class Phases:
    input_processing_s: float
    generation_s: float
    tool_wait_s: float
    app_work_s: float
    gap_source: str
    ttft_source: str

    @property
    def total_s(self) -> float:
        return self.input_processing_s + self.generation_s + self.tool_wait_s + self.app_work_s

    def as_dict(self) -> dict[str, float]:
        return {
            names.PHASE_INPUT_PROCESSING: self.input_processing_s,
            names.PHASE_GENERATION: self.generation_s,
            names.PHASE_TOOL_WAIT: self.tool_wait_s,
            names.PHASE_APP_WORK: self.app_work_s,
        }

    def dominant(self) -> str:
        """The phase that took longest (ties go to the earlier phase in :data:`PHASES`)."""
        parts = self.as_dict()
        return max(names.PHASES, key=lambda p: parts[p])


def _covered_ns(start_ns: int, end_ns: int, intervals: Iterable[tuple[int, int]]) -> int:
    """Nanoseconds of [start, end) covered by the union of the intervals (overlaps once)."""
    clipped = sorted((max(s, start_ns), min(e, end_ns)) for s, e in intervals if e > start_ns and s < end_ns)
    covered = 0
    cursor = start_ns
    for s, e in clipped:
        s = max(s, cursor)
        if e > s:
            covered += e - s
            cursor = e
    return covered


def split_gap(
    gap_start_ns: int,
    gap_end_ns: int,
    *,
    tool_intervals: Iterable[tuple[int, int]] = (),
    previous_asked_tools: bool = False,
    tool_results: int = 0,
    first_turn: bool = False,
) -> GapSplit:
    """Divide the gap before a turn.

    The agent's own ``execute_tool`` spans are the best evidence: the time they cover is
    tool wait, the rest app work. Without them the messages decide: if the previous
    response asked for tools and this request carries tool results, the whole gap was
    spent waiting for tools (an over-estimate by whatever the agent did around the call,
    which is why the source is recorded); otherwise it was app work.
    """
    gap_ns = max(gap_end_ns - gap_start_ns, 0)
    gap_s = gap_ns / 1e9
    if first_turn or gap_ns == 0:
        return GapSplit(0.0, gap_s, names.GAP_SOURCE_NONE if first_turn else names.GAP_SOURCE_MESSAGES)
    intervals = list(tool_intervals)
    if intervals:
        tool_ns = _covered_ns(gap_start_ns, gap_end_ns, intervals)
        return GapSplit(tool_ns / 1e9, (gap_ns - tool_ns) / 1e9, names.GAP_SOURCE_AGENT_SPANS)
    if previous_asked_tools or tool_results > 0:
        return GapSplit(gap_s, 0.0, names.GAP_SOURCE_MESSAGES)
    return GapSplit(0.0, gap_s, names.GAP_SOURCE_MESSAGES)


def split_request(
    request_s: float, *, stream_ttft_s: float | None = None, engine_ttft_s: float | None = None
) -> tuple[float, float, str]:
    """(input processing, generation, ttft source) of the request itself.

    A streamed first chunk is measured directly. For a non-streaming response the client
    sees nothing before the end; the prefill node's span end, or the end of the decode
    node's read of its KV when later (relative to the request start), bounds when the
    first token existed. Without either, the whole response counts
    as input processing, and the source says so.
    """
    request_s = max(request_s, 0.0)
    if stream_ttft_s is not None:
        ttft, source = stream_ttft_s, names.TTFT_SOURCE_STREAM
    elif engine_ttft_s is not None:
        ttft, source = engine_ttft_s, names.TTFT_SOURCE_ENGINE
    else:
        ttft, source = request_s, names.TTFT_SOURCE_RESPONSE
    ttft = min(max(ttft, 0.0), request_s)
    return ttft, request_s - ttft, source


def turn_phases(
    gap: GapSplit, request_s: float, *, stream_ttft_s: float | None = None, engine_ttft_s: float | None = None
) -> Phases:
    inp, gen, source = split_request(request_s, stream_ttft_s=stream_ttft_s, engine_ttft_s=engine_ttft_s)
    return Phases(inp, gen, gap.tool_wait_s, gap.app_work_s, gap.source, source)
