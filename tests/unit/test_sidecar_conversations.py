"""Per-conversation turn state: indexes, gaps, parallel requests and the bounded memory."""

from __future__ import annotations

import threading

from otelkv.sidecar.conversations import ConversationTracker, TurnStart


def _turn(tracker: ConversationTracker, cid: str, end_ns: int, *, asked: bool = False) -> TurnStart:
    start = tracker.begin(cid)
    tracker.end(
        cid, trace_id=f"t{end_ns}", end_ns=end_ns, asked_tools=asked, tool_call_ids=("c",) if asked else ()
    )
    return start


def test_index_increments_per_conversation() -> None:
    """Each conversation counts its own turns from 0."""
    tracker = ConversationTracker()
    assert [_turn(tracker, "a", 10 + i).index for i in range(3)] == [0, 1, 2]
    assert _turn(tracker, "b", 50).index == 0
    assert _turn(tracker, "a", 60).index == 3
    assert len(tracker) == 2


def test_gap_starts_at_previous_end_and_links_previous_turn() -> None:
    """The next turn's gap starts when the previous response ended; tool facts carry over."""
    tracker = ConversationTracker()
    first = _turn(tracker, "a", 100, asked=True)
    assert (first.gap_start_ns, first.previous_trace_id, first.previous_asked_tools) == (0, "", False)
    second = tracker.begin("a")
    assert second.gap_start_ns == 100
    assert second.previous_trace_id == "t100"
    assert second.previous_asked_tools and second.previous_tool_call_ids == ("c",)


def test_parallel_in_flight_requests_have_no_gap() -> None:
    """A request sent while another of the conversation is running has no idle gap before it."""
    tracker = ConversationTracker()
    _turn(tracker, "a", 100)
    one = tracker.begin("a")
    two = tracker.begin("a")
    assert one.gap_start_ns == 100 and two.gap_start_ns == 0
    assert (one.index, two.index) == (1, 2)
    tracker.end("a", trace_id="late", end_ns=300, asked_tools=False)
    tracker.end("a", trace_id="early", end_ns=200, asked_tools=True)  # ends out of order
    after = tracker.begin("a")
    assert after.gap_start_ns == 300 and after.previous_trace_id == "late"
    assert not after.previous_asked_tools


def test_lru_capacity_forgets_least_recently_active() -> None:
    """Past capacity the least recently active conversation is forgotten and restarts at 0."""
    tracker = ConversationTracker(capacity=2)
    _turn(tracker, "a", 1)
    _turn(tracker, "b", 2)
    _turn(tracker, "a", 3)  # a is now more recent than b
    _turn(tracker, "c", 4)  # evicts b
    assert len(tracker) == 2 and tracker.forgotten == 1
    assert tracker.begin("a").index == 2
    restarted = tracker.begin("b")  # evicts c
    assert restarted.index == 0 and restarted.gap_start_ns == 0
    assert tracker.forgotten == 2


def test_end_of_unknown_conversation_is_ignored() -> None:
    """Ending a conversation never begun (or already forgotten) changes nothing."""
    tracker = ConversationTracker()
    tracker.end("ghost", trace_id="t", end_ns=5, asked_tools=True)
    assert len(tracker) == 0
    assert tracker.begin("ghost").gap_start_ns == 0


def test_thread_safe_indexes() -> None:
    """Concurrent begins from many threads hand out every index exactly once."""
    tracker = ConversationTracker()
    seen: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(200):
            index = tracker.begin("a").index
            with lock:
                seen.append(index)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(800))
