"""The reference fleet: a real 1P1D vLLM pair, the router, an OTLP span sink and a driver.

    with Fleet(FleetConfig(decoder_ttl_s=12)) as fleet:
        results = fleet.driver().run_sync([conversation])
        spans = fleet.sink.spans()

Everything it starts (two engine process groups, the router thread, the span sink) is
stopped on exit, also when start-up fails half-way.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import trace

from otelkv import __version__, names
from otelkv.fleet.agent import AgentDriver
from otelkv.fleet.engines import Engine, EngineSpec, free_port
from otelkv.fleet.model import build_tiny_llama
from otelkv.fleet.router import PDRouter
from otelkv.fleet.span_sink import SpanSink

logger = logging.getLogger("otelkv.fleet")

WARMUP_CONVERSATION = names.FLEET_WARMUP_CONVERSATION

DEFAULT_MODEL_DIR = Path(os.environ.get("OTELKV_MODEL_DIR", Path.home() / ".cache" / "otelkv" / "tiny-llama"))


@dataclass(frozen=True)
class FleetConfig:
    """Knobs of the reference fleet (engine settings apply to both nodes unless split)."""

    instrumented: bool = True
    """otelkv's NixlConnector (True) or vLLM's plain one (False)."""
    bidirectional: bool = True
    bidirectional_prefill: bool | None = None
    """Override ``bidirectional`` on the prefill node only (to test a one-sided setup)."""
    bidirectional_decode: bool | None = None
    decoder_ttl_s: float = 480.0
    recompute_threshold: int = 64
    load_failure_policy: str = "fail"
    prefix_caching_prefill: bool = True
    router_handle_ttl_s: float | None = -1.0
    """Router's handle lifetime; -1 means the safe default (decode TTL minus 6 s: the
    prefill node declines reads within 5 s of the deadline). None: never expire, like a
    router whose TTL is longer than the decode node's."""
    stream_decode: bool = False
    stuck_after_s: float = 60.0
    continuity: str = names.CONTINUITY_MODE_OBSERVE
    """``otelkv_continuity`` on both engines: ``guard`` refuses a handle whose KV belongs to
    other tokens than the prompt's."""
    max_model_len: int = 2048
    max_num_seqs_decode: int = 16
    """Requests the decode node runs at once; the rest wait (``vllm:num_requests_waiting``)."""
    as_vllm_starts: bool = False
    """Start the engines exactly as vLLM does: NIXL's progress thread polling a core per
    worker, both engines' KV threads on the host's last core. The default quiets both
    (:mod:`otelkv.fleet.engine_hooks`): on 2 cores they starve everything else."""
    model_dir: Path = DEFAULT_MODEL_DIR
    workdir: Path | None = None
    collect_spans: bool = True
    trace_router: bool = True
    engine_env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 420.0
    router_port: int = 0
    sidecar: bool = False
    """Put otelkv's sidecar in front of the router: the driver talks to it, engines and the
    router export their spans to it, and it keeps them in its store (``sidecar_store``)."""
    sidecar_store: Path | None = None
    """The sidecar's chDB directory (default: ``store`` in the fleet's workdir)."""
    vllm_tracing: bool = True
    """Start the engines with ``--otlp-traces-endpoint`` (vLLM then keeps an incoming
    ``traceparent``). False: vLLM's tracing off, as on most fleets; otelkv's spans still
    go to the same endpoint (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)."""
    router_factory: Callable[[str, str], Any] | None = None
    """A router other than the reference one: called with the prefill and decode URLs, it
    returns an object with ``start(port)`` (returning itself), ``stop()`` and ``url``."""
    warmup: bool = True
    """Run one short conversation before handing the fleet over, so the NIXL handshakes
    (prefill->decode and decode->prefill) happen while the machine is quiet: vLLM gives a
    handshake reply 5 s, which a loaded 2-core machine can miss (the request then fails)."""

    def effective_router_ttl(self) -> float | None:
        if self.router_handle_ttl_s is None:
            return None
        if self.router_handle_ttl_s >= 0:
            return self.router_handle_ttl_s
        return max(self.decoder_ttl_s - 6.0, 1.0)


