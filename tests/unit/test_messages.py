"""otelkv's payloads ride on vLLM's own IPC objects, so they must aggregate and serialize
the way vLLM expects without disturbing the inner connector's own data.

Aggregation bugs would show up as double-counted bytes across TP ranks or silently lost
inner-connector metadata; serialization bugs as a crashed EngineCore -> API server hop.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from types import SimpleNamespace

import msgspec
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from otelkv.engine.messages import (
    KEY_SEP,
    OtelKVStats,
    OtelKVWorkerMeta,
    TransferRecord,
    merge_payload,
    new_payload,
    payload_is_empty,
    series_key,
    split_series_key,
)


@dataclass
class ForeignMeta(KVConnectorWorkerMetadata):
    """Stands in for an inner connector's own worker metadata (module level: picklable)."""

    items: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ForeignMeta)
        self.items.extend(other.items)
        return self


def nixl_stats(*transfers: tuple[float, float, int, int]) -> NixlKVConnectorStats:
    """Inner stats with transfers given as (xfer_us, post_us, bytes, descriptors)."""
    stats = NixlKVConnectorStats()
    for xfer_us, post_us, nbytes, descs in transfers:
        stats.record_transfer(
            SimpleNamespace(xferDuration=xfer_us, postDuration=post_us, totalBytes=nbytes, descCount=descs)
        )
    return stats


# ------------------------------------------------------------------ series keys


@pytest.mark.parametrize(
    ("metric", "labels", "key"),
    [
        ("otelkv_pull_decisions", ("pull", "pulled"), "otelkv_pull_decisions|pull|pulled"),
        ("otelkv_kv_transfer_seconds", ("D->P", "UCX"), "otelkv_kv_transfer_seconds|D->P|UCX"),
        ("otelkv_kv_retained_blocks", ("decode_ttl",), "otelkv_kv_retained_blocks|decode_ttl"),
        ("m", (), "m"),
    ],
)
def test_series_key_roundtrip(metric: str, labels: tuple[str, ...], key: str) -> None:
    assert KEY_SEP == "|"
    assert series_key(metric, *labels) == key
    assert split_series_key(key) == (metric, labels)


def test_empty_label_survives_roundtrip() -> None:
    key = series_key("m", "", "x")
    assert key == "m||x"
    assert split_series_key(key) == ("m", ("", "x"))


# ------------------------------------------------------------------ TransferRecord


def test_transfer_record_merge_of_two_tp_ranks() -> None:
    # Positional: request_id, outcome, bytes, descriptors, handles, xfer_s, post_s,
    # first_post_unix, done_unix, remote_engine_id.
    rank0 = TransferRecord("r1", "ok", 1000, 4, 1, 0.02, 0.001, 100.5, 100.6, None)
    rank1 = TransferRecord("r1", "ok", 3000, 6, 2, 0.01, 0.004, 100.2, 100.9, "decode-0")
    rank0.merge(rank1)
    assert rank0 == TransferRecord("r1", "ok", 4000, 10, 3, 0.02, 0.004, 100.2, 100.9, "decode-0")


def test_transfer_record_merge_keeps_own_times_when_other_has_none() -> None:
    mine = TransferRecord("r1", "ok", first_post_unix=5.0, done_unix=6.0, remote_engine_id="a")
    mine.merge(TransferRecord("r1", "ok", remote_engine_id="b"))
    assert (mine.first_post_unix, mine.done_unix, mine.remote_engine_id) == (5.0, 6.0, "a")


def test_transfer_record_merge_fills_missing_times() -> None:
    mine = TransferRecord("r1", "ok")
    mine.merge(TransferRecord("r1", "ok", first_post_unix=5.0, done_unix=6.0))
    assert (mine.first_post_unix, mine.done_unix) == (5.0, 6.0)


OUTCOMES = [("ok", "failed", "failed"), ("failed", "ok", "failed"), ("ok", "ok", "ok"),
            ("declined_expired", "failed", "failed")]  # fmt: skip


