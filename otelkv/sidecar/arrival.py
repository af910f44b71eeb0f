"""When the kernel received a request's bytes: the earliest arrival a user-space proxy can know.

A proxy that stamps a request when its event loop gets to it books every millisecond the
request waited in the socket (the proxy descheduled on a busy host, its loop busy with
another response) as time before the turn: measured on a 2-core fleet, 0.21 s that the
phase split then counted as the agent's own work. Linux keeps, per TCP socket, the time
since data was last received (``tcpi_last_data_recv`` of ``TCP_INFO``, in jiffies: 1-4 ms
resolution). Read right after the bytes were read from the socket, it dates the segment
that completed them. One ``getsockopt``, about a microsecond.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

_TCP_INFO = getattr(socket, "TCP_INFO", None)
_LAST_DATA_SENT_OFFSET = 44
_LAST_DATA_RECV_OFFSET = 52
"""``tcpi_last_data_sent`` / ``tcpi_last_data_recv`` in ``struct tcp_info``: 8 one-byte
fields, then u32s (rto, ato, snd_mss, rcv_mss, unacked, sacked, lost, retrans, fackets,
last_data_sent, last_ack_sent, last_data_recv), stable since Linux 2.6."""
_MAX_AGE_MS = 60_000
"""An older "last receive" is not this request's (a clock or kernel oddity): not used."""


def socket_of(transport: Any) -> Any:
    """The transport's socket (None for transports that have none, as test doubles)."""
    get = getattr(transport, "get_extra_info", None)
    return get("socket") if get is not None else None


def tcp_times_ns(sock: Any, now_ns: int) -> tuple[int, int] | None:
    """When the kernel last sent and last received data on ``sock`` (wall clock, ns), or
    None where the platform, the socket type or the call does not say. ``now_ns``: the
    caller's clock now."""
    if _TCP_INFO is None or sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 104)
    except (OSError, AttributeError, ValueError, TypeError):
        return None
    if not isinstance(info, bytes) or len(info) < _LAST_DATA_RECV_OFFSET + 4:
        return None
    (sent_ms,) = struct.unpack_from("I", info, _LAST_DATA_SENT_OFFSET)
    (received_ms,) = struct.unpack_from("I", info, _LAST_DATA_RECV_OFFSET)
    return now_ns - sent_ms * 1_000_000, now_ns - received_ms * 1_000_000


def received_ns(sock: Any, now_ns: int) -> int | None:
    """When the kernel last received data on ``sock`` (see :func:`tcp_times_ns`); None also
    when that was over a minute ago (not this request's bytes: a clock or kernel oddity)."""
    times = tcp_times_ns(sock, now_ns)
    if times is None or now_ns - times[1] > _MAX_AGE_MS * 1_000_000:
        return None
    return times[1]
