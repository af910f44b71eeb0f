"""What a completion response says about the turn, read beside the bytes being forwarded.

The proxy hands every chunk to the client first and to a :class:`ResponseObserver`
second; the observer only reads. It learns the first-token time (streaming), usage
(including cached prompt tokens when reported), finish reasons, whether the model asked
for tools (and their call ids), and whether the response carried ``kv_transfer_params``.
It never keeps completion text: the first choice's answer is reduced to two digests when the
response ends (:class:`~otelkv.sidecar.continuity.AnswerCollector` holds the streamed pieces
until then), so the conversation's next request can be checked against it.
Anything it cannot parse is ignored: observation must not change or stop the response.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from otelkv.sidecar.continuity import AnswerCollector, AnswerDigest

logger = logging.getLogger("otelkv.sidecar")

MAX_BUFFERED_BYTES = 8 * 1024 * 1024
"""A non-streaming body (or one SSE line) larger than this is forwarded but not parsed."""

_DECODER = json.JSONDecoder()


def parse_json(data: bytes | bytearray) -> Any:
    """``json.loads(data)``: the same value or exception, without its encoding detection (a
    Python function, a third of the call for a small body) when ``data`` opens with ``{`` and
    a byte that is not NUL, which makes it UTF-8 by the same rules (RFC 8259, as ``json``)."""
    if data[:1] == b"{" and data[1:2] != b"\x00":
        return _DECODER.decode(data.decode("utf-8", "surrogatepass"))
    return json.loads(data)


@dataclass
class ResponseFacts:
    model: str = ""
    response_id: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reasons: list[str] = field(default_factory=list)
    tool_call_ids: list[str] = field(default_factory=list)
    asked_tools: bool = False
    kv_transfer_params: bool = False
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    parsed: bool = False
    stream_done: bool = False
    """The stream's ``data: [DONE]`` went by: the client was sent the whole answer."""
    answer: AnswerDigest | None = None
    """Digests of the one answer the response carried, when it carried exactly one, whole
    (a finish reason seen); None otherwise. Meaningful in the proxy process only (its hash key)."""


_WIRE_FIELDS = (
    "model",
    "response_id",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "finish_reasons",
    "tool_call_ids",
    "asked_tools",
    "kv_transfer_params",
    "first_token_ns",
    "last_token_ns",
    "parsed",
    "stream_done",
)
"""What of :class:`ResponseFacts` crosses to the main process: all but ``answer``."""


def response_to_wire(facts: ResponseFacts) -> tuple[Any, ...]:
    """``facts`` as a plain tuple (:data:`_WIRE_FIELDS`, in order) for the sidecar's channel."""
    d = facts.__dict__
    return tuple([d[name] for name in _WIRE_FIELDS])


def response_from_wire(wire: tuple[Any, ...]) -> ResponseFacts:
    """The facts :func:`response_to_wire` made ``wire`` from, with ``answer`` None."""
    facts = ResponseFacts.__new__(ResponseFacts)
    d = facts.__dict__
    d.update(zip(_WIRE_FIELDS, wire, strict=True))
    d["answer"] = None
    return facts


class ResponseObserver:
    """Feed it the response bytes as they pass; read :attr:`facts` at the end."""

    def __init__(self, *, streaming: bool) -> None:
        self.streaming = streaming
        self.facts = ResponseFacts()
        self._buffer = bytearray()
        self._overflow = False
        self._answer: AnswerCollector | None = AnswerCollector()
        self.answer_errors = 0
        """Errors while digesting the answer (counted by the proxy; the response goes on)."""

    def feed(self, chunk: bytes, now_ns: int) -> None:
        if not chunk or self._overflow:
            return
        if not self.streaming:
            self._buffer += chunk
            if len(self._buffer) > MAX_BUFFERED_BYTES:
                self._overflow = True
                self._buffer = bytearray()
            return
        buffer = self._buffer
        if b"\n" not in chunk:
            buffer += chunk
        else:
            # Every whole line at once (one split, not a find and a copy per line); the
            # unfinished last line waits in the buffer for the next chunk.
            if buffer:
                buffer += chunk
                data = bytes(buffer)
            else:
                data = chunk
            *lines, tail = data.split(b"\n")
            buffer.clear()
            buffer += tail
            for line in lines:
                line = line.strip()
                if line.startswith(b"data:"):
                    self._sse_data(line[5:].strip(), now_ns)
        if len(self._buffer) > MAX_BUFFERED_BYTES:
            self._overflow = True
            self._buffer = bytearray()

    def finish(self, now_ns: int) -> ResponseFacts:
        if not self.streaming and not self._overflow and self._buffer:
            try:
                data = parse_json(self._buffer)
            except (ValueError, UnicodeDecodeError, RecursionError):
                data = None
            if isinstance(data, dict):
                self._absorb(data, chunk=False)
                self.facts.parsed = True
                self.facts.first_token_ns = self.facts.last_token_ns = now_ns
        elif self.streaming and self._buffer.strip().startswith(b"data:"):
            self._sse_data(bytes(self._buffer).strip()[5:].strip(), now_ns)
        self._buffer = bytearray()
        if self._answer is not None and self.facts.finish_reasons and not self._overflow:
            self.facts.answer = self._answer.digest()
        self._answer = None
        return self.facts

    def _sse_data(self, payload: bytes, now_ns: int) -> None:
        if payload == b"[DONE]":
            self.facts.stream_done = True
            return
        if not payload:
            return
        try:
            data = parse_json(payload)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return
        if not isinstance(data, dict):
            return
        self.facts.parsed = True
        if self._absorb(data, chunk=True):
            if self.facts.first_token_ns is None:
                self.facts.first_token_ns = now_ns
            self.facts.last_token_ns = now_ns

    def _absorb(self, data: dict[str, Any], *, chunk: bool) -> bool:
        """Take what one response object (or stream chunk) says; True if it carried tokens."""
        facts = self.facts
        # Checked in this order, each field is looked up only until a chunk has given it.
        if not facts.model:
            model = data.get("model")
            if isinstance(model, str):
                facts.model = model
        if not facts.response_id:
            response_id = data.get("id")
            if isinstance(response_id, str):
                facts.response_id = response_id
        if not facts.kv_transfer_params and data.get("kv_transfer_params"):
            facts.kv_transfer_params = True
        usage = data.get("usage")
        if isinstance(usage, dict):
            facts.prompt_tokens = _int(usage.get("prompt_tokens"), facts.prompt_tokens)
            facts.completion_tokens = _int(usage.get("completion_tokens"), facts.completion_tokens)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                facts.cached_tokens = _int(details.get("cached_tokens"), facts.cached_tokens)
        produced = False
        choices = data.get("choices")
        if not isinstance(choices, list):
            return False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                facts.finish_reasons.append(reason)
                if reason == "tool_calls":
                    facts.asked_tools = True
            if choice.get("kv_transfer_params"):
                facts.kv_transfer_params = True
            message = choice.get("delta" if chunk else "message")
            if isinstance(message, dict):
                self._collect(choice.get("index"), message)
                content = message.get("content") or message.get("reasoning_content")
                if isinstance(content, str) and content:
                    produced = True
                calls = message.get("tool_calls")
                if isinstance(calls, list) and calls:
                    produced = True
                    facts.asked_tools = True
                    for call in calls:
                        if isinstance(call, dict) and isinstance(call.get("id"), str):
                            facts.tool_call_ids.append(call["id"])
            text = choice.get("text")
            if isinstance(text, str) and text:
                produced = True
        return produced

    def _collect(self, index: Any, message: dict[str, Any]) -> None:
        """Feed the answer's digests; a failure there drops only the answer (fail-open)."""
        answer = self._answer
        if answer is None:
            return
        try:
            answer.delta(index, message)
        except Exception:
            logger.exception("otelkv sidecar: could not digest an answer; the response goes on")
            self._answer = None
            self.answer_errors += 1


def _int(value: Any, default: int | None) -> int | None:
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    return default


class RequestFacts(NamedTuple):
    """What the request body says (no text kept): message count, tool results, model (a named
    tuple: it crosses to the main process inside the turn record)."""

    model: str
    stream: bool
    messages: int
    tool_results: int
    tool_result_call_ids: tuple[str, ...]


def request_facts(body: dict[str, Any] | None) -> RequestFacts:
    if body is None:
        return RequestFacts("", False, 0, 0, ())
    messages = body.get("messages")
    count = len(messages) if isinstance(messages, list) else 0
    tool_results = 0
    call_ids: list[str] = []
    if isinstance(messages, list):
        # Tool results that answer the last assistant message: the trailing run of role=tool.
        for message in reversed(messages):
            if not isinstance(message, dict) or message.get("role") != "tool":
                break
            tool_results += 1
            if isinstance(message.get("tool_call_id"), str):
                call_ids.append(message["tool_call_id"])
    model = body.get("model")
    return RequestFacts(
        model if isinstance(model, str) else "",
        bool(body.get("stream")),
        count,
        tool_results,
        tuple(call_ids),
    )