@pytest.mark.parametrize(("mine", "other", "merged"), OUTCOMES)
def test_transfer_record_non_ok_outcome_wins(mine: str, other: str, merged: str) -> None:
    record = TransferRecord("r1", mine)
    record.merge(TransferRecord("r1", other))
    assert record.outcome == merged


# ------------------------------------------------------------------ OtelKVWorkerMeta


def test_worker_meta_aggregate_merges_transfers_and_expired_sends() -> None:
    a = OtelKVWorkerMeta(transfers={"r1": TransferRecord("r1", "ok", 10, handles=1)}, expired_sends={"s1"})
    b = OtelKVWorkerMeta(
        transfers={"r1": TransferRecord("r1", "failed", 5, handles=1), "r2": TransferRecord("r2", "ok", 7)},
        expired_sends={"s2"},
    )
    assert a.aggregate(b) is a
    assert a.transfers == {
        "r1": TransferRecord("r1", "failed", 15, handles=2),
        "r2": TransferRecord("r2", "ok", 7),
    }
    assert a.expired_sends == {"s1", "s2"}
    assert a.inner is None


def test_worker_meta_aggregate_combines_inner_metas() -> None:
    a = OtelKVWorkerMeta(inner=ForeignMeta(["a"]))
    a.aggregate(OtelKVWorkerMeta(inner=ForeignMeta(["b"])))
    a.aggregate(OtelKVWorkerMeta(inner=None))
    assert a.inner == ForeignMeta(["a", "b"])

    empty = OtelKVWorkerMeta()
    empty.aggregate(OtelKVWorkerMeta(inner=ForeignMeta(["c"])))
    assert empty.inner == ForeignMeta(["c"])


def test_worker_meta_folds_foreign_meta_into_inner() -> None:
    meta = OtelKVWorkerMeta(transfers={"r1": TransferRecord("r1", "ok")})
    assert meta.aggregate(ForeignMeta(["x"])) is meta
    assert meta.inner == ForeignMeta(["x"])
    meta.aggregate(ForeignMeta(["y"]))
    assert meta.inner == ForeignMeta(["x", "y"])
    assert list(meta.transfers) == ["r1"]


def test_worker_meta_is_empty() -> None:
    assert OtelKVWorkerMeta().is_empty() is True
    assert OtelKVWorkerMeta(inner=ForeignMeta()).is_empty() is False
    assert OtelKVWorkerMeta(transfers={"r": TransferRecord("r", "ok")}).is_empty() is False
    assert OtelKVWorkerMeta(expired_sends={"s"}).is_empty() is False


def test_worker_meta_pickles() -> None:
    meta = OtelKVWorkerMeta(
        inner=ForeignMeta(["x"]),
        transfers={"r1": TransferRecord("r1", "ok", bytes=3, first_post_unix=1.5)},
        expired_sends={"s1"},
    )
    assert pickle.loads(pickle.dumps(meta)) == meta


# ------------------------------------------------------------------ payload helpers


def test_merge_payload_adds_counters_extends_histograms_replaces_gauges() -> None:
    into = {"c": {"a|x": 1}, "h": {"h|x": [0.1]}, "g": {"g|x": 5, "g|y": 1}}
    merge_payload(into, {"c": {"a|x": 2, "b": 4}, "h": {"h|x": [0.2], "h|y": [0.3]}, "g": {"g|x": 7}})
    assert into == {
        "c": {"a|x": 3, "b": 4},
        "h": {"h|x": [0.1, 0.2], "h|y": [0.3]},
        "g": {"g|x": 7, "g|y": 1},
    }


def test_payload_is_empty() -> None:
    assert new_payload() == {"c": {}, "h": {}, "g": {}}
    assert payload_is_empty(new_payload()) is True
    assert payload_is_empty({"c": {}, "h": {}, "g": {"g": 0}}) is False


# ------------------------------------------------------------------ OtelKVStats


