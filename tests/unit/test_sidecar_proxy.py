"""A real sidecar in front of a small local upstream: bytes pass through untouched and unbuffered,
each completion request becomes one turn span linked to what the upstream receives, and the
admin listener (OTLP receiver, /metrics, query API) behaves as documented.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from yarl import URL

from otelkv import names
from otelkv.sidecar.app import Sidecar, SidecarConfig
from otelkv.spans import SpanRecord

TIMEOUT = 5.0

JSON_BODY = json.dumps(
    {
        "id": "chatcmpl-json",
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "héllo ☃ 日本"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 8}},
    },
    ensure_ascii=False,
).encode()

_SNOW = "☃".encode()  # three bytes: the stream below is cut inside it
SSE_CHUNKS = [
    b'data: {"id":"s1","model":"m","choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"id":"s1","choices":[{"delta":{"content":"caf\xc3\xa9 ' + _SNOW[:1],
    _SNOW[1:] + b'"}}]}\n\n',
    b'data: {"id":"s1","choices":[{"delta":{},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n',
    b"data: [DONE]\n\n",
]
ERROR_BODY = b'{"error": "rate limited \xe2\x80\x94 slow down"}\n\xff\xfe trailing raw bytes'
GATE_FIRST = b'data: {"choices":[{"delta":{"content":"first"}}]}\n\n'
GATE_REST = b'data: {"choices":[{"delta":{"content":"rest"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'


# ------------------------------------------------------------------ the upstream


class Upstream:
    """An OpenAI-like upstream on its own thread and loop, recording what it receives."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-upstream", daemon=True)
        self.received: list[dict[str, Any]] = []
        self.gate: asyncio.Event | None = None
        self.gate_opened_by_client: bool | None = None
        self.runner: web.AppRunner | None = None
        self.port = 0

    def start(self) -> Upstream:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(TIMEOUT)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(TIMEOUT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)
        self.loop.close()

    def open_gate(self) -> None:
        gate = self.gate
        assert gate is not None
        self.loop.call_soon_threadsafe(gate.set)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(
            {
                "method": request.method,
                "path": request.raw_path,
                "headers": request.headers.copy(),
                "body": body,
            }
        )
        mode = request.headers.get("X-Test-Mode", "")
        if request.method == "GET" and request.path == "/v1/models":
            return web.Response(body=b'{"data":[{"id":"m"}]}', content_type="application/json")
        if request.path.startswith("/v1/") and mode in ("", "json"):
            resp = web.Response(body=JSON_BODY, headers={"Content-Type": "application/json; charset=utf-8"})
            resp.headers["X-Upstream-Custom"] = "kept é"
            resp.headers.add("Set-Cookie", "a=1")
            resp.headers.add("Set-Cookie", "b=2")
            return resp
        if mode == "error":
            return web.Response(status=429, body=ERROR_BODY, headers={"X-Upstream-Custom": "err"})
        if mode in ("sse", "gate"):
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "X-Upstream-Custom": "sse"}
            )
            await resp.prepare(request)
            if mode == "sse":
                for chunk in SSE_CHUNKS:
                    await resp.write(chunk)
                    await asyncio.sleep(0.005)
            else:
                self.gate = asyncio.Event()
                self.gate_opened_by_client = None
                await resp.write(GATE_FIRST)
                try:
                    await asyncio.wait_for(self.gate.wait(), TIMEOUT)
                    self.gate_opened_by_client = True
                except TimeoutError:
                    self.gate_opened_by_client = False
                await resp.write(GATE_REST)
            await resp.write_eof()
            return resp
        # Anything else: echo the request, with a status and header of our own.
        return web.Response(status=201, body=b"echo:" + body, headers={"X-Echo-Path": request.raw_path})


# ------------------------------------------------------------------ fixtures and helpers


