"""A corpus of malformed and hostile traffic through a real sidecar (both processes).

Each case is raw bytes on a socket: what a broken client, a fuzzer or an attacker could
send, and what a broken upstream could answer. The promise under test (bad
input gets a clear error or passes through untouched, never a crash) is checked per case:

- ``refused``: the client gets a 4xx/501 with a JSON ``error.message``, the upstream sees
  nothing, and the refusal is counted (``otelkv_sidecar_requests_refused_total``);
- ``passed``: the upstream receives the request body byte for byte (and the headers the
  case names), and the client gets the upstream's response bytes unchanged;
- ``answered``: a hostile *response* reaches the client exactly as the upstream sent it.

After every case the same sidecar proxies a normal completion and records its turn: the
proxy process is still up, and so is the main process that builds the turn span.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from otelkv import names
from otelkv.sidecar.app import Sidecar, SidecarConfig
from otelkv.sidecar.identity import MAX_ID_CHARS, hashed_id
from otelkv.sidecar.relay import MAX_HEAD_BYTES
from otelkv.spans import SpanRecord

TIMEOUT = 5.0
MAX_BODY = 64 * 1024
"""The test sidecar's body cap: small, so over-limit bodies are quick to send."""
PATH = b"/v1/chat/completions"
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
OK_BODY = b'{"id":"r1","model":"m","choices":[{"message":{"content":"ok"},"finish_reason":"stop"}]}'