def test_stats_default_payload_and_emptiness() -> None:
    stats = OtelKVStats()
    assert stats.data == {"c": {}, "h": {}, "g": {}}
    assert stats.is_empty() is True
    assert stats.reduce() == {}
    assert OtelKVStats(inner=NixlKVConnectorStats()).is_empty() is True
    assert OtelKVStats(inner=nixl_stats((1000, 10, 100, 1))).is_empty() is False
    assert OtelKVStats(data={"c": {"m": 1}, "h": {}, "g": {}}).is_empty() is False


def test_stats_aggregate_two_with_real_nixl_inner() -> None:
    a = OtelKVStats(data={"c": {"m|x": 1}, "h": {}, "g": {}}, inner=nixl_stats((2000, 100, 1 << 20, 4)))
    b = OtelKVStats(
        data={"c": {"m|x": 2}, "h": {"t|D->P|UCX": [0.5]}, "g": {}},
        inner=nixl_stats((4000, 300, 3 << 20, 8)),
    )
    assert a.aggregate(b) is a
    assert a.data == {"c": {"m|x": 3}, "h": {"t|D->P|UCX": [0.5]}, "g": {}}
    assert isinstance(a.inner, NixlKVConnectorStats)
    assert a.inner.data["transfer_duration"] == [0.002, 0.004]
    assert a.inner.data["bytes_transferred"] == [1 << 20, 3 << 20]
    assert a.inner.data["num_descriptors"] == [4, 8]
    expected = nixl_stats((2000, 100, 1 << 20, 4), (4000, 300, 3 << 20, 8)).reduce()
    assert a.reduce() == expected
    assert a.reduce()["Num successful transfers"] == 2
    assert a.reduce()["Avg MB per transfer"] == 2.0


def test_stats_aggregate_bare_inner_stats_and_none_inner() -> None:
    # The scheduler-side stats of the inner connector may arrive unwrapped.
    stats = OtelKVStats()
    stats.aggregate(nixl_stats((1000, 10, 100, 1)))
    assert isinstance(stats.inner, NixlKVConnectorStats)
    assert stats.inner.num_successful_transfers == 1
    stats.aggregate(OtelKVStats(data={"c": {"m": 1}, "h": {}, "g": {}}))
    assert stats.inner.num_successful_transfers == 1
    assert stats.data["c"] == {"m": 1}


def test_stats_reset_clears_both() -> None:
    stats = OtelKVStats(data={"c": {"m": 1}, "h": {}, "g": {}}, inner=nixl_stats((1000, 10, 100, 1)))
    stats.reset()
    assert stats.data == new_payload()
    assert stats.inner is not None and stats.inner.num_successful_transfers == 0
    assert stats.is_empty() is True


def test_stats_to_dict_shape() -> None:
    inner = nixl_stats((1000, 10, 100, 1))
    stats = OtelKVStats(data={"c": {"m|x": 1}, "h": {}, "g": {}}, inner=inner)
    out = stats.to_dict()
    assert list(out) == ["otelkv", "inner"]
    assert out["otelkv"] == {"c": {"m|x": 1}, "h": {}, "g": {}}
    assert out["inner"] == inner.to_dict()
    assert OtelKVStats().to_dict() == {"otelkv": new_payload(), "inner": None}


def test_stats_to_dict_roundtrips_through_msgpack() -> None:
    stats = OtelKVStats(
        data={
            "c": {"otelkv_pull_decisions|pull|pulled": 2},
            "h": {"otelkv_kv_transfer_seconds|D->P|UCX": [0.01, 0.02]},
            "g": {"otelkv_kv_retained_blocks|decode_ttl": 5},
        },
        inner=nixl_stats((1500, 20, 4096, 2)),
    )
    payload = stats.to_dict()
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(payload))
    assert decoded == payload
    assert decoded["inner"]["transfer_duration"] == [0.0015]


def test_stats_pickle_roundtrip() -> None:
    stats = OtelKVStats(
        data={"c": {"m": 1}, "h": {"h": [0.1]}, "g": {}}, inner=nixl_stats((1000, 10, 100, 1))
    )
    clone = pickle.loads(pickle.dumps(stats))
    assert clone == stats
    assert type(clone.inner) is NixlKVConnectorStats
    assert clone.reduce() == stats.reduce()
