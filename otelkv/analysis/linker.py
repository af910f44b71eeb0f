"""The one turn linker: turns modelled from a span source, each linked to its previous turn.

A turn's model needs three kinds of spans: its own trace (turn span, router, engines), its
previous turn's trace (whose decode retention says whether the KV this turn could read was
still held), and the agent's tool spans in the gap before it (in the agent's own traces).
Every verb gets its turns here, in a handful of queries whatever the number of turns
(a store may hold a million): the turn spans, then all their traces and their previous
turns' traces in one ``trace_spans`` call (or fewer: a source may hand in traces it read
with the turn spans), then the window's tool spans in one call.
"""

from __future__ import annotations

from collections.abc import Sequence

from otelkv import names
from otelkv.analysis import inferred_join, scope
from otelkv.analysis.model import EngineJoin, Turn, build_turn
from otelkv.analysis.sources import SpanSource, group_by_trace
from otelkv.spans import SpanRecord, attr_float, attr_str, is_engine_request, is_turn_span, opt_int, opt_str
from otelkv.spans.kinds import one_per_trace, turn_rank

ORPHAN_LIMIT = 20_000
"""Most engine requests without a parent read to join one batch of turns by inference."""
NEIGHBOUR_LOOKBACK_S = 600.0
"""How long before an orphan engine request a turn that could have sent it may have started."""
CLUSTER_GAP_S = 60.0
"""Turns to join by inference less than this apart share one orphan query (a conversation's
turns, usually); farther apart, each cluster is read on its own, so a window of days does not
read every engine request in between."""


def load_turns(
    source: SpanSource,
    turn_spans: Sequence[SpanRecord],
    *,
    conversation_id: str | None = None,
    fetched: dict[str, list[SpanRecord]] | None = None,
) -> list[Turn]:
    """Model the given turn spans (one turn per trace), each linked to its previous turn, in
    two or three queries (and three per cluster of turns whose engine requests came in
    traces of their own and are joined by inference, :func:`infer_joins`). ``fetched``: traces
    already read (trace id -> spans), not read again; those that are neither a turn's nor its
    previous turn's are ignored."""
    turn_spans = one_per_trace(turn_spans)
    if not turn_spans:
        return []
    wanted = [s.trace_id for s in turn_spans]
    prev_ids = [attr_str(s.attributes, names.TURN_PREVIOUS_TRACE_ID) for s in turn_spans]
    ids = list(dict.fromkeys(wanted + [p for p in prev_ids if p]))
    needed = set(ids)
    by_trace = {tid: list(spans) for tid, spans in (fetched or {}).items() if tid in needed}
    missing = [tid for tid in ids if tid not in by_trace]
    if missing:
        by_trace.update(group_by_trace(source.trace_spans(missing)))
    for span in turn_spans:  # the turn span itself, even if trace_spans missed it
        group = by_trace.setdefault(span.trace_id, [])
        if not any(s.span_id == span.span_id for s in group):
            group.append(span)
    inferred = infer_joins(source, by_trace)
    for join, spans in inferred.values():
        by_trace[join.turn_trace_id] = by_trace[join.turn_trace_id] + spans
    gaps = [_gap_window(s, by_trace) for s in turn_spans]
    lo, hi = min(g[0] for g in gaps), max(g[1] for g in gaps)
    tools: list[SpanRecord] = []
    if hi > lo:
        if conversation_id is not None:
            tools = source.tool_spans(since_ns=lo, until_ns=hi, conversation_id=conversation_id)
        else:  # only these turns' conversations, and the gaps before them: a window of days
            # holds far more tool spans than the turns (slowest of days, say) can use
            convs = sorted({attr_str(s.attributes, names.GEN_AI_CONVERSATION_ID) for s in turn_spans} - {""})
            tools = (
                source.tool_spans(since_ns=lo, until_ns=hi, conversation_ids=convs, windows=gaps)
                if convs
                else []
            )
    previous: dict[str, Turn | None] = {}
    for pid in set(p for p in prev_ids if p) - set(wanted):
        previous[pid] = build_turn(by_trace.get(pid, []), tool_spans=tools)
        if previous[pid] is not None and pid in inferred:
            previous[pid].join = EngineJoin(names.JOIN_INFERRED, inferred[pid][0].evidence)  # type: ignore[union-attr]
    out: list[Turn] = []
    built: dict[str, Turn] = {}
    # Oldest first, so a turn whose predecessor is also wanted links to the full model of it.
    for span in sorted(turn_spans, key=lambda s: s.start_ns):
        pid = attr_str(span.attributes, names.TURN_PREVIOUS_TRACE_ID)
        prev = built.get(pid) or previous.get(pid)
        turn = build_turn(by_trace[span.trace_id], tool_spans=tools, previous=prev)
        if turn is not None and span.trace_id in inferred:
            turn.join = EngineJoin(names.JOIN_INFERRED, inferred[span.trace_id][0].evidence)
        if turn is not None:
            built[span.trace_id] = turn
            out.append(turn)
    return out


