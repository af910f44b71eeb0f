"""A lean HTTP/1.1 reverse proxy: raw bytes relayed, each exchange shown to an observer.

Why not aiohttp (which the sidecar used first): a full client and server per hop cost
~1.3 ms of added latency at the median on a 2-core machine, more than the whole budget.
Here both sides are plain asyncio protocols with httptools (llhttp) parsers, so a hop is
a few tens of microseconds of CPU:

- the client's request is parsed, its body buffered (bounded), and re-sent upstream with
  hop-by-hop headers dropped, ``Host`` set to the upstream and a ``Content-Length``;
- the upstream's response bytes are written to the client *as received* - status line,
  headers, chunk framing and all - before the parser looks at them, so the client gets
  the upstream's exact bytes with no added buffering; the parser only decides where the
  response ends and feeds the decoded body to the observer.

Upstream connections are pooled (LIFO) and dropped after ``UPSTREAM_IDLE_S`` idle: common
servers (uvicorn, hence vLLM and many routers) close idle connections after 5 s, and a
request written into a connection the server is closing would fail. No idle limit on this
side closes that race: uvicorn (under uvloop) runs its keep-alive timer before reading a
request that arrived while its loop was stalled, so a stall of a second or two drops a
request written on a connection idle for far less. So a request that a *pooled* connection
closed on before a byte of answer is sent once more, on a new connection, and the client
never sees the race. The relay cannot tell that close from an upstream that read the
request and died before answering: such a request is replayed too, once. A new
connection that fails the same way is the upstream's answer (a 502).

Failure behaviour: upstream unreachable or closed before answering -> 502 (JSON); upstream
closed mid-response -> the client connection is closed (the bytes so far were already
sent); the client going away -> the upstream connection is dropped. An exception in an
observer is logged and the exchange goes on without it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import SplitResult, urlsplit

import httptools

from otelkv import names
from otelkv.sidecar import arrival

logger = logging.getLogger("otelkv.sidecar")

UPSTREAM_IDLE_S = 4.0
CLIENT_IDLE_S = 75.0
CONNECT_TIMEOUT_S = 10.0
_MAX_PIPELINED = 16
MAX_HEAD_BYTES = 1 << 20
"""A request line plus headers larger than this is refused (431). httptools buffers a head
without limit (by repeated concatenation: quadratic CPU), so besides the exact size checked
once the head is parsed, the bytes read while a head is still incomplete are counted too:
that bounds the memory and CPU one endless head can take from every other client."""

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",
    }
)


@dataclass
class Request:
    """One client request, as parsed (names and values are the raw header bytes)."""

    method: bytes = b""
    url: bytes = b""
    version: str = "1.1"
    headers: list[tuple[bytes, bytes]] | None = None
    body: bytes = b""
    keep_alive: bool = True
    received_ns: int = 0
    """When the kernel received the connection's latest bytes as this request's first ones
    were parsed (the proxy's clock then where the kernel does not say; wall clock, ns). A
    request pipelined behind another on the same connection is dated when it arrived, so its
    wait behind the one before it counts as its own input processing."""
    read_ns: int = 0
    """The proxy's clock when it read them (``read_ns - received_ns``: time in the socket)."""
    sent_ns: int = 0
    """When the response's last byte left the kernel, read as the exchange ended (0: unknown,
    the exchange failed, or bytes were still queued in the proxy or the kernel): the end even
    if the proxy was descheduled before it could stamp it itself."""

    @property
    def path(self) -> str:
        return self.url.split(b"?", 1)[0].decode("latin-1")

    def header(self, name: bytes) -> bytes | None:
        """First value of header ``name`` (lower-case bytes)."""
        for key, value in self.headers or ():
            if key.lower() == name:
                return value
        return None


class Exchange(Protocol):
    """What an observer returns for a request it watches (see :class:`ExchangeObserver`)."""

    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    def response_body(self, data: bytes) -> None: ...

    def finish(self, status: int, error: str | None) -> None: ...


class ExchangeObserver(Protocol):
    def begin(self, request: Request) -> tuple[Exchange | None, list[tuple[bytes, bytes | None]], bytes]:
        """(exchange or None, headers to set upstream (None: remove), body to send)."""
        ...


REFUSED = "requests_refused"
"""The proxy's counter of refused requests; its key is ``requests_refused:<reason>``."""
_REFUSED_REASONS = {
    400: names.REFUSED_MALFORMED,
    413: names.REFUSED_TOO_LARGE,
    431: names.REFUSED_HEADERS_TOO_LARGE,
    501: names.REFUSED_UPGRADE,
    505: names.REFUSED_HTTP_VERSION,
}
"""The status of each refusal the proxy answers itself, and its ``reason`` label."""


def _error_response(status: int, reason: str, message: str, *, close: bool) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "otelkv"}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
    )
    return head.encode("latin-1") + body


