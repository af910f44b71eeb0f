"""The sidecar's proxy process: relay + turn watching, nothing else.

Why a process of its own: the main sidecar process builds spans, keeps metrics, decodes
OTLP exports and writes the store, and chDB and pyarrow hold the GIL for 8-19 ms per
batch. In one process that showed up directly as the proxy's p99 added latency. Here the
request path shares its interpreter with nothing heavier than the turn bookkeeping, and
finished turns leave through a socketpair in batches (every 5 ms at most). If the main
process falls behind, turns are dropped (counted), never queued without bound.

Started by :class:`otelkv.sidecar.proxy_process.ProxyProcess`; exits when its channel
closes (the main process ended, however it ended).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import socket
import sys
from typing import Any

from otelkv.sidecar import channel
from otelkv.sidecar.identity import MAX_ID_CHARS, IdPolicy
from otelkv.sidecar.relay import Relay
from otelkv.sidecar.turn_watch import TurnRecord, TurnWatcher

logger = logging.getLogger("otelkv.sidecar")

MAX_CHANNEL_BACKLOG_BYTES = 16 * 1024 * 1024
"""Unsent turn bytes beyond which new turns are dropped (the main process is stuck)."""
FLUSH_INTERVAL_S = 0.005
FLUSH_RECORDS = 256
"""Turns leave in batches, at most this late or this many at once: every write on the channel
is a system call in the proxy and a wake-up of the main process's reader."""


class _Channel(asyncio.Protocol):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.transport: asyncio.Transport | None = None
        self.decoder = channel.Decoder()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for message in self.decoder.feed(data):
            self.worker.command(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.worker.stop()


class Worker:
    def __init__(self, args: argparse.Namespace, sock: socket.socket) -> None:
        self.args = args
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.pending: list[TurnRecord] = []
        self.counters: dict[str, int] = {}
        self._sent_counters: dict[str, int] = {}
        self._flush_scheduled = False
        self.stopped = asyncio.Event()
        self.channel: _Channel | None = None
        self.watcher = TurnWatcher(
            self.emit,
            inject_session_header=args.inject_session_header,
            inject_body_conversation_id=args.inject_body_conversation_id,
            inject_body_context=args.inject_body_context,
            id_policy=IdPolicy(args.conversation_id_max_chars, args.hash_conversation_ids),
            count=self.count,
            defer=self.loop.call_soon,
        )
        self.relay: Relay | None = None

    async def run(self) -> int:
        _, self.channel = await self.loop.create_unix_connection(lambda: _Channel(self), sock=self.sock)
        try:
            self.relay = Relay(
                self.args.upstream,
                observer=self.watcher,
                max_body_bytes=self.args.max_body_bytes,
                counters=self.counters,
                on_count=self._schedule_flush,
            )
        except ValueError as exc:
            return await self._fail(str(exc))
        try:
            port = await self.relay.start(self.args.host, self.args.port)
        except OSError as exc:
            where = f"{self.args.host}:{self.args.port}"
            return await self._fail(f"cannot listen on {where}: {exc.strerror or exc}")
        self.send(("ready", port))
        # Everything alive now lives for the whole process: keep the collector off it, and
        # collect young objects rarely (turn records hold no cycles).
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        await self.stopped.wait()
        self.relay.close()
        self._flush()
        return 0

    async def _fail(self, message: str) -> int:
        self.send(("error", message))
        await asyncio.sleep(0.05)  # let the message leave before the process does
        return 2

    def emit(self, record: TurnRecord) -> None:
        self.pending.append(record)
        if len(self.pending) >= FLUSH_RECORDS:
            self._flush()
        else:
            self._schedule_flush()

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter the main process turns into a metric (sent with the next batch)."""
        self.counters[name] = self.counters.get(name, 0) + n
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_later(FLUSH_INTERVAL_S, self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        records, self.pending = self.pending, []
        changed = {k: v - self._sent_counters.get(k, 0) for k, v in self.counters.items()}
        changed = {k: v for k, v in changed.items() if v}
        if not records and not changed:
            return
        transport = self.channel.transport if self.channel else None
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size() > MAX_CHANNEL_BACKLOG_BYTES:
            self.counters["turns_dropped"] = self.counters.get("turns_dropped", 0) + len(records)
            return
        self._sent_counters.update({k: self._sent_counters.get(k, 0) + v for k, v in changed.items()})
        transport.write(channel.encode(("turns", records, changed)))

    def send(self, message: tuple[Any, ...]) -> None:
        if self.channel is not None and self.channel.transport is not None:
            self.channel.transport.write(channel.encode(message))

    def command(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "sync":
            self._flush()
            self.send(("ack", message[1]))
        elif kind == "stop":
            self.stop()

    def stop(self) -> None:
        self.stopped.set()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m otelkv.sidecar.proxy_worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8800)
    parser.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024)
    parser.add_argument("--inject-session-header", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--inject-body-conversation-id", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--inject-body-context", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--conversation-id-max-chars", type=int, default=MAX_ID_CHARS)
    parser.add_argument("--hash-conversation-ids", action=argparse.BooleanOptionalAction, default=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s proxy: %(message)s")
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(False)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run

    async def go() -> int:
        return await Worker(args, sock).run()

    try:
        return int(runner(go()))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
