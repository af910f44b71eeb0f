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

from otelkv.analysis import turn_json
from otelkv.analysis.diagnose import Context, diagnose
from otelkv.analysis.linker import load_trace, load_turns
from otelkv.analysis.model import Turn, per_token_compute_s
from otelkv.analysis.sources import SpanSource

CONVERSATION_LIMIT = 1000
"""Most turns ``conversation`` shows (the last ones are kept when a conversation is longer)."""

_TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")


class NotFound(LookupError):  # noqa: N818 - the name the API promises
    """The turn, trace or conversation asked for is not in the store (message says what to try)."""


def diagnosis_context(turns: Iterable[Turn]) -> Context:
    """What the diagnoses of these turns share: the prefill node's cost per token (theirs and
    their predecessors')."""
    pool: list[Turn] = []
    for turn in turns:
        pool.append(turn)
        if turn.previous is not None:
            pool.append(turn.previous)
    return Context(per_token_s=per_token_compute_s(pool))


# ------------------------------------------------------------------ the three queries


def slow(
    source: SpanSource, *, since_ns: int | None = None, until_ns: int | None = None, limit: int = 10
) -> dict[str, Any]:
    """The slowest turns of the window, each with its phase split and diagnoses."""
    spans = source.turn_spans(since_ns=since_ns, until_ns=until_ns, limit=limit, slowest_first=True)
    turns = load_turns(source, spans)
    ctx = diagnosis_context(turns)
    turns.sort(key=lambda t: (-t.total_s, t.start_ns))
    return turn_json.document(
        "slow",
        **turn_json.window(since_ns, until_ns),
        limit=limit,
        per_token_compute_s=ctx.per_token_s,
        turns=[turn_json.turn_object(t, diagnose(t, ctx)) for t in turns[:limit]],
    )


def conversation(
    source: SpanSource, conversation_id: str, *, limit: int = CONVERSATION_LIMIT
) -> dict[str, Any]:
    """Every turn of a conversation in order, each placed on the conversation's time line."""
    spans = source.turn_spans(
        since_ns=None, until_ns=None, limit=limit, slowest_first=False, conversation_id=conversation_id
    )
    if not spans:
        raise NotFound(
            f"no turns for conversation {conversation_id!r}; `otelkv slow --since 1d` lists recent "
            "conversation ids (clients without an id get a fingerprint id, shown there too)"
        )
    turns = load_turns(source, spans, conversation_id=conversation_id)
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


def parse_ref(ref: str) -> tuple[str, str | None, int | None]:
    """``("trace", trace_id, None)`` or ``("turn", conversation_id, index)``; NotFound if neither."""
    ref = ref.strip()
    if _TRACE_ID.match(ref):
        return "trace", ref.lower(), None
    if "#" in ref:
        conv, _, index = ref.rpartition("#")
        if conv and index.isdigit():
            return "turn", conv, int(index)
    raise NotFound(
        f"{ref!r} is neither a trace id (32 hex digits) nor CONVERSATION#INDEX (e.g. conv-42#3, 0-based)"
    )


def why(source: SpanSource, ref: str) -> dict[str, Any]:
    """Everything that went wrong with one turn, ranked by estimated cost, with evidence and fixes."""
    kind, key, index = parse_ref(ref)
    if kind == "turn":
        assert key is not None and index is not None
        span = source.find_turn(key, index)
        if span is None:
            raise NotFound(f"no turn {index} in conversation {key!r} (turn indexes are 0-based)")
        trace_id = span.trace_id
    else:
        trace_id = str(key)
    spans = source.trace_spans([trace_id])
    if not spans:
        raise NotFound(
            f"no spans for trace {trace_id} in the store (it may have aged out or not arrived yet)"
        )
    turn = load_trace(source, trace_id, spans)
    if turn is None:
        raise NotFound(f"trace {trace_id} holds no agent turn and no engine request")
    ctx = diagnosis_context([turn])
    return turn_json.document(
        "why",
        ref=ref,
        per_token_compute_s=ctx.per_token_s,
        turn=turn_json.turn_object(turn, diagnose(turn, ctx)),
    )
