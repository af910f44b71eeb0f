"""The relay (otelkv.sidecar.relay) on its own, byte by byte.

Each test runs a :class:`Relay` in-process on a fresh event loop (the stdlib loop, and uvloop
too when it is installed, since the proxy worker runs on uvloop when it can) between a
scripted asyncio upstream and a raw-socket client, so both what the upstream receives and
what the client gets can be compared byte for byte, and the relay's own transports can be
inspected for backpressure. A recording observer checks what the turn watcher would see.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import pytest

from otelkv.sidecar import relay as relay_module
from otelkv.sidecar.relay import Relay, Request

TIMEOUT = 5.0
"""Per-test bound: a relay that hangs fails the test instead of blocking the suite."""

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _loop_factories() -> dict[str, LoopFactory]:
    factories: dict[str, LoopFactory] = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is optional
        return factories
    return {**factories, "uvloop": uvloop.new_event_loop}


_LOOPS = _loop_factories()
Run = Callable[[Callable[[], Awaitable[None]]], None]
_T = TypeVar("_T")


@pytest.fixture(params=list(_LOOPS.values()), ids=list(_LOOPS))
def run(request: pytest.FixtureRequest) -> Run:
    """Run a scenario to completion on a fresh loop, failing it after ``TIMEOUT``."""
    factory: LoopFactory = request.param

    def go(scenario: Callable[[], Awaitable[None]]) -> None:
        async def main() -> None:
            try:
                await asyncio.wait_for(scenario(), TIMEOUT)
            finally:
                for client in Client.opened:
                    client.close()
                Client.opened.clear()
                pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                await asyncio.sleep(0)  # let closed transports finish closing

        loop = factory()
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    return go


# ------------------------------------------------------------------ the upstream


@dataclass
class Received:
    """One request as the upstream read it off the wire."""

    head: bytes
    body: bytes

    @property
    def headers(self) -> list[tuple[str, str]]:
        lines = self.head.decode("latin-1").split("\r\n")[1:-2]
        return [(k, v.strip()) for k, v in (line.split(":", 1) for line in lines)]


class UpConn:
    """One connection accepted by the scripted upstream."""

    def __init__(self, server: Upstream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.peer_closed = asyncio.Event()

    async def read_request(self) -> Received | None:
        """The next request, or None when the relay closed the connection."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.peer_closed.set()
            return None
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await self.reader.readexactly(length) if length else b""
        request = Received(head, body)
        self.server.received.append(request)
        return request

    async def wait_peer_closed(self) -> None:
        """Until the relay closes its end (reads and drops anything it still sends)."""
        with contextlib.suppress(ConnectionError):
            while await self.reader.read(65536):
                pass
        self.peer_closed.set()

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


Handler = Callable[[UpConn], Awaitable[None]]


