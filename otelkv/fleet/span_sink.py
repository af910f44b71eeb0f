"""An in-memory OTLP/HTTP trace receiver for the reference fleet, its tests and the demo.

Engines (vLLM's own tracer and otelkv's) export here with
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://127.0.0.1:<port>/v1/traces``. It runs in a
thread of the calling process, keeps at most ``capacity`` spans (oldest dropped first,
drops counted) and answers exactly like an OTLP collector, so exporters never retry.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from otelkv.sidecar.otlp import OtlpDecodeError, decode_traces
from otelkv.spans import SpanRecord

MAX_BODY_BYTES = 32 * 1024 * 1024


class SpanSink:
    """Receives OTLP trace exports on 127.0.0.1 and keeps the spans in memory."""

    def __init__(self, port: int = 0, capacity: int = 200_000, host: str = "127.0.0.1") -> None:
        self._spans: deque[SpanRecord] = deque(maxlen=capacity)
        self._lock = threading.Condition()
        self.dropped = 0
        self.rejected = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                return

            def _reply(self, code: int, body: bytes, ctype: str) -> None:
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the exporter gave up waiting; its spans were already kept

            def do_POST(self) -> None:
                if self.path.rstrip("/") != "/v1/traces":
                    self._reply(404, b"only /v1/traces is served here\n", "text/plain")
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if length < 0 or length > MAX_BODY_BYTES:
                    self._reply(413, b"body too large or without Content-Length\n", "text/plain")
                    return
                body = self.rfile.read(length)
                ctype = self.headers.get("Content-Type")
                try:
                    spans = decode_traces(body, ctype, self.headers.get("Content-Encoding"))
                except OtlpDecodeError as exc:
                    sink.rejected += 1
                    self._reply(exc.status, f"{exc}\n".encode(), "text/plain")
                    return
                sink.add(spans)
                if (ctype or "").startswith("application/json"):
                    self._reply(200, b"{}", "application/json")
                else:
                    self._reply(
                        200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf"
                    )

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otelkv-span-sink", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """Full OTLP/HTTP traces URL (for ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)."""
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def start(self) -> SpanSink:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits forever on a server never started
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> SpanSink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, spans: Iterable[SpanRecord]) -> None:
        with self._lock:
            for span in spans:
                if len(self._spans) == self._spans.maxlen:
                    self.dropped += 1
                self._spans.append(span)
            self._lock.notify_all()

    def spans(self, predicate: Callable[[SpanRecord], bool] | None = None) -> list[SpanRecord]:
        with self._lock:
            items = list(self._spans)
        return [s for s in items if predicate is None or predicate(s)]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(
        self, predicate: Callable[[list[SpanRecord]], bool], timeout: float = 30.0, poll: float = 0.2
    ) -> list[SpanRecord]:
        """Block until ``predicate(all spans)`` holds; return the spans (or raise TimeoutError)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() >= deadline:
                raise TimeoutError(f"spans did not arrive within {timeout:.0f}s ({len(spans)} received)")
            with self._lock:
                self._lock.wait(poll)