class Turns:
    """A pipeline tap collecting the sidecar's own turn spans."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []

    def __call__(self, spans: Any) -> None:
        self.spans.extend(spans)

    def turn_spans(self) -> list[SpanRecord]:
        return [s for s in list(self.spans) if s.scope_name == names.SCOPE_SIDECAR]

    def wait(self, conversation_id: str, index: int) -> SpanRecord:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            for span in self.turn_spans():
                a = span.attributes
                if (
                    a.get(names.GEN_AI_CONVERSATION_ID) == conversation_id
                    and a.get(names.TURN_INDEX) == index
                ):
                    return span
            time.sleep(0.005)
        raise AssertionError(f"no turn span for {conversation_id!r} #{index}")


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    server = Upstream().start()
    yield server
    server.stop()


def _start(upstream_url: str, **kwargs: Any) -> tuple[Sidecar, Turns]:
    sidecar = Sidecar(
        SidecarConfig(upstream=upstream_url, port=0, admin_port=0, store=False, **kwargs)
    ).start()
    turns = Turns()
    sidecar.pipeline.taps.append(turns)
    return sidecar, turns


@pytest.fixture(scope="module")
def sidecar(upstream: Upstream) -> Iterator[tuple[Sidecar, Turns]]:
    sc, turns = _start(upstream.url, token=None)
    yield sc, turns
    sc.stop()


def run(fn: Callable[[aiohttp.ClientSession], Awaitable[Any]]) -> Any:
    """Run ``fn`` with a fresh raw client session (no decompression, nothing added)."""

    async def main() -> Any:
        async with aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=3 * TIMEOUT)
        ) as session:
            return await fn(session)

    return asyncio.run(main())


def request(
    method: str, url: str, *, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, Any, bytes]:
    """(status, headers, body bytes) of one request."""

    async def go(session: aiohttp.ClientSession) -> tuple[int, Any, bytes]:
        target = URL(url, encoded=True)  # send the path and query exactly as written
        async with session.request(method, target, data=body or None, headers=headers or {}) as resp:
            return resp.status, resp.headers.copy(), await resp.read()

    return run(go)  # type: ignore[no-any-return]


def chat(messages: list[dict[str, Any]], *, stream: bool = False, model: str = "m") -> bytes:
    return json.dumps({"model": model, "stream": stream, "messages": messages}).encode()


USER = [{"role": "user", "content": "fix the bug"}]
JSON_CT = {"Content-Type": "application/json"}


def _metric(admin_url: str, name: str) -> float:
    _, _, text = request("GET", admin_url + "/metrics")
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# ------------------------------------------------------------------ (a) byte-for-byte


def test_non_streaming_response_is_byte_identical(sidecar: tuple[Sidecar, Turns]) -> None:
    """Status, body bytes (non-ASCII), length, custom and repeated headers arrive unchanged."""
    sc, _ = sidecar
    status, headers, body = request(
        "POST", sc.url + "/v1/chat/completions", body=chat(USER), headers={**JSON_CT, "X-Test-Mode": "json"}
    )
    assert status == 200
    assert body == JSON_BODY
    assert headers["Content-Length"] == str(len(JSON_BODY))
    assert headers["Content-Type"] == "application/json; charset=utf-8"
    assert headers["X-Upstream-Custom"] == "kept é"
    assert headers.getall("Set-Cookie") == ["a=1", "b=2"]


def test_streaming_response_is_byte_identical(sidecar: tuple[Sidecar, Turns]) -> None:
    """SSE chunks (one cut inside a multibyte character) reach the client exactly as sent."""
    sc, _ = sidecar
    status, headers, body = request(
        "POST",
        sc.url + "/v1/chat/completions",
        body=chat(USER, stream=True),
        headers={**JSON_CT, "X-Test-Mode": "sse", "X-Conversation-Id": "conv-a-sse"},
    )
    assert status == 200
    assert body == b"".join(SSE_CHUNKS)
    assert headers["Content-Type"] == "text/event-stream"
    assert headers["X-Upstream-Custom"] == "sse"


def test_error_status_and_body_pass_through(sidecar: tuple[Sidecar, Turns]) -> None:
    """A non-200 answer with a non-UTF-8 body is forwarded as is; the turn span records the error."""
    sc, turns = sidecar
    status, headers, body = request(
        "POST",
        sc.url + "/v1/chat/completions",
        body=chat(USER),
        headers={**JSON_CT, "X-Test-Mode": "error", "X-Conversation-Id": "conv-a-err"},
    )
    assert (status, body, headers["X-Upstream-Custom"]) == (429, ERROR_BODY, "err")
    span = turns.wait("conv-a-err", 0)
    assert span.attributes[names.HTTP_STATUS] == 429
    assert span.status_code == "Error"
    assert span.attributes[names.ERROR_TYPE] == "429"


# ------------------------------------------------------------------ (b) no buffering


def test_streaming_is_forwarded_chunk_by_chunk(sidecar: tuple[Sidecar, Turns], upstream: Upstream) -> None:
    """The upstream holds the rest of the stream until the client has the first chunk: only a
    proxy that forwards each chunk at once lets this finish."""
    sc, _ = sidecar

    async def go(session: aiohttp.ClientSession) -> tuple[bytes, bytes]:
        async with session.post(
            sc.url + "/v1/chat/completions",
            data=chat(USER, stream=True),
            headers={**JSON_CT, "X-Test-Mode": "gate", "X-Conversation-Id": "conv-b"},
        ) as resp:
            assert resp.status == 200
            first = b""
            while len(first) < len(GATE_FIRST):
                part = await asyncio.wait_for(resp.content.readany(), TIMEOUT - 1)
                assert part, "stream ended before the first chunk"
                first += part
            upstream.open_gate()
            rest = await resp.content.read()
            return first, rest

    first, rest = run(go)
    assert first == GATE_FIRST
    assert rest == GATE_REST
    assert upstream.gate_opened_by_client is True


# ------------------------------------------------------------------ (c) propagation


def _last_received(upstream: Upstream, path: str) -> dict[str, Any]:
    return next(r for r in reversed(upstream.received) if r["path"] == path)


def test_upstream_gets_traceparent_session_header_and_unchanged_body(
    sidecar: tuple[Sidecar, Turns], upstream: Upstream
) -> None:
    """Downstream sees the turn span as parent, the conversation id, and the client's body
    byte for byte up to its closing brace, where the same identity is spliced in as
    ``vllm_xargs`` (for routers that drop the headers)."""
    sc, turns = sidecar
    raw = b'{ "model":"m",  "messages":[{"role":"user","content":"caf\\u00e9 \xc3\xa9"}], "zzz": 1 }'
    status, _, _ = request(
        "POST",
        sc.url + "/v1/chat/completions?x=1&y=%20",
        body=raw,
        headers={**JSON_CT, "X-Session-ID": "sess-c"},
    )
    assert status == 200
    got = _last_received(upstream, "/v1/chat/completions?x=1&y=%20")
    assert got["headers"]["Content-Type"] == "application/json"
    assert got["headers"]["X-Session-ID"] == "sess-c"
    span = turns.wait("sess-c", 0)
    version, trace_id, parent_id, _flags = got["headers"]["traceparent"].split("-")
    assert (version, trace_id, parent_id) == ("00", span.trace_id, span.span_id)
    assert span.parent_span_id == ""
    kept = raw.rstrip()[:-1].rstrip()  # everything before the closing brace
    assert got["body"].startswith(kept + b",")
    assert json.loads(got["body"]) == {
        **json.loads(raw),
        "vllm_xargs": {"otelkv_traceparent": got["headers"]["traceparent"], "session_id": "sess-c"},
    }


def test_no_body_context_forwards_the_body_byte_for_byte(upstream: Upstream) -> None:
    sc, _ = _start(upstream.url, inject_body_context=False, token=None)
    try:
        raw = b'{ "model":"m",  "messages":[{"role":"user","content":"caf\\u00e9"}], "zzz": 1 }'
        status, _, _ = request("POST", sc.url + "/v1/chat/completions", body=raw, headers=JSON_CT)
        assert status == 200
        assert _last_received(upstream, "/v1/chat/completions")["body"] == raw
    finally:
        sc.stop()


def test_fingerprint_id_is_sent_as_session_header(sidecar: tuple[Sidecar, Turns], upstream: Upstream) -> None:
    """Without any client id, the inferred (fingerprint) id goes upstream as X-Session-ID."""
    sc, turns = sidecar
    body = chat([{"role": "user", "content": "a unique first message for test c"}])
    request("POST", sc.url + "/v1/chat/completions", body=body, headers=JSON_CT)
    got = _last_received(upstream, "/v1/chat/completions")
    cid = got["headers"]["X-Session-ID"]
    assert cid.startswith("fp-") and json.loads(got["body"])["vllm_xargs"]["session_id"] == cid
    span = turns.wait(cid, 0)
    assert span.attributes[names.CONVERSATION_INFERRED] is True
    assert span.attributes[names.CONVERSATION_ID_SOURCE] == "fingerprint"


def test_client_traceparent_becomes_the_turn_parent(
    sidecar: tuple[Sidecar, Turns], upstream: Upstream
) -> None:
    """A client's trace continues through the turn span: same trace id, client span as parent."""
    sc, turns = sidecar
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    request(
        "POST",
        sc.url + "/v1/chat/completions",
        body=chat(USER),
        headers={
            **JSON_CT,
            "X-Conversation-Id": "conv-c-parent",
            "traceparent": f"00-{client_trace}-{client_span}-01",
        },
    )
    span = turns.wait("conv-c-parent", 0)
    assert span.trace_id == client_trace and span.parent_span_id == client_span
    got = _last_received(upstream, "/v1/chat/completions")
    assert got["headers"].getall("traceparent") == [f"00-{client_trace}-{span.span_id}-01"]
    assert got["headers"]["X-Session-ID"] == "conv-c-parent"


