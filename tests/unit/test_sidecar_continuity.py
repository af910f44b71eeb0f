"""The sidecar's history comparison (pure logic and its wiring through the proxy's turn watcher):
message digests in canonical form, the comparison with the previous request and answer, the
answer digested from streamed and whole responses, the recent-turn index for resumes under a
new id and its bounds, the per-conversation memory budget, and fail-open."""

from __future__ import annotations

import json
import os
import pickle
import tracemalloc
from typing import Any

import pytest

from otelkv import names
from otelkv.sidecar import continuity
from otelkv.sidecar.continuity import (
    STATE_OVERHEAD_BYTES,
    AnswerCollector,
    HistoryTracker,
    RecentTurns,
    compare,
    digests,
    message_digest,
)
from otelkv.sidecar.recorder import history_attributes
from otelkv.sidecar.relay import Request
from otelkv.sidecar.response import ResponseObserver
from otelkv.sidecar.turn_watch import CONTINUITY_ERRORS, TurnRecord, TurnWatcher

S = 1_000_000_000
SYSTEM = {"role": "system", "content": "you are an agent"}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls is not None:
        message["tool_calls"] = calls
    return message


def call(name: str, arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def answer_of(message: dict[str, Any]) -> continuity.AnswerDigest:
    collector = AnswerCollector()
    collector.delta(0, message)
    digest = collector.digest()
    assert digest is not None
    return digest


# ------------------------------------------------------------------ canonical form


def test_differences_that_cannot_change_the_prompt_do_not_count() -> None:
    """Key order, absent vs null fields, tool-call ids and types, argument whitespace, text parts
    (joined by newlines, as vLLM renders them): the same digest. Words, roles, argument key
    order (vLLM's templates dump arguments in the order given), tool-call names: another."""
    plain = {"role": "user", "content": "line one\nline two"}
    assert message_digest(plain) == message_digest({"content": "line one\nline two", "role": "user"})
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}],
    }
    assert message_digest(parts) == message_digest(plain)
    assert message_digest(assistant("")) == message_digest({"role": "assistant", "content": None})
    with_extras = {**assistant("ok"), "refusal": None, "tool_calls": [], "reasoning_content": "hmm"}
    assert message_digest(with_extras) == message_digest(assistant("ok"))
    spaced = assistant("", [call("get", '{"city": "paris", "days": 2}', "call_a")])
    compact = assistant(
        "", [{"id": "call_b", "function": {"name": "get", "arguments": '{"city":"paris","days":2}'}}]
    )
    assert message_digest(spaced) == message_digest(compact)
    for other in (
        assistant("", [call("get", '{"days":2,"city":"paris"}')]),
        assistant("", [call("put", '{"city":"paris","days":2}')]),
        assistant("", [call("get", '{"city":"rome","days":2}')]),
        {"role": "user", "content": ""},
    ):
        assert message_digest(other) != message_digest(compact)
    assert message_digest(user("fix the bug")) != message_digest(user("fix the bugs"))
    assert message_digest(user("x")) != message_digest({"role": "tool", "content": "x", "tool_call_id": "c"})
    assert message_digest("not a message") != message_digest(user("not a message"))


# ------------------------------------------------------------------ comparison


def _compare(
    previous: list[Any], answer: dict[str, Any] | None, current: list[Any]
) -> continuity.HistoryFacts:
    return compare(digests(previous), answer_of(answer) if answer else None, current, digests(current))


HISTORY = [SYSTEM, user("find the bug"), assistant("it is in cache.py"), user("fix it")]


def test_an_unchanged_history_with_its_answer_back_is_verbatim() -> None:
    facts = _compare(HISTORY, assistant("done"), [*HISTORY, assistant("done"), user("thanks")])
    assert facts == continuity.HistoryFacts(
        previous_messages=4, previous_answer=names.PREVIOUS_ANSWER_VERBATIM
    )
    # A retry of the same request: no answer position yet, nothing to say beyond the count.
    assert _compare(HISTORY, assistant("done"), HISTORY) == continuity.HistoryFacts(previous_messages=4)


