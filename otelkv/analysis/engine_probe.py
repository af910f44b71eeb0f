"""What an engine's ``/metrics`` says about the prerequisites of reverse reuse.

``otelkv doctor`` reads each engine it is told about once: whether otelkv's connector is
installed (its ``otelkv_*`` series), whether NIXL reports (``vllm:nixl_*``), and vLLM's
``vllm:cache_config_info`` (block size, KV dtype, prefix caching). A probe that fails keeps
the failure as a one-line ``error``; the doctor reports it, it never raises.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

PROBE_TIMEOUT_S = 5.0
MAX_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class EngineProbe:
    url: str
    error: str | None = None
    otelkv_metrics: bool = False
    nixl_metrics: bool = False
    cache: dict[str, str] = field(default_factory=dict)
    """``vllm:cache_config_info`` labels (``block_size``, ``cache_dtype``, ``enable_prefix_caching``...)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> EngineProbe:
        """A probe sent over the query API; anything malformed raises ValueError (one line)."""
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            raise ValueError("each probe needs a string 'url'")
        cache = data.get("cache") or {}
        if not isinstance(cache, dict) or not all(isinstance(v, str) for v in cache.values()):
            raise ValueError("a probe's 'cache' maps label names to strings")
        error = data.get("error")
        return cls(
            url=data["url"][:512],
            error=str(error)[:512] if error is not None else None,
            otelkv_metrics=bool(data.get("otelkv_metrics")),
            nixl_metrics=bool(data.get("nixl_metrics")),
            cache={str(k)[:64]: v[:256] for k, v in cache.items()},
        )


def parse(url: str, text: str) -> EngineProbe:
    """Read a Prometheus text exposition (the engine's ``/metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    otelkv = nixl = False
    cache: dict[str, str] = {}
    try:
        for family in text_string_to_metric_families(text):
            name = family.name
            otelkv = otelkv or name.startswith("otelkv_")
            nixl = nixl or name.startswith("vllm:nixl_")
            if name == "vllm:cache_config_info" and family.samples and not cache:
                cache = {k: str(v) for k, v in family.samples[0].labels.items() if k != "engine"}
    except (ValueError, TypeError) as exc:
        return EngineProbe(url, error=f"/metrics is not a Prometheus exposition: {exc}"[:300])
    return EngineProbe(url, otelkv_metrics=otelkv, nixl_metrics=nixl, cache=cache)


def probe(url: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> EngineProbe:
    """GET ``url/metrics`` and :func:`parse` it."""
    base = url.rstrip("/")
    target = base if base.endswith("/metrics") else base + "/metrics"
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as resp:
            text = resp.read(MAX_BYTES).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return EngineProbe(url, error=f"GET {target} answered {exc.code}")
    except Exception as exc:  # noqa: BLE001 - anything (refused, not HTTP, a bad URL) is one line
        reason = getattr(exc, "reason", None) or exc
        return EngineProbe(url, error=f"GET {target} failed: {type(exc).__name__}: {reason}"[:300])
    try:
        return parse(url, text)
    except ImportError:
        return EngineProbe(
            url, error="reading /metrics needs prometheus-client: pip install 'otelkv[sidecar]'"
        )