class _Upstream(asyncio.Protocol):
    """One connection to the upstream; relays its bytes to the current client."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.client: _Client | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.closed = False
        self.idle_since = 0.0
        self._headers: list[tuple[bytes, bytes]] = []
        self._status = 0
        self._head_done = False
        self._complete = False
        self._got_bytes = False
        self._head_request = False
        self._until_close = False
        self._keep_alive = False

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None:  # nothing asked: a server speaking out of turn
            self._abort()
            return
        if not self._got_bytes:
            self._got_bytes = True
            client.answered()
        client.write(data)  # first the bytes, untouched; then look at them
        try:
            assert self.parser is not None
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            # (101 Switching Protocols cannot happen for requests sent without Upgrade.)
            self._fail(f"unparsable upstream response: {exc!r}")
            return
        if self._complete:
            self._done()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.client is None:
            return
        if self._head_done and self._until_close and not self._complete:
            self._complete = True  # a response delimited by the connection's end
            self._done()
        elif not self._got_bytes:
            self._fail("upstream closed the connection before answering", nothing_sent=True)
        else:
            self._fail("upstream closed mid-response")

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # informational: the real head follows
            self._headers = []
            return
        self._status = status
        self._head_done = True
        self._keep_alive = self.parser.should_keep_alive()
        length = False
        encoding = b""  # the last Transfer-Encoding header's
        for key, value in self._headers:
            lower = key.lower()
            if lower == b"content-length":
                length = True
            elif lower == b"transfer-encoding":
                encoding = value
        self._until_close = not length and b"chunked" not in encoding.lower() and status not in (204, 304)
        if self._head_request:
            self._complete = True
        client = self.client
        if client is not None and client.exchange is not None:
            client.observe_head(status, self._headers)

    def on_body(self, body: bytes) -> None:
        client = self.client
        if client is not None and client.exchange is not None:
            client.observe_body(body)

    def on_message_complete(self) -> None:
        if self._head_done:
            self._complete = True

    # exchange lifecycle
    def send(self, client: _Client, head: bytes, body: bytes, *, head_request: bool) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self._headers = []
        self._status = 0
        self._head_done = self._complete = self._got_bytes = self._until_close = False
        self._keep_alive = False
        self._head_request = head_request
        assert self.transport is not None
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)

    def _done(self) -> None:
        client, self.client = self.client, None
        # The client was sent the upstream's own Connection header and framing: it keeps the
        # connection exactly when the upstream meant to keep its own.
        keep_client = self._keep_alive and not self._until_close
        self.parser = None
        if keep_client and not self.closed and not self._head_request:
            self.pool.release(self)
        else:
            self._abort()
        if client is not None:
            client.exchange_done(self._status, None, keep_client=keep_client)

    def _fail(self, error: str, *, nothing_sent: bool = False) -> None:
        client, self.client = self.client, None
        self.parser = None
        self._abort()
        if client is not None:
            client.exchange_failed(error, nothing_sent=nothing_sent, status=self._status)

    def _abort(self) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.abort()

    def detach(self) -> None:
        """The client went away mid-exchange: this connection's response is unusable."""
        self.client = None
        self._abort()


