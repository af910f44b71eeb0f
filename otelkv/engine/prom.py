"""otelkv's counters in vLLM's own ``/metrics``, next to ``vllm:nixl_*``.

vLLM builds connector metrics in the API-server process through the connector class's
``build_prom_metrics`` and feeds them the per-step stats payload. otelkv returns a
composite: the inner connector's own metrics object (so ``vllm:nixl_*`` keep working
exactly as before) plus otelkv's metrics, created with vLLM's metric classes and label
set (``model_name``, ``engine``) so multiprocess mode and label conventions match.

Every counter series whose label values are known when the API server starts is created at 0
for each engine (:func:`known_series`): ``increase()`` needs a sample before the first event,
or the first expiry or failed read after a start would not show.
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


def known_series(backend: str | None) -> list[tuple[str, tuple[str, ...]]]:
    """The counter series (metric, otelkv label values) an engine with this NIXL ``backend``
    label can report, all from closed vocabularies (None: no backend-labelled series). Every
    role: a ``kv_both`` engine is prefill or decode request by request. Transfers start at 0
    for the two P/D hand-off directions only: ``load`` (a connector that is not a P/D
    hand-off) never happens on a NIXL P/D engine and would add a series that always reads 0."""
    roles = names.ROLES
    out: list[tuple[str, tuple[str, ...]]] = []
    out += [(names.METRIC_PULL_DECISIONS, pair) for pair in names.PULL_DECISION_REASONS]
    out += [(names.METRIC_PREFILL_TOKENS, (r, src)) for r in roles for src in names.TOKEN_SOURCES]
    out += [
        (names.METRIC_RETENTIONS, (k, o)) for k in names.RETENTION_KINDS for o in names.RETENTION_OUTCOMES
    ]
    out += [(names.METRIC_RETENTION_BLOCK_SECONDS, (k,)) for k in names.RETENTION_KINDS]
    out += [(names.METRIC_REQUESTS, (r, o)) for r in roles for o in names.REQUEST_OUTCOMES]
    out += [(names.METRIC_BODY_TRACE_CONTEXT, (o,)) for o in names.BODY_CONTEXT_OUTCOMES]
    out += [(names.METRIC_CONTINUITY_TOKENS, (o,)) for o in names.CONTINUITY_OUTCOMES]
    if backend:
        for direction in (names.DIRECTION_D_TO_P, names.DIRECTION_P_TO_D):
            out += [(names.METRIC_TRANSFERS, (direction, backend, o)) for o in names.TRANSFER_OUTCOMES]
            out.append((names.METRIC_TRANSFER_BYTES, (direction, backend)))
    return out


class OtelKVPromMetrics(KVConnectorPromMetrics):
    """Composite: the inner connector's Prometheus metrics plus otelkv's."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        inner: KVConnectorPromMetrics | None,
        *,
        backend: str | None = None,
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
        try:
            for engine_idx in self.per_engine_labelvalues:
                for name, labels in known_series(backend):
                    self._child(name, engine_idx, labels)
        except Exception:  # a missing zero series must never stop vLLM's start
            logger.warning("otelkv: could not create the metrics' zero series", exc_info=True)

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