def _gap_window(turn_span: SpanRecord, by_trace: dict[str, list[SpanRecord]]) -> tuple[int, int]:
    """A time range holding the gap before a turn, however :func:`build_turn` measures it:
    from the turn's trace's first span less ``otelkv.turn.gap_s`` (the sidecar's gap), or
    from the start of the previous turn's trace when it was read (a gap recomputed from the
    previous turn's end), to the turn span's start."""
    trace = by_trace.get(turn_span.trace_id) or [turn_span]
    first = min(s.start_ns for s in trace)
    lo = first - int(attr_float(turn_span.attributes, names.TURN_GAP_SECONDS) * 1e9)
    previous = by_trace.get(attr_str(turn_span.attributes, names.TURN_PREVIOUS_TRACE_ID))
    if previous:
        lo = min(lo, min(s.start_ns for s in previous))
    return lo, max(turn_span.start_ns, first)


WINDOW_CHUNK = 2000
"""Turns modelled per ``trace_spans`` call by :func:`window_turns` (bounds one query's IN list)."""


def window_turns(
    source: SpanSource, *, since_ns: int | None, until_ns: int | None, max_turns: int | None = None
) -> tuple[list[Turn], int]:
    """Every turn of the window, oldest first, each linked to its previous turn; and how many there were.

    Turns of conversations :func:`otelkv.analysis.scope.counted` leaves out (the reference
    fleet's warm-up) are neither modelled nor counted. With more than ``max_turns`` turns only
    the most recent ``max_turns`` are modelled (the count says how many were left out). Traces
    are fetched a chunk at a time; a chunk's first turns still link to predecessors in the
    chunk before (their traces are fetched again).
    """
    spans = source.turn_spans(since_ns=since_ns, until_ns=until_ns, limit=None, slowest_first=False)
    spans = sorted(scope.counted_spans(one_per_trace(spans)), key=lambda s: s.start_ns)
    total = len(spans)
    if max_turns is not None and total > max_turns:
        spans = spans[total - max_turns :]
    turns: list[Turn] = []
    for i in range(0, len(spans), WINDOW_CHUNK):
        turns.extend(load_turns(source, spans[i : i + WINDOW_CHUNK]))
    return turns, total


def load_trace(source: SpanSource, trace_id: str, spans: Sequence[SpanRecord]) -> Turn | None:
    """The turn of one trace whose ``spans`` were read, linked like any other; None when they
    hold neither a turn nor an engine request. A trace with only engine spans (no turn span)
    gives an engine-only turn without a predecessor. ``spans`` may hold other traces' spans
    too (:meth:`SpanSource.turn_trace_spans`): the previous turn's trace is then not read
    again when it is among them."""
    by_trace = group_by_trace(spans)
    own = by_trace.get(trace_id, [])
    turn_spans = [s for s in own if is_turn_span(s)]
    if turn_spans:
        turns = load_turns(source, turn_spans, fetched=by_trace)
        if turns:
            return turns[0]
    return build_turn(own)