class UpstreamPool:
    """Idle upstream connections, most recently used first."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int, *, tls: bool = False) -> None:
        self.loop = loop
        self.host = host
        self.port = port
        # https upstreams: verified with the system's CA store (SSL_CERT_FILE applies).
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if tls else None
        self._idle: deque[_Upstream] = deque()

    @property
    def idle_count(self) -> int:
        """Upstream connections kept open for the next request."""
        return len(self._idle)

    def take(self) -> _Upstream | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < UPSTREAM_IDLE_S:
                return conn
            conn._abort()
        return None

    async def connect(self) -> _Upstream:
        _, conn = await asyncio.wait_for(
            self.loop.create_connection(lambda: _Upstream(self), self.host, self.port, ssl=self.ssl),
            CONNECT_TIMEOUT_S,
        )
        return conn

    def release(self, conn: _Upstream) -> None:
        conn.idle_since = time.monotonic()
        # It may have been paused for a slow client as its response ended: an idle connection
        # reads (to notice the upstream closing it), and the next response must be read.
        if conn.transport is not None and not conn.transport.is_reading():
            conn.transport.resume_reading()
        self._idle.append(conn)

    def forget(self, conn: _Upstream) -> None:
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    def close(self) -> None:
        while self._idle:
            self._idle.pop()._abort()


class _Client(asyncio.Protocol):
    """One client connection: requests in order, one exchange at a time."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request] = deque()
        self.current: Request | None = None
        self.exchange: Exchange | None = None
        self.upstream: _Upstream | None = None
        self.closing = False
        self._req = Request()
        self._body: list[bytes] = []
        self._body_len = 0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None  # loop time the connection went idle; None: busy
        self._writing_paused = False  # the client transport is over its high-water mark
        self._refusal: bytes | None = None  # an error response owed after the pending ones
        self._head_bytes: int | None = None  # bytes read while a request head is incomplete
        self._head_size = 0  # exact size of the current head's URL, names and values
        self._continue_due = False  # a 100 Continue owed once the pending responses are sent
        self._sock: Any = None  # for the kernel's receive time of each request
        # The current exchange's head and body while it is on a pooled connection and no
        # byte of answer came, to send once more if that connection closes; else None.
        self._sent: tuple[bytes, bytes] | None = None

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.relay.clients.add(self)
        self._sock = arrival.socket_of(transport)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self.closing or self._refusal is not None:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(501, "Not Implemented", "protocol upgrades are not proxied by otelkv")
            return
        except httptools.HttpParserError as exc:
            self._refuse(400, "Bad Request", f"malformed HTTP request: {exc}")
            return
        if self._head_bytes is not None:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._head_too_large()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.relay.clients.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        upstream, self.upstream = self.upstream, None
        status = 0
        if upstream is not None:
            status = upstream._status  # what the upstream answered, if it had
            upstream.detach()
        if self.current is not None:
            self._end_exchange(status, names.CLIENT_DISCONNECTED)

    def pause_writing(self) -> None:  # the client reads slower than the upstream sends
        # Kept as state: the transport reports crossing the mark once, and the exchange that
        # crossed it may end before the client catches up; the next upstream starts paused.
        self._writing_paused = True
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    # httptools callbacks
    @property
    def parsed_url(self) -> bytes:
        """The URL of the request this connection read last (its head may still be arriving)."""
        return self._req.url

    def on_message_begin(self) -> None:
        self._head_bytes = 0
        self._head_size = 0
        now = time.time_ns()
        received = arrival.received_ns(self._sock, now)  # never raises
        self._req = Request(headers=[], received_ns=received or now, read_ns=now)
        self._body = []
        self._body_len = 0

    def on_url(self, url: bytes) -> None:
        self._req.url += url
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._req.headers is not None
        self._req.headers.append((name, value))
        self._head_size += len(name) + len(value)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        if self._head_size > MAX_HEAD_BYTES:
            self._head_too_large()
            return
        req = self._req
        req.method = self.parser.get_method()
        req.version = self.parser.get_http_version()
        req.keep_alive = self.parser.should_keep_alive()
        # Upgrade and CONNECT are refused here: the parser completes such a message (which
        # would forward it) before it raises HttpParserUpgrade.
        if self.parser.should_upgrade():
            self._refuse(501, "Not Implemented", "protocol upgrades are not proxied by otelkv")
            return
        if req.version not in ("1.0", "1.1"):  # llhttp reads HTTP/0.9 and 2.0 request lines too
            self._refuse(
                505, "HTTP Version Not Supported", f"HTTP/{req.version} is not proxied (use HTTP/1.1)"
            )
            return
        length = expect = None
        for key, value in req.headers or ():
            lower = key.lower()
            if lower == b"content-length":
                if length is None:
                    length = value
            elif lower == b"expect" and expect is None:
                expect = value
        if length is not None and length.strip().isdigit() and int(length) > self.relay.max_body_bytes:
            self._too_large()
            return
        if expect is not None and expect.lower() == b"100-continue" and req.version != "1.0":
            if self.current is None:
                self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:  # a pipelined request: not in the middle of the response being relayed
                self._continue_due = True

    def on_body(self, body: bytes) -> None:
        if self.closing or self._refusal is not None:
            return
        self._body_len += len(body)
        if self._body_len > self.relay.max_body_bytes:
            self._too_large()
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.closing or self._refusal is not None:
            return
        self._continue_due = False  # the body came without it
        self._req.body = b"".join(self._body)
        self._body = []
        self.queue.append(self._req)
        if self.current is None:
            self._next()
        elif len(self.queue) >= _MAX_PIPELINED and self.transport is not None:
            self.transport.pause_reading()  # a client pipelining ahead waits for its answers

    # exchanges
    def _next(self) -> None:
        if self.closing or not self.queue:
            return
        self._idle_since = None
        if len(self.queue) == _MAX_PIPELINED and self.transport is not None:
            self.transport.resume_reading()
        req = self.current = self.queue.popleft()
        extra: list[tuple[bytes, bytes | None]] = []
        body = req.body
        self.exchange = None
        try:
            if self.relay.observer is not None:
                self.exchange, extra, body = self.relay.observer.begin(req)
        except Exception:
            logger.exception("otelkv sidecar: could not observe a request; passing it through")
            self.exchange, extra, body = None, [], req.body
        head = self.relay.request_head(req, extra, len(body))
        conn = self.relay.pool.take()
        if conn is not None:
            self._sent = (head, body)
            self._send(conn, head, body, req)
        else:
            self.relay.loop.create_task(self._connect_and_send(head, body, req))

    async def _connect_and_send(self, head: bytes, body: bytes, req: Request) -> None:
        try:
            conn = await self.relay.pool.connect()
        except (OSError, asyncio.TimeoutError) as exc:
            self.relay.count("upstream_errors")
            self._reply_error(
                502,
                "Bad Gateway",
                f"otelkv sidecar: upstream {self.relay.upstream_url} unreachable: {exc}",
                f"upstream unreachable: {type(exc).__name__}",
            )
            return
        if self.closing:
            conn.pool.release(conn)
            return
        self._send(conn, head, body, req)

    def _send(self, conn: _Upstream, head: bytes, body: bytes, req: Request) -> None:
        self.upstream = conn
        conn.send(self, head, body, head_request=req.method == b"HEAD")
        if self._writing_paused and conn.transport is not None:
            conn.transport.pause_reading()

    def answered(self) -> None:
        """The upstream's first byte for this exchange: it can no longer be sent again."""
        self._sent = None

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closing:
            self.transport.write(data)

    def observe_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Show the exchange's observer the response head (its failure stops only the observing)."""
        exchange = self.exchange
        if exchange is None:
            return
        try:
            exchange.response_head(status, headers)
        except Exception:
            logger.exception("otelkv sidecar: response observer failed; forwarding only")
            self.exchange = None

    def observe_body(self, data: bytes) -> None:
        """Show the exchange's observer a piece of the decoded response body (ditto)."""
        exchange = self.exchange
        if exchange is None:
            return
        try:
            exchange.response_body(data)
        except Exception:
            logger.exception("otelkv sidecar: response observer failed; forwarding only")
            self.exchange = None

    def exchange_done(self, status: int, error: str | None, *, keep_client: bool) -> None:
        self.upstream = None
        self._sent = None
        self._end_exchange(status, error)
        req, self.current = self.current, None
        if not keep_client or req is None or not req.keep_alive:
            self._close()
            return
        self._advance()

    def exchange_failed(self, error: str, *, nothing_sent: bool, status: int) -> None:
        self.upstream = None
        sent, self._sent = self._sent, None  # set only while a pooled connection owes the answer
        if nothing_sent and sent is not None and self.current is not None and not self.closing:
            self.relay.count("upstream_retries")
            self.relay.loop.create_task(self._connect_and_send(*sent, self.current))
            return
        self.relay.count("upstream_errors")
        if nothing_sent:
            self._reply_error(502, "Bad Gateway", f"otelkv sidecar: {error}", error)
            return
        self._end_exchange(status, f"upstream failed mid-response: {error}")
        self.current = None
        self._close()

    def _reply_error(self, status: int, reason: str, message: str, error: str) -> None:
        self.upstream = None
        self._sent = None
        req, self.current = self.current, None
        keep = req is not None and req.keep_alive
        self.write(_error_response(status, reason, message, close=not keep))
        self._end_exchange(status, error)
        if not keep:
            self._close()
        else:
            self._advance()

    def _advance(self) -> None:
        """After a response: the next request, else an error owed, else a 100 owed, else idle."""
        if self.queue:
            self._next()
        elif self._refusal is not None:
            self.write(self._refusal)
            self._close()
        else:
            if self._continue_due:
                self._continue_due = False
                self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._arm_idle()

    def _end_exchange(self, status: int, error: str | None) -> None:
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return
        try:
            req = self.current
            # Only a response relayed whole: a failed exchange may have written nothing of its own.
            if req is not None and error is None and self.transport is not None:
                if not self.transport.get_write_buffer_size():
                    sent = arrival.all_sent_ns(self._sock, time.time_ns())
                    req.sent_ns = sent if sent is not None and sent >= req.received_ns else 0
            exchange.finish(status, error)
        except Exception:
            logger.exception("otelkv sidecar: could not end a turn")

    def _head_too_large(self) -> None:
        self._refuse(
            431, "Request Header Fields Too Large", f"request line and headers over {MAX_HEAD_BYTES} bytes"
        )

    def _too_large(self) -> None:
        self._refuse(413, "Payload Too Large", f"request body over {self.relay.max_body_bytes} bytes")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        if self.closing or self._refusal is not None:
            return
        self.relay.count(f"{REFUSED}:{_REFUSED_REASONS.get(status, names.REFUSED_MALFORMED)}")
        response = _error_response(status, reason, message, close=True)
        if self.current is None:
            self.write(response)
            self._close()
        else:  # the responses still due come first, then this one and the close
            self._refusal = response

    def _arm_idle(self) -> None:
        """The connection is idle from now: closed once idle for ``CLIENT_IDLE_S``.

        One timer per connection, re-armed only when it fires early, rather than a timer set
        and cancelled for every request (a kept-alive connection's requests cost no timer)."""
        loop = self.relay.loop
        self._idle_since = loop.time()
        if self._idle_timer is None:
            self._idle_timer = loop.call_at(self._idle_since + CLIENT_IDLE_S, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        since = self._idle_since
        if self.closing or since is None:  # busy: the exchange's end arms it again
            return
        due = since + CLIENT_IDLE_S
        if self.relay.loop.time() >= due:
            self._close()
        else:
            self._idle_timer = self.relay.loop.call_at(due, self._idle_check)

    def _close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()


def check_upstream(upstream: str) -> SplitResult:
    """``upstream`` split, when it is an ``http(s)://host[:port]`` URL without a path; else a
    ``ValueError`` whose message says what is wrong (the CLI checks it before starting anything)."""
    try:
        parts = urlsplit(upstream)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        raise ValueError(f"upstream must be an http(s)://host[:port] URL, got {upstream!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"upstream must be an http(s)://host[:port] URL, got {upstream!r}")
    if parts.path not in ("", "/"):
        raise ValueError(f"upstream URL must not have a path, got {upstream!r}")
    return parts


class Relay:
    """The proxy server: ``await start(host, port)``, then ``close()``."""

    def __init__(
        self,
        upstream: str,
        *,
        observer: ExchangeObserver | None = None,
        max_body_bytes: int = 32 * 1024 * 1024,
        counters: dict[str, int] | None = None,
        on_count: Callable[[], None] | None = None,
    ) -> None:
        parts = check_upstream(upstream)
        self.upstream_url = upstream.rstrip("/")
        self.host = parts.hostname
        tls = parts.scheme == "https"
        self.port = parts.port or (443 if tls else 80)
        default_port = parts.port in (None, 443 if tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        self._host_header = (host if default_port else f"{host}:{self.port}").encode("idna")
        self.observer = observer
        self.max_body_bytes = max_body_bytes
        self.counters = counters if counters is not None else {}
        self.on_count = on_count
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self.pool = UpstreamPool(self.loop, self.host, self.port, tls=tls)
        self.clients: set[_Client] = set()
        self.server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        self.loop = asyncio.get_running_loop()
        self.pool.loop = self.loop
        self.server = await self.loop.create_server(lambda: _Client(self), host, port, reuse_address=True)
        return int(self.server.sockets[0].getsockname()[1])

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for client in list(self.clients):
            client._close()
        self.pool.close()

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
        if self.on_count is not None:
            self.on_count()

    def request_head(self, req: Request, extra: list[tuple[bytes, bytes | None]], body_len: int) -> bytes:
        """The request line and headers sent upstream: the client's, minus hop-by-hop ones."""
        headers = req.headers
        assert headers is not None
        lowered = [key.lower() for key, _ in headers]
        named: set[bytes] = set()
        if b"connection" in lowered:
            for (_, value), lower in zip(headers, lowered, strict=True):
                if lower == b"connection":
                    named.update(token.strip().lower() for token in value.split(b","))
        replaced = {key.lower() for key, _ in extra}  # a value of None: drop only
        version = b"1.0" if req.version == "1.0" else b"1.1"
        parts = [req.method, b" ", req.url, b" HTTP/", version, b"\r\nHost: ", self._host_header, b"\r\n"]
        for (key, value), lower in zip(headers, lowered, strict=True):
            if lower in _HOP_BY_HOP or lower in named or lower in replaced:
                continue
            parts += (key, b": ", value, b"\r\n")
        for key, extra_value in extra:
            if extra_value is not None:
                parts += (key, b": ", extra_value, b"\r\n")
        if body_len or req.method in (b"POST", b"PUT", b"PATCH"):
            parts += (b"Content-Length: ", str(body_len).encode(), b"\r\n")
        if version == b"1.0":
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)


def header_dict(headers: list[tuple[bytes, bytes]] | None) -> dict[str, str]:
    """Lower-cased header names to their first value (decoded UTF-8, lenient)."""
    out: dict[str, str] = {}
    for key, value in headers or ():
        name = key.decode("latin-1").lower()
        if name not in out:
            out[name] = value.decode("utf-8", "replace")
    return out


class LowerHeaders(dict[str, str]):
    """A dict of lower-cased header names whose ``get`` ignores case, for shared helpers."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(key.lower(), default)

    @classmethod
    def of(cls, headers: list[tuple[bytes, bytes]] | None) -> LowerHeaders:
        """:func:`header_dict` of ``headers``, as one of these."""
        out = cls()
        for key, value in headers or ():
            name = key.decode("latin-1").lower()
            if name not in out:
                out[name] = value.decode("utf-8", "replace")
        return out
