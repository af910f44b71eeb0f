"""The response observer reads usage, finish reasons, tool calls, KV params and the first-token
time beside the forwarded bytes, whatever the chunking, and never raises on what it cannot parse.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from otelkv.sidecar import response as response_mod
from otelkv.sidecar.response import ResponseFacts, ResponseObserver, request_facts


def _sse(*events: dict[str, Any] | str) -> bytes:
    out = b""
    for event in events:
        payload = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)
        out += b"data: " + payload.encode() + b"\n\n"
    return out


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **extra,
    }


STREAM = (
    b": keep-alive comment\n\n"
    + _sse(_chunk({"role": "assistant", "content": ""}))
    + b"data: {not json\n\n"
    + b"event: ping\n"
    + b"garbage line without colon\n\n"
    + _sse(
        _chunk({"content": "h\u00e9llo \u2603"}),
        _chunk({"tool_calls": [{"id": "call_a", "function": {"name": "f"}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
        _chunk({}, "tool_calls"),
        {
            "id": "chatcmpl-1",
            "choices": [],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 8},
            },
        },
        "[DONE]",
    )
)


def _observe(parts: list[bytes], *, streaming: bool = True) -> ResponseFacts:
    observer = ResponseObserver(streaming=streaming)
    for i, part in enumerate(parts):
        observer.feed(part, 100 + i)
    return observer.finish(1000)


def _comparable(facts: ResponseFacts) -> dict[str, Any]:
    d = dict(vars(facts))
    d.pop("first_token_ns")
    d.pop("last_token_ns")
    return d


def test_non_streaming_json() -> None:
    """A whole JSON response: model, id, usage with cached tokens, tool calls, KV params."""
    body = {
        "id": "cmpl-9",
        "model": "llama",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}, {"id": "c2"}]},
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 64},
        },
        "kv_transfer_params": {"remote_block_ids": [1]},
    }
    raw = json.dumps(body).encode()
    facts = _observe([raw[:5], raw[5:17], raw[17:]], streaming=False)
    assert facts.parsed
    assert (facts.model, facts.response_id) == ("llama", "cmpl-9")
    assert (facts.prompt_tokens, facts.completion_tokens, facts.cached_tokens) == (100, 7, 64)
    assert facts.finish_reasons == ["tool_calls"]
    assert facts.asked_tools and facts.tool_call_ids == ["c1", "c2"]
    assert facts.kv_transfer_params
    assert facts.first_token_ns == facts.last_token_ns == 1000


def test_non_streaming_kv_params_per_choice_and_plain_stop() -> None:
    """``kv_transfer_params`` inside a choice counts; a plain stop asks for no tools."""
    body = {
        "choices": [{"message": {"content": "hi"}, "finish_reason": "stop", "kv_transfer_params": {"a": 1}}]
    }
    facts = _observe([json.dumps(body).encode()], streaming=False)
    assert facts.kv_transfer_params and not facts.asked_tools
    assert facts.finish_reasons == ["stop"] and facts.cached_tokens is None
    empty = _observe([json.dumps({"choices": [], "kv_transfer_params": None}).encode()], streaming=False)
    assert empty.parsed and not empty.kv_transfer_params


def test_non_streaming_garbage_and_non_object() -> None:
    """Not JSON, JSON that is not an object, bad UTF-8: nothing learned, nothing raised."""
    for raw in (b"<html>502</html>", b"[1,2]", b"\xff\xfe\x00garbage", b""):
        facts = _observe([raw], streaming=False)
        assert not facts.parsed and facts.first_token_ns is None


def test_usage_ignores_non_integers() -> None:
    """Usage values that are not integers (or are booleans) are not taken."""
    body = {"usage": {"prompt_tokens": "10", "completion_tokens": True, "prompt_tokens_details": [1]}}
    facts = _observe([json.dumps(body).encode()], streaming=False)
    assert (facts.prompt_tokens, facts.completion_tokens, facts.cached_tokens) == (None, None, None)


def test_streaming_facts() -> None:
    """SSE: content, tool calls (ids once), finish reasons and final usage; garbage skipped."""
    facts = _observe([STREAM])
    assert facts.parsed
    assert (facts.model, facts.response_id) == ("m", "chatcmpl-1")
    assert facts.finish_reasons == ["tool_calls"]
    assert facts.asked_tools and facts.tool_call_ids == ["call_a"]
    assert (facts.prompt_tokens, facts.completion_tokens, facts.cached_tokens) == (10, 3, 8)
    assert not facts.kv_transfer_params


def test_streaming_any_split_point_gives_same_facts() -> None:
    """Cutting the stream at every byte (mid-line, mid-UTF-8 character) changes nothing."""
    whole = _comparable(_observe([STREAM]))
    for cut in range(len(STREAM) + 1):
        assert _comparable(_observe([STREAM[:cut], STREAM[cut:]])) == whole, cut
    assert _comparable(_observe([bytes([b]) for b in STREAM])) == whole


def test_first_token_time_is_first_chunk_with_content() -> None:
    """The role-only first chunk is not a token; the time is that of the feed completing it."""
    role = _sse(_chunk({"role": "assistant", "content": ""}))
    first = _sse(_chunk({"content": "a"}))
    second = _sse(_chunk({"content": "b"}))
    observer = ResponseObserver(streaming=True)
    observer.feed(role, 1)
    observer.feed(first[:10], 2)
    assert observer.facts.first_token_ns is None
    observer.feed(first[10:], 3)
    observer.feed(second, 4)
    observer.feed(_sse("[DONE]"), 5)
    facts = observer.finish(6)
    assert (facts.first_token_ns, facts.last_token_ns) == (3, 4)


def test_reasoning_content_and_completions_text_count_as_tokens() -> None:
    """Reasoning deltas and /v1/completions ``text`` chunks set the first-token time."""
    reasoning = _sse(_chunk({"reasoning_content": "thinking"}))
    text = _sse({"id": "cmpl", "choices": [{"text": "x", "finish_reason": None}]})
    for stream in (reasoning, text):
        observer = ResponseObserver(streaming=True)
        observer.feed(stream, 7)
        assert observer.finish(8).first_token_ns == 7


def test_last_line_without_newline_is_read_at_finish() -> None:
    """A final ``data:`` line the upstream did not terminate is still parsed."""
    observer = ResponseObserver(streaming=True)
    observer.feed(b'data: {"choices":[{"delta":{"content":"z"},"finish_reason":"stop"}]}', 5)
    facts = observer.finish(9)
    assert facts.finish_reasons == ["stop"] and facts.first_token_ns == 9


def test_crlf_line_endings() -> None:
    """SSE with CRLF line endings parses like LF."""
    facts = _observe([STREAM.replace(b"\n", b"\r\n")])
    assert _comparable(facts) == _comparable(_observe([STREAM]))


def test_oversize_bodies_stop_parsing_without_raising(monkeypatch: Any) -> None:
    """Past the buffer cap the observer gives up (bytes still flow through the proxy)."""
    monkeypatch.setattr(response_mod, "MAX_BUFFERED_BYTES", 1024)
    big = json.dumps({"model": "m", "pad": "x" * 4096, "choices": []}).encode()
    facts = _observe([big[:1000], big[1000:], b"more"], streaming=False)
    assert not facts.parsed and facts.model == ""
    # One SSE line longer than the cap: parsing stops, later lines are ignored.
    observer = ResponseObserver(streaming=True)
    observer.feed(b"data: " + b"x" * 2000, 1)
    observer.feed(b"\n\n" + _sse(_chunk({"content": "late"})), 2)
    facts = observer.finish(3)
    assert not facts.parsed and facts.first_token_ns is None


def test_deeply_nested_json_does_not_raise() -> None:
    """Pathological nesting (RecursionError in json) is ignored like any unparsable body."""
    nested = b"[" * 100_000 + b"]" * 100_000
    assert not _observe([nested], streaming=False).parsed
    assert not _observe([b"data: " + nested + b"\n\n"]).parsed


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.binary(max_size=80), max_size=12)
    | st.lists(st.sampled_from([STREAM[i : i + 7] for i in range(0, len(STREAM), 7)]), max_size=30),
    streaming=st.booleans(),
)
def test_arbitrary_bytes_in_arbitrary_chunks_never_raise(data: list[bytes], streaming: bool) -> None:
    """Whatever bytes arrive, in whatever pieces, feed() and finish() do not raise."""
    observer = ResponseObserver(streaming=streaming)
    for i, part in enumerate(data):
        observer.feed(part, i)
    facts = observer.finish(len(data))
    assert isinstance(facts, ResponseFacts)


# ------------------------------------------------------------------ request facts


def test_request_facts_counts_trailing_tool_messages() -> None:
    """Only the tool results after the last assistant message count, with their call ids."""
    body = {
        "model": "m",
        "stream": True,
        "messages": [
            {"role": "user", "content": "u"},
            {"role": "assistant", "tool_calls": [{"id": "old"}]},
            {"role": "tool", "tool_call_id": "old", "content": "r0"},
            {"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]},
            {"role": "tool", "tool_call_id": "a", "content": "r1"},
            {"role": "tool", "content": "no id"},
            {"role": "tool", "tool_call_id": "b", "content": "r2"},
        ],
    }
    facts = request_facts(body)
    assert (facts.model, facts.stream, facts.messages, facts.tool_results) == ("m", True, 7, 3)
    assert sorted(facts.tool_result_call_ids) == ["a", "b"]


def test_request_facts_without_tools_or_body() -> None:
    """No trailing tool messages, odd values, or no body at all."""
    facts = request_facts({"model": 3, "messages": [{"role": "tool"}, {"role": "user"}]})
    assert (facts.model, facts.stream, facts.messages, facts.tool_results) == ("", False, 2, 0)
    assert request_facts({"messages": "x"}).messages == 0
    none = request_facts(None)
    assert (none.model, none.stream, none.messages, none.tool_results, none.tool_result_call_ids) == (
        "",
        False,
        0,
        0,
        (),
    )