def _facts(span: SpanRecord) -> inferred_join.TurnFacts:
    a = span.attributes
    return inferred_join.TurnFacts(
        trace_id=span.trace_id,
        start_ns=span.start_ns,
        end_ns=span.end_ns,
        input_tokens=opt_int(a, names.GEN_AI_USAGE_INPUT_TOKENS),
        output_tokens=opt_int(a, names.GEN_AI_USAGE_OUTPUT_TOKENS),
        response_id=opt_str(a, names.GEN_AI_RESPONSE_ID),
    )


def _clusters(intervals: Sequence[tuple[int, int]], gap_ns: int) -> list[tuple[int, int]]:
    """The intervals merged where less than ``gap_ns`` apart (one orphan query per cluster)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1] + gap_ns:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _orphans(spans: Sequence[SpanRecord]) -> list[inferred_join.Orphan]:
    """One entry per engine request without a parent in an orphan trace."""
    out = []
    for root in spans:
        if is_engine_request(root) and not root.parent_span_id:
            kids = [s for s in spans if s.parent_span_id == root.span_id]
            built = build_turn([root, *kids])
            leg = (built.prefill or built.decode) if built else None
            if leg is not None:
                out.append(inferred_join.Orphan(root.trace_id, leg))
    return out


def infer_joins(
    source: SpanSource, by_trace: dict[str, list[SpanRecord]]
) -> dict[str, tuple[inferred_join.Join, list[SpanRecord]]]:
    """For the turns in ``by_trace`` whose trace holds no engine request: the engine requests
    that arrived in traces of their own and :func:`otelkv.analysis.inferred_join.match` ties
    to them (turn trace id -> the join and the engine traces' spans).

    Orphan requests are read around each cluster of such turns; the candidates are every
    turn those requests could belong to, loaded or not, so a turn's join is the same
    whichever verb asked for it (as long as a cluster holds fewer than
    :data:`ORPHAN_LIMIT` orphan requests and no turn lasted longer than
    :data:`NEIGHBOUR_LOOKBACK_S`). Nothing is read when every turn has its engine requests
    (a fleet whose identity reaches the engines).
    """
    bare: dict[str, SpanRecord] = {}
    for tid, spans in by_trace.items():
        turns = [s for s in spans if is_turn_span(s)]
        if turns and not any(is_engine_request(s) for s in spans):
            bare[tid] = min(turns, key=turn_rank)
    tol = int(inferred_join.TOLERANCE_S * 1e9)
    lookback = int(NEIGHBOUR_LOOKBACK_S * 1e9)
    out: dict[str, tuple[inferred_join.Join, list[SpanRecord]]] = {}
    windows = [(s.start_ns - tol, s.end_ns + tol) for s in bare.values()]
    for lo, hi in _clusters(windows, int(CLUSTER_GAP_S * 1e9)):
        roots = source.engine_requests(since_ns=lo, until_ns=hi, roots_only=True, limit=ORPHAN_LIMIT)
        if not roots:
            continue
        orphan_spans = {
            tid: spans
            for tid, spans in group_by_trace(source.trace_spans([r.trace_id for r in roots])).items()
            if not any(is_turn_span(s) for s in spans)
        }
        orphans = [o for spans in orphan_spans.values() for o in _orphans(spans)]
        if not orphans:
            continue
        o_lo = min(o.leg.start_ns for o in orphans) - tol
        o_hi = max(o.leg.end_ns for o in orphans) + tol
        candidates = {
            tid: span for tid, span in bare.items() if span.end_ns >= o_lo and span.start_ns <= o_hi
        }
        others = [
            s
            for s in one_per_trace(
                source.turn_spans(since_ns=o_lo - lookback, until_ns=o_hi, limit=None, slowest_first=False)
            )
            if s.trace_id not in by_trace and s.end_ns >= o_lo
        ]
        if others:
            joined = {
                s.trace_id for s in source.trace_spans([s.trace_id for s in others]) if is_engine_request(s)
            }
            candidates.update((s.trace_id, s) for s in others if s.trace_id not in joined)
        outcome = inferred_join.match([_facts(s) for s in candidates.values()], orphans)
        for join in outcome.joins:
            if join.turn_trace_id in bare and join.turn_trace_id not in out:
                out[join.turn_trace_id] = (join, [s for tid in join.trace_ids for s in orphan_spans[tid]])
    return out
