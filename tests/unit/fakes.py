"""Fakes for unit tests of pure logic (never used by the fleet tests).

``RecordingConnector`` is a complete ``KVConnectorBase_V1`` that records every call and
returns a distinct sentinel, so forwarding can be checked hook by hook.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
CLASS_CALLS: list[tuple[str, tuple[Any, ...]]] = []
RAISE: dict[str, BaseException] = {}


class Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _record(name: str, *args: Any, **kwargs: Any) -> Any:
    CALLS.append((name, args, kwargs))
    if name in RAISE:
        raise RAISE[name]
    return RETURNS.setdefault(name, Sentinel(f"ret:{name}"))


RETURNS: dict[str, Any] = {}


def reset() -> None:
    CALLS.clear()
    CLASS_CALLS.clear()
    RAISE.clear()
    RETURNS.clear()


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):
    """Every hook recorded; attribute access on unknown names fails loudly."""

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return _record("supports_divergent_local_hybrid_hits")  # type: ignore[no-any-return]

    @property
    def requires_kv_delivery(self) -> bool:
        return _record("requires_kv_delivery")  # type: ignore[no-any-return]


def _make_method(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _record(name, *args, **kwargs)

    method.__name__ = name
    return method


INSTANCE_HOOKS = (
    "get_mem_pool_context",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "register_kv_caches",
    "set_host_xfer_buffer_ops",
    "finish_forward",
    "reset_capture_state",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "shutdown",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "get_handshake_metadata",
    "build_connector_worker_meta",
    "bind_kv_cache_manager",
    "bind_gpu_block_pool",
    "get_loaded_kv_cache_group_ids",
    "get_num_new_matched_tokens",
    "get_external_cache_hit_sources",
    "update_state_after_alloc",
    "build_connector_meta",
    "on_new_request",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "register_finished_partial_tail",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_finished_count",
    "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware",
    "reset_cache",
)
for _name in INSTANCE_HOOKS:
    setattr(RecordingConnector, _name, _make_method(_name))


def _make_classmethod(name: str) -> Any:
    def method(cls: Any, *args: Any) -> Any:
        CLASS_CALLS.append((name, args))
        if name in RAISE:
            raise RAISE[name]
        return RETURNS.setdefault(f"cls:{name}", Sentinel(f"ret:cls:{name}"))

    method.__name__ = name
    return classmethod(method)


CLASS_HOOKS = (
    "get_required_kvcache_layout",
    "requires_piecewise_for_cudagraph",
    "build_kv_connector_stats",
    "build_prom_metrics",
)
for _name in CLASS_HOOKS:
    setattr(RecordingConnector, _name, _make_classmethod(_name))
RecordingConnector.__abstractmethods__ = frozenset()


DECODE_HANDLE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_block_ids": [[4, 5, 6, 7]],
    "remote_engine_id": "decode-0",
    "remote_request_id": "chatcmpl-prev-0badf00d",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "remote_num_tokens": 130,
}
"""A decode node's handle as the router forwards it to the next turn's prefill."""


def vllm_config(extra: dict[str, Any] | None = None, *, kv_role: str = "kv_producer") -> Any:
    """A duck-typed VllmConfig with just what the connector reads."""
    extra_config = {
        "otelkv_inner_connector": "RecordingConnector",
        "otelkv_inner_module_path": "tests.unit.fakes",
        **(extra or {}),
    }
    ktc = SimpleNamespace(
        kv_connector="OtelKVConnector",
        kv_connector_module_path="otelkv.engine.connector",
        kv_connector_extra_config=extra_config,
        engine_id="engine-under-test",
        kv_role=kv_role,
        kv_load_failure_policy="fail",
        is_kv_producer=kv_role == "kv_producer",
    )
    return SimpleNamespace(
        kv_transfer_config=ktc,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
        model_config=SimpleNamespace(served_model_name="tiny", model="/models/tiny"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        observability_config=SimpleNamespace(otlp_traces_endpoint=None),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE, prefix_caching_hash_algo="sha256"),
    )


BLOCK_SIZE = 16
"""The fake engines' block size (and vLLM's hash block size)."""


def vllm_block_hashes(token_ids: list[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
    """``request.block_hashes`` as vLLM's EngineCore computes them (sha256, the default
    algorithm, with its default seed): chained over whole blocks of ``token_ids``."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    if not isinstance(getattr(kv_cache_utils, "NONE_HASH", None), bytes):
        kv_cache_utils.init_none_hash(sha256)
    out: list[bytes] = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        out.append(
            kv_cache_utils.hash_block_tokens(
                sha256, out[-1] if out else None, token_ids[start : start + block_size]
            )
        )
    return out


def block_hashing() -> Any:
    """The fake engines' :class:`otelkv.engine.continuity.Hashing`."""
    from otelkv.engine import continuity

    vllm_block_hashes([])  # vLLM's NONE_HASH, set as EngineCore sets it
    return continuity.vllm_hashing(BLOCK_SIZE, "sha256")


def decode_digest(token_ids: list[int], prompt_tokens: int) -> dict[str, Any] | None:
    """The continuity digest a fake decode engine writes for KV over ``token_ids``."""
    from otelkv.engine import continuity

    return continuity.digest(
        vllm_block_hashes(token_ids), token_ids, len(token_ids), prompt_tokens, block_hashing()
    )


class TokenRequest(SimpleNamespace):
    """A duck-typed vLLM request whose ``block_hashes`` follow its token ids, as vLLM keeps
    them: over ``all_token_ids`` when set (a request that generated), else ``prompt_token_ids``."""

    @property
    def block_hashes(self) -> list[bytes]:
        tokens = getattr(self, "all_token_ids", None) or getattr(self, "prompt_token_ids", None) or []
        return vllm_block_hashes(list(tokens))


def kv_cache_config(num_blocks: int = 100, bytes_per_block: int = 65536) -> Any:
    return SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_tensors=[SimpleNamespace(size=num_blocks * bytes_per_block)],
    )


class NonHMAConnector(KVConnectorBase_V1):
    """A connector without SupportsHMA (vLLM then calls request_finished directly)."""


for _name in INSTANCE_HOOKS:
    if _name != "request_finished_all_groups":
        setattr(NonHMAConnector, _name, _make_method(_name))
NonHMAConnector.__abstractmethods__ = frozenset()