class Upstream:
    """An asyncio server that runs ``handler`` on each connection it accepts."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections: list[UpConn] = []
        self.received: list[Received] = []
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = UpConn(self, reader, writer)
        self.connections.append(conn)
        try:
            await self.handler(conn)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        for conn in self.connections:
            conn.writer.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def replies(answer: Callable[[Received], bytes]) -> Handler:
    """A keep-alive upstream answering each request with ``answer(request)``, written at once."""

    async def handler(conn: UpConn) -> None:
        while (request := await conn.read_request()) is not None:
            await conn.write(answer(request))

    return handler


def ok(body: bytes, *extra: str) -> bytes:
    """A Content-Length response with ``body`` (and ``extra`` header lines)."""
    head = "HTTP/1.1 200 OK\r\n" + "".join(f"{h}\r\n" for h in extra) + f"Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def echo_path(request: Received) -> bytes:
    return ok(b"you asked " + request.head.split(b" ")[1])


# ------------------------------------------------------------------ the client


class Client:
    """A raw TCP client: exact bytes out, exact bytes in."""

    opened: ClassVar[list[Client]] = []
    """Every client of the running scenario, closed when it ends."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.buf = b""
        Client.opened.append(self)

    @classmethod
    async def connect(cls, port: int, *, rcvbuf: int | None = None) -> Client:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connecting, so the window is small from the start
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        client = cls(sock)
        await client.loop.sock_connect(sock, ("127.0.0.1", port))
        return client

    async def send(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    async def _fill(self) -> bool:
        data = await self.loop.sock_recv(self.sock, 1 << 20)
        self.buf += data
        return bool(data)

    async def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self._fill():
                raise AssertionError(f"connection closed after {self.buf!r}, {n} bytes expected")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    async def until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            if not await self._fill():
                raise AssertionError(f"connection closed after {self.buf!r}, {marker!r} expected")
        end = self.buf.index(marker) + len(marker)
        out, self.buf = self.buf[:end], self.buf[end:]
        return out

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        """One Content-Length response (the relay's own, or an upstream's): status, headers, body."""
        head = (await self.until(b"\r\n\r\n")).decode("latin-1")
        lines = head.split("\r\n")[:-2]
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        body = await self.exactly(int(headers.get("content-length", "0")))
        return int(lines[0].split()[1]), headers, body

    async def eof(self) -> bytes:
        """Everything until the relay closes the connection."""
        while await self._fill():
            pass
        out, self.buf = self.buf, b""
        return out

    def close(self) -> None:
        self.sock.close()


# ------------------------------------------------------------------ the observer


@dataclass
class Seen:
    """One exchange as the observer saw it."""

    fail_in: str = ""
    heads: list[tuple[int, list[tuple[bytes, bytes]]]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    finishes: list[tuple[int, str | None]] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    on_body: Callable[[bytes], None] | None = None

    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.heads.append((status, list(headers)))
        if self.fail_in == "response_head":
            raise RuntimeError("observer bug in response_head")

    def response_body(self, data: bytes) -> None:
        self.chunks.append(data)
        if self.on_body is not None:
            self.on_body(data)
        if self.fail_in == "response_body":
            raise RuntimeError("observer bug in response_body")

    def finish(self, status: int, error: str | None) -> None:
        self.finishes.append((status, error))
        self.done.set()
        if self.fail_in == "finish":
            raise RuntimeError("observer bug in finish")


class Recorder:
    """An observer recording every exchange; ``extra``/``body`` are what ``begin`` returns."""

    def __init__(
        self,
        *,
        extra: list[tuple[bytes, bytes | None]] | None = None,
        body: bytes | None = None,
        fail_in: str = "",
        on_body: Callable[[bytes], None] | None = None,
    ) -> None:
        self.extra = extra or []
        self.body = body
        self.fail_in = fail_in
        self.on_body = on_body
        self.requests: list[Request] = []
        self.seen: list[Seen] = []
        self.began = asyncio.Event()

    def begin(self, request: Request) -> tuple[Seen | None, list[tuple[bytes, bytes | None]], bytes]:
        self.requests.append(request)
        self.began.set()
        if self.fail_in == "begin":
            raise RuntimeError("observer bug in begin")
        seen = Seen(fail_in=self.fail_in, on_body=self.on_body)
        self.seen.append(seen)
        return seen, list(self.extra), request.body if self.body is None else self.body

    async def finished(self, index: int) -> Seen:
        while len(self.seen) <= index:
            self.began.clear()
            await self.began.wait()
        await self.seen[index].done.wait()
        return self.seen[index]


# ------------------------------------------------------------------ the set-up


@dataclass
class Env:
    relay: Relay
    upstream: Upstream
    port: int

    async def client(self, *, rcvbuf: int | None = None) -> Client:
        return await Client.connect(self.port, rcvbuf=rcvbuf)

    async def relay_side(self) -> relay_module._Client:
        """The relay's protocol for the (only) client connection."""
        side = await until(lambda: next(iter(self.relay.clients), None))
        assert side is not None
        return side


@contextlib.asynccontextmanager
async def proxied(
    handler: Handler,
    *,
    observer: Recorder | None = None,
    max_body_bytes: int = 1 << 20,
    counters: dict[str, int] | None = None,
) -> AsyncIterator[Env]:
    upstream = Upstream(handler)
    await upstream.start()
    relay = Relay(
        f"http://127.0.0.1:{upstream.port}",
        observer=observer,
        max_body_bytes=max_body_bytes,
        counters=counters,
    )
    port = await relay.start("127.0.0.1", 0)
    try:
        yield Env(relay, upstream, port)
    finally:
        relay.close()
        await upstream.close()


async def until(probe: Callable[[], _T]) -> _T:
    """Poll ``probe`` every millisecond until it returns something truthy, and return that.

    Only for relay state that has no event to await (transport pause flags, buffer sizes);
    the scenario's ``TIMEOUT`` bounds it.
    """
    while not (value := probe()):
        await asyncio.sleep(0.001)
    return value


def get(path: str = "/", *headers: str, method: str = "GET") -> bytes:
    """A request without a body; ``headers`` are whole header lines."""
    lines = "".join(h + "\r\n" for h in headers)
    return f"{method} {path} HTTP/1.1\r\nHost: client\r\n{lines}\r\n".encode()


def post(path: str, body: bytes, *headers: str) -> bytes:
    lines = "".join(h + "\r\n" for h in headers)
    return (
        f"POST {path} HTTP/1.1\r\nHost: client\r\n{lines}Content-Length: {len(body)}\r\n\r\n".encode() + body
    )


def error_json(body: bytes) -> dict[str, str]:
    parsed = json.loads(body)
    assert parsed["error"]["type"] == "otelkv"
    return parsed["error"]  # type: ignore[no-any-return]


def free_port() -> int:
    """A port nothing listens on (bound, read, released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------ 1. responses, byte for byte


def test_content_length_response_is_relayed_byte_for_byte(run: Run) -> None:
    """The client gets the upstream's exact bytes: reason phrase, header case and spacing,
    repeated headers, a body that is not UTF-8. The observer sees the parsed head, the body and
    a clean finish. Pinned because clients (SDKs, routers) must not see a proxy in between."""
    body = "héllo ☃".encode() + b"\xff\xfe raw"
    response = (
        b"HTTP/1.1 201 Made Up\r\ncontent-TYPE:  application/json\r\nSet-Cookie: a=1\r\n"
        b"Set-Cookie: b=2\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )

    async def scenario() -> None:
        observer = Recorder()
        async with proxied(replies(lambda _: response), observer=observer) as env:
            client = await env.client()
            await client.send(post("/v1/chat/completions", b"{}"))
            assert await client.exactly(len(response)) == response
            seen = await observer.finished(0)
            assert seen.heads == [
                (
                    201,
                    [
                        (b"content-TYPE", b"application/json"),
                        (b"Set-Cookie", b"a=1"),
                        (b"Set-Cookie", b"b=2"),
                        (b"Content-Length", str(len(body)).encode()),
                    ],
                )
            ]
            assert b"".join(seen.chunks) == body
            assert seen.finishes == [(201, None)]
            assert client.buf == b""

    run(scenario)


def test_chunked_response_keeps_its_framing_and_split_characters(run: Run) -> None:
    """A chunked response reaches the client with its own chunk sizes, extensions and trailer;
    the observer gets the de-chunked body in the pieces that arrived, even when a chunk ends
    inside a multi-byte UTF-8 character (the relay never decodes or re-joins text)."""
    snow = "☃".encode()
    first, second = "café ".encode() + snow[:1], snow[1:] + b"!"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    frame1 = f"{len(first):x};ext=1\r\n".encode() + first + b"\r\n"
    frame2 = f"{len(second):X}\r\n".encode() + second + b"\r\n0\r\nX-Trailer: t\r\n\r\n"

    async def scenario() -> None:
        gate = asyncio.Event()

        async def handler(conn: UpConn) -> None:
            await conn.read_request()
            await conn.write(head + frame1)
            await gate.wait()
            await conn.write(frame2)
            await conn.wait_peer_closed()

        observer = Recorder()
        async with proxied(handler, observer=observer) as env:
            client = await env.client()
            await client.send(post("/v1/chat/completions", b"{}"))
            assert await client.exactly(len(head + frame1)) == head + frame1
            gate.set()
            assert await client.exactly(len(frame2)) == frame2
            seen = await observer.finished(0)
            assert seen.chunks == [first, second]
            assert seen.finishes == [(200, None)]

    run(scenario)


# ------------------------------------------------------------------ 2. the request upstream


def test_request_upstream_drops_hop_by_hop_headers_and_applies_the_observer(run: Run) -> None:
    """What the upstream receives, exactly: the raw path and query, Host set to the upstream,
    hop-by-hop headers gone (Connection and the headers it names, Keep-Alive, TE, Trailer,
    Transfer-Encoding, Proxy-*, Expect), the observer's headers replacing or removing the
    client's, the client's order otherwise kept, and a Content-Length for the de-chunked body."""
    client_request = (
        b"POST /v1/x?q=%2F&a=%41 HTTP/1.1\r\n"
        b"Host: client.example\r\n"
        b"X-First: 1\r\n"
        b"Connection: keep-alive, X-Named\r\n"
        b"Keep-Alive: timeout=5\r\n"
        b"X-Named: dropped\r\n"
        b"TE: trailers\r\n"
        b"Trailer: X-T\r\n"
        b"Proxy-Authorization: Basic eA==\r\n"
        b"Proxy-Connection: keep-alive\r\n"
        b"Expect: 100-continue\r\n"
        b"X-Remove: gone\r\n"
        b"authorization: Bearer k\r\n"
        b"X-Replace: old\r\n"
        b"Transfer-Encoding: chunked\r\n"
        b"X-Last: z\r\n"
        b"\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )

    async def scenario() -> None:
        observer = Recorder(extra=[(b"X-Remove", None), (b"x-replace", b"new"), (b"X-Added", b"yes")])
        async with proxied(replies(lambda _: ok(b"done")), observer=observer) as env:
            client = await env.client()
            await client.send(client_request)
            assert await client.exactly(25) == b"HTTP/1.1 100 Continue\r\n\r\n"
            assert await client.exactly(len(ok(b"done"))) == ok(b"done")
            [received] = env.upstream.received
            assert received.head == (
                b"POST /v1/x?q=%2F&a=%41 HTTP/1.1\r\n"
                + f"Host: 127.0.0.1:{env.upstream.port}\r\n".encode()
                + b"X-First: 1\r\nauthorization: Bearer k\r\nX-Last: z\r\n"
                b"x-replace: new\r\nX-Added: yes\r\nContent-Length: 11\r\n\r\n"
            )
            assert received.body == b"hello world"
            [request] = observer.requests
            assert (request.method, request.url, request.path) == (b"POST", b"/v1/x?q=%2F&a=%41", "/v1/x")
            assert request.body == b"hello world" and request.header(b"x-replace") == b"old"

    run(scenario)


def test_observer_body_and_content_length_rules(run: Run) -> None:
    """The body the observer returns is what goes upstream, with its own length; a GET without
    a body gets no Content-Length, a POST with an empty one gets ``Content-Length: 0``."""

    async def scenario() -> None:
        observer = Recorder(body=b'{"rewritten": true}')
        async with proxied(replies(lambda _: ok(b"")), observer=observer) as env:
            client = await env.client()
            await client.send(post("/a", b'{"x": 1}') + get("/b") + post("/c", b""))
            for _ in range(3):
                assert await client.exactly(len(ok(b""))) == ok(b"")
            a, b, c = env.upstream.received
            assert a.body == b'{"rewritten": true}' and ("Content-Length", "19") in a.headers
            assert b.body == b'{"rewritten": true}' and ("Content-Length", "19") in b.headers
            observer.body = None
            await client.send(post("/d", b"") + get("/e"))
            for _ in range(2):
                await client.exactly(len(ok(b"")))
            d, e = env.upstream.received[3:]
            assert ("Content-Length", "0") in d.headers
            assert not any(k.lower() == "content-length" for k, _ in e.headers)
            assert c.body == b'{"rewritten": true}'

    run(scenario)


def test_ipv6_upstream_host_header_is_bracketed() -> None:
    """``Host`` for an IPv6 upstream is ``[addr]:port`` (RFC 7230 5.4); a bare ``::1:8000``
    is not a valid authority, and strict servers answer it with 400."""
    req = Request(method=b"GET", url=b"/", headers=[])

    def host_line(upstream: str) -> bytes:
        return Relay(upstream).request_head(req, [], 0).split(b"\r\n")[1]

    assert host_line("http://[::1]:8000") == b"Host: [::1]:8000"
    assert host_line("http://[::1]") == b"Host: [::1]"
    assert host_line("http://Example.com:80") == b"Host: example.com"
    assert host_line("http://127.0.0.1:8000") == b"Host: 127.0.0.1:8000"


def test_upstream_url_must_be_http_or_https_without_a_path() -> None:
    """``http(s)://host[:port]`` only: a path prefix would not be relayed, so it is refused."""
    for bad in ("ftp://h:1", "http://h:1/v1", "h:1", "http://:1"):
        with pytest.raises(ValueError):
            Relay(bad)
    assert Relay("https://h").port == 443 and Relay("http://h").port == 80


def test_https_upstream_is_verified_and_relayed(
    run: Run, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An https upstream is reached over TLS, its certificate checked against the CA store
    (here ``SSL_CERT_FILE`` names a self-signed one), and the client still gets plain bytes."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    response = ok(b"over tls")

    async def scenario() -> None:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(cert, key)
        upstream = Upstream(replies(lambda _: response))
        upstream.server = await asyncio.start_server(upstream._serve, "127.0.0.1", 0, ssl=server_ctx)
        port = upstream.server.sockets[0].getsockname()[1]
        relay = Relay(f"https://localhost:{port}")
        relay_port = await relay.start("127.0.0.1", 0)
        try:
            client = await Client.connect(relay_port)
            await client.send(get("/tls"))
            assert await client.exactly(len(response)) == response
            assert upstream.received[0].head.startswith(b"GET /tls HTTP/1.1\r\nHost: localhost:")
            monkeypatch.delenv("SSL_CERT_FILE")  # the system store does not know this cert
            untrusting = Relay(f"https://localhost:{port}")
            other = await Client.connect(await untrusting.start("127.0.0.1", 0))
            await other.send(get("/tls"))
            status, _, body = await other.response()
            assert status == 502 and "SSL" in error_json(body)["message"]
            untrusting.close()
        finally:
            relay.close()
            await upstream.close()

    run(scenario)


# ------------------------------------------------------------------ 3. keep-alive


def test_keep_alive_reuses_one_upstream_connection(run: Run) -> None:
    """Two requests on one client connection go over one pooled upstream connection."""

    async def scenario() -> None:
        async with proxied(replies(echo_path)) as env:
            client = await env.client()
            for path in ("/one", "/two"):
                await client.send(get(path))
                assert await client.response() == (
                    200,
                    {"content-length": str(10 + len(path))},
                    b"you asked " + path.encode(),
                )
            assert len(env.upstream.connections) == 1

    run(scenario)


def test_upstream_connection_close_closes_the_client_after_the_response(run: Run) -> None:
    """``Connection: close`` from the upstream reaches the client with the response, and the
    relay closes the client connection after it (and does not pool the upstream one)."""
    response = ok(b"bye", "Connection: close")

    async def scenario() -> None:
        async def handler(conn: UpConn) -> None:
            await conn.read_request()
            await conn.write(response)

        async with proxied(handler) as env:
            client = await env.client()
            await client.send(get())
            assert await client.eof() == response
            other = await env.client()
            await other.send(get())
            assert await other.eof() == response
            assert len(env.upstream.connections) == 2

    run(scenario)


def test_client_connection_close_closes_after_its_response(run: Run) -> None:
    """A client's ``Connection: close`` ends its connection after the response; the upstream
    connection (which the upstream keeps alive) goes back to the pool for the next client."""

    async def scenario() -> None:
        async with proxied(replies(echo_path)) as env:
            client = await env.client()
            await client.send(get("/bye", "Connection: close"))
            assert await client.eof() == ok(b"you asked /bye")
            other = await env.client()
            await other.send(get("/again"))
            assert await other.response() == (200, {"content-length": "16"}, b"you asked /again")
            assert len(env.upstream.connections) == 1

    run(scenario)


def test_http10_client_gets_its_response_then_a_close(run: Run) -> None:
    """An HTTP/1.0 client (no keep-alive) is asked for upstream as HTTP/1.0 with
    ``Connection: close``, gets the response, and its connection is closed after it."""
    response = b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def scenario() -> None:
        async def handler(conn: UpConn) -> None:
            await conn.read_request()
            await conn.write(response)

        async with proxied(handler) as env:
            client = await env.client()
            await client.send(b"GET /old HTTP/1.0\r\n\r\n")
            assert await client.eof() == response
            [received] = env.upstream.received
            assert received.head == (
                f"GET /old HTTP/1.0\r\nHost: 127.0.0.1:{env.upstream.port}\r\nConnection: close\r\n\r\n".encode()
            )

    run(scenario)


# ------------------------------------------------------------------ 4. pipelining


def test_pipelined_requests_are_answered_in_order(run: Run) -> None:
    """Requests sent back to back on one connection (more than the relay queues before it
    stops reading) are answered in order, one upstream connection, nothing lost."""
    paths = [f"/p{i}" for i in range(relay_module._MAX_PIPELINED + 8)]

    async def scenario() -> None:
        async with proxied(replies(echo_path)) as env:
            client = await env.client()
            await client.send(b"".join(get(p) for p in paths[:-1]) + post(paths[-1], b"last"))
            for path in paths:
                assert await client.exactly(len(ok(b"you asked " + path.encode()))) == ok(
                    b"you asked " + path.encode()
                )
            assert [r.head.split(b" ")[1].decode() for r in env.upstream.received] == paths
            assert env.upstream.received[-1].body == b"last"
            assert len(env.upstream.connections) == 1

    run(scenario)


# ------------------------------------------------------------------ 5. Expect: 100-continue


def test_expect_100_continue_gets_an_interim_response(run: Run) -> None:
    """A client waiting for ``100 Continue`` before sending its body gets one from the relay
    (the upstream, which never sees ``Expect``, is only asked once the body is in)."""

    async def scenario() -> None:
        async with proxied(replies(lambda r: ok(b"got " + r.body))) as env:
            client = await env.client()
            await client.send(
                b"POST /up HTTP/1.1\r\nHost: c\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
            )
            assert await client.exactly(25) == b"HTTP/1.1 100 Continue\r\n\r\n"
            assert env.upstream.received == []
            await client.send(b"hello")
            assert await client.response() == (200, {"content-length": "9"}, b"got hello")
            assert not any(k.lower() == "expect" for k, _ in env.upstream.received[0].headers)

    run(scenario)


def test_expect_100_continue_behind_a_pipelined_response_waits_its_turn(run: Run) -> None:
    """A pipelined request's ``100 Continue`` comes after the responses before it: written
    at once it would land inside the previous response's body (corrupting it), or be read as
    an interim response to the earlier request."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"

    async def scenario() -> None:
        gate = asyncio.Event()

        async def handler(conn: UpConn) -> None:
            await conn.read_request()
            await conn.write(head + b"01234")
            await gate.wait()
            await conn.write(b"56789")
            request = await conn.read_request()
            assert request is not None
            await conn.write(ok(b"got " + request.body))

        async with proxied(handler) as env:
            client = await env.client()
            await client.send(get("/slow"))
            assert await client.exactly(len(head) + 5) == head + b"01234"
            await client.send(
                b"POST /next HTTP/1.1\r\nHost: c\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
            )
            side = await env.relay_side()
            await until(lambda: side.parsed_url == b"/next")  # the relay has read that head
            gate.set()
            assert await client.exactly(5 + 25) == b"56789HTTP/1.1 100 Continue\r\n\r\n"
            await client.send(b"hello")
            assert await client.exactly(len(ok(b"got hello"))) == ok(b"got hello")

    run(scenario)


# ------------------------------------------------------------------ 6-8. framing corner cases


def test_response_delimited_by_close_is_relayed_whole(run: Run) -> None:
    """A response with neither Content-Length nor chunking ends when the upstream closes: the
    client gets every byte, then its connection is closed (it cannot know the end otherwise);
    the observer finishes cleanly."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n"

    async def scenario() -> None:
        gate = asyncio.Event()

        async def handler(conn: UpConn) -> None:
            await conn.read_request()
            await conn.write(head + b"first part, ")
            await gate.wait()
            await conn.write(b"second part")

        observer = Recorder()
        async with proxied(handler, observer=observer) as env:
            client = await env.client()
            await client.send(get())
            assert await client.exactly(len(head) + 12) == head + b"first part, "
            gate.set()
            assert await client.eof() == b"second part"
            seen = await observer.finished(0)
            assert b"".join(seen.chunks) == b"first part, second part"
            assert seen.finishes == [(200, None)]

    run(scenario)


def test_head_response_with_a_length_but_no_body_completes(run: Run) -> None:
    """A HEAD response announces a Content-Length but carries no body: the exchange ends at the
    headers (no wait for 1234 body bytes that never come) and the client connection stays
    usable for the next request."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1234\r\n\r\n"

    async def scenario() -> None:
        observer = Recorder()

        def answer(request: Received) -> bytes:
            return head if request.head.startswith(b"HEAD ") else ok(b"after")

        async with proxied(replies(answer), observer=observer) as env:
            client = await env.client()
            await client.send(get("/doc", method="HEAD"))
            assert await client.exactly(len(head)) == head
            seen = await observer.finished(0)
            assert (seen.chunks, seen.finishes) == ([], [(200, None)])
            await client.send(get("/after"))
            assert await client.exactly(len(ok(b"after"))) == ok(b"after")
            assert client.buf == b""

    run(scenario)


def test_informational_response_is_relayed_and_the_final_one_completes(run: Run) -> None:
    """A ``103 Early Hints`` before the final response reaches the client as sent; the
    observer sees only the final head, and the exchange (and connection reuse) completes on
    the final response."""
    hints = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
    final = ok(b"done", "X-Final: 1")

    async def scenario() -> None:
        gate = asyncio.Event()

        async def handler(conn: UpConn) -> None:
            await conn.read_request()
            await conn.write(hints)
            await gate.wait()
            await conn.write(final)
            while await conn.read_request() is not None:
                await conn.write(final)

        observer = Recorder()
        async with proxied(handler, observer=observer) as env:
            client = await env.client()
            await client.send(get())
            assert await client.exactly(len(hints)) == hints
            gate.set()
            assert await client.exactly(len(final)) == final
            seen = await observer.finished(0)
            assert seen.heads == [(200, [(b"X-Final", b"1"), (b"Content-Length", b"4")])]
            assert seen.finishes == [(200, None)]
            await client.send(get())
            assert await client.exactly(len(final)) == final
            assert len(env.upstream.connections) == 1

    run(scenario)


# ------------------------------------------------------------------ 9. upstream failures


def test_unreachable_upstream_is_a_502(run: Run) -> None:
    """Nothing listening upstream: a 502 JSON error of type ``otelkv``, counted, and the
    client connection stays open for the next request."""

    async def scenario() -> None:
        counters: dict[str, int] = {}
        observer = Recorder()
        relay = Relay(f"http://127.0.0.1:{free_port()}", observer=observer, counters=counters)
        port = await relay.start("127.0.0.1", 0)
        try:
            client = await Client.connect(port)
            for attempt in (1, 2):
                await client.send(post("/v1/chat/completions", b"{}"))
                status, headers, body = await client.response()
                assert (status, headers["content-type"]) == (502, "application/json")
                assert "unreachable" in error_json(body)["message"]
                assert "connection" not in headers
                assert counters["upstream_errors"] == attempt
            assert observer.seen[0].finishes == [(502, "upstream unreachable: ConnectionRefusedError")]
        finally:
            relay.close()

    run(scenario)


def test_upstream_closing_before_answering_is_a_502(run: Run) -> None:
    """The upstream reads the request and hangs up: 502, counted, observer told why."""

    async def scenario() -> None:
        async def handler(conn: UpConn) -> None:
            await conn.read_request()

        counters: dict[str, int] = {}
        observer = Recorder()
        async with proxied(handler, observer=observer, counters=counters) as env:
            client = await env.client()
            await client.send(get())
            status, _, body = await client.response()
            assert status == 502 and "before answering" in error_json(body)["message"]
            assert counters == {"upstream_errors": 1}
            seen = await observer.finished(0)
            assert seen.finishes == [(502, "upstream closed the connection before answering")]

    run(scenario)


def test_upstream_closing_mid_body_closes_the_client(run: Run) -> None:
    """The upstream dies after part of a Content-Length body: the client got those bytes and
    then sees its connection closed (it can tell the response is short); the observer's
    finish carries the error."""
    partial = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789"

    async def scenario() -> None:
        async def handler(conn: UpConn) -> None:
            await conn.read_request()
            await conn.write(partial)

        counters: dict[str, int] = {}
        observer = Recorder()
        async with proxied(handler, observer=observer, counters=counters) as env:
            client = await env.client()
            await client.send(get())
            assert await client.eof() == partial
            seen = await observer.finished(0)
            assert seen.finishes == [(200, "upstream failed mid-response: upstream closed mid-response")]
            assert counters == {"upstream_errors": 1}

    run(scenario)


# ------------------------------------------------------------------ 10. client going away


def test_client_disconnecting_mid_stream_drops_the_upstream_connection(run: Run) -> None:
    """A client that hangs up during a streamed response: the relay closes the upstream
    connection (so the engine stops generating) and the observer finishes with
    ``client disconnected``."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    frame = b"7\r\ndata: 1\r\n"

    async def scenario() -> None:
        async def handler(conn: UpConn) -> None:
            await conn.read_request()
            await conn.write(head + frame)
            await conn.wait_peer_closed()  # the rest of the stream would come later

        observer = Recorder()
        async with proxied(handler, observer=observer) as env:
            client = await env.client()
            await client.send(get("/stream"))
            assert await client.exactly(len(head + frame)) == head + frame
            client.close()
            await env.upstream.connections[0].peer_closed.wait()
            seen = await observer.finished(0)
            assert [error for _, error in seen.finishes] == ["client disconnected"]
            assert env.relay.pool.idle_count == 0

    run(scenario)


# ------------------------------------------------------------------ 11. refused requests


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        pytest.param(post("/big", b"x" * 101), 413, id="content-length"),
        pytest.param(
            b"POST /big HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1000\r\n" + b"x" * 101,
            413,
            id="inside-a-chunk",
        ),
        pytest.param(
            b"POST /big HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"40\r\n" + b"x" * 64 + b"\r\n") * 2
            + b"0\r\n\r\n",
            413,
            id="chunked",
        ),
        pytest.param(b"NOT HTTP AT ALL\r\n\r\n", 400, id="malformed"),
        pytest.param(
            get("/ws", "Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13"),
            501,
            id="upgrade",
        ),
        pytest.param(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 501, id="connect"),
    ],
)
def test_refused_requests_get_an_error_and_a_close(run: Run, request_bytes: bytes, status: int) -> None:
    """Bodies over ``max_body_bytes`` (declared or counted while de-chunking), unparsable
    requests and protocol upgrades get an ``otelkv`` JSON error with ``Connection: close``, the
    connection is closed, and the upstream is never asked."""

    async def scenario() -> None:
        async with proxied(replies(echo_path), max_body_bytes=100) as env:
            client = await env.client()
            await client.send(request_bytes)
            code, headers, body = await client.response()
            assert (code, headers["connection"]) == (status, "close")
            error_json(body)
            assert await client.eof() == b""
            assert env.upstream.received == []

    run(scenario)


def test_body_of_exactly_max_body_bytes_is_accepted(run: Run) -> None:
    """The limit is inclusive: a body of ``max_body_bytes`` goes through, chunked or not."""

    async def scenario() -> None:
        async with proxied(replies(lambda r: ok(b"%d" % len(r.body))), max_body_bytes=100) as env:
            client = await env.client()
            chunked = (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n" + b"y" * 100 + b"\r\n0\r\n\r\n"
            )
            await client.send(post("/", b"x" * 100) + chunked)
            assert await client.exactly(2 * len(ok(b"100"))) == 2 * ok(b"100")

    run(scenario)


@pytest.mark.parametrize(
    ("bad", "status"),
    [
        pytest.param(post("/big", b"x" * 101), 413, id="too-large"),
        pytest.param(b"NOT HTTP AT ALL\r\n\r\n", 400, id="malformed"),
        pytest.param(get("/ws", "Connection: Upgrade", "Upgrade: websocket"), 501, id="upgrade"),
    ],
)
def test_refusal_behind_pipelined_requests_comes_after_their_responses(
    run: Run, bad: bytes, status: int
) -> None:
    """A bad request pipelined behind requests still being answered: those responses are
    delivered whole and in order, then the error, then the close - not a silently dropped
    response and a connection left hanging until the idle timeout."""

    async def scenario() -> None:
        gate = asyncio.Event()

        async def handler(conn: UpConn) -> None:
            while (request := await conn.read_request()) is not None:
                await gate.wait()
                await conn.write(echo_path(request))

        observer = Recorder()
        async with proxied(handler, observer=observer, max_body_bytes=100) as env:
            client = await env.client()
            await client.send(get("/first") + get("/second") + bad)
            await observer.began.wait()
            gate.set()
            for path in (b"/first", b"/second"):
                assert await client.exactly(len(ok(b"you asked " + path))) == ok(b"you asked " + path)
            code, headers, _ = await client.response()
            assert (code, headers["connection"]) == (status, "close")
            assert await client.eof() == b""
            assert [r.head.split(b" ")[1] for r in env.upstream.received] == [b"/first", b"/second"]
            assert [s.finishes for s in observer.seen] == [[(200, None)], [(200, None)]]

    run(scenario)


# ------------------------------------------------------------------ 12. backpressure

_MB = 1 << 20


def _pattern(size: int) -> bytes:
    return bytes(range(256)) * (size // 256)


def _small_socket_buffers(side: relay_module._Client) -> None:
    """Bound what the kernel holds between the relay and a client that does not read
    (autotuning lets loopback sockets absorb megabytes), so the relay's own buffering shows."""
    assert side.transport is not None
    side.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)


def test_slow_client_pauses_the_upstream_instead_of_buffering(run: Run) -> None:
    """A client that does not read while the upstream streams 8 MB: the relay stops reading
    the upstream (TCP pushes back to it) rather than holding the body in memory - its write
    buffer to the client stays near the high-water mark - and the client gets every byte
    once it reads."""
    size = 8 * _MB
    body = _pattern(size)
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode()

    async def scenario() -> None:
        finished_writing = asyncio.Event()

        async def handler(conn: UpConn) -> None:
            await conn.read_request()
            await conn.write(head)
            for i in range(0, size, 64 * 1024):
                await conn.write(body[i : i + 64 * 1024])
            finished_writing.set()
            await conn.wait_peer_closed()

        peak = 0

        def sample(_: bytes) -> None:  # right after the relay wrote a piece to the client
            nonlocal peak
            assert side.transport is not None
            peak = max(peak, side.transport.get_write_buffer_size())

        observer = Recorder(on_body=sample)
        async with proxied(handler, observer=observer) as env:
            client = await env.client(rcvbuf=64 * 1024)
            side = await env.relay_side()
            _small_socket_buffers(side)
            await client.send(get("/big"))
            upstream = await until(lambda: side.upstream)
            assert upstream is not None and upstream.transport is not None
            transport = upstream.transport
            await until(lambda: not transport.is_reading())
            assert not finished_writing.is_set()
            assert peak < _MB
            assert await client.exactly(len(head) + size) == head + body
            assert peak < _MB
            assert (await observer.finished(0)).finishes == [(200, None)]

    run(scenario)


def test_backpressure_carries_over_to_the_next_exchange(run: Run) -> None:
    """The client's connection is still over its high-water mark when the next exchange
    starts (a keep-alive client that stopped reading): that exchange's upstream is paused from
    the start. Otherwise nothing pauses it - the transport only reports crossing the mark -
    and the whole next response would pile up in memory."""
    first = ok(_pattern(_MB))
    size = 8 * _MB
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode()
    body = _pattern(size)

    async def scenario() -> None:
        finished_writing = asyncio.Event()

        async def handler(conn: UpConn) -> None:
            await conn.read_request()
            await conn.write(first)
            await conn.read_request()
            await conn.write(head)
            for i in range(0, size, 64 * 1024):
                await conn.write(body[i : i + 64 * 1024])
            finished_writing.set()
            await conn.wait_peer_closed()

        observer = Recorder()
        async with proxied(handler, observer=observer) as env:
            client = await env.client(rcvbuf=64 * 1024)
            side = await env.relay_side()
            _small_socket_buffers(side)
            assert side.transport is not None
            side.transport.set_write_buffer_limits(high=64 * _MB)  # the first response: all buffered
            await client.send(get("/first"))
            await observer.finished(0)
            buffered = side.transport.get_write_buffer_size()
            assert buffered > 256 * 1024  # the client has not read; its socket is full
            side.transport.set_write_buffer_limits()  # the default mark, long crossed
            await client.send(get("/big"))

            def paused_or_done() -> bool:
                up = side.upstream
                paused = up is not None and up.transport is not None and not up.transport.is_reading()
                return paused or finished_writing.is_set()

            await until(paused_or_done)
            assert side.transport.get_write_buffer_size() < buffered + _MB
            assert await client.exactly(len(first) + len(head) + size) == first + head + body
            assert (await observer.finished(1)).finishes == [(200, None)]

    run(scenario)


def test_upstream_paused_as_its_response_ends_is_pooled_reading(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A response whose last bytes push the client's buffer over the high-water mark pauses
    its upstream connection just as the exchange ends; that connection must go back to the
    pool reading again, or the next request sent on it never gets its answer read."""
    first = ok(_pattern(_MB))
    small = ok(b"s" * 4000)

    async def scenario() -> None:
        def answer(request: Received) -> bytes:
            return first if request.head.startswith(b"GET /first ") else small

        observer = Recorder()
        async with proxied(replies(answer), observer=observer) as env:
            client = await env.client(rcvbuf=64 * 1024)
            side = await env.relay_side()
            assert side.transport is not None
            transport = side.transport
            _small_socket_buffers(side)
            transport.set_write_buffer_limits(high=64 * _MB)  # the first response: all buffered
            await client.send(get("/first"))
            await observer.finished(0)
            assert transport.get_write_buffer_size() > 0  # the client has not read; its socket is full
            plain_write = side.write

            def write(data: bytes) -> None:
                if data.endswith(small[-100:]):  # the second response's last bytes cross the mark
                    transport.set_write_buffer_limits(high=transport.get_write_buffer_size() + 1, low=0)
                plain_write(data)

            monkeypatch.setattr(side, "write", write)
            await client.send(get("/second"))
            await observer.finished(1)
            assert await client.exactly(len(first) + len(small)) == first + small
            await client.send(get("/third"))
            assert await client.exactly(len(small)) == small
            assert len(env.upstream.connections) == 1

    run(scenario)


# ------------------------------------------------------------------ 13. observer failures


@pytest.mark.parametrize("fail_in", ["begin", "response_head", "response_body", "finish"])
def test_observer_failures_do_not_break_the_exchange(
    run: Run, fail_in: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An observer raising in any callback is logged and the bytes flow on untouched, for
    this exchange and the next one on the connection (a ``begin`` that fails sends the
    request as the client sent it)."""
    response = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n"

    async def scenario() -> None:
        observer = Recorder(fail_in=fail_in, extra=[(b"X-Observed", b"1")])
        async with proxied(replies(lambda _: response), observer=observer) as env:
            client = await env.client()
            for _ in range(2):
                await client.send(post("/v1/chat/completions", b"{}"))
                assert await client.exactly(len(response)) == response
            assert len(observer.requests) == 2
            observed = [("X-Observed", "1") in r.headers for r in env.upstream.received]
            assert observed == ([False, False] if fail_in == "begin" else [True, True])
            if fail_in == "finish":
                assert [s.finishes for s in observer.seen] == [[(200, None)], [(200, None)]]

    run(scenario)
    assert any(r.name == "otelkv.sidecar" and r.exc_info for r in caplog.records)


# ------------------------------------------------------------------ 14. the upstream pool


def test_idle_upstream_connection_is_not_reused_after_the_idle_limit(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pooled connection idle for ``UPSTREAM_IDLE_S`` or more is closed, not reused: the
    upstream may be closing it at that very moment (uvicorn does after 5 s), and a request
    written into it would fail."""
    monkeypatch.setattr(relay_module, "UPSTREAM_IDLE_S", 0.0)  # every pooled connection is stale

    async def scenario() -> None:
        async with proxied(replies(echo_path)) as env:
            client = await env.client()
            for path in (b"/one", b"/two"):
                await client.send(get(path.decode()))
                assert await client.exactly(len(ok(b"you asked " + path))) == ok(b"you asked " + path)
            assert len(env.upstream.connections) == 2
            await env.upstream.connections[0].peer_closed.wait()

    run(scenario)


def test_upstream_closing_an_idle_connection_is_noticed(run: Run) -> None:
    """An upstream that closes a keep-alive connection while it sits in the pool: the relay
    forgets it, and the next request goes over a new connection instead of failing."""

    async def scenario() -> None:
        async def handler(conn: UpConn) -> None:
            request = await conn.read_request()
            assert request is not None
            await conn.write(echo_path(request))  # then the idle timeout: closed

        async with proxied(handler) as env:
            client = await env.client()
            await client.send(get("/one"))
            assert await client.exactly(len(ok(b"you asked /one"))) == ok(b"you asked /one")
            await until(lambda: len(env.upstream.connections) == 1 and env.relay.pool.idle_count == 0)
            await client.send(get("/two"))
            assert await client.exactly(len(ok(b"you asked /two"))) == ok(b"you asked /two")
            assert len(env.upstream.connections) == 2

    run(scenario)


def _closes_on_its_second_request(answer_on_fresh: bool) -> Handler:
    """An upstream whose first connection answers one request, then reads the next and
    hangs up unanswered (a keep-alive timer firing as the request arrives); later
    connections answer (``answer_on_fresh``) or hang up the same way."""

    async def handler(conn: UpConn) -> None:
        first = len(conn.server.connections) == 1
        request = await conn.read_request()
        if request is None:
            return
        if first or answer_on_fresh:
            await conn.write(echo_path(request))
        if first:
            await conn.read_request()  # and close, unanswered
        elif answer_on_fresh:
            while (request := await conn.read_request()) is not None:
                await conn.write(echo_path(request))

    return handler


def test_request_a_pooled_connection_closes_on_unanswered_is_sent_again(run: Run) -> None:
    """The request goes once more, on a new connection: the client gets the answer, the
    observer one exchange, and the retry is counted (not as an error)."""

    async def scenario() -> None:
        counters: dict[str, int] = {}
        observer = Recorder()
        async with proxied(_closes_on_its_second_request(True), observer=observer, counters=counters) as env:
            client = await env.client()
            for path in (b"/one", b"/two"):
                await client.send(post(path.decode(), b'{"n": 1}'))
                assert await client.exactly(len(ok(b"you asked " + path))) == ok(b"you asked " + path)
            assert [r.head.split(b" ")[1] for r in env.upstream.received] == [b"/one", b"/two", b"/two"]
            assert [r.body for r in env.upstream.received] == [b'{"n": 1}'] * 3
            assert len(env.upstream.connections) == 2
            assert counters == {"upstream_retries": 1}
            assert (await observer.finished(1)).finishes == [(200, None)]
            assert len(observer.seen) == 2

    run(scenario)


def test_request_a_new_connection_also_closes_on_is_a_502(run: Run) -> None:
    """Sent once more at most: a new connection closing unanswered is the upstream's answer."""

    async def scenario() -> None:
        counters: dict[str, int] = {}
        async with proxied(_closes_on_its_second_request(False), counters=counters) as env:
            client = await env.client()
            await client.send(get("/one"))
            assert await client.exactly(len(ok(b"you asked /one"))) == ok(b"you asked /one")
            await client.send(get("/two"))
            status, _, body = await client.response()
            assert status == 502 and "before answering" in error_json(body)["message"]
            assert counters == {"upstream_retries": 1, "upstream_errors": 1}
            assert len(env.upstream.received) == 3

    run(scenario)


def test_retries_and_errors_counted_in_the_proxy_become_the_sidecars_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay's ``upstream_retries`` and ``upstream_errors`` reach ``/metrics``."""
    import os

    from otelkv import names
    from otelkv.sidecar.app import Sidecar, SidecarConfig
    from tests.unit.sidecar_harness import metric

    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    sidecar = Sidecar(SidecarConfig(upstream="http://127.0.0.1:9", store=False))
    sidecar._proxy_counters({"upstream_retries": 2, "upstream_errors": 1})
    sidecar._proxy_counters({"upstream_retries": 1})
    text = sidecar.metrics.exposition().decode()
    assert metric(text, names.METRIC_SIDECAR_UPSTREAM_RETRIES + "_total") == 3
    assert metric(text, names.METRIC_SIDECAR_UPSTREAM_ERRORS + "_total") == 1


def test_unparsable_upstream_response_closes_the_client(run: Run) -> None:
    """An upstream answering something that is not HTTP: the bytes were already relayed (the
    relay never holds them back to parse first), so the client connection is closed, the
    error counted and reported to the observer; the connection is not pooled."""

    async def scenario() -> None:
        async def handler(conn: UpConn) -> None:
            await conn.read_request()
            await conn.write(b"SPDY/9 banana\r\n\r\n")
            await conn.wait_peer_closed()

        counters: dict[str, int] = {}
        observer = Recorder()
        async with proxied(handler, observer=observer, counters=counters) as env:
            client = await env.client()
            await client.send(get())
            assert await client.eof() == b"SPDY/9 banana\r\n\r\n"
            seen = await observer.finished(0)
            [(status, error)] = seen.finishes
            assert status == 0 and error is not None and "unparsable upstream response" in error
            assert counters == {"upstream_errors": 1}
            await env.upstream.connections[0].peer_closed.wait()
            assert env.relay.pool.idle_count == 0

    run(scenario)


def test_request_is_dated_by_the_kernels_receive_time(run: Run) -> None:
    """A request that sat in the socket while the proxy's loop was busy is dated when the
    kernel received it (the client's send time, within the kernel's jiffy), not when the
    proxy read it: that wait is the client's, not the agent's work before the turn."""
    import time

    async def scenario() -> None:
        observer = Recorder()
        async with proxied(replies(lambda _: ok(b"x")), observer=observer) as env:
            client = await env.client()
            await client.send(get("/warm"))
            await client.response()  # connected and idle, as between turns
            await client.send(get("/late"))
            sent_ns = time.time_ns()
            time.sleep(0.3)  # the proxy's loop busy: the bytes wait in the socket
            await client.response()
            late = observer.requests[-1]
            assert late.path == "/late"
            assert abs(late.received_ns - sent_ns) < 20_000_000, (late.received_ns - sent_ns) / 1e9
            assert late.read_ns - late.received_ns >= 280_000_000
            # The response's last byte left the proxy's kernel before the exchange ended.
            assert late.received_ns <= late.sent_ns <= time.time_ns()

    run(scenario)


def test_sockets_without_a_kernel_receive_time_fall_back_to_the_proxys_clock() -> None:
    from otelkv.sidecar import arrival

    a, b = socket.socketpair()  # AF_UNIX: no TCP_INFO
    try:
        assert arrival.received_ns(a, 123) is None
        assert arrival.received_ns(None, 123) is None
        assert arrival.socket_of(object()) is None
    finally:
        a.close()
        b.close()
