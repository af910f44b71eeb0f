"""Task time: a whole conversation's wall time, as the sidecar can know it.

A task starts at its conversation's first request arrival and ends at the last response
byte of its last turn. Nothing in an OpenAI-style request says "this was the last turn", so a
conversation counts as finished once no turn of it ended for ``idle_s`` seconds
(:data:`otelkv.names.CONVERSATION_IDLE_SECONDS` by default), or when the bounded state has to
forget it to make room. A conversation that comes back after the idle time starts a new task:
the metric then shows two tasks, which is what an operator's "task" usually is anyway (an
agent resumed after a quarter of an hour has also lost its decode KV).

Runs in the sidecar's main process from finished turn records; :meth:`TaskClock.expire` is
called as turns are recorded and on every ``/metrics`` scrape, so a finished task shows up at
the latest one scrape after its idle time ran out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from otelkv import names


@dataclass
class _Task:
    start_ns: int
    end_ns: int
    model: str


@dataclass(frozen=True)
class FinishedTask:
    model: str
    seconds: float


class TaskClock:
    """Thread-safe, bounded: conversation id -> first arrival and last end of its turns."""

    def __init__(self, idle_s: float = names.CONVERSATION_IDLE_SECONDS, capacity: int = 100_000) -> None:
        self.idle_ns = int(idle_s * 1e9)
        self.capacity = capacity
        self._tasks: OrderedDict[str, _Task] = OrderedDict()
        """Ordered by last end: the first entry is the one idle longest."""
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tasks)

    def turn(self, conversation_id: str, model: str, start_ns: int, end_ns: int) -> list[FinishedTask]:
        """Add one finished turn; returns tasks this turn ended (it came after the idle time,
        or the state was full and the longest-idle conversation had to go)."""
        finished: list[FinishedTask] = []
        with self._lock:
            task = self._tasks.get(conversation_id)
            if task is not None and start_ns - task.end_ns > self.idle_ns:
                finished.append(_finish(task))
                task = None
            if task is None:
                task = _Task(start_ns, end_ns, model)
                self._tasks[conversation_id] = task
                while len(self._tasks) > self.capacity:
                    _, oldest = self._tasks.popitem(last=False)
                    finished.append(_finish(oldest))
            else:
                task.start_ns = min(task.start_ns, start_ns)
                task.end_ns = max(task.end_ns, end_ns)
            self._tasks.move_to_end(conversation_id)
        return finished

    def expire(self, now_ns: int) -> list[FinishedTask]:
        """Tasks whose last turn ended more than the idle time before ``now_ns``."""
        finished: list[FinishedTask] = []
        with self._lock:
            while self._tasks:
                conversation_id, task = next(iter(self._tasks.items()))
                if now_ns - task.end_ns <= self.idle_ns:
                    break
                del self._tasks[conversation_id]
                finished.append(_finish(task))
        return finished


def _finish(task: _Task) -> FinishedTask:
    return FinishedTask(task.model, max(task.end_ns - task.start_ns, 0) / 1e9)