@pytest.mark.parametrize(
    ("sent_back", "state"),
    [
        (assistant("done."), names.PREVIOUS_ANSWER_CONTENT_DIFFERS),
        (assistant("done", [call("run", "{}")]), names.PREVIOUS_ANSWER_TOOL_CALLS_DIFFER),
        (assistant("do", [call("run", "{}")]), names.PREVIOUS_ANSWER_BOTH_DIFFER),
        (user("thanks"), names.PREVIOUS_ANSWER_DROPPED),
    ],
)
def test_the_answer_in_its_position_says_what_differs(sent_back: dict[str, Any], state: str) -> None:
    facts = _compare(HISTORY, assistant("done"), [*HISTORY, sent_back, user("go on")])
    assert (facts.previous_answer, facts.rewritten_at, facts.id_reused) == (state, None, False)


def test_a_changed_or_dropped_message_is_where_the_history_was_rewritten() -> None:
    edited = [SYSTEM, user("find the bug"), assistant("it is in store.py"), user("fix it"), user("now")]
    assert _compare(HISTORY, None, edited).rewritten_at == 2
    # A trimmed window keeps later messages: rewritten (at 1), not another conversation.
    trimmed = [SYSTEM, assistant("it is in cache.py"), user("fix it"), assistant("done"), user("more")]
    facts = _compare(HISTORY, None, trimmed)
    assert (facts.rewritten_at, facts.id_reused) == (1, False)
    # A new system prompt over the same history: rewritten at 0.
    assert (
        _compare(HISTORY, None, [{"role": "system", "content": "be brief"}, *HISTORY[1:]]).rewritten_at == 0
    )
    # Messages dropped from the end (the agent went back): rewritten where the request stops.
    assert _compare(HISTORY, None, HISTORY[:2]).rewritten_at == 2


def test_one_id_with_another_conversation_is_a_reused_id() -> None:
    other = [SYSTEM, user("what is the weather in paris"), assistant("sunny"), user("and tomorrow")]
    facts = _compare(HISTORY, assistant("done"), other)
    assert facts == continuity.HistoryFacts(previous_messages=4, id_reused=True)
    no_system = [user("plan the release"), assistant("ok")]
    assert _compare(HISTORY, None, no_system).id_reused is True
    # Only a leading *system* message may be shared.
    first_user = [user("find the bug"), assistant("a"), user("b")]
    assert _compare([user("find the bug"), assistant("x")], None, first_user).id_reused is False


# ------------------------------------------------------------------ the answer from the response


def _observe(streaming: bool, chunks: list[bytes]) -> Any:
    observer = ResponseObserver(streaming=streaming)
    for i, chunk in enumerate(chunks):
        observer.feed(chunk, i)
    return observer.finish(len(chunks))


def _sse(*deltas: dict[str, Any], finish: str = "stop", index: int = 0) -> list[bytes]:
    out = [
        b"data: " + json.dumps({"choices": [{"index": index, "delta": d}]}).encode() + b"\n\n" for d in deltas
    ]
    final = {
        "choices": [{"index": index, "delta": {}, "finish_reason": finish}],
        "usage": {"prompt_tokens": 9},
    }
    return [*out, b"data: " + json.dumps(final).encode() + b"\n\n", b"data: [DONE]\n\n"]


