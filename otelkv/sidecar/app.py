"""The sidecar process: proxy, OTLP receiver, store, query API and /metrics, wired together.

Two processes, so telemetry work (building spans, decoding a large OTLP export, writing
the store, answering a query) never delays a proxied byte:

- the proxy process (default 127.0.0.1:8800), in front of the fleet's router: a lean
  relay that only identifies turns and times them (``proxy_worker.py``);
- this process: turn spans and metrics from the proxy's turn records, the admin listener
  (default 127.0.0.1:8801: ``/v1/traces`` OTLP/HTTP, ``/metrics``, ``/api/v1/...`` query
  API) on its own thread and event loop, and the store writer.

Both bind to localhost unless told otherwise; with ``OTELKV_TOKEN`` set, the OTLP
receiver and the query API require it as a bearer token.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from otelkv import __version__, names
from otelkv.sidecar.api import QueryApi, token_guard
from otelkv.sidecar.forward import CollectorForwarder
from otelkv.sidecar.identity import MAX_ID_CHARS, IdPolicy
from otelkv.sidecar.metrics import SidecarMetrics
from otelkv.sidecar.pipeline import SpanPipeline
from otelkv.sidecar.proxy_process import ProxyProcess
from otelkv.sidecar.receiver import MAX_OTLP_BODY_BYTES, OtlpReceiver
from otelkv.sidecar.recorder import TurnRecorder
from otelkv.sidecar.relay import REFUSED
from otelkv.sidecar.tool_spans import ToolSpanIndex
from otelkv.spans import SpanRecord

logger = logging.getLogger("otelkv.sidecar")

QUERY_SETTLE_S = 2.0
"""How long a query-API request waits, at most, for the proxy's finished turns and the store
writer together, before it reads the store (see :mod:`otelkv.sidecar.api`)."""


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
    store_flush_s: float = 5.0
    """Spans wait at most this long in the store writer's queue (sooner once 5000 are queued;
    ``flush()`` writes at once). The query API flushes before it reads, so its answers are
    not this late; a ClickHouse server read directly (Grafana) sees a span up to this late,
    and a killed main process loses up to this much. An insert into the embedded store
    costs 35-60 ms of CPU up to a few hundred spans, merges included, and 15-20 us a span
    more beyond that (``bench/store_insert_cost.py``), so below a few thousand spans a
    second this interval sets what the store costs: at 20 turns a second, an insert every
    5 s is about 1.3 % of a core, every 2 s about 3 % (each API query with spans waiting
    adds an insert)."""
    inject_session_header: bool = True
    inject_body_conversation_id: bool = False
    inject_body_context: bool = True
    """Write the turn's traceparent and conversation id into completion bodies' ``vllm_xargs``
    (for routers that copy the body but drop headers; vLLM hands them to the engines)."""
    conversation_id_max_chars: int = MAX_ID_CHARS
    """Client conversation ids longer than this are replaced by ``h-`` + a hash of them."""
    hash_conversation_ids: bool = False
    """Replace every client conversation id by its hash (none kept in clear; docs/security.md)."""
    token: str | None = field(default_factory=lambda: os.environ.get(names.ENV_SIDECAR_TOKEN) or None)
    service_name: str = "otelkv-sidecar"
    max_body_bytes: int = 32 * 1024 * 1024
    engine_urls: tuple[str, ...] = ()
    """Engines whose ``/metrics`` ``otelkv doctor`` reads (their HTTP base URLs)."""
    router_handle_ttl_s: float | None = None
    """The router's handle TTL, for ``otelkv doctor`` when the router does not say."""


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
        # No auto_decompress: aiohttp would inflate gzip bodies itself, without the OTLP
        # decoder's zip-bomb limit, answer a bad gzip with a 500, and hand the decoder an
        # inflated body it then tried to inflate again (every gzip export refused).
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False)
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
        policy = IdPolicy(config.conversation_id_max_chars, config.hash_conversation_ids)
        self.tools = ToolSpanIndex(id_policy=policy)
        self.store: Any = None
        self.writer: Any = None
        self.source: Any = None
        self.pipeline = SpanPipeline(self.metrics, self.tools, None)
        self.forwarder = CollectorForwarder.from_env(on_drop=self._on_forward_drop)
        self.recorder = TurnRecorder(
            metrics=self.metrics,
            tools=self.tools,
            resource={"service.name": config.service_name, "service.version": __version__},
            accept=self._accept_turns,
        )
        self.proxy = ProxyProcess(
            upstream=config.upstream,
            host=config.host,
            port=config.port,
            on_turns=self.recorder.record,
            on_counters=self._proxy_counters,
            max_body_bytes=config.max_body_bytes,
            inject_session_header=config.inject_session_header,
            inject_body_conversation_id=config.inject_body_conversation_id,
            inject_body_context=config.inject_body_context,
            id_policy=policy,
        )
        self.receiver = OtlpReceiver(self.pipeline, self.metrics)
        self._proxy_started = False
        self._admin_loop: _LoopThread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Sidecar:
        try:
            self._open_store()
            self.proxy.start()
            self._proxy_started = True
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

    def _accept_turns(self, spans: list[SpanRecord]) -> None:
        self.pipeline.accept(spans, "sidecar")
        if self.forwarder is not None:
            self.forwarder.forward(spans)

    def _proxy_counters(self, counters: dict[str, int]) -> None:
        if counters.get("upstream_errors"):
            self.metrics.upstream_errors.inc(counters["upstream_errors"])
        if counters.get("upstream_retries"):
            self.metrics.upstream_retries.inc(counters["upstream_retries"])
        for key, count in counters.items():
            kind, _, reason = key.partition(":")
            if kind == REFUSED and count and reason in names.REQUEST_REFUSED_REASONS:
                self.metrics.requests_refused.labels(reason).inc(count)
        if counters.get("turns_dropped"):
            self.metrics.dropped.labels(names.DROP_PROXY_CHANNEL_FULL).inc(counters["turns_dropped"])
        if counters.get("continuity_errors"):
            self.metrics.continuity_errors.inc(counters["continuity_errors"])

    def _admin_app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_OTLP_BODY_BYTES, middlewares=[token_guard(self.config.token)]
        )
        app.router.add_post("/v1/traces", self.receiver.handle)
        app.router.add_get("/metrics", self._metrics)
        api = QueryApi(
            self.source,
            self.describe_store(),
            engine_urls=self.config.engine_urls,
            router_handle_ttl_s=self.config.router_handle_ttl_s,
            settle=lambda: self.flush(QUERY_SETTLE_S),
        )
        app.router.add_routes(api.routes())
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        # Counts reflect every response already sent: fetch the proxy's finished turns first.
        if self._proxy_started:
            await asyncio.get_running_loop().run_in_executor(None, self.proxy.sync, 2.0)
        self.metrics.expire_tasks()
        if self.writer is not None:
            self.metrics.store_queue.set(self.writer.stats().get("queued", 0))
        return web.Response(body=self.metrics.exposition(), content_type="text/plain", charset="utf-8")

    def _open_store(self) -> None:
        cfg = self.config
        if not cfg.store:
            return
        from otelkv.analysis.sources import StoreSource
        from otelkv.store import open_store
        from otelkv.store.writer import BatchWriter

        if cfg.clickhouse_url:
            self.store = open_store(clickhouse_url=cfg.clickhouse_url, retention_days=cfg.retention_days)
        else:
            assert cfg.store_path is not None
            cfg.store_path.mkdir(parents=True, exist_ok=True)
            self.store = open_store(path=cfg.store_path, retention_days=cfg.retention_days)
        # The writer takes a backlog in the largest inserts the store declares.
        self.writer = BatchWriter(
            self.store,
            flush_interval_s=cfg.store_flush_s,
            on_drop=self._on_drop,
        )
        self.pipeline.writer = self.writer
        self.source = StoreSource(self.store)

    def _on_drop(self, reason: str, count: int) -> None:
        if reason != "queue_full":  # queue-full drops are counted where they happen
            self.metrics.dropped.labels(reason).inc(count)

    def _on_forward_drop(self, reason: str, count: int) -> None:
        self.metrics.forward_dropped.labels(reason).inc(count)

    def describe_store(self) -> str:
        if self.store is None:
            return "none"
        describe = getattr(self.store, "describe", None)
        return describe() if callable(describe) else type(self.store).__name__

    def stop(self) -> None:
        try:
            self.proxy.stop()  # its last turns are recorded before the store closes
        except Exception:
            logger.exception("otelkv sidecar: error while stopping the proxy process")
        self._proxy_started = False
        if self._admin_loop is not None:
            self._admin_loop.stop()
            self._admin_loop = None
        if self.forwarder is not None:
            self.forwarder.shutdown()
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
        port = self.proxy.port if self._proxy_started else self.config.port
        return f"http://{self.config.host}:{port}"

    @property
    def admin_url(self) -> str:
        port = self._admin_loop.port if self._admin_loop else self.config.admin_port
        return f"http://{self.config.admin_host}:{port}"

    @property
    def otlp_endpoint(self) -> str:
        return f"{self.admin_url}/v1/traces"

    def flush(self, timeout: float = 10.0) -> bool:
        """Write everything received so far to the store (query API, tests, demo, shutdown);
        True when it was all written within ``timeout`` seconds (one deadline for both steps).

        "Received" includes every turn whose response has been sent: the proxy process is
        asked to hand over its finished turns first.
        """
        deadline = time.monotonic() + timeout
        synced = not self._proxy_started or self.proxy.sync(timeout)
        writer = self.writer  # stop() may clear it meanwhile
        if writer is None:
            return synced
        return writer.flush(max(deadline - time.monotonic(), 0.0)) and synced
