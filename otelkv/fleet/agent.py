"""A scripted multi-turn agent: growing history, tool calls, pauses of chosen length.

Each :class:`Conversation` is a list of :class:`Turn`\\ s. Before a turn the agent waits
(``pause_s``: a tool running, a person reading); a turn whose ``tool`` is set is sent as
a tool result following an assistant tool call, the way agents do, so the history grows
exactly as it would with a real model. Every turn gets its own trace: the agent starts a
``chat {model}`` client span (and an ``execute_tool`` span for the pause before a tool
result) when it has a tracer, or at least a fresh W3C ``traceparent``, and records the
trace id it used so tests can find everything that happened for that turn.

Completions are requested with ``ignore_eos`` and a fixed ``max_tokens``: the tests need
predictable token counts, whatever the model would choose to stop at.

A turn with ``interrupt_after`` is streamed and the driver hangs up after that many
content chunks, the way a user presses stop: the connection is closed mid-response, the
text received so far stays in the history (as chat clients keep a stopped answer) and the
conversation goes on. The next prompt then extends a partial answer, not the full one the
decode node computed.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otelkv import names
from otelkv.sidecar import arrival


@dataclass(frozen=True)
class Turn:
    """One request of the agent. ``tool`` makes it a tool result after a tool call."""

    user: str
    max_tokens: int = 64
    pause_s: float = 0.0
    tool: str | None = None
    interrupt_after: int | None = None
    """Hang up after this many streamed content chunks (the turn is streamed even if the
    conversation is not). One chunk is one token when the server streams token by token;
    the reference router re-emits a finished answer, so there the first chunk is all of it."""
    rewrite_first_user: str | None = None
    """Before this turn the app replaces its first user message with this text (an edited
    message, a compacted history), under the same conversation id: the history no longer
    matches the KV the decode node holds for the previous turn."""
    before_send: Callable[[], Any] | None = None
    """Called right before the request is sent, after the pause (a scenario stalls an
    engine here, so the request meets it stalled)."""


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    turns: Sequence[Turn]
    system: str = "you are a helpful agent"
    send_conversation_id: bool = True
    stream: bool = False
    tools: bool = False


@dataclass
class TurnResult:
    conversation_id: str
    index: int
    trace_id: str
    status: int
    latency_s: float
    ttft_s: float | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str | None = None
    started_unix: float = 0.0
    """The client's wall clock just before it handed the request to its HTTP client."""
    done_unix: float = 0.0
    """... and when it had read the response's last byte (or given up)."""
    sent_kernel_unix: float | None = None
    """When the client's kernel sent the request's last bytes (``TCP_INFO``), free of the
    client process's own scheduling delays; None where the platform does not say or the
    connection carried another request before they were read (a session shared by
    concurrent conversations: :meth:`AgentDriver.run_many` gives each its own)."""
    done_kernel_unix: float | None = None
    """When the client's kernel received the response's last bytes (likewise)."""
    pause_unix: tuple[float, float] | None = None
    """When the pause before this turn (tool call or app work) began and ended, client clock."""
    interrupted: bool = False
    """The driver hung up mid-stream on purpose (``Turn.interrupt_after``): still ``ok``."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def _random_traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


class AgentDriver:
    """Runs conversations against an OpenAI-compatible endpoint (the router)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        tracer: trace.Tracer | None = None,
        timeout_s: float = 120.0,
        extra_body: dict[str, Any] | None = None,
        chat_spans: bool = True,
        flush: Callable[[], Any] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.tracer = tracer
        self.timeout_s = timeout_s
        self.extra_body = extra_body or {}
        self.chat_spans = chat_spans
        """False: no ``chat`` span of its own (a sidecar's span is the turn); tool spans stay."""
        self.flush = flush
        """Called after each tool span ends, so the span is exported before the next request."""

    async def run(self, conversation: Conversation, session: aiohttp.ClientSession) -> list[TurnResult]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": conversation.system}]
        results: list[TurnResult] = []
        for index, turn in enumerate(conversation.turns):
            # Unique like a model's call ids: the sidecar matches tool spans by them.
            call_id = f"call_{secrets.token_hex(8)}"
            paused = None
            if turn.pause_s > 0:
                began = time.time()
                await self._pause(conversation, turn, call_id)
                paused = (began, time.time())
            if turn.before_send is not None:
                turn.before_send()
            if turn.rewrite_first_user is not None:
                first = next((m for m in messages if m["role"] == "user"), None)
                if first is not None:
                    first["content"] = turn.rewrite_first_user
            if turn.tool and len(messages) > 1 and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [
                    {"id": call_id, "type": "function", "function": {"name": turn.tool, "arguments": "{}"}}
                ]
                messages.append({"role": "tool", "tool_call_id": call_id, "content": turn.user})
            else:
                messages.append({"role": "user", "content": turn.user})
            result = await self._turn(conversation, index, turn, messages, session)
            result.pause_unix = paused
            results.append(result)
            if not result.ok:
                break
            messages.append({"role": "assistant", "content": result.text})
        return results

    async def _pause(self, conversation: Conversation, turn: Turn, call_id: str) -> None:
        if self.tracer is not None and turn.tool:
            span = self.tracer.start_span(
                names.SPAN_TOOL.format(name=turn.tool),
                kind=SpanKind.INTERNAL,
                attributes={
                    names.GEN_AI_OPERATION_NAME: names.OPERATION_EXECUTE_TOOL,
                    names.GEN_AI_TOOL_NAME: turn.tool,
                    names.GEN_AI_TOOL_CALL_ID: call_id,
                    names.GEN_AI_CONVERSATION_ID: conversation.conversation_id,
                },
            )
            await asyncio.sleep(turn.pause_s)
            span.end()
            if self.flush is not None:
                await asyncio.get_running_loop().run_in_executor(None, self.flush)
        else:
            await asyncio.sleep(turn.pause_s)

    async def _turn(
        self,
        conversation: Conversation,
        index: int,
        turn: Turn,
        messages: list[dict[str, Any]],
        session: aiohttp.ClientSession,
    ) -> TurnResult:
        stream = conversation.stream or turn.interrupt_after is not None
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": turn.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": stream,
            **self.extra_body,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"Content-Type": "application/json"}
        if conversation.send_conversation_id:
            headers["X-Conversation-Id"] = conversation.conversation_id

        span = None
        if self.tracer is not None and self.chat_spans:
            span = self.tracer.start_span(
                names.SPAN_AGENT_TURN.format(model=self.model),
                kind=SpanKind.CLIENT,
                attributes={
                    names.GEN_AI_OPERATION_NAME: names.OPERATION_CHAT,
                    names.GEN_AI_REQUEST_MODEL: self.model,
                    names.GEN_AI_CONVERSATION_ID: conversation.conversation_id,
                    names.TURN_INDEX: index,
                },
            )
            propagate.inject(headers, context=trace.set_span_in_context(span))
            trace_id = format(span.get_span_context().trace_id, "032x")
        if span is None or not span.get_span_context().is_valid:
            trace_id, headers["traceparent"] = _random_traceparent()

        result = TurnResult(
            conversation.conversation_id, index, trace_id, 0, 0.0, None, started_unix=time.time()
        )
        started = time.perf_counter()
        try:
            async with session.post(
                f"{self.base_url}/v1/chat/completions",
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as resp:
                result.status = resp.status
                # The socket the response came on (aiohttp may already have pooled the
                # connection, so through the body's reader; None if that ever changes).
                protocol = getattr(resp.content, "_protocol", None)
                sock = arrival.socket_of(getattr(protocol, "transport", None))
                if resp.status != 200:
                    result.error = (await resp.text())[:500]
                elif stream:
                    await _read_stream(resp, result, started, stop_after=turn.interrupt_after)
                else:
                    data = await resp.json()
                    result.ttft_s = time.perf_counter() - started
                    result.text = data["choices"][0]["message"]["content"] or ""
                    usage = data.get("usage") or {}
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.completion_tokens = int(usage.get("completion_tokens") or 0)
                _kernel_times(result, arrival.tcp_times_ns(sock, time.time_ns()))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        result.latency_s = time.perf_counter() - started
        result.done_unix = time.time()
        if span is not None:
            span.set_attributes(
                {
                    names.HTTP_STATUS: result.status,
                    names.GEN_AI_USAGE_INPUT_TOKENS: result.prompt_tokens,
                    names.GEN_AI_USAGE_OUTPUT_TOKENS: result.completion_tokens,
                }
            )
            if not result.ok:
                span.set_status(Status(StatusCode.ERROR, result.error or str(result.status)))
            span.end()
        return result

    async def run_many(self, conversations: Sequence[Conversation]) -> list[list[TurnResult]]:
        """Run conversations concurrently, each with its own HTTP client (as separate agents
        are, and so that no other conversation's request goes out on a connection between a
        response and the reading of its kernel times); results in the order given."""

        async def one(conversation: Conversation) -> list[TurnResult]:
            async with aiohttp.ClientSession() as session:
                return await self.run(conversation, session)

        return list(await asyncio.gather(*(one(c) for c in conversations)))

    def run_sync(self, conversations: Sequence[Conversation]) -> list[list[TurnResult]]:
        return asyncio.run(self.run_many(conversations))


_JIFFY_S = 0.011
"""The kernel's times are in jiffies (up to 10 ms at HZ=100): the slack allowed against the
process clock when checking they belong to this request."""


def _kernel_times(result: TurnResult, times: arrival.TcpTimes | None) -> None:
    """Keep the connection's kernel times if they can only be this request's: sent after the
    client started it, and before the response's last byte came (a request of another task
    sent on the same pooled connection in between would break both)."""
    if times is None:
        return
    sent, done = times.sent_ns / 1e9, times.received_ns / 1e9
    if result.started_unix - _JIFFY_S <= sent <= done + _JIFFY_S:
        result.sent_kernel_unix, result.done_kernel_unix = sent, done


async def _read_stream(
    resp: aiohttp.ClientResponse, result: TurnResult, started: float, *, stop_after: int | None = None
) -> None:
    """Read an SSE completion; with ``stop_after``, close the connection after that many content chunks."""
    parts: list[str] = []
    chunks = 0
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        for choice in chunk.get("choices", []):
            text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if text and result.ttft_s is None:
                result.ttft_s = time.perf_counter() - started
            parts.append(text)
            chunks += 1 if text else 0
        if stop_after is not None and chunks >= stop_after:
            # close(), not release(): the server must see the client go, as when a user stops.
            resp.close()
            result.interrupted = True
            break
        usage = chunk.get("usage")
        if usage:
            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            result.completion_tokens = int(usage.get("completion_tokens") or 0)
    result.text = "".join(parts)