def response(body: bytes, *headers: bytes, status: bytes = b"200 OK") -> bytes:
    head = b"".join(h + b"\r\n" for h in headers)
    return b"HTTP/1.1 " + status + b"\r\n" + head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def sse(*lines: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + b"".join(
        lines
    )


REPLIES: dict[str, bytes | None] = {
    "json": response(OK_BODY, b"Content-Type: application/json"),
    "sse-garbage": sse(
        b"data: {not json\n\n",
        b"data: [1, 2]\n\n",
        b'data: "str"\n\n',
        b"event: x\nid: 1\nretry: nope\n: comment\n\n",
        b'data: {"choices": "nope", "usage": {"prompt_tokens": "12"}}\n\n',
        b'data: {"choices": [null, 1, {"delta": []}, {"delta": {"tool_calls": [7, {"id": 3}]}}]}\n\n',
        b"data:\n\ndata: [DONE]\n\n",
    ),
    "sse-invalid-utf8": sse(
        b'data: {"choices":[{"delta":{"content":"\xff\xfe\xc3"}}]}\n\n', b"data: \xc3\x28\n\n"
    ),
    "sse-nested": sse(b"data: " + b"[" * 100_000 + b"\n\n", b"data: " + b'{"a":' * 50_000 + b"\n\n"),
    "sse-long-line": sse(b"data: " + b"x" * 1_000_000, b"\n\n"),
    "sse-no-final-newline": sse(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"trunc'),
    "sse-nul-and-cr": sse(b"data: \x00\x00\r\r\rdata: {}\r\n\r\n"),
    "json-broken": response(b'{"choices": [', b"Content-Type: application/json"),
    "json-not-object": response(b'["a", 1, null]', b"Content-Type: application/json"),
    "json-nested": response(b"[" * 200_000 + b"]" * 200_000, b"Content-Type: application/json"),
    "json-wrong-types": response(
        b'{"id": 5, "model": ["m"], "usage": {"prompt_tokens": 1e400, "completion_tokens": true,'
        b' "prompt_tokens_details": {"cached_tokens": -99999999999999999999999999}},'
        b' "choices": [{"finish_reason": {"x": 1}, "message": {"tool_calls": "all"}}],'
        b' "kv_transfer_params": {"remote_engine_id": "\xff"}}',
        b"Content-Type: application/json",
    ),
    "gzip-garbage": response(b"\x1f\x8b\x08\x00 not really gzip", b"Content-Encoding: gzip"),
    "gzip-bomb": response(gzip.compress(b"\0" * 4_000_000), b"Content-Encoding: gzip"),
    "odd-headers": response(
        OK_BODY, b"X-Odd: \xff\xfe latin \xe9", b"X-Empty:", b"Set-Cookie: a=1", b"Set-Cookie: b=2"
    ),
    "error-status": response(b"\xff\x00 not json", status=b"500 Internal Server Error"),
    "bad-http": b"HTTP/1.1 2xx Nope\r\nContent-Length: zz\r\n\r\ngarbage",
    "close-early": None,  # the upstream closes the connection without answering
}


# ------------------------------------------------------------------ the upstream


@dataclass
class Got:
    """One request as the upstream read it: raw head and body."""

    head: bytes
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


class RawUpstream:
    """A byte-level upstream on its own thread: records each request, answers per ``X-Reply``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="raw-upstream", daemon=True)
        self.received: list[Got] = []
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    def start(self) -> RawUpstream:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(TIMEOUT)
        return self

    async def _listen(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=4 * MAX_HEAD_BYTES)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                got = Got(head, b"")
                length = int(got.header(b"content-length") or 0)
                got.body = await reader.readexactly(length) if length else b""
                self.received.append(got)
                reply = REPLIES[(got.header(b"x-reply") or b"json").decode()]
                if reply is None:
                    break
                writer.write(reply)
                await writer.drain()
                if b"Connection: close" in reply.split(b"\r\n\r\n", 1)[0] or b"2xx" in reply:
                    break
        writer.close()

    def stop(self) -> None:
        async def close() -> None:
            assert self.server is not None
            self.server.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(TIMEOUT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)
        self.loop.close()


# ------------------------------------------------------------------ the client


def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw`` and read until the sidecar closes the connection (every case ends so)."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(raw)
        chunks = []
        with contextlib.suppress(ConnectionResetError):
            while data := sock.recv(1 << 16):
                chunks.append(data)
    return b"".join(chunks)


def status_of(reply: bytes) -> int:
    match = re.match(rb"HTTP/1\.[01] (\d{3}) ", reply)
    assert match, reply[:200]
    return int(match.group(1))


def body_of(reply: bytes) -> bytes:
    return reply.split(b"\r\n\r\n", 1)[1]


def req(
    *headers: bytes, body: bytes = CHAT, method: bytes = b"POST", path: bytes = PATH, length: bool = True
) -> bytes:
    """A request with Connection: close (the sidecar closes after answering: read to EOF)."""
    lines = [method + b" " + path + b" HTTP/1.1", b"Host: x", b"Connection: close", *headers]
    if length:
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def chunked(*chunks: bytes, trailer: bytes = b"") -> bytes:
    framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return req(b"Transfer-Encoding: chunked", body=framed + b"0\r\n" + trailer + b"\r\n", length=False)


# ------------------------------------------------------------------ the corpus


@dataclass
class Case:
    id: str
    raw: bytes
    kind: str
    """refused | passed | answered"""
    status: int = 0
    """refused: the status the client must get."""
    body: bytes | None = None
    """passed: what the upstream must receive (default: the body in ``raw``)."""
    reply: str = "json"
    check: Callable[[Got, Sidecar], None] | None = None
    """passed: a further check on what the upstream received."""
    extra: dict[str, object] = field(default_factory=dict)


def refused(name: str, raw: bytes, status: int = 400) -> Case:
    return Case(name, raw, "refused", status=status)


def passed(
    name: str, raw: bytes, *, body: bytes | None = None, check: Callable[[Got, Sidecar], None] | None = None
) -> Case:
    return Case(
        name, raw, "passed", body=body if body is not None else raw.split(b"\r\n\r\n", 1)[1], check=check
    )


def answered(reply: str, *, status: int = 200) -> Case:
    return Case(
        f"upstream-{reply}", req(b"X-Reply: " + reply.encode()), "answered", status=status, reply=reply
    )


def header_is(name: bytes, value: bytes) -> Callable[[Got, Sidecar], None]:
    def check(got: Got, _: Sidecar) -> None:
        assert got.header(name) == value, (name, got.header(name))

    return check


GIANT_ID = b"c" * 100_000
SESSION = b"X-Session-ID"

CORPUS: list[Case] = [
    # -- not HTTP, or broken HTTP framing: a 400 from the relay, nothing upstream
    refused("not-http-binary-garbage", b"\x00\x01\x02\xff garbage\r\n\r\n"),
    refused("not-http-tls-client-hello", bytes.fromhex("160301020001000100fc0303") + b"\x00" * 64),
    refused("invalid-method-token", b"G@T / HTTP/1.1\r\nHost: x\r\n\r\n"),
    refused("request-line-without-version", b"POST /v1/chat/completions\r\nHost: x\r\n\r\n", 505),
    refused("http2-prior-knowledge-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    refused("http-version-2-request-line", b"POST / HTTP/2.0\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 505),
    refused("http-version-garbage", b"POST / HTTP/x.y\r\nHost: x\r\n\r\n"),
    refused("space-in-header-name", req(b"X Conversation-Id: a")),
    refused("header-line-without-colon", req(b"X-Conversation-Id")),
    refused("nul-in-header-value", req(b"X-Conversation-Id: a\x00b")),
    refused("bare-cr-in-header-value", req(b"X-Conversation-Id: a\rb")),
    refused("content-length-not-a-number", req(b"Content-Length: 12abc", length=False)),
    refused("content-length-negative", req(b"Content-Length: -1", length=False)),
    refused("content-length-twice-different", req(b"Content-Length: 3", body=CHAT)),
    refused(
        "content-length-and-chunked",
        req(b"Transfer-Encoding: chunked", b"Content-Length: 5", body=b"0\r\n\r\n", length=False),
    ),
    refused(
        "chunk-size-not-hex", req(b"Transfer-Encoding: chunked", body=b"zz\r\nabc\r\n0\r\n\r\n", length=False)
    ),
    refused(
        "chunk-size-overflow",
        req(b"Transfer-Encoding: chunked", body=b"ffffffffffffffffff\r\nab\r\n0\r\n\r\n", length=False),
    ),
    refused(
        "chunk-without-crlf", req(b"Transfer-Encoding: chunked", body=b"3\r\nabcXX0\r\n\r\n", length=False)
    ),
    refused("transfer-encoding-unknown-last", req(b"Transfer-Encoding: chunked, gzip", length=False)),
    # -- too large: 413 for the body (the test sidecar caps it at 64 KiB), 431 for the head
    refused("body-over-limit-by-content-length", req(b"Content-Length: 99999999999", length=False), 413),
    refused("body-over-limit-chunked", chunked(*[b"x" * 16_384] * 5), 413),
    refused("content-length-beyond-int64", req(b"Content-Length: 99999999999999999999999", length=False)),
    refused("header-value-over-head-limit", req(b"X-Big: " + b"a" * (MAX_HEAD_BYTES + 10)), 431),
    refused("url-over-head-limit", req(path=PATH + b"?" + b"q" * (MAX_HEAD_BYTES + 10)), 431),
    refused(
        "many-headers-over-head-limit", req(*[b"X-H%d: %s" % (i, b"v" * 100) for i in range(12_000)]), 431
    ),
    # -- protocols the relay does not proxy: 501
    refused(
        "websocket-upgrade", req(b"Upgrade: websocket", b"Connection: Upgrade", method=b"GET", body=b""), 501
    ),
    refused("connect-method", b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 501),
    refused(
        "h2c-upgrade",
        req(b"Upgrade: h2c", b"Connection: Upgrade, HTTP2-Settings", method=b"GET", body=b""),
        501,
    ),
    # -- bodies the turn watcher cannot read: forwarded byte for byte
    passed("body-invalid-json", req(body=b'{"model": "m", "messages": [')),
    passed("body-invalid-utf8", req(body=b'{"model": "\xff\xfe\xc3", "messages": []}')),
    passed("body-json-array", req(body=b"[1, 2, 3]")),
    passed("body-json-scalar", req(body=b'"just a string"')),
    passed("body-json-null", req(body=b"null")),
    passed("body-deeply-nested", req(body=b"[" * 30_000 + b"]" * 30_000)),
    passed("body-nested-model", req(body=b'{"model":' + b"[" * 900 + b"]" * 900 + b',"messages":[]}')),
    passed("body-messages-not-a-list", req(body=b'{"model":"m","messages":"hello"}')),
    passed(
        "body-messages-odd-items",
        req(body=b'{"messages":[null,1,"x",[],{"role":{"a":1},"content":[1,{"text":2}]}]}'),
    ),
    passed("body-huge-model-name", req(body=b'{"model":"' + b"m" * 50_000 + b'","messages":[]}')),
    passed("body-empty-with-length-zero", req(body=b"")),
    passed(
        "body-nan-and-infinity", req(body=b'{"model":"m","temperature":NaN,"top_p":Infinity,"messages":[]}')
    ),
    passed("body-duplicate-keys", req(body=b'{"conversation_id":"a","conversation_id":"b","messages":[]}')),
    passed("body-bom-prefixed", req(body=b"\xef\xbb\xbf" + CHAT)),
    passed("body-gzip-encoded-garbage", req(b"Content-Encoding: gzip", body=b"\x1f\x8b not gzip")),
    passed("body-wrong-content-type", req(b"Content-Type: text/plain; charset=ebcdic", body=CHAT)),
    passed(
        "body-chunked-with-trailer", chunked(CHAT[:10], CHAT[10:], trailer=b"X-Trailer: t\r\n"), body=CHAT
    ),
    # -- hostile conversation ids: hashed, refused or passed through, never a crash
    passed(
        "conversation-id-giant-header",
        req(b"X-Conversation-Id: " + GIANT_ID),
        check=header_is(SESSION, hashed_id(GIANT_ID.decode()).encode()),
    ),
    passed(
        "session-id-giant-header-is-replaced-by-its-hash",
        req(SESSION + b": " + GIANT_ID),
        check=header_is(SESSION, hashed_id(GIANT_ID.decode()).encode()),
    ),
    passed(
        "session-id-at-the-cap-is-kept",
        req(SESSION + b": " + b"s" * MAX_ID_CHARS),
        check=header_is(SESSION, b"s" * MAX_ID_CHARS),
    ),
    refused("conversation-id-control-characters", req(b"X-Conversation-Id: a\x01b\x1bc\x7f")),
    passed("conversation-id-invalid-utf8", req(b"X-Conversation-Id: \xff\xfe\xc3\x28")),
    passed("conversation-id-tab-and-spaces-only", req(b"X-Conversation-Id: \t   \t")),
    passed("conversation-id-repeated-headers", req(b"X-Conversation-Id: a", b"X-Conversation-Id: b")),
    passed(
        "body-conversation-id-lone-surrogate",
        req(body=b'{"conversation_id":"\\ud800","messages":[{"role":"user","content":"x"}]}'),
    ),
    passed("body-conversation-id-line-separator", req(body=b'{"conversation_id":"a\\u2028b","messages":[]}')),
    passed(
        "body-conversation-id-object",
        req(body=b'{"conversation_id":{"a":[1]},"session_id":[1],"messages":[]}'),
    ),
    passed("body-conversation-id-huge-integer", req(body=b'{"conversation_id":' + b"9" * 5000 + b"}")),
    passed("body-conversation-id-giant-string", req(body=b'{"conversation_id":"' + b"g" * 60_000 + b'"}')),
    passed("baggage-garbage", req(b"baggage: %zz=%%, ,,=;;, session.id=%E0%A4%A, =v, k", b"baggage: x")),
    passed(
        "baggage-ten-thousand-members", req(b"baggage: " + b",".join(b"k%d=v" % i for i in range(10_000)))
    ),
    # -- trace context garbage: a fresh trace, the client's header replaced, nothing breaks
    passed("traceparent-garbage", req(b"traceparent: \xff-zz-", b"tracestate: \xff")),
    passed("traceparent-all-zero-ids", req(b"traceparent: 00-" + b"0" * 32 + b"-" + b"0" * 16 + b"-01")),
    passed(
        "tracestate-huge",
        req(b"traceparent: 00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01", b"tracestate: " + b"k=v," * 20_000),
    ),
    # -- odd but legal requests: passed through
    passed("many-small-headers", req(*[b"X-H%d: v" % i for i in range(2_000)])),
    passed(
        "header-value-obs-text",
        req(b"X-Note: caf\xe9 \x80\xff"),
        check=header_is(b"x-note", b"caf\xe9 \x80\xff"),
    ),
    passed("path-with-odd-escapes", req(path=b"/v1/chat/completions/%ff%00?q=%zz&")),
    refused("path-with-raw-non-ascii", req(path=b"/v1/chat/completions?q=\xc3\xa9")),
    passed("get-with-body-on-a-completion-path", req(method=b"GET")),
    passed(
        "http10-request",
        b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT),
    ),
    passed("expect-100-continue", req(b"Expect: 100-continue")),
    passed("leading-empty-lines", b"\r\n\r\n" + req(), body=CHAT),
    # -- hostile upstream answers: relayed to the client exactly as sent
    answered("sse-garbage"),
    answered("sse-invalid-utf8"),
    answered("sse-nested"),
    answered("sse-long-line"),
    answered("sse-no-final-newline"),
    answered("sse-nul-and-cr"),
    answered("json-broken"),
    answered("json-not-object"),
    answered("json-nested"),
    answered("json-wrong-types"),
    answered("gzip-garbage"),
    answered("gzip-bomb"),
    answered("odd-headers"),
    answered("error-status", status=500),
    answered("bad-http", status=0),
    answered("close-early", status=502),
]


# ------------------------------------------------------------------ the sidecar


class Taps:
    """Every span the sidecar's main process accepts."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []

    def __call__(self, spans: list[SpanRecord]) -> None:
        self.spans.extend(spans)

    def turn(self, conversation_id: str) -> SpanRecord | None:
        for span in list(self.spans):
            if span.attributes.get(names.GEN_AI_CONVERSATION_ID) == conversation_id:
                return span
        return None


@pytest.fixture(scope="module")
def upstream() -> Iterator[RawUpstream]:
    server = RawUpstream().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sidecar(upstream: RawUpstream) -> Iterator[tuple[Sidecar, Taps]]:
    config = SidecarConfig(
        upstream=f"http://127.0.0.1:{upstream.port}",
        port=0,
        admin_port=0,
        store=False,
        token=None,
        max_body_bytes=MAX_BODY,
    )
    sc = Sidecar(config).start()
    taps = Taps()
    sc.pipeline.taps.append(taps)
    yield sc, taps
    sc.stop()


def assert_forwarded(got: bytes, sent: bytes) -> None:
    """The upstream got the client's bytes, except that the sidecar spliced the turn's
    ``vllm_xargs`` in before the closing brace of a JSON object that had none."""
    if got == sent:
        return
    kept = sent.rstrip()[:-1].rstrip()
    assert got.startswith(kept), got
    assert got[len(kept) :].lstrip(b",").startswith(b'"vllm_xargs":{"otelkv_traceparent":'), got
    forwarded = json.loads(got)
    del forwarded["vllm_xargs"]
    assert forwarded == json.loads(sent)


REFUSED_REASON = {
    400: "malformed",
    413: "too_large",
    431: "headers_too_large",
    501: "upgrade",
    505: "http_version",
}
"""The ``reason`` label docs/telemetry.md gives each status the proxy refuses with."""


def refusals(sc: Sidecar) -> dict[str, float]:
    sc.flush()  # the proxy process hands over its counters with its turns
    metric = names.METRIC_SIDECAR_REQUESTS_REFUSED + "_total"
    return {
        reason: sc.metrics.registry.get_sample_value(metric, {"reason": reason}) or 0.0
        for reason in REFUSED_REASON.values()
    }


def still_serves(sc: Sidecar, taps: Taps, upstream: RawUpstream, case_id: str) -> None:
    """A normal completion after the case: proxied, answered, and its turn recorded."""
    assert sc.proxy.pid is not None and sc.proxy.returncode is None, "the proxy process died"
    cid = f"after-{case_id}"
    reply = exchange(sc.proxy.port, req(b"X-Conversation-Id: " + cid.encode()))
    assert status_of(reply) == 200 and body_of(reply) == OK_BODY
    assert_forwarded(upstream.received[-1].body, CHAT)
    sc.flush()
    span = taps.turn(cid)
    assert span is not None, "the main process recorded no turn"
    assert span.attributes[names.HTTP_STATUS] == 200


def test_corpus_is_large_and_ids_are_unique() -> None:
    ids = [case.id for case in CORPUS]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 50


@pytest.mark.parametrize("case", CORPUS, ids=[case.id for case in CORPUS])
def test_bad_input_gets_an_error_or_passes_through(
    case: Case, sidecar: tuple[Sidecar, Taps], upstream: RawUpstream
) -> None:
    sc, taps = sidecar
    before_refused = refusals(sc)
    before_received = len(upstream.received)
    reply = exchange(sc.proxy.port, case.raw)
    if case.kind == "refused":
        assert status_of(reply) == case.status
        assert reply.split(b"\r\n\r\n", 1)[0].lower().count(b"content-type: application/json") == 1
        assert json.loads(body_of(reply))["error"]["message"]
        assert len(upstream.received) == before_received, "a refused request reached the upstream"
        reason = REFUSED_REASON[case.status]
        assert refusals(sc) == {**before_refused, reason: before_refused[reason] + 1}
    elif case.kind == "passed":
        assert len(upstream.received) == before_received + 1
        got = upstream.received[-1]
        assert_forwarded(got.body, case.body)
        if case.check is not None:
            case.check(got, sc)
        expected = REPLIES["json"]
        assert expected is not None
        assert reply.endswith(expected) and status_of(reply) in (100, 200)
        assert refusals(sc) == before_refused
    else:
        sent = REPLIES[case.reply]
        if sent is None:  # nothing came back from the upstream: the relay's own 502
            assert status_of(reply) == 502 and json.loads(body_of(reply))["error"]["message"]
        else:
            assert reply == sent
    still_serves(sc, taps, upstream, case.id)


def test_hostile_ids_are_recorded_bounded_and_clean(sidecar: tuple[Sidecar, Taps]) -> None:
    """Every turn span's conversation id is short, printable and encodable, whatever was sent."""
    sc, taps = sidecar
    for case in CORPUS:
        if case.id.startswith(("conversation-id", "session-id", "body-conversation-id", "baggage")):
            exchange(sc.proxy.port, case.raw)
    sc.flush()
    ids = [s.attributes.get(names.GEN_AI_CONVERSATION_ID) for s in taps.spans]
    for cid in ids:
        if cid is None:
            continue
        assert isinstance(cid, str) and 0 < len(cid) <= MAX_ID_CHARS
        assert cid.isprintable() or "\ufffd" in cid, repr(cid)
        cid.encode("utf-8")
    assert hashed_id(GIANT_ID.decode()) in ids
