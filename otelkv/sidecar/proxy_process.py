"""The main process's handle on the proxy process: start it, take its turns, stop it.

A reader thread receives finished turns from the proxy process and hands them to a
callback (the :class:`~otelkv.sidecar.recorder.TurnRecorder`); :meth:`sync` waits until
every turn the proxy finished before the call has been handed over, which is what
``Sidecar.flush`` needs to make "the response arrived" imply "the turn is recorded".
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from otelkv.sidecar import channel
from otelkv.sidecar.identity import DEFAULT_POLICY, IdPolicy

logger = logging.getLogger("otelkv.sidecar")

START_TIMEOUT_S = 30.0


class ProxyStartError(RuntimeError):
    """The proxy process could not start (message says why, e.g. the port is taken)."""


class ProxyProcess:
    def __init__(
        self,
        *,
        upstream: str,
        host: str,
        port: int,
        on_turns: Callable[[list[Any]], None],
        on_counters: Callable[[dict[str, int]], None],
        max_body_bytes: int = 32 * 1024 * 1024,
        inject_session_header: bool = True,
        inject_body_conversation_id: bool = False,
        inject_body_context: bool = True,
        id_policy: IdPolicy = DEFAULT_POLICY,
    ) -> None:
        self.on_turns = on_turns
        self.on_counters = on_counters
        self.port = 0
        self._args = [
            *("--upstream", upstream, "--host", host, "--port", str(port)),
            *("--max-body-bytes", str(max_body_bytes)),
            "--inject-session-header" if inject_session_header else "--no-inject-session-header",
            "--inject-body-conversation-id"
            if inject_body_conversation_id
            else "--no-inject-body-conversation-id",
            "--inject-body-context" if inject_body_context else "--no-inject-body-context",
            *("--conversation-id-max-chars", str(id_policy.max_chars)),
            "--hash-conversation-ids" if id_policy.hash_all else "--no-hash-conversation-ids",
        ]
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.exited = threading.Event()
        """Set once the proxy process is gone (its channel closed), however it ended."""
        self._error: str | None = None
        self._acks: dict[int, threading.Event] = {}
        self._next_sync = 0
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> int:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    *("-m", "otelkv.sidecar.proxy_worker", "--fd", str(theirs.fileno())),
                    *self._args,
                ],
                pass_fds=(theirs.fileno(),),
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
        finally:
            theirs.close()
        self._thread = threading.Thread(target=self._read, name="otelkv-proxy-channel", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            self.stop()
            raise ProxyStartError(
                f"otelkv sidecar: the proxy process did not start in {START_TIMEOUT_S:.0f} s"
            )
        if self._error is not None:
            error = self._error
            self.stop()
            raise ProxyStartError(f"otelkv sidecar: {error}")
        return self.port

    def _read(self) -> None:
        decoder = channel.Decoder()
        assert self._sock is not None
        try:
            while True:
                data = self._sock.recv(1 << 20)
                if not data:
                    break
                for message in decoder.feed(data):
                    self._dispatch(message)
        except OSError:
            pass
        except Exception:
            logger.exception("otelkv sidecar: the proxy channel failed")
        finally:
            if not self._ready.is_set():
                self._error = self._error or "the proxy process exited during start-up"
                self._ready.set()
            with self._lock:
                for event in self._acks.values():
                    event.set()
            self.exited.set()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "turns":
            _, records, counters = message
            try:
                if records:
                    self.on_turns(records)
                if counters:
                    self.on_counters(counters)
            except Exception:  # a bad record must not stop the channel
                logger.exception("otelkv sidecar: could not record turns")
        elif kind == "ack":
            with self._lock:
                event = self._acks.pop(message[1], None)
            if event is not None:
                event.set()
        elif kind == "ready":
            self.port = int(message[1])
            self._ready.set()
        elif kind == "error":
            self._error = str(message[1])
            self._ready.set()

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def sync(self, timeout: float = 10.0) -> bool:
        """True once every turn finished before this call has been handed to ``on_turns``."""
        if self._sock is None or self._proc is None or self._proc.poll() is not None:
            return False
        with self._lock:
            self._next_sync += 1
            n = self._next_sync
            event = self._acks[n] = threading.Event()
        try:
            self._sock.sendall(channel.encode(("sync", n)))
            return event.wait(timeout)
        except OSError:
            return False
        finally:
            with self._lock:
                self._acks.pop(n, None)  # answered, or given up on: either way not kept

    def stop(self, timeout: float = 10.0) -> None:
        if self._sock is not None:
            try:
                self._sock.sendall(channel.encode(("stop",)))
            except OSError:
                pass
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout)
            self._proc = None
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
