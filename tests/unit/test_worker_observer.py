"""The worker-side probe attributes NIXL telemetry to requests without changing calls.

The NIXL worker here is a stand-in with the few members the probe touches; the real
one is exercised by the fleet tests.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from otelkv import names
from otelkv.engine.guard import ErrorLedger
from otelkv.engine.worker_observer import WorkerObserver


class FakeAgent:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.next_handle = 100
        self.tag = "agent"

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> int:
        self.calls.append(("make_prepped_xfer", args, kwargs))
        self.next_handle += 1
        return self.next_handle

    def get_xfer_telemetry(self, handle: int) -> Any:
        self.calls.append(("get_xfer_telemetry", (handle,), {}))
        return SimpleNamespace(totalBytes=131072, descCount=2, xferDuration=12000, postDuration=400)

    def check_xfer_state(self, handle: int) -> str:
        return "DONE"


class FakeNixlWorker:
    def __init__(self) -> None:
        self.nixl_wrapper: Any = FakeAgent()
        self._reqs_to_send: dict[str, float] = {}
        self.expired_next: set[str] = set()

    def _is_turn2_read_expired(self, meta: Any) -> bool:
        return bool(meta.remote.request_id.startswith("old"))

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        # Like vLLM: only leases it still tracks can expire.
        expired = {r for r in self.expired_next if r in self._reqs_to_send}
        for request_id in expired:
            del self._reqs_to_send[request_id]
        done_sending |= expired


def req_meta(remote_id: str) -> Any:
    return SimpleNamespace(remote=SimpleNamespace(request_id=remote_id, engine_id="decode-0"))


def make() -> tuple[WorkerObserver, FakeNixlWorker, FakeAgent]:
    worker = FakeNixlWorker()
    agent = worker.nixl_wrapper
    observer = WorkerObserver(ErrorLedger(), SimpleNamespace(connector_worker=worker))
    return observer, worker, agent


def test_probe_forwards_to_the_real_agent_unchanged() -> None:
    observer, worker, agent = make()
    assert observer.attached == ["nixl_agent", "expiry_decline", "lease_expiry"]
    handle = worker.nixl_wrapper.make_prepped_xfer("READ", 1, [2], 3, [4], notif_msg=b"x:1")
    assert handle == 101 and agent.calls[0] == (
        "make_prepped_xfer",
        ("READ", 1, [2], 3, [4]),
        {"notif_msg": b"x:1"},
    )
    assert worker.nixl_wrapper.tag == "agent"  # other attributes pass through
    assert worker.nixl_wrapper.check_xfer_state(handle) == "DONE"
    worker.nixl_wrapper.tag = "changed"
    assert agent.tag == "changed"


def test_bytes_and_durations_are_attributed_to_the_reading_request() -> None:
    observer, worker, _ = make()
    observer.before_load(SimpleNamespace(reqs_to_recv={"local-1": req_meta("remote-9")}))
    handles = [
        worker.nixl_wrapper.make_prepped_xfer("READ", 1, [2], 3, [4], notif_msg=b"remote-9:1")
        for _ in range(2)
    ]
    for h in handles:
        worker.nixl_wrapper.get_xfer_telemetry(h)
    observer.after_results(KVConnectorTransferResults(finished_recving={"local-1"}))
    meta = observer.take_meta(None)
    assert meta is not None
    record = meta.transfers["local-1"]
    assert (record.bytes, record.descriptors, record.handles) == (262144, 4, 2)
    assert record.xfer_s == 0.024 and record.post_s == 0.0008
    assert record.outcome == names.TRANSFER_OK and record.remote_engine_id == "decode-0"
    assert observer.take_meta(None) is None  # each record is shipped once


def test_declined_expired_reads_and_reaped_leases_are_told_apart() -> None:
    observer, worker, _ = make()
    observer.before_load(
        SimpleNamespace(reqs_to_recv={"late": req_meta("old-1"), "broken": req_meta("new-1")})
    )
    assert worker._is_turn2_read_expired(req_meta("old-1")) is True
    assert worker._is_turn2_read_expired(req_meta("new-1")) is False
    worker._reqs_to_send = {"kept-for-p": 0.0}
    worker.expired_next = {"kept-for-p"}
    done: set[str] = {"read-by-p"}
    worker._reap_expired_send_leases(done)
    assert done == {"read-by-p", "kept-for-p"}  # the real method's effect is intact
    observer.after_results(
        KVConnectorTransferResults(finished_recving={"late", "broken"}, failed_recving={"late", "broken"})
    )
    inner = object()
    meta = observer.take_meta(inner)
    assert meta is not None and meta.inner is inner
    assert meta.transfers["late"].outcome == names.TRANSFER_DECLINED_EXPIRED
    assert meta.transfers["broken"].outcome == names.TRANSFER_FAILED
    assert meta.expired_sends == {"kept-for-p"}


def test_inner_meta_passes_even_when_otelkv_has_nothing() -> None:
    observer, _, _ = make()
    inner = object()
    meta = observer.take_meta(inner)
    assert meta is not None and meta.inner is inner and not meta.transfers


def test_connector_without_nixl_worker_gets_no_probe() -> None:
    observer = WorkerObserver(ErrorLedger(), SimpleNamespace())
    assert observer.attached == []
    assert observer.take_meta(None) is None


def test_probe_errors_never_reach_the_transfer_path() -> None:
    observer, worker, _ = make()
    observer.errors.fault_sites = frozenset({"all"})
    observer.before_load(SimpleNamespace(reqs_to_recv={"local-1": req_meta("remote-9")}))
    handle = worker.nixl_wrapper.make_prepped_xfer("READ", 1, [2], 3, [4], notif_msg=b"remote-9:1")
    telemetry = worker.nixl_wrapper.get_xfer_telemetry(handle)
    assert handle == 101 and telemetry.totalBytes == 131072
    assert observer.errors.total["worker.make_prepped_xfer"] == 1
    assert observer.errors.total["worker.get_xfer_telemetry"] == 1
