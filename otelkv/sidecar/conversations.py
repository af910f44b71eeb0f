"""Per-conversation turn state: turn index, the gap before each turn, the previous turn.

The sidecar sees each turn as the agent sent it; what it remembers between turns is
what it needs to split the gap (when the previous response ended, whether it asked for
tools) and to link turns (the previous trace id). State is bounded: the least recently
active conversation is forgotten first, and a forgotten conversation restarts at the
index it had (unknown: counted from 0 again, which ``otelkv`` shows as a new session).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class _State:
    next_index: int = 0
    last_end_ns: int = 0
    last_trace_id: str = ""
    last_asked_tools: bool = False
    last_tool_call_ids: tuple[str, ...] = ()
    in_flight: int = 0


class TurnStart(NamedTuple):
    """What the sidecar knows about a turn when its request arrives (a named tuple: it crosses
    to the main process inside the turn record, see :mod:`otelkv.sidecar.channel`)."""

    index: int
    previous_trace_id: str
    gap_start_ns: int
    """When the previous response ended (0: first turn, or previous still running)."""
    previous_asked_tools: bool
    previous_tool_call_ids: tuple[str, ...]


class ConversationTracker:
    """Thread-safe, bounded map from conversation id to its turn state."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._states: OrderedDict[str, _State] = OrderedDict()
        self._lock = threading.Lock()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._states)

    def begin(self, conversation_id: str) -> TurnStart:
        with self._lock:
            state = self._states.get(conversation_id)
            if state is None:
                state = _State()
                self._states[conversation_id] = state
                while len(self._states) > self._capacity:
                    self._states.popitem(last=False)
                    self.forgotten += 1
            else:
                self._states.move_to_end(conversation_id)
            index = state.next_index
            state.next_index += 1
            # A gap exists only when nothing of this conversation was in flight: an agent
            # sending parallel requests has no idle time between them.
            gap_start = state.last_end_ns if state.in_flight == 0 else 0
            state.in_flight += 1
            return TurnStart(
                index, state.last_trace_id, gap_start, state.last_asked_tools, state.last_tool_call_ids
            )

    def end(
        self,
        conversation_id: str,
        *,
        trace_id: str,
        end_ns: int,
        asked_tools: bool,
        tool_call_ids: tuple[str, ...] = (),
    ) -> None:
        with self._lock:
            state = self._states.get(conversation_id)
            if state is None:
                return
            state.in_flight = max(state.in_flight - 1, 0)
            if end_ns >= state.last_end_ns:
                state.last_end_ns = end_ns
                state.last_trace_id = trace_id
                state.last_asked_tools = asked_tools
                state.last_tool_call_ids = tool_call_ids