def test_inject_body_conversation_id(upstream: Upstream) -> None:
    """With inject_body_conversation_id the upstream body gains conversation_id (unless present)."""
    sc, _ = _start(upstream.url, inject_body_conversation_id=True, inject_body_context=False, token=None)
    try:
        request(
            "POST",
            sc.url + "/v1/chat/completions",
            body=chat(USER),
            headers={**JSON_CT, "X-Conversation-Id": "conv-inject"},
        )
        sent = json.loads(_last_received(upstream, "/v1/chat/completions")["body"])
        assert sent == {**json.loads(chat(USER)), "conversation_id": "conv-inject"}
        own = json.dumps({"model": "m", "messages": USER, "conversation_id": "mine"}).encode()
        request("POST", sc.url + "/v1/chat/completions", body=own, headers=JSON_CT)
        assert _last_received(upstream, "/v1/chat/completions")["body"] == own
    finally:
        sc.stop()


# ------------------------------------------------------------------ (d) the turn span


def _check_phases(span: SpanRecord) -> None:
    a = span.attributes
    parts = [
        a[names.TURN_INPUT_PROCESSING_SECONDS],
        a[names.TURN_GENERATION_SECONDS],
        a[names.TURN_TOOL_WAIT_SECONDS],
        a[names.TURN_APP_WORK_SECONDS],
    ]
    assert all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(a[names.TURN_TOTAL_SECONDS], abs=1e-9)
    request_s = (span.end_ns - span.start_ns) / 1e9
    assert a[names.TURN_TOTAL_SECONDS] == pytest.approx(a[names.TURN_GAP_SECONDS] + request_s, abs=1e-6)


