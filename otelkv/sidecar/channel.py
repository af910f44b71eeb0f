"""Length-prefixed pickled messages between the sidecar's two processes (pure logic).

A local socketpair, both ends ours: pickle is safe here because nothing else can write to
it. Messages are tuples whose first item names them:

- proxy -> main: ``("ready", port)``, ``("error", text)``, ``("turns", [TurnRecord], counters)``,
  ``("ack", n)``;
- main -> proxy: ``("sync", n)`` (answer ``ack`` once every earlier turn is sent), ``("stop",)``.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

_HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def encode(message: tuple[Any, ...]) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class Decoder:
    """Feed bytes as they arrive; get whole messages back."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[Any, ...]]:
        self._buffer += data
        out = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > MAX_MESSAGE_BYTES:
                raise ValueError(f"sidecar channel: message of {size} bytes")
            end = _HEADER.size + size
            if len(self._buffer) < end:
                break
            out.append(pickle.loads(bytes(self._buffer[_HEADER.size : end])))
            del self._buffer[:end]
        return out
