"""Where the analysis reads spans from: a store, a ClickHouse cluster, or a list in memory.

Every source answers the same questions (:class:`SpanSource`), so ``slow``,
``conversation``, ``why``, ``tune`` and ``compare`` run unchanged on the sidecar's embedded
store, a fleet's ClickHouse and the spans of a unit test.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from otelkv import names
from otelkv.analysis.model import request_compute_rate
from otelkv.spans import (
    SpanRecord,
    attr_float,
    attr_int,
    attr_str,
    is_engine_request,
    is_tool_span,
    is_turn_span,
    opt_int,
)
from otelkv.spans.kinds import one_per_trace, turn_rank


def group_by_trace(spans: Iterable[SpanRecord]) -> dict[str, list[SpanRecord]]:
    out: dict[str, list[SpanRecord]] = {}
    for span in spans:
        out.setdefault(span.trace_id, []).append(span)
    return out


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

    def slowest_turns(
        self, *, since_ns: int | None, until_ns: int | None, limit: int
    ) -> tuple[list[SpanRecord], dict[str, list[SpanRecord]]]:
        """``turn_spans``' ``limit`` slowest turn spans of the window, and the traces the
        source read with them (trace id -> spans: theirs and, as far as it could guess them,
        their previous turns'; empty when it read none)."""
        ...

    def conversation_spans(self, conversation_id: str, *, limit: int) -> list[SpanRecord]:
        """Every span of the traces of a conversation's first ``limit`` turns (the turns
        ``turn_spans`` finds for ``conversation_id``), their turn spans included."""
        ...

    def turn_trace_spans(self, trace_id: str) -> list[SpanRecord]:
        """Every span of one trace and, when the source can tell cheaply which turn came
        before it in its conversation, of that turn's trace too, read together. Only a
        guess: the turn span's own link (``otelkv.turn.previous_trace_id``) decides which
        trace is its previous turn's (:func:`otelkv.analysis.linker.load_trace`)."""
        ...

    def tool_spans(
        self,
        *,
        since_ns: int | None,
        until_ns: int | None,
        conversation_id: str | None = None,
        conversation_ids: Sequence[str] | None = None,
        windows: Sequence[tuple[int, int]] | None = None,
    ) -> list[SpanRecord]:
        """Tool spans overlapping ``[since_ns, until_ns]`` (and, with ``windows``, one of these
        ``[lo, hi]``: the gaps before a few turns far apart), of one conversation or several."""
        ...

    def find_turn(self, conversation_id: str, index: int) -> SpanRecord | None: ...

    def traces_with_prefix(self, prefix: str, *, limit: int = 100) -> list[str]:
        """Trace ids starting with ``prefix`` (lower-case hex) whose trace holds a turn span
        or an engine request, sorted, at most ``limit`` (a short id's lookup)."""
        ...

    def engine_requests(
        self,
        *,
        since_ns: int,
        until_ns: int,
        roots_only: bool = False,
        limit: int | None = None,
    ) -> list[SpanRecord]:
        """Engine request spans starting in ``[since_ns, until_ns)``, in start order, at most
        ``limit``."""
        ...

    def fastest_compute_rate(self, *, since_ns: int, until_ns: int) -> float | None:
        """The fewest seconds per computed prompt token among the prefill requests starting in
        ``[since_ns, until_ns)`` (:func:`otelkv.analysis.model.request_compute_rate`), or None
        when none measures compute."""
        ...


def _span_total_s(span: SpanRecord) -> float:
    return attr_float(span.attributes, names.TURN_TOTAL_SECONDS, span.duration_s)


class InMemorySource:
    """A :class:`SpanSource` over a span list (unit tests, span files, the demo)."""

    def __init__(self, spans: Iterable[SpanRecord]) -> None:
        self.spans = list(spans)
        # One turn span per trace, picked as the store's query picks it.
        self._turns = one_per_trace([s for s in self.spans if is_turn_span(s)])

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

    def slowest_turns(
        self, *, since_ns: int | None, until_ns: int | None, limit: int
    ) -> tuple[list[SpanRecord], dict[str, list[SpanRecord]]]:
        return self.turn_spans(since_ns=since_ns, until_ns=until_ns, limit=limit), {}

    def conversation_spans(self, conversation_id: str, *, limit: int) -> list[SpanRecord]:
        turns = self.turn_spans(limit=limit, slowest_first=False, conversation_id=conversation_id)
        return self.trace_spans([s.trace_id for s in turns])

    def turn_trace_spans(self, trace_id: str) -> list[SpanRecord]:
        return self.trace_spans([trace_id])

    def tool_spans(
        self,
        *,
        since_ns: int | None = None,
        until_ns: int | None = None,
        conversation_id: str | None = None,
        conversation_ids: Sequence[str] | None = None,
        windows: Sequence[tuple[int, int]] | None = None,
    ) -> list[SpanRecord]:
        wanted = set(conversation_ids) if conversation_ids is not None else None
        return [
            s
            for s in self.spans
            if is_tool_span(s)
            and (since_ns is None or s.end_ns > since_ns)
            and (until_ns is None or s.start_ns < until_ns)
            and (windows is None or any(s.end_ns >= lo and s.start_ns <= hi for lo, hi in windows))
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
        return min(found, key=turn_rank) if found else None

    def traces_with_prefix(self, prefix: str, *, limit: int = 100) -> list[str]:
        found = {
            s.trace_id
            for s in self.spans
            if s.trace_id.startswith(prefix) and (is_turn_span(s) or is_engine_request(s))
        }
        return sorted(found)[:limit]

    def engine_requests(
        self,
        *,
        since_ns: int,
        until_ns: int,
        roots_only: bool = False,
        limit: int | None = None,
    ) -> list[SpanRecord]:
        out = sorted(
            (
                s
                for s in self.spans
                if is_engine_request(s)
                and since_ns <= s.start_ns < until_ns
                and (not roots_only or not s.parent_span_id)
            ),
            key=lambda s: (s.start_ns, s.span_id),
        )
        if limit is not None:
            out = out[:limit]
        return out

    def fastest_compute_rate(self, *, since_ns: int, until_ns: int) -> float | None:
        rates = [
            rate
            for rate in map(request_compute_rate, self.engine_requests(since_ns=since_ns, until_ns=until_ns))
            if rate is not None
        ]
        return min(rates, default=None)


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

    def slowest_turns(
        self, *, since_ns: int | None, until_ns: int | None, limit: int
    ) -> tuple[list[SpanRecord], dict[str, list[SpanRecord]]]:
        turns, traces = self._q().slowest_turns(self.store, since_ns=since_ns, until_ns=until_ns, limit=limit)
        return list(turns), dict(traces)

    def conversation_spans(self, conversation_id: str, *, limit: int) -> list[SpanRecord]:
        return list(self._q().conversation_spans(self.store, conversation_id, limit=limit))

    def turn_trace_spans(self, trace_id: str) -> list[SpanRecord]:
        return list(self._q().turn_trace_spans(self.store, trace_id))

    def tool_spans(
        self,
        *,
        since_ns: int | None = None,
        until_ns: int | None = None,
        conversation_id: str | None = None,
        conversation_ids: Sequence[str] | None = None,
        windows: Sequence[tuple[int, int]] | None = None,
    ) -> list[SpanRecord]:
        return list(
            self._q().tool_spans(
                self.store,
                since_ns=since_ns,
                until_ns=until_ns,
                conversation_id=conversation_id,
                conversation_ids=conversation_ids,
                windows=windows,
            )
        )

    def find_turn(self, conversation_id: str, index: int) -> SpanRecord | None:
        return self._q().find_turn(self.store, conversation_id, index)  # type: ignore[no-any-return]

    def traces_with_prefix(self, prefix: str, *, limit: int = 100) -> list[str]:
        return list(self._q().traces_with_prefix(self.store, prefix, limit=limit))

    def engine_requests(
        self,
        *,
        since_ns: int,
        until_ns: int,
        roots_only: bool = False,
        limit: int | None = None,
    ) -> list[SpanRecord]:
        return list(
            self._q().engine_requests(
                self.store,
                since_ns=since_ns,
                until_ns=until_ns,
                roots_only=roots_only,
                limit=limit,
            )
        )

    def fastest_compute_rate(self, *, since_ns: int, until_ns: int) -> float | None:
        return self._q().fastest_compute_rate(  # type: ignore[no-any-return]
            self.store, since_ns=since_ns, until_ns=until_ns
        )
