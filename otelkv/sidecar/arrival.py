"""When the kernel received a request's bytes and sent a response's: the closest a
user-space proxy can get to the wire.

A proxy that stamps a request when its event loop gets to it books every millisecond the
request waited in the socket (the proxy descheduled on a busy host, its loop busy with
another response) as time before the turn: measured on a 2-core fleet, 0.21 s that the
phase split then counted as the agent's own work. Linux keeps, per TCP socket, the time
since data was last received and last sent (``tcpi_last_data_recv`` / ``_sent`` of
``TCP_INFO``: milliseconds, counted in jiffies, so 1-10 ms resolution depending on the
kernel's HZ; 4 ms on the reference machine). Read right after bytes were read from the
socket, the first dates the latest segment read so far; read as a response ends, with
nothing left unsent (``tcpi_notsent_bytes``), the second dates its last byte leaving. One
``getsockopt``, 3-5 microseconds measured.
"""

from __future__ import annotations

import socket
import struct
from typing import Any, NamedTuple

_TCP_INFO = getattr(socket, "TCP_INFO", None)
_LAST_DATA_SENT_OFFSET = 44
_LAST_DATA_RECV_OFFSET = 52
_NOTSENT_BYTES_OFFSET = 144
"""Fields of ``struct tcp_info``: 8 one-byte fields, then u32s (rto, ato, snd_mss, rcv_mss,
unacked, sacked, lost, retrans, fackets, last_data_sent, last_ack_sent, last_data_recv, ...);
``tcpi_notsent_bytes`` since Linux 4.6 (older kernels return a shorter struct: unknown)."""
_TIMES = struct.Struct("=I4xI")
"""``tcpi_last_data_sent``, (``tcpi_last_ack_sent``,) ``tcpi_last_data_recv``, from offset 44."""
_NOTSENT = struct.Struct("=I")
_INFO_BYTES = 160
_MAX_AGE_MS = 60_000
"""An older "last receive" is not this request's (a clock or kernel oddity): not used."""


class TcpTimes(NamedTuple):
    """A TCP socket's latest traffic, as its kernel dates it."""

    sent_ns: int
    """When the kernel last sent data on the socket (wall clock, ns)."""
    received_ns: int
    """When it last received data."""
    unsent_bytes: int | None
    """Bytes written but not yet sent (None: the kernel does not say)."""


class _Probe:
    """A transport's socket descriptor, read with ``getsockopt`` only.

    uvloop's transport socket builds a Python-level ``socket.socket`` for every ``getsockopt``
    and detaches it again (3-4 us, twice per proxied request); this keeps one C-level socket
    object on the descriptor for the connection's life. It never closes the descriptor (the
    transport owns it): it is detached as soon as this object goes away."""

    __slots__ = ("_sock",)

    def __init__(self, family: int, kind: int, proto: int, fd: int) -> None:
        self._sock = socket.SocketType(family, kind, proto, fd)

    def getsockopt(self, level: int, option: int, buflen: int) -> bytes:
        return self._sock.getsockopt(level, option, buflen)  # type: ignore[no-any-return]

    def __del__(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.detach()


def socket_of(transport: Any) -> Any:
    """Something to read the transport's TCP socket options with: a :class:`_Probe` for a
    TCP transport, the transport's own socket object for others, None for transports that
    have none (test doubles)."""
    get = getattr(transport, "get_extra_info", None)
    sock = get("socket") if get is not None else None
    if sock is None or _TCP_INFO is None:
        return sock
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return sock
        return _Probe(sock.family, sock.type, sock.proto, sock.fileno())
    except Exception:  # noqa: BLE001 - an odd socket object: read it the slow way
        return sock


def tcp_times_ns(sock: Any, now_ns: int) -> TcpTimes | None:
    """The kernel's last send and receive times on ``sock``, or None where the platform, the
    socket type or the call does not say. ``now_ns``: the caller's clock now. Never raises:
    it runs on every request the proxy relays."""
    if _TCP_INFO is None or sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_BYTES)
        if not isinstance(info, bytes) or len(info) < _LAST_DATA_RECV_OFFSET + 4:
            return None
        sent_ms, received_ms = _TIMES.unpack_from(info, _LAST_DATA_SENT_OFFSET)
        unsent = None
        if len(info) >= _NOTSENT_BYTES_OFFSET + 4:
            (unsent,) = _NOTSENT.unpack_from(info, _NOTSENT_BYTES_OFFSET)
    except Exception:  # noqa: BLE001 - instrumentation: an odd socket object must not cost the request
        return None
    return TcpTimes(now_ns - sent_ms * 1_000_000, now_ns - received_ms * 1_000_000, unsent)


def received_ns(sock: Any, now_ns: int) -> int | None:
    """When the kernel last received data on ``sock`` (see :func:`tcp_times_ns`); None also
    when that was over a minute ago (not this request's bytes: a clock or kernel oddity)."""
    times = tcp_times_ns(sock, now_ns)
    if times is None or now_ns - times.received_ns > _MAX_AGE_MS * 1_000_000:
        return None
    return times.received_ns


def all_sent_ns(sock: Any, now_ns: int) -> int | None:
    """When the last byte written to ``sock`` left, if the kernel has sent everything written
    to it (None otherwise, or where it does not say)."""
    times = tcp_times_ns(sock, now_ns)
    if times is None or times.unsent_bytes != 0:
        return None
    return times.sent_ns
