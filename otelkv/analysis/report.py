"""The query service behind ``otelkv slow|conversation|why`` and the sidecar's query API.

Every function takes a :class:`~otelkv.analysis.sources.SpanSource` and returns a JSON-able
document (:mod:`otelkv.analysis.turn_json`); the CLI renders the documents and the
sidecar's HTTP API returns them unchanged, so both show the same thing. Turns come from the
one linker (:mod:`otelkv.analysis.linker`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from otelkv import names
from otelkv.analysis import scope, turn_json
from otelkv.analysis.diagnose import Context, diagnose
from otelkv.analysis.linker import load_trace, load_turns
from otelkv.analysis.model import Turn, per_token_compute_s
from otelkv.analysis.sources import SpanSource, group_by_trace
from otelkv.spans import SpanRecord, attr_str, is_turn_span
from otelkv.spans.kinds import one_per_trace

CONVERSATION_LIMIT = 1000
"""Most turns ``conversation`` shows (the first ones when a conversation is longer)."""

_HEX = re.compile(r"^[0-9a-fA-F]+$")
TRACE_ID_DIGITS = 32
SHORT_ID_DIGITS = 8
"""How many leading hex digits of a trace id the tables print (``otelkv slow``); any unique
prefix of at least :data:`MIN_PREFIX_DIGITS` digits finds the turn again."""
MIN_PREFIX_DIGITS = 4
PREFIX_MATCH_LIMIT = 100
"""Most matches of an ambiguous prefix counted one by one (more are "over 100")."""


class NotFound(LookupError):  # noqa: N818 - the name the API promises
    """The turn, trace or conversation asked for is not in the store (message says what to try)."""


class BadRef(ValueError):  # noqa: N818 - pairs with NotFound
    """The reference is not one ``why`` reads, or a trace id prefix matches several turns: the
    caller's input (CLI exit 2, API 400); the message says what to give instead."""


PRICE_LOOKBACK_S = 3600.0
"""``why`` prices recomputing from the prefill requests of the hour before the turn (and the
turn itself): one turn and its predecessor alone often measure nothing, and then a pull
slower than recomputing went unnamed in ``why`` while ``slow`` named it."""


def diagnosis_context(turns: Iterable[Turn], *, measured_rate: float | None = None) -> Context:
    """What the diagnoses of these turns share: the prefill node's cost per token, the fastest
    of the rate measured by these turns and their predecessors and ``measured_rate`` (one
    found beside them, as :meth:`SpanSource.fastest_compute_rate` finds it)."""
    pool: list[Turn] = []
    for turn in turns:
        pool.append(turn)
        if turn.previous is not None:
            pool.append(turn.previous)
    rates = [] if measured_rate is None else [measured_rate]
    found = per_token_compute_s(pool)
    if found is not None:
        rates.append(found)
    return Context(per_token_s=min(rates) if rates else None)


def _why_context(source: SpanSource, turn: Turn) -> Context:
    """:func:`diagnosis_context` for one turn, priced over the hour before it (every prefill
    request of that hour: a store's span index keeps their rates in narrow rows)."""
    start = turn.prefill.start_ns if turn.prefill is not None else turn.start_ns
    end = max(turn.end_ns, start + 1)
    rate = source.fastest_compute_rate(since_ns=max(start - int(PRICE_LOOKBACK_S * 1e9), 0), until_ns=end)
    return diagnosis_context([turn], measured_rate=rate)


# ------------------------------------------------------------------ the three queries


def slow(
    source: SpanSource, *, since_ns: int | None = None, until_ns: int | None = None, limit: int = 10
) -> dict[str, Any]:
    """The slowest counted turns of the window (:func:`otelkv.analysis.scope.counted`), each
    with its phase split and diagnoses."""
    spans, traces = _slowest_counted(source, since_ns, until_ns, limit)
    turns = load_turns(source, spans, fetched=traces)
    ctx = diagnosis_context(turns)
    turns.sort(key=lambda t: (-t.total_s, t.start_ns))
    return turn_json.document(
        "slow",
        **turn_json.window(since_ns, until_ns),
        limit=limit,
        per_token_compute_s=ctx.per_token_s,
        turns=[turn_json.turn_object(t, diagnose(t, ctx)) for t in turns[:limit]],
    )


def _slowest_counted(
    source: SpanSource, since_ns: int | None, until_ns: int | None, limit: int
) -> tuple[list[SpanRecord], dict[str, list[SpanRecord]]]:
    """The ``limit`` slowest turn spans of counted conversations, and the traces the source
    read with them: asks again for as many more as were left out, so left-out turns never
    shorten the list (there are few of them)."""
    ask = limit
    while True:
        spans, traces = source.slowest_turns(since_ns=since_ns, until_ns=until_ns, limit=ask)
        kept = scope.counted_spans(spans)
        if len(kept) >= limit or len(spans) < ask:
            return kept[:limit], traces
        ask += len(spans) - len(kept)


