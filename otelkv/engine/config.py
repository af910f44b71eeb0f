"""Engine-side settings, read once per connector instance into a frozen dataclass.

Where a setting lives:

* ``kv_connector_extra_config`` keys starting with ``otelkv_`` (same JSON the operator
  already edits for NIXL), then
* ``OTELKV_*`` environment variables, then
* the defaults below.

Trace export itself is configured with the standard ``OTEL_*`` variables
(see :mod:`otelkv.engine.telemetry`), never here.

NIXL's own settings (threshold, TTL, ...) are read from the same extra config with
vLLM's defaults, so spans state the values in force rather than what someone meant.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from otelkv import names

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

# vLLM 0.32.0 NIXL defaults (base_scheduler.py / base_worker.py).
NIXL_DEFAULT_RECOMPUTE_THRESHOLD = 64
NIXL_DEFAULT_DECODER_TTL_S = 480
NIXL_DEFAULT_LEASE_S = 30
NIXL_DEFAULT_BACKENDS = ("UCX",)


class ConfigError(ValueError):
    """An otelkv setting has a value otelkv cannot use; the message names it."""


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{key}={value!r}: expected true/false")


def _as_float(key: str, value: Any) -> float:
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: expected a number of seconds") from None
    if result <= 0:
        raise ConfigError(f"{key}={value!r}: must be > 0")
    return result


def _number(extra: dict[str, Any], key: str, default: float, kind: type[int] | type[float]) -> Any:
    value = extra.get(key, default)
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}={value!r}: expected a number") from None


@dataclass(frozen=True)
class EngineSettings:
    """Everything the instrumented connector needs to know about its engine."""

    enabled: bool = True
    traces: bool = True
    stuck_after_s: float = 60.0
    """A request waiting for remote KV longer than this is reported as stuck."""
    fault_sites: frozenset[str] = frozenset()

    engine_id: str = ""
    kv_role: str = ""
    model: str = ""
    bidirectional: bool = False
    recompute_threshold: int = NIXL_DEFAULT_RECOMPUTE_THRESHOLD
    decoder_ttl_s: float = NIXL_DEFAULT_DECODER_TTL_S
    lease_s: float = NIXL_DEFAULT_LEASE_S
    load_failure_policy: str = "fail"
    backends: tuple[str, ...] = NIXL_DEFAULT_BACKENDS
    vllm_traces_endpoint: str | None = None
    block_size: int | None = None
    kv_cache_dtype: str = ""
    prefix_caching: bool | None = None
    hash_block_size: int | None = None
    """Tokens per ``request.block_hashes`` entry (vLLM's ``kv_cache_config.hash_block_size``;
    None: as ``block_size``)."""
    prefix_hash_algo: str | None = None
    """vLLM's ``prefix_caching_hash_algo``: whether block hashes may leave the engine
    (:mod:`otelkv.engine.continuity`)."""
    continuity: str = names.CONTINUITY_MODE_OBSERVE
    """What the prefill node does with a decode handle whose KV belongs to other tokens:
    ``observe`` records it and lets vLLM load it, ``guard`` makes vLLM recompute."""

    @property
    def engine_role(self) -> str:
        """The node's role in P/D terms, from vLLM's ``kv_role``."""
        return {
            "kv_producer": names.ROLE_PREFILL,
            "kv_consumer": names.ROLE_DECODE,
        }.get(self.kv_role, names.ROLE_UNIFIED)

    @property
    def backend_label(self) -> str:
        return "+".join(self.backends) or "unknown"


def settings_from_vllm_config(vllm_config: Any, environ: dict[str, str] | None = None) -> EngineSettings:
    """Build the settings from a ``VllmConfig`` (duck-typed) and the environment."""
    env = os.environ if environ is None else environ
    ktc = vllm_config.kv_transfer_config
    extra: dict[str, Any] = dict(getattr(ktc, "kv_connector_extra_config", None) or {})

    def pick(extra_key: str, env_key: str, default: Any) -> Any:
        if extra_key in extra:
            return extra[extra_key]
        if env_key in env:
            return env[env_key]
        return default

    enabled = _as_bool(names.CONFIG_ENABLED, pick(names.CONFIG_ENABLED, names.ENV_ENABLED, True))
    traces = _as_bool(names.CONFIG_TRACES, pick(names.CONFIG_TRACES, names.ENV_TRACES, True))
    stuck = _as_float(
        names.CONFIG_STUCK_AFTER_SECONDS,
        pick(names.CONFIG_STUCK_AFTER_SECONDS, names.ENV_STUCK_AFTER_SECONDS, 60.0),
    )
    raw_mode = pick(names.CONFIG_CONTINUITY, names.ENV_CONTINUITY, names.CONTINUITY_MODE_OBSERVE)
    # An empty value (``OTELKV_CONTINUITY=`` in a compose file) means the default.
    continuity = str(raw_mode).strip().lower() or names.CONTINUITY_MODE_OBSERVE
    if continuity not in names.CONTINUITY_MODES:
        raise ConfigError(
            f"{names.CONFIG_CONTINUITY}={raw_mode!r}: expected one of {', '.join(names.CONTINUITY_MODES)}"
        )
    faults = frozenset(s.strip() for s in env.get(names.ENV_FAULT_INJECT, "").split(",") if s.strip())

    backends = extra.get("backends") or NIXL_DEFAULT_BACKENDS
    if isinstance(backends, str):
        backends = (backends,)
    if not isinstance(backends, (list, tuple)):
        raise ConfigError(f"backends={backends!r}: expected a list of NIXL backend names")
    model_config = getattr(vllm_config, "model_config", None)
    model = ""
    if model_config is not None:
        served = getattr(model_config, "served_model_name", None)
        if isinstance(served, (list, tuple)):
            served = served[0] if served else None
        model = str(served or getattr(model_config, "model", "") or "")
    observability = getattr(vllm_config, "observability_config", None)
    block_size, kv_dtype, prefix_caching = _cache_facts(vllm_config)

    return EngineSettings(
        enabled=enabled,
        traces=traces,
        stuck_after_s=stuck,
        fault_sites=faults,
        engine_id=str(getattr(ktc, "engine_id", "") or ""),
        kv_role=str(getattr(ktc, "kv_role", "") or ""),
        model=model,
        # vLLM tests the raw value's truthiness (a string "false" means on): so do we, so
        # spans state what is really in force.
        bidirectional=bool(extra.get("bidirectional_kv_xfer", False)),
        recompute_threshold=_number(extra, "kv_recompute_threshold", NIXL_DEFAULT_RECOMPUTE_THRESHOLD, int),
        decoder_ttl_s=_number(extra, "decoder_kv_blocks_ttl", NIXL_DEFAULT_DECODER_TTL_S, float),
        lease_s=_number(extra, "kv_lease_duration", NIXL_DEFAULT_LEASE_S, float),
        load_failure_policy=str(getattr(ktc, "kv_load_failure_policy", "fail") or "fail"),
        backends=tuple(str(b) for b in backends),
        vllm_traces_endpoint=getattr(observability, "otlp_traces_endpoint", None),
        block_size=block_size,
        kv_cache_dtype=kv_dtype,
        prefix_caching=prefix_caching,
        prefix_hash_algo=_text_or_none(
            getattr(getattr(vllm_config, "cache_config", None), "prefix_caching_hash_algo", None)
        ),
        continuity=continuity,
    )


def _cache_facts(vllm_config: Any) -> tuple[int | None, str, bool | None]:
    """(block size, KV dtype in force, prefix caching): what both sides of a hand-off must
    agree on, read defensively (any of them may be absent on another vLLM build)."""
    cache = getattr(vllm_config, "cache_config", None)
    block = getattr(cache, "block_size", None)
    block_size = block if isinstance(block, int) and not isinstance(block, bool) else None
    dtype = str(getattr(cache, "cache_dtype", "") or "")
    if dtype in ("", "auto"):
        model_dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
        dtype = str(model_dtype).removeprefix("torch.") if model_dtype is not None else dtype
    caching = getattr(cache, "enable_prefix_caching", None)
    return block_size, dtype, caching if isinstance(caching, bool) else None


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