class Fleet:
    """Starts and owns every process and thread of the reference fleet."""

    def __init__(self, config: FleetConfig | None = None) -> None:
        self.config = config or FleetConfig()
        self.workdir = Path(self.config.workdir or tempfile.mkdtemp(prefix="otelkv-fleet-"))
        self.sink: SpanSink | None = None
        self.prefill: Engine | None = None
        self.decode: Engine | None = None
        self.router: Any = None
        self.sidecar: Any = None
        self._provider: Any = None
        self.tracer: trace.Tracer | None = None
        self.warmup_turns: list[Any] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Fleet:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        cfg = self.config
        model_dir = build_tiny_llama(cfg.model_dir)
        router_port = cfg.router_port or free_port()
        if cfg.sidecar:
            self._start_sidecar(router_port)
        if cfg.collect_spans:
            self.sink = SpanSink()
            if self.sidecar is not None:
                # Spans reach the sidecar; the sink keeps an in-memory copy for tests.
                self.sidecar.pipeline.taps.append(self.sink.add)
            else:
                self.sink.start()
        endpoint = self.sidecar.otlp_endpoint if self.sidecar else (self.sink.endpoint if self.sink else None)
        if endpoint:
            self._provider, self.tracer = _fleet_tracer(endpoint)
        common = {
            "model_dir": model_dir,
            "instrumented": cfg.instrumented,
            "decoder_ttl_s": cfg.decoder_ttl_s,
            "recompute_threshold": cfg.recompute_threshold,
            "load_failure_policy": cfg.load_failure_policy,
            "max_model_len": cfg.max_model_len,
            "otlp_traces_endpoint": endpoint if cfg.vllm_tracing else None,
            "otelkv_extra": (
                {names.CONFIG_STUCK_AFTER_SECONDS: cfg.stuck_after_s, names.CONFIG_CONTINUITY: cfg.continuity}
                if cfg.instrumented
                else {}
            ),
            "env": {
                **(
                    {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}
                    if endpoint and not cfg.vllm_tracing
                    else {}
                ),
                **cfg.engine_env,
            },
            "nixl_progress_thread": cfg.as_vllm_starts,
            "own_kv_core": not cfg.as_vllm_starts,
        }
        bidir_p = cfg.bidirectional if cfg.bidirectional_prefill is None else cfg.bidirectional_prefill
        bidir_d = cfg.bidirectional if cfg.bidirectional_decode is None else cfg.bidirectional_decode
        cores = os.cpu_count() or 1
        self.prefill = Engine(
            EngineSpec(
                role=names.ROLE_PREFILL,
                engine_id="prefill-0",
                bidirectional=bidir_p,
                prefix_caching=cfg.prefix_caching_prefill,
                cpu_core=0,
                **common,
            ),
            self.workdir / "prefill.log",
        )
        self.decode = Engine(
            EngineSpec(
                role=names.ROLE_DECODE,
                engine_id="decode-0",
                bidirectional=bidir_d,
                max_num_seqs=cfg.max_num_seqs_decode,
                cpu_core=1 % cores,
                **common,
            ),
            self.workdir / "decode.log",
        )
        started = time.monotonic()
        self.prefill.start()
        self.decode.start()
        with ThreadPoolExecutor(2) as pool:
            for future in [
                pool.submit(e.wait_ready, cfg.start_timeout_s) for e in (self.prefill, self.decode)
            ]:
                future.result()
        logger.info("fleet engines ready in %.0fs (logs in %s)", time.monotonic() - started, self.workdir)
        if cfg.router_factory is not None:
            self.router = cfg.router_factory(self.prefill.url, self.decode.url).start(router_port)
        else:
            self.router = PDRouter(
                self.prefill.url,
                self.decode.url,
                handle_ttl_s=cfg.effective_router_ttl(),
                stream_decode=cfg.stream_decode,
                tracer=self.tracer if cfg.trace_router else None,
            ).start(router_port)
        if cfg.warmup:
            self._warm_up()

    def _start_sidecar(self, router_port: int) -> None:
        from otelkv.sidecar.app import Sidecar, SidecarConfig

        self.sidecar = Sidecar(
            SidecarConfig(
                upstream=f"http://127.0.0.1:{router_port}",
                port=0,
                admin_port=0,
                store_path=self.config.sidecar_store or self.workdir / "store",
            )
        ).start()

    def _warm_up(self) -> None:
        from otelkv.fleet.agent import Conversation, Turn

        conversation = Conversation(
            WARMUP_CONVERSATION,
            [Turn("warm up the engines please", 40), Turn("and read back the blocks", 8, pause_s=0.2)],
        )
        (self.warmup_turns,) = self.driver().run_sync([conversation])
        failed = [t for t in self.warmup_turns if not t.ok]
        if failed:
            logger.warning("fleet warm-up turn failed (%s); continuing", failed[0].error)

    def stop(self) -> None:
        for closer in (
            self.router.stop if self.router else None,
            self.prefill.stop if self.prefill else None,
            self.decode.stop if self.decode else None,
            self._provider.shutdown if self._provider else None,
            self.sidecar.stop if self.sidecar else None,
            self.sink.close if self.sink else None,
        ):
            if closer is None:
                continue
            try:
                closer()
            except Exception:
                logger.exception("fleet: error while stopping")
        self.router = None
        self.sidecar = None
        self.prefill = self.decode = None
        self.sink = None
        self._provider = None

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ use

    @property
    def url(self) -> str:
        """Where agents send requests: the sidecar when there is one, else the router."""
        if self.sidecar is not None:
            return str(self.sidecar.url)
        assert self.router is not None, "fleet not started"
        return self.router.url

    def driver(self, *, traced: bool = True, **kwargs: Any) -> AgentDriver:
        """An agent driver. ``traced``: it exports its own spans (turns and tool calls).

        Behind the sidecar, the sidecar's span is the turn: the driver then only exports
        its ``execute_tool`` spans (flushed before the next request, so the sidecar sees
        them when it splits the gap) and sends a ``traceparent`` so tests know the trace.
        """
        if self.sidecar is not None:
            kwargs.setdefault("chat_spans", False)
            if traced:
                kwargs.setdefault("flush", self.flush_spans)
        return AgentDriver(self.url, "tiny-llama", tracer=self.tracer if traced else None, **kwargs)

    def flush_spans(self) -> None:
        if self._provider is not None:
            self._provider.force_flush()

    def engine_log_lines(self, *needles: str, limit: int = 20) -> list[str]:
        """The engines' log lines that contain any of ``needles`` (default: vLLM's KV
        warnings and errors), the last ``limit`` of each engine, prefixed with its role.

        A failed request on the fleet says only "Internal server error"; the reason
        (an expired read, a failed transfer) is in an engine log the test runner may not
        keep, so failing assertions quote these lines.
        """
        needles = needles or ("Declining expired", "KV load failure", "Releasing expired", "ERROR")
        lines: list[str] = []
        for engine in (self.prefill, self.decode):
            if engine is None or not engine.log_path.exists():
                continue
            role = engine.spec.role
            with engine.log_path.open(errors="replace") as log:
                found = [f"[{role}] {line.rstrip()}" for line in log if any(n in line for n in needles)]
            lines += found[-limit:]
        return lines

    def flush_store(self, timeout: float = 15.0) -> None:
        """Everything exported so far written to the sidecar's store (engines export every
        ~0.2 s; call after the spans you need have reached the sink)."""
        self.flush_spans()
        if self.sidecar is not None:
            self.sidecar.flush(timeout)


def _fleet_tracer(endpoint: str) -> tuple[Any, trace.Tracer]:
    """A private tracer provider for the router and driver, exporting to the sink."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "otelkv-fleet"}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=200)
    )
    return provider, provider.get_tracer(names.SCOPE_FLEET, __version__)