def test_turn_spans_across_a_conversation(sidecar: tuple[Sidecar, Turns]) -> None:
    """Three turns: index 0,1,2, linked; the gap is tool wait when tool results come back,
    app work otherwise; the four phases add up to the turn."""
    sc, turns = sidecar
    cid = "conv-d"
    headers = {**JSON_CT, "X-Conversation-Id": cid, "X-Test-Mode": "sse"}
    history: list[dict[str, Any]] = list(USER)
    request("POST", sc.url + "/v1/chat/completions", body=chat(history, stream=True), headers=headers)
    first = turns.wait(cid, 0)
    time.sleep(0.05)
    history += [
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "result"},
    ]
    request("POST", sc.url + "/v1/chat/completions", body=chat(history, stream=True), headers=headers)
    second = turns.wait(cid, 1)
    time.sleep(0.05)
    history += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]
    request("POST", sc.url + "/v1/chat/completions", body=chat(history, stream=True), headers=headers)
    third = turns.wait(cid, 2)

    for span in (first, second, third):
        a = span.attributes
        assert span.name == "chat m" and span.scope_name == names.SCOPE_SIDECAR and span.kind == "Server"
        assert a[names.GEN_AI_OPERATION_NAME] == "chat"
        assert a[names.GEN_AI_REQUEST_MODEL] == "m"
        assert a[names.GEN_AI_PROVIDER_NAME] == names.PROVIDER_VLLM
        assert a[names.HTTP_ROUTE] == "/v1/chat/completions"
        assert a[names.CONVERSATION_ID_SOURCE] == "header_conversation_id"
        assert a[names.CONVERSATION_INFERRED] is False
        assert a[names.TURN_STREAM] is True
        assert a[names.HTTP_STATUS] == 200
        assert a[names.TURN_TTFT_SOURCE] == names.TTFT_SOURCE_STREAM
        assert 0 < a[names.TURN_TTFT_SECONDS] <= a[names.TURN_LAST_TOKEN_SECONDS]
        assert a[names.GEN_AI_RESPONSE_ID] == "s1"
        assert a[names.GEN_AI_USAGE_INPUT_TOKENS] == 5 and a[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 2
        assert list(a[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]
        assert a[names.TURN_ASKED_TOOLS] is False and a[names.TURN_RESPONSE_KV_PARAMS] is False
        assert span.status_code != "Error"
        _check_phases(span)

    a0, a1, a2 = first.attributes, second.attributes, third.attributes
    assert (a0[names.TURN_MESSAGES], a1[names.TURN_MESSAGES], a2[names.TURN_MESSAGES]) == (1, 3, 5)
    assert (a0[names.TURN_TOOL_RESULTS], a1[names.TURN_TOOL_RESULTS], a2[names.TURN_TOOL_RESULTS]) == (
        1 - 1,
        1,
        0,
    )
    assert a0[names.TURN_PREVIOUS_TRACE_ID] == ""
    assert a1[names.TURN_PREVIOUS_TRACE_ID] == first.trace_id
    assert a2[names.TURN_PREVIOUS_TRACE_ID] == second.trace_id
    assert len({first.trace_id, second.trace_id, third.trace_id}) == 3

    assert a0[names.TURN_GAP_SOURCE] == names.GAP_SOURCE_NONE and a0[names.TURN_GAP_SECONDS] == 0
    assert a1[names.TURN_GAP_SOURCE] == names.GAP_SOURCE_MESSAGES
    assert a1[names.TURN_GAP_SECONDS] >= 0.05
    assert (
        a1[names.TURN_TOOL_WAIT_SECONDS] == a1[names.TURN_GAP_SECONDS]
        and a1[names.TURN_APP_WORK_SECONDS] == 0
    )
    assert a2[names.TURN_GAP_SOURCE] == names.GAP_SOURCE_MESSAGES
    assert a2[names.TURN_GAP_SECONDS] >= 0.05
    assert (
        a2[names.TURN_APP_WORK_SECONDS] == a2[names.TURN_GAP_SECONDS]
        and a2[names.TURN_TOOL_WAIT_SECONDS] == 0
    )
    # The gap runs from the previous span's end to this span's start.
    assert a1[names.TURN_GAP_SECONDS] == pytest.approx((second.start_ns - first.end_ns) / 1e9, abs=1e-6)


def test_non_streaming_turn_and_completions(sidecar: tuple[Sidecar, Turns]) -> None:
    """Non-streaming: usage and cached tokens recorded, input processing is the whole request;
    /v1/completions is observed as a text completion."""
    sc, turns = sidecar
    request(
        "POST",
        sc.url + "/v1/chat/completions",
        body=chat(USER),
        headers={**JSON_CT, "X-Conversation-Id": "conv-d-ns"},
    )
    a = turns.wait("conv-d-ns", 0).attributes
    assert a[names.TURN_TTFT_SOURCE] == names.TTFT_SOURCE_RESPONSE and names.TURN_TTFT_SECONDS not in a
    assert a[names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 8
    assert a[names.TURN_GENERATION_SECONDS] == 0
    body = json.dumps({"model": "m", "prompt": "complete me"}).encode()
    request(
        "POST", sc.url + "/v1/completions", body=body, headers={**JSON_CT, "X-Conversation-Id": "conv-d-cmp"}
    )
    span = turns.wait("conv-d-cmp", 0)
    assert span.attributes[names.GEN_AI_OPERATION_NAME] == "text_completion"
    assert span.attributes[names.HTTP_ROUTE] == "/v1/completions"


def test_unparsable_request_bodies_still_make_a_turn(
    sidecar: tuple[Sidecar, Turns], upstream: Upstream
) -> None:
    """Invalid or pathologically nested JSON is forwarded untouched and still observed."""
    sc, turns = sidecar
    for i, raw in enumerate([b"{not json", b"[" * 50_000 + b"]" * 50_000, b"[1, 2]"]):
        cid = f"conv-d-bad-{i}"
        status, _, _ = request(
            "POST", sc.url + "/v1/chat/completions", body=raw, headers={"X-Conversation-Id": cid}
        )
        assert status == 200
        assert _last_received(upstream, "/v1/chat/completions")["body"] == raw
        span = turns.wait(cid, 0)
        assert span.name == "chat unknown" and span.attributes[names.TURN_MESSAGES] == 0


# ------------------------------------------------------------------ (e) upstream down


def test_upstream_down_gives_502_and_counts() -> None:
    """An unreachable upstream: the client gets a JSON 502, the error is counted and spanned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    sc, turns = _start(f"http://127.0.0.1:{dead_port}", token=None)
    try:
        metric = names.METRIC_SIDECAR_UPSTREAM_ERRORS + "_total"
        assert _metric(sc.admin_url, metric) == 0
        status, headers, body = request(
            "POST", sc.url + "/v1/chat/completions", body=chat(USER), headers={"X-Conversation-Id": "conv-e"}
        )
        assert status == 502 and headers["Content-Type"].startswith("application/json")
        assert json.loads(body)["error"]["type"] == "otelkv"
        status, _, _ = request("GET", sc.url + "/v1/models")
        assert status == 502
        assert _metric(sc.admin_url, metric) == 2
        span = turns.wait("conv-e", 0)
        assert span.attributes[names.HTTP_STATUS] == 502 and span.status_code == "Error"
    finally:
        sc.stop()


# ------------------------------------------------------------------ (f) other paths


def test_other_paths_pass_through_without_a_turn(sidecar: tuple[Sidecar, Turns], upstream: Upstream) -> None:
    """GET /v1/models, POST /other and GET on a completion path: forwarded, not observed."""
    sc, turns = sidecar
    before = len(turns.turn_spans())
    status, _, body = request("GET", sc.url + "/v1/models?limit=5")
    assert (status, body) == (200, b'{"data":[{"id":"m"}]}')
    got = _last_received(upstream, "/v1/models?limit=5")
    assert "traceparent" not in got["headers"] and "X-Session-ID" not in got["headers"]
    raw = b"\x00\xffodd bytes \xc3\xa9"
    status, headers, body = request(
        "POST",
        sc.url + "/other?q=%2F",
        body=raw,
        headers={"X-Conversation-Id": "conv-f", "X-Test-Mode": "echo"},
    )
    assert (status, body, headers["X-Echo-Path"]) == (201, b"echo:" + raw, "/other?q=%2F")
    got = _last_received(upstream, "/other?q=%2F")
    assert "traceparent" not in got["headers"] and got["headers"]["X-Conversation-Id"] == "conv-f"
    status, _, _ = request("GET", sc.url + "/v1/chat/completions", headers={"X-Conversation-Id": "conv-f"})
    assert status == 200
    # An observed request afterwards is the only new turn span.
    request(
        "POST", sc.url + "/v1/chat/completions", body=chat(USER), headers={"X-Conversation-Id": "conv-f2"}
    )
    turns.wait("conv-f2", 0)
    new = turns.turn_spans()[before:]
    assert [s.attributes[names.GEN_AI_CONVERSATION_ID] for s in new] == ["conv-f2"]


# ------------------------------------------------------------------ (g) OTLP receiver


def _tool_span_export(conversation_id: str, start_ns: int, end_ns: int) -> bytes:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    span = provider.get_tracer("agent").start_span(
        "execute_tool grep",
        attributes={
            names.GEN_AI_OPERATION_NAME: "execute_tool",
            names.GEN_AI_CONVERSATION_ID: conversation_id,
        },
        start_time=start_ns,
    )
    span.end(end_time=end_ns)
    spans: tuple[ReadableSpan, ...] = exporter.get_finished_spans()
    provider.shutdown()
    return encode_spans(spans).SerializeToString()  # type: ignore[no-any-return]


def test_otlp_receiver_formats_and_rejections(sidecar: tuple[Sidecar, Turns]) -> None:
    """Protobuf and JSON exports are accepted; garbage gets a 400 and is counted."""
    sc, turns = sidecar
    now = time.time_ns()
    status, headers, body = request(
        "POST",
        sc.otlp_endpoint,
        body=_tool_span_export("conv-g-formats", now, now + 1000),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert status == 200 and headers["Content-Type"] == "application/x-protobuf"
    ExportTraceServiceResponse().ParseFromString(body)
    doc = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "engine"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "otelkv.engine"},
                        "spans": [
                            {
                                "traceId": "0af7651916cd43dd8448eb211c80319c",
                                "spanId": "b7ad6b7169203331",
                                "name": "kv_request prefill",
                                "startTimeUnixNano": "1",
                                "endTimeUnixNano": "2",
                                "attributes": [
                                    {"key": names.ROLE, "value": {"stringValue": "prefill"}},
                                    {"key": names.TOKENS_PULLED, "value": {"intValue": "96"}},
                                ],
                            }
                        ],
                    }
                ],
            }
        ]
    }
    status, _, body = request(
        "POST", sc.otlp_endpoint, body=json.dumps(doc).encode(), headers={"Content-Type": "application/json"}
    )
    assert (status, body) == (200, b"{}")
    received = [s for s in turns.spans if s.span_id == "b7ad6b7169203331"]
    assert received and received[0].attributes[names.TOKENS_PULLED] == 96
    metric = names.METRIC_SIDECAR_OTLP_REJECTED + '_total{reason="malformed"}'
    before = _metric(sc.admin_url, metric)
    for ctype, garbage in (
        ("application/x-protobuf", b"\xff\xff\xff garbage"),
        ("application/json", b"{nope"),
    ):
        status, _, _ = request("POST", sc.otlp_endpoint, body=garbage, headers={"Content-Type": ctype})
        assert status == 400
    assert _metric(sc.admin_url, metric) == before + 2
    pulled = _metric(sc.admin_url, names.METRIC_TRACE_PREFILL_TOKENS + '_total{source="pulled"}')
    assert pulled >= 96


def test_agent_tool_span_splits_the_next_gap(sidecar: tuple[Sidecar, Turns]) -> None:
    """An execute_tool span received during the gap makes that turn's gap source agent_spans."""
    sc, turns = sidecar
    cid = "conv-g-tools"
    headers = {**JSON_CT, "X-Conversation-Id": cid}
    request("POST", sc.url + "/v1/chat/completions", body=chat(USER), headers=headers)
    first = turns.wait(cid, 0)
    tool_start = time.time_ns()
    time.sleep(0.05)
    tool_end = time.time_ns()
    status, _, _ = request(
        "POST",
        sc.otlp_endpoint,
        body=_tool_span_export(cid, tool_start, tool_end),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert status == 200
    time.sleep(0.02)
    request("POST", sc.url + "/v1/chat/completions", body=chat(USER), headers=headers)
    a = turns.wait(cid, 1).attributes
    assert first.end_ns <= tool_start
    assert a[names.TURN_GAP_SOURCE] == names.GAP_SOURCE_AGENT_SPANS
    assert a[names.TURN_TOOL_WAIT_SECONDS] == pytest.approx((tool_end - tool_start) / 1e9, abs=1e-6)
    assert a[names.TURN_APP_WORK_SECONDS] > 0
    assert a[names.TURN_TOOL_WAIT_SECONDS] + a[names.TURN_APP_WORK_SECONDS] == pytest.approx(
        a[names.TURN_GAP_SECONDS]
    )


# ------------------------------------------------------------------ (h) token


def test_token_guards_otlp_and_query_api(upstream: Upstream) -> None:
    """With a token, /v1/traces and the query API need the bearer; /metrics and health do not."""
    sc, _ = _start(upstream.url, token="s3cret")
    try:
        export = _tool_span_export("conv-h", 1, 2)
        proto = {"Content-Type": "application/x-protobuf"}
        good = {"Authorization": "Bearer s3cret"}
        bad = {"Authorization": "Bearer wrong"}
        assert request("POST", sc.otlp_endpoint, body=export, headers=proto)[0] == 401
        assert request("POST", sc.otlp_endpoint, body=export, headers={**proto, **bad})[0] == 401
        assert request("POST", sc.otlp_endpoint, body=export, headers={**proto, **good})[0] == 200
        assert request("GET", sc.admin_url + "/api/v1/slow")[0] == 401
        assert request("GET", sc.admin_url + "/api/v1/slow", headers=bad)[0] == 401
        assert request("GET", sc.admin_url + "/api/v1/slow", headers=good)[0] == 503  # no store
        assert request("GET", sc.admin_url + "/metrics")[0] == 200
        status, _, body = request("GET", sc.admin_url + "/api/v1/health")
        assert status == 200 and json.loads(body)["ok"] is True
        # The proxy itself never asks for the token.
        assert request("GET", sc.url + "/v1/models")[0] == 200
    finally:
        sc.stop()
