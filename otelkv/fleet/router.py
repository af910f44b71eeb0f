"""A conversation-aware prefill/decode router for the reference fleet.

What it does per request (``/v1/chat/completions`` and ``/v1/completions``):

1. Identify the conversation (``X-Conversation-Id``, ``X-Session-ID``, body
   ``conversation_id``/``session_id``) and take the decode node's handle
   (``kv_transfer_params``) it remembered for that conversation - single use, dropped
   once older than ``handle_ttl_s``, which should stay below the decode TTL.
2. Call the prefill node non-streaming with ``max_tokens=1`` and either that handle
   (``do_remote_decode`` plus the decode node's fields: a reverse pull) or an empty one.
3. Call the decode node with the prefill node's ``kv_transfer_params``. Non-streaming by
   default, because vLLM 0.32.0 returns ``kv_transfer_params`` only on non-streaming
   responses; a streaming client then gets the answer re-emitted as SSE. With
   ``stream_decode=True`` the decode leg streams straight through - and no handle comes
   back, which otelkv should diagnose.
4. Remember the decode node's new handle for the conversation's next turn.

Both legs carry the caller's ``traceparent``/``tracestate``/``baggage``, the conversation
id as ``X-Session-ID`` (vLLM's per-request ``session_id``) and one ``X-Request-Id``, so
the prefill and decode requests share vLLM's base request id. The router's own spans
(``router {operation}`` with a ``router_leg`` per engine call) are emitted when it is
given a tracer.

This is a reference implementation for tests, demos and benchmarks, not a production
router: one prefill and one decode endpoint, no load balancing, no retries.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otelkv import names

_PASS_HEADERS = ("traceparent", "tracestate", "baggage")
_PREFILL_DROP = ("max_completion_tokens", "min_tokens", "stream_options")


@dataclass
class RouterStats:
    requests: int = 0
    handle_hits: int = 0
    handle_misses: int = 0
    handle_stale: int = 0
    no_conversation: int = 0
    handles_stored: int = 0
    prefill_errors: int = 0
    decode_errors: int = 0
    prefill_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    """Wall time of each prefill leg (the benchmark's TTFT), most recent last."""


class HandleCache:
    """Decode handles per conversation: single use, age-limited, size-bounded (LRU)."""

    def __init__(self, ttl_s: float | None, capacity: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], float]] = OrderedDict()

    def put(self, conversation_id: str, params: dict[str, Any], now: float | None = None) -> None:
        self._items[conversation_id] = (params, time.monotonic() if now is None else now)
        self._items.move_to_end(conversation_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def take(
        self, conversation_id: str, now: float | None = None
    ) -> tuple[str, dict[str, Any] | None, float]:
        """Pop the conversation's handle: (state, params or None, age in seconds)."""
        entry = self._items.pop(conversation_id, None)
        if entry is None:
            return names.ROUTER_HANDLE_MISS, None, 0.0
        params, stored = entry
        age = (time.monotonic() if now is None else now) - stored
        if self.ttl_s is not None and age > self.ttl_s:
            return names.ROUTER_HANDLE_STALE, None, age
        return names.ROUTER_HANDLE_HIT, params, age

    def __len__(self) -> int:
        return len(self._items)


def conversation_id_of(headers: Any, body: dict[str, Any]) -> str | None:
    for header in ("X-Conversation-Id", "X-Session-ID"):
        value = headers.get(header)
        if value:
            return str(value)
    for key in ("conversation_id", "session_id"):
        value = body.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _empty_handle() -> dict[str, Any]:
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


class PDRouter:
    """The router as an aiohttp application; :meth:`start` serves it from a thread."""

    def __init__(
        self,
        prefill_url: str,
        decode_url: str,
        *,
        handle_ttl_s: float | None,
        stream_decode: bool = False,
        tracer: trace.Tracer | None = None,
        engine_host: str = "127.0.0.1",
    ) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.handles = HandleCache(handle_ttl_s)
        self.stream_decode = stream_decode
        self.tracer = tracer or trace.NoOpTracer()
        self.engine_host = engine_host
        self.stats = RouterStats()
        self.between_legs: Callable[[], None] | None = None
        """Called (in the router's loop) after a prefill leg succeeded and before its decode
        leg: tests use it to stall an engine at exactly that point."""
        self.port: int | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        return app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int = 0) -> PDRouter:
        self._thread = threading.Thread(target=self._serve, args=(port,), name="otelkv-router", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._start_error is not None:
            raise RuntimeError(f"router failed to start: {self._start_error}") from self._start_error
        return self

    def _serve(self, port: int) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._setup(port))
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._teardown())
        loop.close()

    async def _setup(self, port: int) -> None:
        # One connection per leg, none kept idle. vLLM's API server (uvicorn) closes a
        # connection 5 s after its last response, by a timer that runs before the reads of
        # a loop waking from a stall: a request written on a pooled connection while the
        # engine's loop was stalled past that mark is dropped unanswered, however soon this
        # side reused it ("Can not write request body", "Server disconnected"). A fresh
        # connection has no such timer; on the fleet's loopback its connect costs well under
        # a millisecond against a leg of tens of milliseconds or more (engines on other
        # hosts, or behind TLS, would pay a handshake per leg).
        # A loopback connect to a live engine completes in the kernel; one that times out
        # means this thread could not run (the machine was starved), not a dead engine
        # (refused at once), so the limit only has to catch a hung listener.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=60),
            connector=aiohttp.TCPConnector(force_close=True),
        )
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        server = site._server
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def _teardown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(15)

    # ------------------------------------------------------------------ handlers

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "cached_conversations": len(self.handles)})

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        async with self._session.get(f"{self.prefill_url}/v1/models") as resp:
            return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "request body is not valid JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "request body must be a JSON object"}}, status=400)
        self.stats.requests += 1
        path = request.path
        chat = path.endswith("chat/completions")
        operation = names.OPERATION_CHAT if chat else names.OPERATION_TEXT_COMPLETION
        conversation_id = conversation_id_of(request.headers, body)
        body.pop("conversation_id", None)  # not an OpenAI field; vLLM gets X-Session-ID instead
        client_stream = bool(body.get("stream"))

        carrier = {k: v for k in _PASS_HEADERS if (v := request.headers.get(k))}
        parent = propagate.extract(carrier)
        span = self.tracer.start_span(
            names.SPAN_ROUTER_TURN.format(operation=operation), context=parent, kind=SpanKind.SERVER
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            return await self._route(request, body, path, conversation_id, client_stream, span)
        finally:
            otel_context.detach(token)
            span.end()

    def _leg_headers(self, request_id: str, conversation_id: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        propagate.inject(headers)  # the current span: the router leg
        if conversation_id:
            headers["X-Session-ID"] = conversation_id
        return headers

    async def _route(
        self,
        request: web.Request,
        body: dict[str, Any],
        path: str,
        conversation_id: str | None,
        client_stream: bool,
        span: trace.Span,
    ) -> web.StreamResponse:
        assert self._session is not None
        request_id = uuid.uuid4().hex
        if conversation_id is None:
            state, handle, age = names.ROUTER_HANDLE_NO_CONVERSATION, None, 0.0
            self.stats.no_conversation += 1
        else:
            state, handle, age = self.handles.take(conversation_id)
            if state == names.ROUTER_HANDLE_HIT:
                self.stats.handle_hits += 1
            elif state == names.ROUTER_HANDLE_STALE:
                self.stats.handle_stale += 1
            else:
                self.stats.handle_misses += 1
        if span.is_recording():
            span.set_attributes(
                {
                    names.ROUTER_HANDLE: state,
                    names.ROUTER_HANDLE_AGE_SECONDS: age,
                    names.ROUTER_DECODE_STREAMED: self.stream_decode and client_stream,
                    names.GEN_AI_REQUEST_MODEL: str(body.get("model", "")),
                }
            )
            if conversation_id:
                span.set_attribute(names.GEN_AI_CONVERSATION_ID, conversation_id)
            if self.handles.ttl_s is not None:
                span.set_attribute(names.ROUTER_HANDLE_TTL_SECONDS, float(self.handles.ttl_s))

        kv = dict(handle, do_remote_decode=True, do_remote_prefill=False) if handle else _empty_handle()
        prefill_body = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
        prefill_body.update(stream=False, max_tokens=1, kv_transfer_params=kv)

        started = time.perf_counter()
        status, prefill = await self._leg(names.ROLE_PREFILL, path, prefill_body, request_id, conversation_id)
        self.stats.prefill_seconds.append(time.perf_counter() - started)
        if status != 200 or not isinstance(prefill, dict):
            self.stats.prefill_errors += 1
            return _leg_failed(names.ROLE_PREFILL, status, prefill, span)

        if self.between_legs is not None:
            self.between_legs()
        decode_body = dict(body)
        p_kv = prefill.get("kv_transfer_params")
        if p_kv:
            decode_body["kv_transfer_params"] = dict(p_kv, remote_host=self.engine_host)
        if self.stream_decode and client_stream:
            return await self._stream_decode(request, path, decode_body, request_id, conversation_id, span)

        decode_body["stream"] = False
        decode_body.pop("stream_options", None)
        status, decoded = await self._leg(names.ROLE_DECODE, path, decode_body, request_id, conversation_id)
        if status != 200 or not isinstance(decoded, dict):
            self.stats.decode_errors += 1
            return _leg_failed(names.ROLE_DECODE, status, decoded, span)
        d_kv = decoded.pop("kv_transfer_params", None)
        if d_kv and conversation_id:
            self.handles.put(conversation_id, dict(d_kv, remote_host=self.engine_host))
            self.stats.handles_stored += 1
        span.set_attribute(names.HTTP_STATUS, 200)
        if client_stream:
            return await _reemit_as_sse(request, decoded, body.get("stream_options"))
        return web.json_response(decoded)

    async def _leg(
        self, role: str, path: str, body: dict[str, Any], request_id: str, conversation_id: str | None
    ) -> tuple[int, Any]:
        assert self._session is not None
        base = self.prefill_url if role == names.ROLE_PREFILL else self.decode_url
        with self.tracer.start_as_current_span(
            names.SPAN_ROUTER_LEG.format(role=role), kind=SpanKind.CLIENT
        ) as leg:
            try:
                async with self._session.post(
                    f"{base}{path}", json=body, headers=self._leg_headers(request_id, conversation_id)
                ) as resp:
                    raw = await resp.read()
                    leg.set_attribute(names.HTTP_STATUS, resp.status)
                    try:
                        return resp.status, json.loads(raw)
                    except json.JSONDecodeError:
                        return resp.status, raw.decode(errors="replace")
            except aiohttp.ClientError as exc:
                leg.set_status(Status(StatusCode.ERROR, str(exc)))
                return 502, {"error": {"message": f"{role} engine unreachable: {exc}"}}

    async def _stream_decode(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        request_id: str,
        conversation_id: str | None,
        span: trace.Span,
    ) -> web.StreamResponse:
        assert self._session is not None
        with self.tracer.start_as_current_span(
            names.SPAN_ROUTER_LEG.format(role=names.ROLE_DECODE), kind=SpanKind.CLIENT
        ) as leg:
            async with self._session.post(
                f"{self.decode_url}{path}", json=body, headers=self._leg_headers(request_id, conversation_id)
            ) as resp:
                leg.set_attribute(names.HTTP_STATUS, resp.status)
                out = web.StreamResponse(status=resp.status)
                out.content_type = resp.content_type
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out


def _leg_failed(role: str, status: int, body: Any, span: trace.Span) -> web.Response:
    """Hand an engine's error to the client with its status (a 200 without JSON: 502)."""
    if status == 200:
        status = 502
    span.set_status(Status(StatusCode.ERROR, f"{role} returned {status}"))
    span.set_attribute(names.HTTP_STATUS, status)
    payload = body if isinstance(body, dict) else {"error": {"message": f"{role} engine: {body}"}}
    return web.json_response(payload, status=status)


async def _reemit_as_sse(
    request: web.Request, response: dict[str, Any], stream_options: Any
) -> web.StreamResponse:
    """Send a complete (non-streaming) completion to a streaming client as SSE chunks."""
    out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    chat = response.get("object") == "chat.completion"
    for choice in response.get("choices", []):
        if chat:
            message = choice.get("message") or {}
            delta = {"role": "assistant", "content": message.get("content") or ""}
            chunk_choice = {"index": choice.get("index", 0), "delta": delta, "finish_reason": None}
        else:
            chunk_choice = {
                "index": choice.get("index", 0),
                "text": choice.get("text", ""),
                "finish_reason": None,
            }
        await out.write(_sse(response, chat, [chunk_choice]))
        final = {"index": choice.get("index", 0), "finish_reason": choice.get("finish_reason")}
        final["delta" if chat else "text"] = {} if chat else ""
        await out.write(_sse(response, chat, [final]))
    if isinstance(stream_options, dict) and stream_options.get("include_usage"):
        await out.write(_sse(response, chat, [], usage=response.get("usage")))
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


def _sse(response: dict[str, Any], chat: bool, choices: list[dict[str, Any]], usage: Any = None) -> bytes:
    chunk: dict[str, Any] = {
        "id": response.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": response.get("created"),
        "model": response.get("model"),
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n".encode()
