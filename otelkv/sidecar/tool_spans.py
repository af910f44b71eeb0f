"""Recent ``execute_tool`` spans from agents, to measure tool wait between turns.

Agents that export their own spans (to the sidecar's OTLP receiver) say exactly when
tools ran. The sidecar keeps the recent ones, bounded, indexed by conversation id and by
tool call id (an agent's tool span may carry either), and answers "which tool time fell
in this gap" at turn end.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable

from otelkv import names
from otelkv.sidecar.identity import DEFAULT_POLICY, IdPolicy, clean_id
from otelkv.spans import SpanRecord, is_tool_span

_PER_KEY = 64


class ToolSpanIndex:
    def __init__(self, capacity: int = 50_000, *, id_policy: IdPolicy = DEFAULT_POLICY) -> None:
        self._capacity = capacity
        self._id_policy = id_policy
        self._by_key: OrderedDict[str, deque[tuple[int, int]]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, spans: Iterable[SpanRecord]) -> int:
        added = 0
        for span in spans:
            if not is_tool_span(span):
                continue
            keys = []
            # The agent sends the id as it knows it; the turn was keyed by the id as the
            # sidecar keeps it (over-long or hash mode: hashed), so look it up the same way.
            conversation = clean_id(span.attributes.get(names.GEN_AI_CONVERSATION_ID), self._id_policy)
            if conversation:
                keys.append("c:" + conversation)
            call_id = span.attributes.get(names.GEN_AI_TOOL_CALL_ID)
            if isinstance(call_id, str) and call_id:
                keys.append("t:" + call_id)
            if not keys:
                continue
            with self._lock:
                for key in keys:
                    bucket = self._by_key.get(key)
                    if bucket is None:
                        bucket = self._by_key[key] = deque(maxlen=_PER_KEY)
                        while len(self._by_key) > self._capacity:
                            self._by_key.popitem(last=False)
                    else:
                        self._by_key.move_to_end(key)
                    bucket.append((span.start_ns, span.end_ns))
            added += 1
        return added

    def intervals(
        self, start_ns: int, end_ns: int, *, conversation_id: str, call_ids: Iterable[str] = ()
    ) -> list[tuple[int, int]]:
        """Tool intervals of this conversation (or these calls) that overlap [start, end)."""
        keys = ["c:" + conversation_id, *("t:" + c for c in call_ids)]
        out: set[tuple[int, int]] = set()
        with self._lock:
            for key in keys:
                for s, e in self._by_key.get(key, ()):
                    if e > start_ns and s < end_ns:
                        out.add((s, e))
        return sorted(out)
