"""The transparent reverse proxy: one turn span per completion request, bytes untouched.

Every request goes to the upstream (the fleet's router) with the same method, path,
query, headers and body; every response comes back with the same status, headers and
bytes, chunk by chunk as the upstream sent them (no added buffering: a chunk is written
to the client before the observer reads it). Only ``/v1/chat/completions`` and
``/v1/completions`` are observed; on those the sidecar adds ``traceparent`` (its turn
span) and ``X-Session-ID`` (the conversation id) for the router and engines, and - when
configured, for routers that key on it - ``conversation_id`` in the body.

Failure behaviour: upstream unreachable -> 502 with a JSON error (counted); the client
going away -> the upstream response is closed and the span says so; any error inside
otelkv's own observation is logged and the bytes keep flowing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from yarl import URL

from otelkv import names
from otelkv.analysis.phases import Phases, split_gap, turn_phases
from otelkv.sidecar.conversations import ConversationTracker, TurnStart
from otelkv.sidecar.identity import ConversationIdentity, identify
from otelkv.sidecar.metrics import SidecarMetrics
from otelkv.sidecar.response import RequestFacts, ResponseFacts, ResponseObserver, request_facts
from otelkv.sidecar.tool_spans import ToolSpanIndex

logger = logging.getLogger("otelkv.sidecar")

OBSERVED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}

_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)


def upstream_request_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """Client headers as sent upstream: all but hop-by-hop ones (aiohttp sets Host and length)."""
    connection_named = (
        {token.strip().lower() for value in headers.getall("Connection", []) for token in value.split(",")}
        if hasattr(headers, "getall")
        else set()
    )
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        lower = key.lower()
        if lower in _HOP_BY_HOP or lower in connection_named:
            continue
        out.add(key, value)
    return out


def client_response_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """Upstream response headers as sent to the client: all but hop-by-hop ones.

    Content-Length is kept (the body is forwarded unchanged and undecoded), so a sized
    response stays sized; Transfer-Encoding is re-done by the server.
    """
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        lower = key.lower()
        if lower in _HOP_BY_HOP and lower != "content-length":
            continue
        out.add(key, value)
    return out


@dataclass(frozen=True)
class ProxyConfig:
    upstream: str
    inject_session_header: bool = True
    inject_body_conversation_id: bool = False
    max_body_bytes: int = 32 * 1024 * 1024
    upstream_timeout_s: float | None = None
    """Total time allowed per upstream request (None: no limit, like a plain proxy)."""


class _Turn:
    """One observed request's state between arrival and last byte."""

    __slots__ = ("arrival_ns", "identity", "operation", "request", "span", "start", "status")

    def __init__(self, arrival_ns: int, operation: str, request: RequestFacts) -> None:
        self.arrival_ns = arrival_ns
        self.operation = operation
        self.request = request
        self.identity: ConversationIdentity | None = None
        self.start: TurnStart | None = None
        self.span: trace.Span | None = None
        self.status = 0


