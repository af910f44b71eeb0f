"""otelkv's counters in vLLM's own ``/metrics``, next to ``vllm:nixl_*``.

vLLM builds connector metrics in the API-server process through the connector class's
``build_prom_metrics`` and feeds them the per-step stats payload. otelkv returns a
composite: the inner connector's own metrics object (so ``vllm:nixl_*`` keep working
exactly as before) plus otelkv's metrics, created with vLLM's metric classes and label
set (``model_name``, ``engine``) so multiprocess mode and label conventions match.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from otelkv import names
from otelkv.engine.messages import split_series_key

logger = logging.getLogger("vllm.otelkv")

METRICS: dict[str, names.Metric] = {m.name: m for m in names.ENGINE_METRICS}
"""The metrics this module creates, from :data:`otelkv.names.ENGINE_METRICS`."""


class OtelKVPromMetrics(KVConnectorPromMetrics):
    """Composite: the inner connector's Prometheus metrics plus otelkv's."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        inner: KVConnectorPromMetrics | None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.inner = inner
        self._metrics: dict[str, Any] = {}
        self._children: dict[tuple[str, int, tuple[str, ...]], Any] = {}
        self._warned = False
        for spec in METRICS.values():
            labels = [*labelnames, *spec.labels]
            if spec.kind == names.COUNTER:
                metric = self._counter_cls(name=spec.name, documentation=spec.help, labelnames=labels)
            elif spec.kind == names.GAUGE:
                metric = self._gauge_cls(
                    name=spec.name, documentation=spec.help, labelnames=labels, multiprocess_mode="mostrecent"
                )
            else:
                metric = self._histogram_cls(
                    name=spec.name, documentation=spec.help, labelnames=labels, buckets=list(spec.buckets)
                )
            self._metrics[spec.name] = metric

    def _child(self, name: str, engine_idx: int, labels: tuple[str, ...]) -> Any:
        key = (name, engine_idx, labels)
        child = self._children.get(key)
        if child is None:
            metric = self._metrics[name]
            child = metric.labels(*self.per_engine_labelvalues[engine_idx], *labels)
            self._children[key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if "otelkv" not in transfer_stats_data:
            # Not our payload (should not happen): hand it to the inner metrics as-is.
            if self.inner is not None:
                self.inner.observe(transfer_stats_data, engine_idx)
            return
        inner_data = transfer_stats_data.get("inner")
        if self.inner is not None and inner_data:
            self.inner.observe(inner_data, engine_idx)
        self._observe_otelkv(transfer_stats_data["otelkv"], engine_idx)

    def _observe_otelkv(self, payload: dict[str, dict[str, Any]], engine_idx: int) -> None:
        for kind in ("c", "h", "g"):
            for key, value in payload.get(kind, {}).items():
                name, labels = split_series_key(key)
                if name not in self._metrics:
                    continue  # a newer engine-side otelkv than this API server knows
                try:
                    child = self._child(name, engine_idx, labels)
                    if kind == "c":
                        child.inc(value)
                    elif kind == "g":
                        child.set(value)
                    else:
                        for observation in value:
                            child.observe(observation)
                except Exception:  # metrics must never break vLLM's stat loop
                    if not self._warned:
                        self._warned = True
                        logger.warning(
                            "otelkv: could not record a metrics payload (logged once)", exc_info=True
                        )
