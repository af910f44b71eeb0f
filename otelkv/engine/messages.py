"""Containers otelkv sends across vLLM's process boundaries, piggybacking on vLLM's own.

* :class:`OtelKVWorkerMeta` rides on ``KVConnectorOutput.kv_connector_worker_meta``
  (worker -> EngineCore, every step): the worker's per-request transfer observations.
  The scheduler side unwraps it before the inner connector sees the output, so the inner
  connector gets exactly what it would have got without otelkv.
* :class:`OtelKVStats` rides on ``kv_connector_stats`` (worker -> EngineCore -> API
  server): vLLM's own stats object of the inner connector, untouched, plus otelkv's
  counters for ``/metrics``. vLLM's ``KV Transfer metrics`` log line is built from the
  inner object only, so it reads exactly as before.

Both must pickle (worker -> EngineCore) and their ``to_dict`` payload must msgpack
(EngineCore -> API server): only str keys, numbers, lists and dicts inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

KEY_SEP = "|"
"""Joins a metric name and its label values into one msgpack-friendly dict key."""


def series_key(metric: str, *labels: str) -> str:
    return KEY_SEP.join((metric, *labels))


def split_series_key(key: str) -> tuple[str, tuple[str, ...]]:
    metric, *labels = key.split(KEY_SEP)
    return metric, tuple(labels)


@dataclass
class TransferRecord:
    """What one worker saw of one request's KV load (summed over its NIXL handles)."""

    request_id: str
    outcome: str
    bytes: int = 0
    descriptors: int = 0
    handles: int = 0
    xfer_s: float = 0.0
    post_s: float = 0.0
    first_post_unix: float | None = None
    done_unix: float | None = None
    remote_engine_id: str | None = None

    def merge(self, other: TransferRecord) -> None:
        """Fold another TP rank's view of the same request into this one."""
        self.bytes += other.bytes
        self.descriptors += other.descriptors
        self.handles += other.handles
        self.xfer_s = max(self.xfer_s, other.xfer_s)
        self.post_s = max(self.post_s, other.post_s)
        if other.first_post_unix is not None:
            self.first_post_unix = min(self.first_post_unix or other.first_post_unix, other.first_post_unix)
        if other.done_unix is not None:
            self.done_unix = max(self.done_unix or other.done_unix, other.done_unix)
        if other.outcome != "ok":
            self.outcome = other.outcome
        self.remote_engine_id = self.remote_engine_id or other.remote_engine_id


@dataclass
class OtelKVWorkerMeta(KVConnectorWorkerMetadata):
    """otelkv's worker observations for one step, wrapping the inner connector's meta."""

    inner: KVConnectorWorkerMetadata | None = None
    transfers: dict[str, TransferRecord] = field(default_factory=dict)
    expired_sends: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, OtelKVWorkerMeta):
            self.inner = other if self.inner is None else self.inner.aggregate(other)
            return self
        if self.inner is None:
            self.inner = other.inner
        elif other.inner is not None:
            self.inner = self.inner.aggregate(other.inner)
        for req_id, rec in other.transfers.items():
            mine = self.transfers.get(req_id)
            if mine is None:
                self.transfers[req_id] = rec
            else:
                mine.merge(rec)
        self.expired_sends |= other.expired_sends
        return self

    def is_empty(self) -> bool:
        return self.inner is None and not self.transfers and not self.expired_sends


def new_payload() -> dict[str, dict[str, Any]]:
    """Empty otelkv metrics payload: counters, histogram observations, gauges."""
    return {"c": {}, "h": {}, "g": {}}


def merge_payload(into: dict[str, dict[str, Any]], other: dict[str, dict[str, Any]]) -> None:
    counters = into["c"]
    for key, value in other.get("c", {}).items():
        counters[key] = counters.get(key, 0) + value
    histograms = into["h"]
    for key, values in other.get("h", {}).items():
        histograms.setdefault(key, []).extend(values)
    into["g"].update(other.get("g", {}))


def payload_is_empty(payload: dict[str, dict[str, Any]]) -> bool:
    return not (payload["c"] or payload["h"] or payload["g"])


@dataclass
class OtelKVStats(KVConnectorStats):
    """The inner connector's stats plus otelkv's metric observations.

    ``data`` holds otelkv's payload (see :func:`new_payload`); ``inner`` the inner
    connector's own stats object, aggregated with its own ``aggregate``.
    """

    inner: KVConnectorStats | None = None

    def __post_init__(self) -> None:
        if not self.data:
            self.data = new_payload()

    def reset(self) -> None:
        self.data = new_payload()
        if self.inner is not None:
            self.inner.reset()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if isinstance(other, OtelKVStats):
            merge_payload(self.data, other.data)
            other_inner = other.inner
        else:
            other_inner = other
        if other_inner is not None:
            self.inner = other_inner if self.inner is None else self.inner.aggregate(other_inner)
        return self

    def reduce(self) -> dict[str, int | float]:
        return self.inner.reduce() if self.inner is not None else {}

    def is_empty(self) -> bool:
        return payload_is_empty(self.data) and (self.inner is None or self.inner.is_empty())

    def to_dict(self) -> dict[str, Any]:
        return {
            "otelkv": self.data,
            "inner": self.inner.to_dict() if self.inner is not None else None,
        }
