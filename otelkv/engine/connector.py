"""The instrumented connector: a delegating wrapper around any vLLM v1 KV connector.

Like vLLM's ``MultiConnector`` it owns the inner connector by composition and forwards
every hook, property and classmethod of ``KVConnectorBase_V1`` and ``SupportsHMA``;
return values and exceptions of the inner connector pass through unchanged, with one
opt-in exception: in guard mode (``otelkv_continuity: "guard"``) a prefill request whose
decode handle offers KV computed for other tokens is told "nothing to load", so vLLM
recomputes instead of using wrong KV. The
observations live in two role-specific modules picked once in ``__init__``:
:mod:`~otelkv.engine.scheduler_observer` (EngineCore) and
:mod:`~otelkv.engine.worker_observer` (worker). Each observer call is guarded: an
otelkv bug is counted and logged once, never raised into vLLM.

Hooks that otelkv does not observe - including the per-layer ``wait_for_layer_load``
and ``save_kv_layer`` - are rebound in ``__init__`` to the inner connector's bound
methods, so calling them costs exactly what it costs without otelkv. The class-level
definitions below exist for the abstract base class, for readers, and for the test that
fails when vLLM grows a hook this module does not forward.

Loading (any inner connector)::

    --kv-transfer-config '{"kv_connector": "OtelKVConnector",
        "kv_connector_module_path": "otelkv.engine.connector",
        "kv_connector_extra_config": {"otelkv_inner_connector": "LMCacheConnectorV1"}}'

For NIXL use the preset in :mod:`otelkv.engine.nixl`, which keeps the class name
``NixlConnector`` so vLLM's name-based checks still see NIXL.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CopyBlocksOp,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    supports_hma,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from otelkv import names
from otelkv.engine import telemetry
from otelkv.engine.config import ConfigError, EngineSettings, settings_from_vllm_config
from otelkv.engine.guard import ErrorLedger
from otelkv.engine.messages import OtelKVStats, OtelKVWorkerMeta, new_payload

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.otelkv")

# Hooks rebound straight to the inner connector when otelkv is on (not observed).
_PASS_THROUGH = (
    "get_mem_pool_context",
    "register_kv_caches",
    "set_host_xfer_buffer_ops",
    "finish_forward",
    "reset_capture_state",
    "handle_preemptions",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_connector_kv_cache_events",
    "get_handshake_metadata",
    "bind_gpu_block_pool",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "register_finished_partial_tail",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_finished_count",
    "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware",
    "reset_cache",
)
# Observed hooks, rebound to the inner connector too when their observer is off. Never
# rebound: update_connector_output, which must always unwrap otelkv's worker meta.
_SCHEDULER_OBSERVED = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "request_finished_all_groups",
)
_WORKER_OBSERVED = ("start_load_kv", "get_transfer_results")
_STATS_HOOKS = ("get_kv_connector_stats", "build_connector_worker_meta")


@functools.lru_cache(maxsize=32)
def _load_class(name: str, module_path: str | None) -> type[KVConnectorBase_V1]:
    if module_path:
        module = importlib.import_module(module_path)
        try:
            return getattr(module, name)  # type: ignore[no-any-return]
        except AttributeError:
            raise ConfigError(f"otelkv: class {name!r} not found in module {module_path!r}") from None
    return KVConnectorFactory.get_connector_class_by_name(name)  # type: ignore[return-value]


class OtelKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Delegating, instrumented KV connector. See the module docstring."""

    _otelkv_inner_name: ClassVar[str | None] = None
    """Presets pin the inner connector's registered name here."""

    # ------------------------------------------------------------------ class plumbing

    @classmethod
    def _inner_spec(cls, extra_config: dict[str, Any] | None) -> tuple[str, str | None]:
        if cls._otelkv_inner_name:
            return cls._otelkv_inner_name, None
        extra = extra_config or {}
        name = extra.get(names.CONFIG_INNER_CONNECTOR)
        if not name:
            raise ConfigError(
                f"otelkv: set kv_connector_extra_config.{names.CONFIG_INNER_CONNECTOR} to the "
                'connector to wrap (e.g. "NixlConnector"), or load a preset such as '
                "otelkv.engine.nixl"
            )
        return str(name), extra.get(names.CONFIG_INNER_MODULE_PATH) or None

    @classmethod
    def inner_class(cls, extra_config: dict[str, Any] | None = None) -> type[KVConnectorBase_V1]:
        """The wrapped connector class (resolved from the preset or the extra config)."""
        name, module_path = cls._inner_spec(extra_config)
        inner = _load_class(name, module_path)
        if issubclass(inner, OtelKVConnector):
            raise ConfigError("otelkv: the inner connector cannot itself be an otelkv connector")
        return inner

    @classmethod
    def _inner_class_for(cls, vllm_config: VllmConfig) -> type[KVConnectorBase_V1]:
        ktc = vllm_config.kv_transfer_config
        return cls.inner_class(getattr(ktc, "kv_connector_extra_config", None))

    # ------------------------------------------------------------------ construction

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        inner_cls = self._inner_class_for(vllm_config)
        hma_enabled = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        if hma_enabled and not supports_hma(inner_cls):
            raise ValueError(
                f"Connector {inner_cls.__name__} (wrapped by otelkv) does not support HMA but "
                "HMA is enabled. Please set `--disable-hybrid-kv-cache-manager`."
            )
        self._inner: KVConnectorBase_V1 = inner_cls(vllm_config, role, kv_cache_config)
        self._inner_name = inner_cls.__name__
        self._errors = ErrorLedger()
        self._sched = None
        self._worker = None
        try:
            self._settings = settings_from_vllm_config(vllm_config)
        except ConfigError as exc:
            logger.error("otelkv: instrumentation disabled, bad configuration: %s", exc)
            self._settings = EngineSettings(enabled=False)
        self._errors.fault_sites = self._settings.fault_sites
        if self._settings.enabled:
            try:
                self._start_observers(vllm_config, role, kv_cache_config)
            except Exception:
                logger.exception("otelkv: instrumentation disabled, observer set-up failed")
                self._sched = self._worker = None
        self._bind_fast_paths()

    def _start_observers(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        settings = self._settings
        if role == KVConnectorRole.SCHEDULER:
            hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
            if (
                isinstance(hash_block_size, int)
                and not isinstance(hash_block_size, bool)
                and hash_block_size > 0
            ):
                # what request.block_hashes are computed at (DCP, hybrid models: not block_size)
                settings = self._settings = dataclasses.replace(settings, hash_block_size=hash_block_size)
            from otelkv.engine.scheduler_observer import SchedulerObserver, engine_resource_attributes

            writer = telemetry.get_span_writer(
                process_kind="scheduler",
                engine_id=settings.engine_id,
                role=settings.engine_role,
                vllm_endpoint=settings.vllm_traces_endpoint,
                enabled=settings.traces,
                resource=engine_resource_attributes(settings, self._inner_name),
            )
            self._sched = SchedulerObserver(
                settings,
                self._errors,
                writer,
                connector_name=self._inner_name,
                bytes_per_block=_bytes_per_block(vllm_config, kv_cache_config),
            )
        elif role == KVConnectorRole.WORKER:
            from otelkv.engine.worker_observer import WorkerObserver

            self._worker = WorkerObserver(self._errors, self._inner)
        logger.info(
            "otelkv: instrumenting %s (%s, engine %s, role %s)",
            self._inner_name,
            role.name.lower(),
            settings.engine_id,
            settings.engine_role,
        )

    def _bind_fast_paths(self) -> None:
        """Shadow unobserved hooks with the inner connector's bound methods."""
        names_to_bind = list(_PASS_THROUGH)
        if self._sched is None:
            names_to_bind += _SCHEDULER_OBSERVED
        if self._worker is None:
            names_to_bind += _WORKER_OBSERVED
        if self._sched is None and self._worker is None:
            names_to_bind += _STATS_HOOKS
        inner = self._inner
        for name in names_to_bind:
            if name == "request_finished_all_groups" and not isinstance(inner, SupportsHMA):
                continue  # keep ours: it maps to request_finished, as vLLM would
            setattr(self, name, getattr(inner, name))

    @property
    def inner(self) -> KVConnectorBase_V1:
        """The wrapped connector (for operators and tests)."""
        return self._inner

    # ------------------------------------------------------------------ properties

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._inner.supports_divergent_local_hybrid_hits

    @property
    def requires_kv_delivery(self) -> bool:
        return self._inner.requires_kv_delivery

    # ------------------------------------------------------------------ worker side

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        return self._inner.get_mem_pool_context()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # super() too: vLLM's attention hook asks *this* object has_connector_metadata().
        super().bind_connector_metadata(connector_metadata)
        return self._inner.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        return self._inner.clear_connector_metadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        return self._inner.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        return self._inner.set_host_xfer_buffer_ops(copy_operation)

    def finish_forward(self) -> None:
        return self._inner.finish_forward()

    def reset_capture_state(self) -> None:
        return self._inner.reset_capture_state()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        return self._inner.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.before_load(self._connector_metadata)
        return self._inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        return self._inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self._inner.get_transfer_results(finished_req_ids)
        if self._worker is not None:
            self._worker.after_results(results)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._inner.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        try:
            return self._inner.shutdown()
        finally:
            if self._sched is not None:
                self._sched.shutdown()  # guarded: ends open retentions as dropped
                try:
                    telemetry.flush(timeout_s=2.0)  # hand queued spans to the exporter
                except Exception:
                    logger.debug("otelkv: span flush at shutdown failed", exc_info=True)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        inner_stats = self._inner.get_kv_connector_stats()
        if self._sched is not None:
            payload = self._sched.take_payload()
        else:
            payload = self._worker_payload()
        if payload is None and inner_stats is None:
            return None
        return OtelKVStats(data=payload or new_payload(), inner=inner_stats)

    def _worker_payload(self) -> dict[str, dict[str, Any]] | None:
        errors = self._errors.drain()
        if not errors:
            return None
        payload = new_payload()
        for site, n in errors.items():
            payload["c"][f"{names.METRIC_INSTRUMENTATION_ERRORS}|{site}"] = n
        return payload

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self._inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._inner.get_handshake_metadata()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        inner_meta = self._inner.build_connector_worker_meta()
        if self._worker is None:
            return inner_meta
        try:
            return self._worker.take_meta(inner_meta)
        except Exception as exc:  # noqa: BLE001 - fail open: the inner meta still goes up
            self._errors.record("worker.build_connector_worker_meta", exc)
            return inner_meta

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        # As the base class does, remember the manager; the inner connector binds the
        # block pool itself (calling super() here would bind it twice).
        self._kv_cache_manager = kv_cache_manager
        return self._inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        return self._inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._inner.get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        result = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        sched = self._sched
        if sched is not None:
            refused = bool(result[0]) and sched.guarding and sched.refuses(request) is True
            if refused:
                # Guard mode: KV computed for other tokens is not loaded, vLLM recomputes.
                # The inner connector still gets the handle in update_state_after_alloc and,
                # as for a full local prefix hit, tells the decode node to release its blocks.
                result = (0, False)
            sched.on_matched(request, num_computed_tokens, result, refused=refused)
        return result

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return self._inner.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        result = self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if self._sched is not None:
            self._sched.on_alloc(request, num_external_tokens)
        return result

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._inner.build_connector_meta(scheduler_output)
        if self._sched is not None:
            self._sched.on_step()
        return meta

    def on_new_request(self, request: Request) -> None:
        result = self._inner.on_new_request(request)
        if self._sched is not None:
            self._sched.on_new_request(request)
        return result

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        ours = meta if type(meta) is OtelKVWorkerMeta else None  # not isinstance: an ABC's check costs ~1 us
        if ours is not None:
            # The inner connector (and anything in vLLM after it) sees its own worker
            # meta, exactly as without otelkv. In place: copying the output cost ~0.1 ms.
            connector_output.kv_connector_worker_meta = ours.inner
        result = self._inner.update_connector_output(connector_output)
        if self._sched is not None:
            self._sched.on_output(connector_output, ours)
        return result

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        result = self._inner.request_finished(request, block_ids)
        if self._sched is not None:
            self._sched.on_finished(request, block_ids, result)
        return result

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if isinstance(self._inner, SupportsHMA):
            result = self._inner.request_finished_all_groups(request, block_ids)
        else:
            # What vLLM's scheduler does for a connector without HMA (one KV group).
            result = self._inner.request_finished(request, block_ids[0])
        if self._sched is not None:
            self._sched.on_finished(request, block_ids, result)
        return result

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        return self._inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._inner.take_events()

    def has_pending_block_frees(self) -> bool:
        return self._inner.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self._inner.has_pending_push_work()

    def get_finished_count(self) -> int | None:
        return self._inner.get_finished_count()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        return self._inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        return self._inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def reset_cache(self) -> bool | None:
        return self._inner.reset_cache()

    # ------------------------------------------------------------------ class methods

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return cls._inner_class_for(vllm_config).get_required_kvcache_layout(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return cls.inner_class(extra_config).requires_piecewise_for_cudagraph(extra_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        # vLLM only uses this for its "KV Transfer metrics" log line: hand it the inner
        # connector's stats, so the line reads exactly as it would without otelkv.
        inner_cls = cls._stats_inner_class()
        if data is not None and "otelkv" in data:
            data = data.get("inner")
        if inner_cls is None:
            return None
        return inner_cls.build_kv_connector_stats(data)

    @classmethod
    def _stats_inner_class(cls) -> type[KVConnectorBase_V1] | None:
        if cls._otelkv_inner_name:
            return cls.inner_class()
        return _GENERIC_INNER.get(cls)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        from otelkv.engine.prom import OtelKVPromMetrics

        inner_cls = cls._inner_class_for(vllm_config)
        _GENERIC_INNER[cls] = inner_cls
        inner = inner_cls.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        try:
            settings = settings_from_vllm_config(vllm_config)
        except ConfigError:
            return inner
        if not settings.enabled:
            return inner
        return OtelKVPromMetrics(
            vllm_config,
            metric_types,
            labelnames,
            per_engine_labelvalues,
            inner,
            backend=settings.backend_label,
        )


# Generic wrappers learn their inner class from the config in build_prom_metrics (the
# API-server process builds its metrics before it builds any stats object).
_GENERIC_INNER: dict[type, type[KVConnectorBase_V1]] = {}


def _bytes_per_block(vllm_config: Any, kv_cache_config: Any) -> int:
    """Bytes one KV block occupies, summed over layers, groups and TP ranks."""
    try:
        num_blocks = int(kv_cache_config.num_blocks)
        per_rank = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
        tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        return per_rank // num_blocks * tp if num_blocks else 0
    except Exception:  # noqa: BLE001 - an estimate; never block start-up over it
        return 0
