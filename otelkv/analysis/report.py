"""The query service behind ``otelkv slow|conversation|why`` and the sidecar's query API.

Every function takes a :class:`SpanSource` and returns a JSON-able dict; the CLI renders
the dicts and the sidecar's HTTP API returns them unchanged, so both show the same
thing. Queries stay few on purpose (a store may hold a million turns): fetch the N turn
spans, then their traces and their previous turns' traces in one ``trace_spans`` call,
then the agent's tool spans of the window in one ``tool_spans`` call.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from otelkv import names
from otelkv.analysis.attrs import attr_float, attr_int, attr_str, opt_int
from otelkv.analysis.diagnose import Context, Diagnosis, diagnose
from otelkv.analysis.model import (
    Turn,
    build_turn,
    group_by_trace,
    is_agent_turn_span,
    is_sidecar_turn_span,
    is_tool_span,
    per_token_compute_s,
)
from otelkv.sidecar.otlp import SpanRecord

CONVERSATION_LIMIT = 1000
"""Most turns ``conversation`` shows (the last ones are kept when a conversation is longer)."""

_TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")


class NotFound(LookupError):  # noqa: N818 - the name the API promises
    """The turn, trace or conversation asked for is not in the store (message says what to try)."""


class SpanSource(Protocol):
    """Where spans come from: the store, a ClickHouse cluster, or a list in memory."""

    def turn_spans(
        self,
        *,
        since_ns: int | None,
        until_ns: int | None,
        limit: int | None,
        slowest_first: bool = True,
        conversation_id: str | None = None,
    ) -> list[SpanRecord]: ...

    def trace_spans(self, trace_ids: Sequence[str]) -> list[SpanRecord]: ...

    def tool_spans(
        self,
        *,
        since_ns: int | None,
        until_ns: int | None,
        conversation_id: str | None = None,
        conversation_ids: Sequence[str] | None = None,
    ) -> list[SpanRecord]: ...

    def find_turn(self, conversation_id: str, index: int) -> SpanRecord | None: ...


def _span_total_s(span: SpanRecord) -> float:
    return attr_float(span.attributes, names.TURN_TOTAL_SECONDS, span.duration_s)


class InMemorySource:
    """A :class:`SpanSource` over a span list (unit tests, span files, the demo)."""

    def __init__(self, spans: Iterable[SpanRecord]) -> None:
        self.spans = list(spans)
        by_trace = group_by_trace(self.spans)
        # A trace's turn span: the sidecar's, else an agent chat span with a turn index.
        self._turns: list[SpanRecord] = []
        for group in by_trace.values():
            sidecar = [s for s in group if is_sidecar_turn_span(s)]
            self._turns.extend(sidecar or [s for s in group if is_agent_turn_span(s)][:1])

    def turn_spans(
        self,
        *,
        since_ns: int | None = None,
        until_ns: int | None = None,
        limit: int | None = 20,
        slowest_first: bool = True,
        conversation_id: str | None = None,
    ) -> list[SpanRecord]:
        out = [
            s
            for s in self._turns
            if (since_ns is None or s.start_ns >= since_ns)
            and (until_ns is None or s.start_ns < until_ns)
            and (
                conversation_id is None
                or attr_str(s.attributes, names.GEN_AI_CONVERSATION_ID) == conversation_id
            )
        ]
        if slowest_first:
            out.sort(key=lambda s: (-_span_total_s(s), s.start_ns))
        else:
            out.sort(key=lambda s: (s.start_ns, attr_int(s.attributes, names.TURN_INDEX)))
        return out[:limit]

    def trace_spans(self, trace_ids: Sequence[str]) -> list[SpanRecord]:
        wanted = set(trace_ids)
        return [s for s in self.spans if s.trace_id in wanted]

    def tool_spans(
        self,
        *,
        since_ns: int | None = None,
        until_ns: int | None = None,
        conversation_id: str | None = None,
        conversation_ids: Sequence[str] | None = None,
    ) -> list[SpanRecord]:
        wanted = set(conversation_ids) if conversation_ids is not None else None
        return [
            s
            for s in self.spans
            if is_tool_span(s)
            and (since_ns is None or s.end_ns > since_ns)
            and (until_ns is None or s.start_ns < until_ns)
            and (
                conversation_id is None
                or attr_str(s.attributes, names.GEN_AI_CONVERSATION_ID) == conversation_id
            )
            and (wanted is None or attr_str(s.attributes, names.GEN_AI_CONVERSATION_ID) in wanted)
        ]

    def find_turn(self, conversation_id: str, index: int) -> SpanRecord | None:
        found = [
            s
            for s in self._turns
            if attr_str(s.attributes, names.GEN_AI_CONVERSATION_ID) == conversation_id
            and opt_int(s.attributes, names.TURN_INDEX) == index
        ]
        return max(found, key=lambda s: s.start_ns) if found else None


class StoreSource:
    """A :class:`SpanSource` over an open store, through :mod:`otelkv.store.queries`."""

    def __init__(self, store: Any) -> None:
        self.store = store

    @staticmethod
    def _q() -> Any:
        from otelkv.store import queries  # lazy: chDB is an optional, heavy import

        return queries

    def turn_spans(
        self,
        *,
        since_ns: int | None = None,
        until_ns: int | None = None,
        limit: int | None = 20,
        slowest_first: bool = True,
        conversation_id: str | None = None,
    ) -> list[SpanRecord]:
        return list(
            self._q().turn_spans(
                self.store,
                since_ns=since_ns,
                until_ns=until_ns,
                limit=limit,
                slowest_first=slowest_first,
                conversation_id=conversation_id,
            )
        )

    def trace_spans(self, trace_ids: Sequence[str]) -> list[SpanRecord]:
        if not trace_ids:
            return []
        return list(self._q().trace_spans(self.store, list(trace_ids)))

    def tool_spans(
        self,
        *,
        since_ns: int | None = None,
        until_ns: int | None = None,
        conversation_id: str | None = None,
        conversation_ids: Sequence[str] | None = None,
    ) -> list[SpanRecord]:
        return list(
            self._q().tool_spans(
                self.store,
                since_ns=since_ns,
                until_ns=until_ns,
                conversation_id=conversation_id,
                conversation_ids=conversation_ids,
            )
        )

    def find_turn(self, conversation_id: str, index: int) -> SpanRecord | None:
        return self._q().find_turn(self.store, conversation_id, index)  # type: ignore[no-any-return]


# ------------------------------------------------------------------ assembling turns


def _load_turns(
    source: SpanSource, turn_spans: Sequence[SpanRecord], *, conversation_id: str | None = None
) -> list[Turn]:
    """Model the given turn spans, each linked to its previous turn, in two or three queries."""
    if not turn_spans:
        return []
    wanted = [s.trace_id for s in turn_spans]
    prev_ids = [attr_str(s.attributes, names.TURN_PREVIOUS_TRACE_ID) for s in turn_spans]
    ids = list(dict.fromkeys(wanted + [p for p in prev_ids if p]))
    by_trace = group_by_trace(source.trace_spans(ids))
    for span in turn_spans:  # the turn span itself, even if trace_spans missed it
        group = by_trace.setdefault(span.trace_id, [])
        if not any(s.span_id == span.span_id for s in group):
            group.append(span)
    lo = min(s.start_ns - int(attr_float(s.attributes, names.TURN_GAP_SECONDS) * 1e9) for s in turn_spans)
    hi = max(s.start_ns for s in turn_spans)
    tools: list[SpanRecord] = []
    if hi > lo:
        if conversation_id is not None:
            tools = source.tool_spans(since_ns=lo, until_ns=hi, conversation_id=conversation_id)
        else:  # only these turns' conversations: a window of days holds far more tool spans
            convs = sorted({attr_str(s.attributes, names.GEN_AI_CONVERSATION_ID) for s in turn_spans} - {""})
            tools = source.tool_spans(since_ns=lo, until_ns=hi, conversation_ids=convs) if convs else []
    previous: dict[str, Turn | None] = {}
    for pid in set(p for p in prev_ids if p) - set(wanted):
        previous[pid] = build_turn(by_trace.get(pid, []), tool_spans=tools)
    out: list[Turn] = []
    built: dict[str, Turn] = {}
    # Oldest first, so a turn whose predecessor is also wanted links to the full model of it.
    for span in sorted(turn_spans, key=lambda s: s.start_ns):
        pid = attr_str(span.attributes, names.TURN_PREVIOUS_TRACE_ID)
        prev = built.get(pid) or previous.get(pid)
        turn = build_turn(by_trace[span.trace_id], tool_spans=tools, previous=prev)
        if turn is not None:
            built[span.trace_id] = turn
            out.append(turn)
    return out


WINDOW_CHUNK = 2000
"""Turns modelled per ``trace_spans`` call by :func:`window_turns` (bounds one query's IN list)."""


def window_turns(
    source: SpanSource, *, since_ns: int | None, until_ns: int | None, max_turns: int | None = None
) -> tuple[list[Turn], int]:
    """Every turn of the window, oldest first, each linked to its previous turn; and how many there were.

    With more than ``max_turns`` turns only the most recent ``max_turns`` are modelled (the
    count says how many were left out). Traces are fetched a chunk at a time; a chunk's first
    turns still link to predecessors in the chunk before (their traces are fetched again).
    """
    spans = source.turn_spans(since_ns=since_ns, until_ns=until_ns, limit=None, slowest_first=False)
    spans = sorted(spans, key=lambda s: s.start_ns)
    total = len(spans)
    if max_turns is not None and total > max_turns:
        spans = spans[total - max_turns :]
    turns: list[Turn] = []
    for i in range(0, len(spans), WINDOW_CHUNK):
        turns.extend(_load_turns(source, spans[i : i + WINDOW_CHUNK]))
    return turns, total


def diagnosis_context(turns: Iterable[Turn]) -> Context:
    """What the diagnoses of these turns share: the prefill node's cost per token (theirs and
    their predecessors')."""
    pool: list[Turn] = []
    for turn in turns:
        pool.append(turn)
        if turn.previous is not None:
            pool.append(turn.previous)
    return Context(per_token_s=per_token_compute_s(pool))


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def turn_row(turn: Turn, diagnoses: Sequence[Diagnosis]) -> dict[str, Any]:
    """The summary row of a turn (one line of ``slow``)."""
    phases = turn.phases
    return {
        "trace_id": turn.trace_id,
        "conversation_id": turn.conversation_id,
        "conversation_inferred": turn.conversation_inferred,
        "turn_index": turn.index,
        "model": turn.model,
        "start_ns": turn.start_ns,
        "total_s": _r(turn.total_s),
        "request_s": _r(turn.request_s),
        "phases": {k: _r(v) for k, v in phases.as_dict().items()} if phases else None,
        "gap_source": phases.gap_source if phases else None,
        "ttft_s": _r(turn.ttft_s),
        "ttft_source": phases.ttft_source if phases else None,
        "stream": turn.stream,
        "status": turn.status,
        "http_status": turn.http_status,
        "top_diagnosis": diagnoses[0].brief() if diagnoses else None,
    }


def waterfall_row(turn: Turn, diagnoses: Sequence[Diagnosis]) -> dict[str, Any]:
    """A ``conversation`` row: the summary plus what happened inside input processing."""
    row = turn_row(turn, diagnoses)
    p = turn.prefill
    t = p.transfer if p else None
    d = turn.decode
    ret = d.retention if d else None
    row.update(
        {
            "gap_s": _r(turn.gap_s),
            "tokens": {
                "input": turn.input_tokens
                if turn.input_tokens is not None
                else (p.prompt_tokens if p else None),
                "computed": p.computed if p else None,
                "local_cache": p.local_hit if p else None,
                "pulled": p.pulled if p else None,
                "remote_reusable": p.remote_reusable if p else None,
                "output": turn.output_tokens,
            },
            "pull": {
                "decision": p.decision if p else None,
                "reason": p.reason if p else None,
                "threshold": p.threshold if p else None,
                "bytes": t.bytes if t else None,
                "seconds": _r(t.xfer_s) if t else None,
                "wait_s": _r(t.wait_s) if t else None,
                "outcome": t.outcome if t else None,
            },
            "handoff": {
                "bytes": d.transfer.bytes if d and d.transfer else None,
                "wait_s": _r(d.transfer.wait_s) if d and d.transfer else None,
                "kv_params_returned": d.kv_params_returned if d else None,
            },
            "retention": {
                "outcome": ret.outcome if ret else None,
                "held_s": _r(ret.held_s) if ret else None,
                "ttl_s": _r(ret.ttl_s) if ret else None,
                "blocks": ret.blocks if ret else None,
                "bytes": ret.bytes if ret else None,
            },
            "router_handle": turn.router.handle if turn.router else None,
            "diagnoses": [diag.id for diag in diagnoses],
        }
    )
    return row


# ------------------------------------------------------------------ the three queries


def slow(
    source: SpanSource, *, since_ns: int | None = None, until_ns: int | None = None, limit: int = 10
) -> dict[str, Any]:
    """The slowest turns of the window, each with its phase split and top diagnosis."""
    spans = source.turn_spans(since_ns=since_ns, until_ns=until_ns, limit=limit, slowest_first=True)
    turns = _load_turns(source, spans)
    ctx = diagnosis_context(turns)
    turns.sort(key=lambda t: (-t.total_s, t.start_ns))
    return {
        "since_ns": since_ns,
        "until_ns": until_ns,
        "limit": limit,
        "per_token_compute_s": ctx.per_token_s,
        "turns": [turn_row(t, diagnose(t, ctx)) for t in turns[:limit]],
    }


def conversation(
    source: SpanSource, conversation_id: str, *, limit: int = CONVERSATION_LIMIT
) -> dict[str, Any]:
    """Every turn of a conversation in order, as waterfall rows."""
    spans = source.turn_spans(
        since_ns=None, until_ns=None, limit=limit, slowest_first=False, conversation_id=conversation_id
    )
    if not spans:
        raise NotFound(
            f"no turns for conversation {conversation_id!r}; `otelkv slow --since 1d` lists recent "
            "conversation ids (clients without an id get a fingerprint id, shown there too)"
        )
    turns = _load_turns(source, spans, conversation_id=conversation_id)
    turns.sort(key=lambda t: (t.index if t.index is not None else -1, t.start_ns))
    ctx = diagnosis_context(turns)
    origin = min(t.gap_start_ns for t in turns) if turns else 0
    rows = []
    for turn in turns:
        row = waterfall_row(turn, diagnose(turn, ctx))
        row["offset_s"] = _r((turn.gap_start_ns - origin) / 1e9)
        rows.append(row)
    return {
        "conversation_id": conversation_id,
        "turn_count": len(rows),
        "total_s": _r(sum(t.total_s for t in turns)),
        "per_token_compute_s": ctx.per_token_s,
        "turns": rows,
    }


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
    probe = build_turn(spans)
    if probe is None:
        raise NotFound(f"trace {trace_id} holds no agent turn and no engine request")
    prev_spans = source.trace_spans([probe.previous_trace_id]) if probe.previous_trace_id else []
    tools: list[SpanRecord] = []
    if probe.conversation_id and probe.gap_s > 0:
        tools = source.tool_spans(
            since_ns=probe.gap_start_ns, until_ns=probe.start_ns, conversation_id=probe.conversation_id
        )
    previous = build_turn(prev_spans) if prev_spans else None
    turn = build_turn(spans, tool_spans=tools, previous=previous) or probe
    ctx = diagnosis_context([turn])
    found = diagnose(turn, ctx)
    return {
        "ref": ref,
        "trace_id": turn.trace_id,
        "conversation_id": turn.conversation_id,
        "turn_index": turn.index,
        "total_s": _r(turn.total_s),
        "phases": {k: _r(v) for k, v in turn.phases.as_dict().items()} if turn.phases else None,
        "per_token_compute_s": ctx.per_token_s,
        "diagnoses": [d.as_dict() for d in found],
        "turn": turn.as_dict(),
    }