class Proxy:
    def __init__(
        self,
        config: ProxyConfig,
        *,
        tracer: trace.Tracer,
        metrics: SidecarMetrics,
        tracker: ConversationTracker,
        tools: ToolSpanIndex,
    ) -> None:
        self.config = config
        self.upstream = config.upstream.rstrip("/")
        self.tracer = tracer
        self.metrics = metrics
        self.tracker = tracker
        self.tools = tools
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.upstream_timeout_s, sock_connect=10)
        self._session = aiohttp.ClientSession(
            timeout=timeout,
            auto_decompress=False,  # forward the upstream's bytes as they are
            # Idle upstream connections are closed before common server keep-alive limits
            # (uvicorn, which vLLM and many routers use: 5 s), so a reused connection is not
            # closed under a request ("Server disconnected" would become a 502).
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=60, keepalive_timeout=4.0),
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ handler

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrival_ns = time.time_ns()
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return web.json_response(
                {
                    "error": {
                        "message": f"request body over {self.config.max_body_bytes} bytes",
                        "type": "otelkv",
                    }
                },
                status=413,
            )
        operation = OBSERVED_PATHS.get(request.path) if request.method == "POST" else None
        headers = upstream_request_headers(request.headers)
        turn: _Turn | None = None
        if operation is not None:
            try:
                turn, body = self._begin(request, body, headers, operation, arrival_ns)
            except Exception:  # never let observation stop the request
                logger.exception("otelkv sidecar: could not start a turn span; passing through")
                turn = None
        try:
            return await self._forward(request, body, headers, turn)
        finally:
            if turn is not None:
                try:
                    self._finish_unended(turn)
                except Exception:
                    logger.exception("otelkv sidecar: could not end a turn span")

    def _begin(
        self,
        request: web.Request,
        body: bytes,
        headers: CIMultiDict[str],
        operation: str,
        arrival_ns: int,
    ) -> tuple[_Turn, bytes]:
        parsed: dict[str, Any] | None = None
        try:
            value = json.loads(body) if body else None
            parsed = value if isinstance(value, dict) else None
        except (ValueError, UnicodeDecodeError, RecursionError):
            parsed = None  # forwarded untouched; the upstream answers it
        facts = request_facts(parsed)
        turn = _Turn(arrival_ns, operation, facts)
        identity = identify(request.headers, parsed)
        turn.identity = identity
        parent = propagate.extract(request.headers)
        model = facts.model or "unknown"
        attributes: dict[str, Any] = {
            names.GEN_AI_OPERATION_NAME: operation,
            names.GEN_AI_REQUEST_MODEL: facts.model,
            names.GEN_AI_PROVIDER_NAME: names.PROVIDER_VLLM,
            names.HTTP_ROUTE: request.path,
            names.TURN_STREAM: facts.stream,
            names.TURN_MESSAGES: facts.messages,
            names.TURN_TOOL_RESULTS: facts.tool_results,
        }
        if identity is not None:
            turn.start = self.tracker.begin(identity.conversation_id)
            attributes.update(
                {
                    names.GEN_AI_CONVERSATION_ID: identity.conversation_id,
                    names.CONVERSATION_ID_SOURCE: identity.source,
                    names.CONVERSATION_INFERRED: identity.inferred,
                    names.TURN_INDEX: turn.start.index,
                    names.TURN_PREVIOUS_TRACE_ID: turn.start.previous_trace_id,
                }
            )
        span = self.tracer.start_span(
            names.SPAN_AGENT_TURN.format(model=model),
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=arrival_ns,
        )
        turn.span = span
        # Downstream sees the turn span as its parent (replacing the client's traceparent,
        # which is this span's parent), and the conversation id vLLM puts on request.session_id.
        for key in ("traceparent", "tracestate"):
            headers.popall(key, None)
        propagate.inject(headers, context=trace.set_span_in_context(span))
        if identity is not None:
            if self.config.inject_session_header and "X-Session-ID" not in headers:
                headers["X-Session-ID"] = identity.conversation_id
            if (
                self.config.inject_body_conversation_id
                and parsed is not None
                and "conversation_id" not in parsed
            ):
                body = json.dumps({**parsed, "conversation_id": identity.conversation_id}).encode()
                headers["Content-Type"] = "application/json"
        return turn, body

    async def _forward(
        self, request: web.Request, body: bytes, headers: CIMultiDict[str], turn: _Turn | None
    ) -> web.StreamResponse:
        assert self._session is not None, "proxy not started"
        # Path and query exactly as the client sent them (encoded=True: yarl would otherwise
        # re-quote them, e.g. turn ?q=%2F into ?q=/ and %41 into A).
        url = URL(self.upstream + request.raw_path, encoded=True)
        try:
            upstream = await self._session.request(
                request.method, url, data=body, headers=headers, allow_redirects=False
            )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.metrics.upstream_errors.inc()
            if turn is not None:
                turn.status = 502
                self._end(turn, None, error=f"upstream unreachable: {type(exc).__name__}")
            return web.json_response(
                {
                    "error": {
                        "message": f"otelkv sidecar: upstream {self.upstream} unreachable: {exc}",
                        "type": "otelkv",
                    }
                },
                status=502,
            )
        observer = None
        if turn is not None:
            turn.status = upstream.status
            ctype = upstream.headers.get("Content-Type", "")
            streaming = ctype.startswith("text/event-stream")
            if not upstream.headers.get("Content-Encoding"):
                observer = ResponseObserver(streaming=streaming)
        out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        out.headers.update(client_response_headers(upstream.headers))
        error: str | None = None
        try:
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
                if observer is not None:
                    try:
                        observer.feed(chunk, time.time_ns())
                    except Exception:
                        logger.exception("otelkv sidecar: response observer failed; forwarding only")
                        observer = None
            await out.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            error = "client disconnected"
            logger.info("otelkv sidecar: client went away during %s", request.path)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            error = f"upstream failed mid-response: {type(exc).__name__}"
            self.metrics.upstream_errors.inc()
        finally:
            upstream.release()
            if turn is not None:
                facts = None
                if observer is not None:
                    try:
                        facts = observer.finish(time.time_ns())
                    except Exception:
                        logger.exception("otelkv sidecar: response observer failed")
                self._end(turn, facts, error=error)
        return out

    # ------------------------------------------------------------------ turn end

    def _end(self, turn: _Turn, facts: ResponseFacts | None, *, error: str | None) -> None:
        span = turn.span
        if span is None:
            return
        turn.span = None
        end_ns = time.time_ns()
        try:
            self._record(turn, span, facts, error, end_ns)
        finally:
            span.end(end_time=end_ns)

    def _record(
        self, turn: _Turn, span: trace.Span, facts: ResponseFacts | None, error: str | None, end_ns: int
    ) -> None:
        request_s = (end_ns - turn.arrival_ns) / 1e9
        stream_ttft = None
        if facts is not None and turn.request.stream and facts.first_token_ns is not None:
            stream_ttft = (facts.first_token_ns - turn.arrival_ns) / 1e9
        start = turn.start
        conversation_id = turn.identity.conversation_id if turn.identity else ""
        if start is not None and start.gap_start_ns:
            call_ids = (*start.previous_tool_call_ids, *turn.request.tool_result_call_ids)
            intervals = self.tools.intervals(
                start.gap_start_ns, turn.arrival_ns, conversation_id=conversation_id, call_ids=call_ids
            )
            gap = split_gap(
                start.gap_start_ns,
                turn.arrival_ns,
                tool_intervals=intervals,
                previous_asked_tools=start.previous_asked_tools,
                tool_results=turn.request.tool_results,
            )
        else:
            gap = split_gap(0, 0, first_turn=True)
        phases: Phases = turn_phases(gap, request_s, stream_ttft_s=stream_ttft)
        ok = error is None and 200 <= turn.status < 300
        attributes: dict[str, Any] = {
            names.HTTP_STATUS: turn.status,
            names.TURN_GAP_SECONDS: gap.tool_wait_s + gap.app_work_s,
            names.TURN_GAP_SOURCE: gap.source,
            names.TURN_TOOL_WAIT_SECONDS: phases.tool_wait_s,
            names.TURN_APP_WORK_SECONDS: phases.app_work_s,
            names.TURN_INPUT_PROCESSING_SECONDS: phases.input_processing_s,
            names.TURN_GENERATION_SECONDS: phases.generation_s,
            names.TURN_TOTAL_SECONDS: phases.total_s,
            names.TURN_TTFT_SOURCE: phases.ttft_source,
        }
        if facts is not None:
            if facts.model:
                attributes[names.GEN_AI_RESPONSE_MODEL] = facts.model
            if facts.response_id:
                attributes[names.GEN_AI_RESPONSE_ID] = facts.response_id
            if facts.prompt_tokens is not None:
                attributes[names.GEN_AI_USAGE_INPUT_TOKENS] = facts.prompt_tokens
            if facts.completion_tokens is not None:
                attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] = facts.completion_tokens
            if facts.cached_tokens is not None:
                attributes[names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = facts.cached_tokens
            if facts.finish_reasons:
                attributes[names.GEN_AI_RESPONSE_FINISH_REASONS] = facts.finish_reasons[:16]
            attributes[names.TURN_RESPONSE_KV_PARAMS] = facts.kv_transfer_params
            attributes[names.TURN_ASKED_TOOLS] = facts.asked_tools
            if stream_ttft is not None:
                attributes[names.TURN_TTFT_SECONDS] = stream_ttft
            if facts.last_token_ns is not None:
                attributes[names.TURN_LAST_TOKEN_SECONDS] = (facts.last_token_ns - turn.arrival_ns) / 1e9
        span.set_attributes(attributes)
        if not ok:
            message = error or f"upstream returned {turn.status}"
            span.set_status(Status(StatusCode.ERROR, message))
            span.set_attribute(
                names.ERROR_TYPE,
                "client_disconnected" if error == "client disconnected" else str(turn.status or "upstream"),
            )
        if turn.identity is not None and start is not None:
            ctx = span.get_span_context()
            self.tracker.end(
                conversation_id,
                trace_id=format(ctx.trace_id, "032x"),
                end_ns=end_ns,
                asked_tools=bool(facts and facts.asked_tools),
                tool_call_ids=tuple(facts.tool_call_ids[:32]) if facts else (),
            )
        self.metrics.observe_turn(
            model=turn.request.model or "unknown",
            phases=phases,
            ttft_s=stream_ttft,
            turn_index=start.index if start else 0,
            ok=ok,
            stream=turn.request.stream,
        )

    def _finish_unended(self, turn: _Turn) -> None:
        """A turn whose response never completed (cancelled handler): end its span once."""
        if turn.span is not None:
            self._end(turn, None, error="request cancelled")