def conversation(
    source: SpanSource, conversation_id: str, *, limit: int = CONVERSATION_LIMIT
) -> dict[str, Any]:
    """Every turn of a conversation in order, each placed on the conversation's time line.

    The turns' traces are read with their turn spans in one go (:meth:`SpanSource.conversation_spans`)
    and each trace's turn span picked here as ``turn_spans`` picks it."""
    by_trace = group_by_trace(source.conversation_spans(conversation_id, limit=limit))
    spans = one_per_trace(
        [
            s
            for trace in by_trace.values()
            for s in trace
            if is_turn_span(s) and attr_str(s.attributes, names.GEN_AI_CONVERSATION_ID) == conversation_id
        ]
    )
    if not spans:
        raise NotFound(
            f"no turns for conversation {conversation_id!r}; `otelkv slow --since 1d` lists recent "
            "conversation ids (clients without an id get a fingerprint id, shown there too)"
        )
    turns = load_turns(source, spans, conversation_id=conversation_id, fetched=by_trace)
    turns.sort(key=lambda t: (t.index if t.index is not None else -1, t.start_ns))
    ctx = diagnosis_context(turns)
    origin = min(t.gap_start_ns for t in turns) if turns else 0
    return turn_json.document(
        "conversation",
        conversation_id=conversation_id,
        turn_count=len(turns),
        total_s=turn_json.r6(sum(t.total_s for t in turns)),
        per_token_compute_s=ctx.per_token_s,
        turns=[
            turn_json.turn_object(t, diagnose(t, ctx), offset_s=(t.gap_start_ns - origin) / 1e9)
            for t in turns
        ],
    )


def parse_ref(ref: str) -> tuple[str, str, int | None]:
    """``("trace", trace_id, None)``, ``("prefix", leading_digits, None)`` (a short trace id
    as the tables print it) or ``("turn", conversation_id, index)``; :class:`BadRef` if none."""
    ref = ref.strip()
    if _HEX.match(ref) and len(ref) == TRACE_ID_DIGITS:
        return "trace", ref.lower(), None
    if _HEX.match(ref) and MIN_PREFIX_DIGITS <= len(ref) < TRACE_ID_DIGITS:
        return "prefix", ref.lower(), None
    if "#" in ref:
        conv, _, index = ref.rpartition("#")
        if conv and index.isdigit():
            return "turn", conv, int(index)
    raise BadRef(
        f"{ref[:80]!r} is neither a trace id (32 hex digits, or its first {MIN_PREFIX_DIGITS} or more) "
        "nor CONVERSATION#INDEX (e.g. conv-42#3, 0-based)"
    )


def trace_by_prefix(source: SpanSource, prefix: str) -> str:
    """The one turn's trace id starting with ``prefix``: :class:`NotFound` when none does,
    :class:`BadRef` (saying how many) when several do."""
    found = source.traces_with_prefix(prefix, limit=PREFIX_MATCH_LIMIT + 1)
    if not found:
        raise NotFound(
            f"no turn's trace id starts with {prefix} (it may have aged out or not arrived yet; "
            "`otelkv slow` lists recent turns)"
        )
    if len(found) > 1:
        many = f"over {PREFIX_MATCH_LIMIT}" if len(found) > PREFIX_MATCH_LIMIT else str(len(found))
        raise BadRef(
            f"{prefix} is ambiguous: {many} turns have a trace id starting with it; give more digits "
            "(`--wide` prints whole ids) or CONVERSATION#INDEX"
        )
    return found[0]


def _no_turn(source: SpanSource, conversation_id: str, index: int) -> str:
    """Why CONVERSATION#INDEX found nothing: no such conversation (or a shortened id copied
    from a table), or no such turn in it."""
    if ".." in conversation_id:
        return (
            f"no conversation {conversation_id!r}: ids with '..' are shortened in tables; use the "
            "TRACE column, or --wide for whole ids"
        )
    if not source.turn_spans(since_ns=None, until_ns=None, limit=1, conversation_id=conversation_id):
        return (
            f"no conversation {conversation_id!r} in the store; `otelkv slow --since 1d` lists recent "
            "conversation ids"
        )
    return f"no turn {index} in conversation {conversation_id!r} (turn indexes are 0-based)"


def why(source: SpanSource, ref: str) -> dict[str, Any]:
    """Everything that went wrong with one turn, ranked by estimated cost, with evidence and fixes.

    ``ref`` as :func:`parse_ref` reads it: a trace id, a unique prefix of one (the short id
    the tables print), or CONVERSATION#INDEX.
    """
    kind, key, index = parse_ref(ref)
    if kind == "turn":
        assert index is not None
        span = source.find_turn(key, index)
        if span is None:
            raise NotFound(_no_turn(source, key, index))
        trace_id = span.trace_id
    elif kind == "prefix":
        trace_id = trace_by_prefix(source, key)
    else:
        trace_id = key
    spans = source.turn_trace_spans(trace_id)
    if not any(s.trace_id == trace_id for s in spans):
        raise NotFound(
            f"no spans for trace {trace_id} in the store (it may have aged out or not arrived yet)"
        )
    turn = load_trace(source, trace_id, spans)
    if turn is None:
        raise NotFound(f"trace {trace_id} holds no agent turn and no engine request")
    ctx = _why_context(source, turn)
    return turn_json.document(
        "why",
        ref=ref,
        per_token_compute_s=ctx.per_token_s,
        turn=turn_json.turn_object(turn, diagnose(turn, ctx)),
    )