def test_a_streamed_answer_digests_like_the_message_the_agent_sends_back() -> None:
    """Content deltas and tool-call deltas (name first, arguments in pieces) assemble into the
    assistant message an agent appends to its history; a whole response gives the same."""
    stream = _sse(
        {"role": "assistant", "content": "let me "},
        {"content": "check ☃"},
        {
            "tool_calls": [
                {"index": 0, "id": "call_9", "type": "function", "function": {"name": "get", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"paris"}'}}]},
        finish="tool_calls",
    )
    split = b"".join(stream)
    facts = _observe(True, [split[i : i + 7] for i in range(0, len(split), 7)])  # any split
    sent_back = assistant("let me check ☃", [call("get", '{"city":"paris"}', "call_9")])
    assert facts.answer is not None and facts.answer.message == message_digest(sent_back)
    whole = {"choices": [{"index": 0, "message": sent_back, "finish_reason": "tool_calls"}]}
    assert _observe(False, [json.dumps(whole).encode()]).answer == facts.answer
    pickle.loads(pickle.dumps(facts))  # it rides on the turn record to the main process


def test_no_answer_digest_for_anything_but_one_whole_answer() -> None:
    interrupted = _sse({"content": "half"})[:1]  # no finish reason: the client stopped it
    assert _observe(True, interrupted).answer is None
    assert _observe(True, _sse({"content": "x"}, index=1)).answer is None  # n > 1
    huge = AnswerCollector()
    huge.delta(0, {"content": "x" * (continuity.MAX_ANSWER_CHARS + 1)})
    assert huge.digest() is None


# ------------------------------------------------------------------ resumed under a new id


def _finish(
    tracker: HistoryTracker, cid: str, messages: list[Any], answer: dict[str, Any], end_ns: int
) -> None:
    observed = tracker.begin(cid, messages, first_turn=False, now_ns=end_ns - S)
    assert observed is not None
    tracker.end(cid, observed, answer_of(answer), trace_id=f"trace-{cid}", end_ns=end_ns, tokens=140)


def test_a_new_id_that_opens_with_a_recent_turn_names_it() -> None:
    tracker = HistoryTracker()
    _finish(tracker, "old", HISTORY, assistant("done"), end_ns=100 * S)
    resumed = [*HISTORY, assistant("done"), user("go on")]
    observed = tracker.begin("new", resumed, first_turn=True, now_ns=102 * S)
    assert observed is not None and observed.facts is not None
    assert observed.facts.resumed == continuity.Resumed("old", "trace-old", 2.0, 140, 5)
    # The same conversation is no resume; neither is a first request that ends at the answer,
    # nor one whose answer differs, nor a request that is not a first turn.
    assert tracker.begin("new2", [*HISTORY, assistant("done")], first_turn=True, now_ns=102 * S).facts is None  # type: ignore[union-attr]
    changed = [*HISTORY, assistant("done!"), user("go on")]
    assert tracker.begin("new3", changed, first_turn=True, now_ns=102 * S).facts is None  # type: ignore[union-attr]
    assert tracker.begin("new4", resumed, first_turn=False, now_ns=102 * S).facts is None  # type: ignore[union-attr]


def test_the_longest_recent_turn_wins() -> None:
    tracker = HistoryTracker()
    _finish(tracker, "a", HISTORY, assistant("done"), end_ns=100 * S)
    longer = [*HISTORY, assistant("done"), user("and then")]
    _finish(tracker, "a", longer, assistant("finished"), end_ns=110 * S)
    observed = tracker.begin(
        "b", [*longer, assistant("finished"), user("next")], first_turn=True, now_ns=111 * S
    )
    assert observed is not None and observed.facts is not None and observed.facts.resumed is not None
    assert (observed.facts.resumed.messages, observed.facts.resumed.gap_s) == (7, 1.0)


def test_recent_turns_expire_and_are_bounded() -> None:
    recent = RecentTurns(capacity=3, ttl_s=10.0)
    tracker = HistoryTracker(recent=recent)
    for i in range(5):
        _finish(tracker, f"c{i}", [SYSTEM, user(f"task {i}")], assistant(f"answer {i}"), end_ns=(100 + i) * S)
    assert len(recent) == 3  # the two oldest dropped

    def resumes(i: int, now_s: float) -> bool:
        msgs = [SYSTEM, user(f"task {i}"), assistant(f"answer {i}"), user("more")]
        observed = tracker.begin(f"n{i}-{now_s}", msgs, first_turn=True, now_ns=int(now_s * S))
        return observed is not None and observed.facts is not None

    assert [resumes(i, 105) for i in range(5)] == [False, False, True, True, True]
    assert not resumes(2, 112.5)  # 10.5 s after it ended: expired
    assert resumes(4, 113.5) and len(recent) == 1  # only the newest left


# ------------------------------------------------------------------ bounded memory


def test_state_is_held_to_its_budget_and_the_estimate_is_honest() -> None:
    """What 1,000 conversations of 60 messages (9-character ids) really hold, measured with
    tracemalloc, stays within the estimate the budget is kept with."""
    messages = [SYSTEM] + [user(f"m{i}") if i % 2 else assistant(f"a{i}") for i in range(59)]
    per_conversation = 60 * continuity.DIGEST_BYTES + STATE_OVERHEAD_BYTES + len("conv-0000")
    n = 1000
    tracker = HistoryTracker(budget_bytes=n * per_conversation, recent=RecentTurns(capacity=0))
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(n):
        cid = f"conv-{i:04d}"
        observed = tracker.begin(cid, messages, first_turn=True)
        assert observed is not None
        tracker.end(cid, observed, answer_of(assistant("x")), trace_id="t", end_ns=i, tokens=1)
    del observed
    used = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert 0.8 * per_conversation <= used / n <= per_conversation, (used / n, per_conversation)
    assert tracker.state_bytes == n * per_conversation and tracker.forgotten == 0
    observed = tracker.begin("one-more", messages, first_turn=False)
    assert observed is not None
    tracker.end("one-more", observed, None, trace_id="t", end_ns=1, tokens=None)
    assert len(tracker) == n and tracker.forgotten == 1  # the least recently active went
    assert tracker.begin("conv-0000", messages, first_turn=False).facts is None  # type: ignore[union-attr]


def test_histories_too_long_or_empty_are_not_compared() -> None:
    tracker = HistoryTracker()
    assert tracker.begin("c", [], first_turn=True) is None
    assert tracker.begin("c", [user("x")] * (continuity.MAX_MESSAGES + 1), first_turn=True) is None


# ------------------------------------------------------------------ through the turn watcher


def _request(body: dict[str, Any], conversation: str, **headers: str) -> Request:
    raw = json.dumps(body).encode()
    head = [(b"X-Conversation-Id", conversation.encode()), (b"Content-Type", b"application/json")]
    head += [(k.encode(), v.encode()) for k, v in headers.items()]
    return Request(method=b"POST", url=b"/v1/chat/completions", headers=head, body=raw)


def _turn(watcher: TurnWatcher, conversation: str, messages: list[Any], reply: str, *, stream: bool) -> None:
    exchange, _, body = watcher.begin(
        _request({"model": "m", "messages": messages, "stream": stream}, conversation)
    )
    assert exchange is not None and json.loads(body)["messages"] == messages  # forwarded as sent
    if stream:
        exchange.response_head(200, [(b"Content-Type", b"text/event-stream")])
        for chunk in _sse({"content": reply}):
            exchange.response_body(chunk)
    else:
        exchange.response_head(200, [(b"Content-Type", b"application/json")])
        exchange.response_body(
            json.dumps(
                {
                    "choices": [{"index": 0, "message": assistant(reply), "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 30, "completion_tokens": 12},
                }
            ).encode()
        )
    exchange.finish(200, None)


def test_the_turn_record_carries_the_comparison_to_the_turn_span() -> None:
    records: list[TurnRecord] = []
    watcher = TurnWatcher(records.append)
    first = [SYSTEM, user("find the bug")]
    _turn(watcher, "c1", first, "in cache.py", stream=True)
    second = [*first, assistant("in cache"), user("fix it")]  # the answer trimmed by the app
    _turn(watcher, "c1", second, "fixed", stream=False)
    third = [
        SYSTEM,
        user("find the bugs"),
        assistant("in cache"),
        user("fix it"),
        assistant("fixed"),
        user("ok"),
    ]
    _turn(watcher, "c1", third, "good", stream=False)
    resumed = [*third, assistant("good"), user("more")]
    _turn(watcher, "c2", resumed, "sure", stream=False)
    assert records[0].history is None  # a first turn that continues nothing
    assert history_attributes(records[1].history) == {  # type: ignore[arg-type]
        names.TURN_PREVIOUS_MESSAGES: 2,
        names.CONVERSATION_ID_REUSED: False,
        names.TURN_PREVIOUS_ANSWER: names.PREVIOUS_ANSWER_CONTENT_DIFFERS,
    }
    assert history_attributes(records[2].history) == {  # type: ignore[arg-type]
        names.TURN_PREVIOUS_MESSAGES: 4,
        names.CONVERSATION_ID_REUSED: False,
        names.TURN_HISTORY_REWRITTEN_AT: 1,
    }
    assert history_attributes(records[3].history) == {  # type: ignore[arg-type]
        names.CONVERSATION_RESUMED_FROM: "c1",
        names.CONVERSATION_RESUMED_FROM_TRACE_ID: records[2].trace_id,
        names.CONVERSATION_RESUMED_GAP_SECONDS: (records[3].arrival_ns - records[2].end_ns) / S,
        names.CONVERSATION_RESUMED_MESSAGES: 7,
        names.CONVERSATION_RESUMED_TOKENS: 42,
    }
    pickle.loads(pickle.dumps(records[3]))


def test_a_failed_answer_is_not_kept_and_completions_are_not_compared() -> None:
    records: list[TurnRecord] = []
    watcher = TurnWatcher(records.append)
    exchange, _, _ = watcher.begin(_request({"model": "m", "messages": HISTORY}, "c"))
    assert exchange is not None
    exchange.finish(502, "upstream unreachable")
    assert len(watcher.history) == 0  # a refused request is not what the agent goes on from
    req = Request(
        method=b"POST",
        url=b"/v1/completions",
        headers=[(b"X-Conversation-Id", b"c")],
        body=json.dumps({"model": "m", "prompt": "hi"}).encode(),
    )
    exchange, _, _ = watcher.begin(req)
    assert exchange is not None
    exchange.finish(200, None)
    assert records[-1].history is None and len(watcher.history) == 0


def test_an_error_in_the_comparison_is_counted_and_the_request_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted: list[tuple[str, int]] = []
    records: list[TurnRecord] = []
    watcher = TurnWatcher(records.append, count=lambda name, n: counted.append((name, n)))

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(watcher.history, "begin", boom)
    req = _request({"model": "m", "messages": HISTORY}, "c")
    exchange, extra, body = watcher.begin(req)
    assert (
        exchange is not None
        and dict(extra)[b"X-Session-ID"] == b"c"
        and json.loads(body)["messages"] == HISTORY
    )
    exchange.finish(200, None)
    assert records[0].history is None and counted == [(CONTINUITY_ERRORS, 1)]
    monkeypatch.undo()
    monkeypatch.setattr(watcher.history, "end", boom)
    _turn(watcher, "d", HISTORY, "x", stream=False)
    assert counted == [(CONTINUITY_ERRORS, 1), (CONTINUITY_ERRORS, 1)] and len(records) == 2


# ------------------------------------------------------------------ a real sidecar


def test_a_real_sidecar_puts_the_comparison_on_its_turn_spans() -> None:
    """Through the proxy process and the channel to the main process: a whole answer and a
    streamed one sent back verbatim, then a new id that continues the conversation."""
    from tests.unit.test_sidecar_proxy import JSON_CT, Upstream, _start, chat, request

    upstream = Upstream().start()
    sidecar, turns = _start(upstream.url, token=None)
    try:
        url = sidecar.url + "/v1/chat/completions"
        history: list[dict[str, Any]] = [SYSTEM, user("find the bug")]
        json_mode = {**JSON_CT, "X-Conversation-Id": "conv-e2e", "X-Test-Mode": "json"}
        assert request("POST", url, body=chat(history), headers=json_mode)[0] == 200
        turns.wait("conv-e2e", 0)
        history += [assistant("héllo ☃ 日本"), user("stream it")]  # the upstream's whole answer
        sse_mode = {**json_mode, "X-Test-Mode": "sse"}
        assert request("POST", url, body=chat(history, stream=True), headers=sse_mode)[0] == 200
        second = turns.wait("conv-e2e", 1)
        history += [assistant("café ☃"), user("thanks")]  # the upstream's streamed answer
        assert request("POST", url, body=chat(history), headers=json_mode)[0] == 200
        third = turns.wait("conv-e2e", 2)
        resumed = [*history, assistant("héllo ☃ 日本"), user("go on")]
        moved = {**json_mode, "X-Conversation-Id": "conv-e2e-moved"}
        assert request("POST", url, body=chat(resumed), headers=moved)[0] == 200
        fourth = turns.wait("conv-e2e-moved", 0)
    finally:
        sidecar.stop()
        upstream.stop()
    for span, previous in ((second, 2), (third, 4)):
        a = span.attributes
        assert a[names.TURN_PREVIOUS_MESSAGES] == previous
        assert a[names.TURN_PREVIOUS_ANSWER] == names.PREVIOUS_ANSWER_VERBATIM
        assert a[names.CONVERSATION_ID_REUSED] is False and names.TURN_HISTORY_REWRITTEN_AT not in a
    a = fourth.attributes
    assert a[names.CONVERSATION_RESUMED_FROM] == "conv-e2e"
    assert a[names.CONVERSATION_RESUMED_FROM_TRACE_ID] == third.trace_id
    assert a[names.CONVERSATION_RESUMED_MESSAGES] == 7
    assert a[names.CONVERSATION_RESUMED_TOKENS] == 12 + 4  # the upstream's usage for that turn
    assert (
        0
        < a[names.CONVERSATION_RESUMED_GAP_SECONDS]
        == pytest.approx((fourth.start_ns - third.end_ns) / S, abs=1e-3)
    )


# ------------------------------------------------------------------ hostile shapes


def _fuzz_strategies() -> Any:
    from hypothesis import strategies as st

    from tests.unit.test_bad_input_fuzz import any_text, json_values

    field = st.sampled_from(
        ["role", "content", "tool_calls", "tool_call_id", "name", "function", "index", "type"]
    )
    message = json_values | st.dictionaries(field, json_values | any_text, max_size=6)
    call = st.dictionaries(field, json_values | st.dictionaries(field, json_values, max_size=3), max_size=4)
    delta = st.dictionaries(field, json_values | st.lists(call, max_size=3), max_size=4)
    return st.lists(message, max_size=8), st.lists(st.tuples(json_values, delta), max_size=6)


_MESSAGES, _DELTAS = _fuzz_strategies()


def test_any_message_list_and_any_answer_delta_is_digested_without_raising() -> None:
    """Whatever a client sends as messages and an upstream as deltas (lone surrogates, odd
    types, NaN), digesting, comparing, indexing and collecting never raise."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(previous=_MESSAGES, current=_MESSAGES, deltas=_DELTAS)
    def check(previous: list[Any], current: list[Any], deltas: list[tuple[Any, Any]]) -> None:
        tracker = HistoryTracker()
        collector = AnswerCollector()
        for index, delta in deltas:
            collector.delta(index, delta)
        answer = collector.digest()
        observed = tracker.begin("a", previous, first_turn=True, now_ns=S)
        if observed is not None:
            tracker.end("a", observed, answer, trace_id="t", end_ns=2 * S, tokens=None)
        for cid in ("a", "b"):
            again = tracker.begin(cid, current, first_turn=True, now_ns=3 * S)
            if again is not None and again.facts is not None:
                history_attributes(again.facts)

    check()


def test_errors_counted_in_the_proxy_become_the_sidecars_metric(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy worker's ``continuity_errors`` counter reaches ``/metrics`` in the main process."""
    from otelkv.sidecar.app import Sidecar, SidecarConfig
    from tests.unit.sidecar_harness import metric

    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    sidecar = Sidecar(SidecarConfig(upstream="http://127.0.0.1:9", store=False))
    sidecar._proxy_counters({CONTINUITY_ERRORS: 2})
    sidecar._proxy_counters({CONTINUITY_ERRORS: 1})
    text = sidecar.metrics.exposition().decode()
    assert metric(text, names.METRIC_SIDECAR_CONTINUITY_ERRORS + "_total") == 3


def test_odd_roles_do_not_break_the_comparison() -> None:
    previous = [{"role": ["system"], "content": "x"}, user("a")]
    assert _compare(previous, None, [{"role": ["system"], "content": "x"}, user("b")]).id_reused is False
    assert _compare(previous, None, [{"role": {"r": 1}}, user("b")]).id_reused is True


def test_the_comparison_waits_until_the_request_has_gone_upstream() -> None:
    """With a ``defer`` (the proxy's ``loop.call_soon``) ``begin`` returns before digesting; the
    deferred call (or, if it never ran, ``finish``) does it, with the same outcome."""
    queue: list[Any] = []
    records: list[TurnRecord] = []
    watcher = TurnWatcher(records.append, defer=queue.append)
    _turn_deferred = watcher.begin(_request({"model": "m", "messages": HISTORY}, "c"))[0]
    assert _turn_deferred is not None and len(queue) == 1 and len(watcher.history) == 0
    queue.pop()()  # the loop runs it
    _turn_deferred.finish(200, None)
    exchange = watcher.begin(_request({"model": "m", "messages": [*HISTORY[:2], user("other")]}, "c"))[0]
    assert exchange is not None and len(queue) == 1
    exchange.finish(200, None)  # before the loop got to it: finish runs it
    assert records[1].history is not None and records[1].history.rewritten_at == 2
    queue.pop()()  # a late call does nothing more
    assert len(records) == 2
