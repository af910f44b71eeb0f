"""The sidecar process: proxy, OTLP receiver, store, query API and /metrics, wired together.

Two listeners, each on its own thread and event loop, so telemetry work (decoding a
large OTLP export, answering a query) never delays a proxied byte:

- the proxy (default 127.0.0.1:8800), in front of the fleet's router;
- the admin listener (default 127.0.0.1:8801): ``/v1/traces`` (OTLP/HTTP), ``/metrics``,
  ``/api/v1/...`` (query API).

Both bind to localhost unless told otherwise; with ``OTELKV_TOKEN`` set, the OTLP
receiver and the query API require it as a bearer token.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from otelkv import __version__, names
from otelkv.sidecar.api import QueryApi, token_guard
from otelkv.sidecar.conversations import ConversationTracker
from otelkv.sidecar.metrics import SidecarMetrics
from otelkv.sidecar.pipeline import PipelineSpanProcessor, SpanPipeline
from otelkv.sidecar.proxy import Proxy, ProxyConfig
from otelkv.sidecar.receiver import MAX_OTLP_BODY_BYTES, OtlpReceiver
from otelkv.sidecar.tool_spans import ToolSpanIndex

logger = logging.getLogger("otelkv.sidecar")


def default_store_path() -> Path:
    return Path(os.environ.get("OTELKV_STORE", Path.home() / ".local" / "share" / "otelkv" / "store"))


@dataclass(frozen=True)
class SidecarConfig:
    upstream: str
    host: str = "127.0.0.1"
    port: int = 8800
    admin_host: str = "127.0.0.1"
    admin_port: int = 8801
    store_path: Path | None = field(default_factory=default_store_path)
    clickhouse_url: str | None = None
    store: bool = True
    """False: no store at all (metrics and proxying only)."""
    retention_days: int = 7
    inject_session_header: bool = True
    inject_body_conversation_id: bool = False
    token: str | None = field(default_factory=lambda: os.environ.get(names.ENV_SIDECAR_TOKEN) or None)
    service_name: str = "otelkv-sidecar"
    max_body_bytes: int = 32 * 1024 * 1024


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (vLLM brings it): it roughly halves the proxy's per-request CPU."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _LoopThread:
    """An asyncio loop on a daemon thread, serving one aiohttp app."""

    def __init__(self, name: str) -> None:
        self.loop = _new_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self.thread.start()

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def serve(self, app: web.Application, host: str, port: int) -> int:
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, reuse_address=True)
        await site.start()
        server = site._server  # the bound port, when 0 was asked for
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        return self.port

    def stop(self) -> None:
        if self.runner is not None:
            try:
                self.call(self.runner.cleanup(), timeout=10)
            except Exception:
                logger.exception("otelkv sidecar: error while stopping a listener")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()  # else its self-pipe sockets leak (ResourceWarning at GC)


class Sidecar:
    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.metrics = SidecarMetrics()
        self.tools = ToolSpanIndex()
        self.tracker = ConversationTracker()
        self.store: Any = None
        self.writer: Any = None
        self.source: Any = None
        self.pipeline = SpanPipeline(self.metrics, self.tools, None)
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name, "service.version": __version__})
        )
        self.provider.add_span_processor(PipelineSpanProcessor(self.pipeline))
        _maybe_forward(self.provider)
        self.tracer = self.provider.get_tracer(names.SCOPE_SIDECAR, __version__)
        self.proxy = Proxy(
            ProxyConfig(
                config.upstream,
                inject_session_header=config.inject_session_header,
                inject_body_conversation_id=config.inject_body_conversation_id,
                max_body_bytes=config.max_body_bytes,
            ),
            tracer=self.tracer,
            metrics=self.metrics,
            tracker=self.tracker,
            tools=self.tools,
        )
        self.receiver = OtlpReceiver(self.pipeline, self.metrics)
        self._proxy_loop: _LoopThread | None = None
        self._admin_loop: _LoopThread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Sidecar:
        try:
            self._open_store()
            self._proxy_loop = _LoopThread("otelkv-sidecar-proxy")
            self._proxy_loop.start()
            self._proxy_loop.call(self._start_proxy())
            self._admin_loop = _LoopThread("otelkv-sidecar-admin")
            self._admin_loop.start()
            self._admin_loop.call(
                self._admin_loop.serve(self._admin_app(), self.config.admin_host, self.config.admin_port)
            )
        except BaseException:
            self.stop()
            raise
        logger.info(
            "otelkv sidecar: proxy %s -> %s, OTLP/API/metrics on %s, store: %s",
            self.url,
            self.config.upstream,
            self.admin_url,
            self.describe_store(),
        )
        return self

    async def _start_proxy(self) -> None:
        assert self._proxy_loop is not None
        await self.proxy.start()
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self.proxy.handle)
        await self._proxy_loop.serve(app, self.config.host, self.config.port)

    def _admin_app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_OTLP_BODY_BYTES, middlewares=[token_guard(self.config.token)]
        )
        app.router.add_post("/v1/traces", self.receiver.handle)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_routes(QueryApi(self.source, self.describe_store()).routes())
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.writer is not None:
            self.metrics.store_queue.set(self.writer.stats().get("queued", 0))
        return web.Response(body=self.metrics.exposition(), content_type="text/plain", charset="utf-8")

    def _open_store(self) -> None:
        cfg = self.config
        if not cfg.store:
            return
        from otelkv.analysis.report import StoreSource
        from otelkv.store import open_store
        from otelkv.store.writer import BatchWriter

        if cfg.clickhouse_url:
            self.store = open_store(clickhouse_url=cfg.clickhouse_url, retention_days=cfg.retention_days)
        else:
            assert cfg.store_path is not None
            cfg.store_path.mkdir(parents=True, exist_ok=True)
            self.store = open_store(path=cfg.store_path, retention_days=cfg.retention_days)
        self.writer = BatchWriter(self.store, on_drop=self._on_drop)
        self.pipeline.writer = self.writer
        self.source = StoreSource(self.store)

    def _on_drop(self, reason: str, count: int) -> None:
        if reason != "queue_full":  # queue-full drops are counted where they happen
            self.metrics.dropped.labels(reason).inc(count)

    def describe_store(self) -> str:
        if self.store is None:
            return "none"
        describe = getattr(self.store, "describe", None)
        return describe() if callable(describe) else type(self.store).__name__

    def stop(self) -> None:
        if self._proxy_loop is not None:
            try:
                self._proxy_loop.call(self.proxy.close(), timeout=10)
            except Exception:
                logger.exception("otelkv sidecar: error while closing the upstream session")
            self._proxy_loop.stop()
            self._proxy_loop = None
        if self._admin_loop is not None:
            self._admin_loop.stop()
            self._admin_loop = None
        try:
            self.provider.shutdown()
        except Exception:
            logger.exception("otelkv sidecar: error while shutting the tracer down")
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def __enter__(self) -> Sidecar:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ addresses

    @property
    def url(self) -> str:
        port = self._proxy_loop.port if self._proxy_loop else self.config.port
        return f"http://{self.config.host}:{port}"

    @property
    def admin_url(self) -> str:
        port = self._admin_loop.port if self._admin_loop else self.config.admin_port
        return f"http://{self.config.admin_host}:{port}"

    @property
    def otlp_endpoint(self) -> str:
        return f"{self.admin_url}/v1/traces"

    def flush(self, timeout: float = 10.0) -> None:
        """Write everything received so far to the store (tests, demo, shutdown)."""
        if self.writer is not None:
            self.writer.flush(timeout)


def _maybe_forward(provider: TracerProvider) -> None:
    """Also send the sidecar's turn spans to a collector when OTEL_EXPORTER_OTLP_* says so."""
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    ):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
