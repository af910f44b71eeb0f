"""Length-prefixed ``marshal`` messages between the sidecar's two processes (pure logic).

A local socketpair, both ends ours and the same interpreter (``marshal``'s format is only
stable within one Python version, which is all this needs). Messages are tuples whose first
item names them:

- proxy -> main: ``("ready", port)``, ``("error", text)``, ``("turns", [TurnRecord], counters)``,
  ``("ack", n)``;
- main -> proxy: ``("sync", n)`` (answer ``ack`` once every earlier turn is sent), ``("stop",)``.

Why ``marshal`` of plain tuples rather than ``pickle`` of the record objects: every turn crosses
here. Pickling a turn record (eight nested dataclasses) cost 79k instructions in the proxy
process and unpickling it 96k in the main one (valgrind, a batch of 256); as plain tuples
(:meth:`TurnRecord.to_wire <otelkv.sidecar.turn_watch.TurnRecord.to_wire>`) it is 25k and 40k,
about 3 and 7 us on the reference machine.
``encode`` turns the records of a ``turns`` message into tuples and :class:`Decoder` turns them
back, so both ends deal in :class:`~otelkv.sidecar.turn_watch.TurnRecord`.
"""

from __future__ import annotations

import marshal
import struct
from typing import Any

from otelkv.sidecar.turn_watch import TurnRecord

_HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
TURNS = "turns"


def encode(message: tuple[Any, ...]) -> bytes:
    if message[0] == TURNS:
        _, records, counters = message
        message = (TURNS, [record.to_wire() for record in records], counters)
    payload = marshal.dumps(message)
    return _HEADER.pack(len(payload)) + payload


class Decoder:
    """Feed bytes as they arrive; get whole messages back."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[Any, ...]]:
        if self._buffer:
            self._buffer += data
            buffer: bytes | bytearray = self._buffer
        else:  # the usual case, whole messages in one read: no copy into the buffer
            buffer = data
        out = []
        start, end = 0, len(buffer)
        view = memoryview(buffer)
        try:
            while end - start >= _HEADER.size:
                (size,) = _HEADER.unpack_from(buffer, start)
                if size > MAX_MESSAGE_BYTES:
                    raise ValueError(f"sidecar channel: message of {size} bytes")
                stop = start + _HEADER.size + size
                if stop > end:
                    break
                message = marshal.loads(view[start + _HEADER.size : stop])
                if message[0] == TURNS:
                    _, wire, counters = message
                    message = (TURNS, [TurnRecord.from_wire(w) for w in wire], counters)
                out.append(message)
                start = stop
        finally:
            view.release()
        if buffer is self._buffer:
            del self._buffer[:start]
        else:
            self._buffer = bytearray(data[start:])
        return out
