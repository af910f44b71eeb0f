"""Worker-side measurements (vLLM worker process): what each KV read moved, and how long.

vLLM's NIXL stats carry bytes and durations per transfer but no request id. otelkv gets
them per request by putting a thin probe in front of the worker's NIXL agent
(``connector_worker.nixl_wrapper``): ``make_prepped_xfer`` tells which request a handle
belongs to (its notification names the remote request), ``get_xfer_telemetry`` - which
vLLM calls once per finished handle - gives the bytes, descriptors and durations. Both
calls go to the real agent unchanged; the probe only looks at arguments and results.

Two more facts need vLLM internals, and are read by wrapping a private method on the
worker *instance* (never the class): a turn-2 read declined because the decode node's
blocks (nearly) expired (``_is_turn2_read_expired``), and blocks released because their
lease or TTL ran out (``_reap_expired_send_leases``). When a vLLM version lacks one of
them, otelkv logs it once and reports those cases as plain failures / deadline-based.

Nothing here creates spans: each step's records go to the scheduler in
:class:`~otelkv.engine.messages.OtelKVWorkerMeta`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

from otelkv import names
from otelkv.engine.guard import ErrorLedger, guarded
from otelkv.engine.messages import OtelKVWorkerMeta, TransferRecord

logger = logging.getLogger("vllm.otelkv")

_MAX_TRACKED = 8192
"""Bound on requests tracked between posting a read and its completion (memory cap)."""


class _AgentProbe:
    """Stands in for the NIXL agent; forwards everything, watches two calls."""

    __slots__ = ("_otelkv_agent", "_otelkv_observer")

    def __init__(self, agent: Any, observer: WorkerObserver) -> None:
        object.__setattr__(self, "_otelkv_agent", agent)
        object.__setattr__(self, "_otelkv_observer", observer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._otelkv_agent, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._otelkv_agent, name, value)

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        handle = self._otelkv_agent.make_prepped_xfer(*args, **kwargs)
        notif = kwargs.get("notif_msg", args[5] if len(args) > 5 else None)
        self._otelkv_observer.on_prepped(handle, notif)
        return handle

    def get_xfer_telemetry(self, handle: Any) -> Any:
        result = self._otelkv_agent.get_xfer_telemetry(handle)
        self._otelkv_observer.on_telemetry(handle, result)
        return result


class WorkerObserver:
    """Per-request transfer records for one worker, shipped to the scheduler each step."""

    def __init__(self, errors: ErrorLedger, inner_connector: Any) -> None:
        self.errors = errors
        self._remote_to_local: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._local_to_remote: dict[str, str] = {}
        self._records: OrderedDict[str, TransferRecord] = OrderedDict()
        self._handle_req: dict[Any, str] = {}
        self._declined: set[str] = set()
        self._done: dict[str, TransferRecord] = {}
        self._expired_sends: set[str] = set()
        self.attached: list[str] = []
        self._attach(getattr(inner_connector, "connector_worker", None))

    # ------------------------------------------------------------------ set-up

    def _attach(self, worker: Any) -> None:
        if worker is None or not hasattr(worker, "nixl_wrapper"):
            logger.info("otelkv: inner connector has no NIXL worker; per-request bytes unavailable")
            return
        worker.nixl_wrapper = _AgentProbe(worker.nixl_wrapper, self)
        self.attached.append("nixl_agent")

        is_expired = getattr(worker, "_is_turn2_read_expired", None)
        if callable(is_expired):

            def _is_turn2_read_expired(meta: Any, _orig: Any = is_expired) -> bool:
                expired = _orig(meta)
                if expired:
                    self.on_declined(meta)
                return expired

            worker._is_turn2_read_expired = _is_turn2_read_expired
            self.attached.append("expiry_decline")
        else:
            logger.warning("otelkv: this vLLM has no _is_turn2_read_expired; expired reads show as failed")

        reap = getattr(worker, "_reap_expired_send_leases", None)
        if callable(reap):

            def _reap_expired_send_leases(done_sending: set[str], _orig: Any = reap) -> None:
                before = set(done_sending) if getattr(worker, "_reqs_to_send", True) else None
                _orig(done_sending)
                if before is not None and len(done_sending) > len(before):
                    self.on_expired_sends(done_sending - before)

            worker._reap_expired_send_leases = _reap_expired_send_leases
            self.attached.append("lease_expiry")
        else:
            logger.warning("otelkv: this vLLM has no _reap_expired_send_leases; expiry is deadline-based")

    # ------------------------------------------------------------------ probe callbacks

    @guarded("worker.make_prepped_xfer")
    def on_prepped(self, handle: Any, notif: Any) -> None:
        if notif is None:
            return
        text = notif.decode() if isinstance(notif, (bytes, bytearray)) else str(notif)
        remote_request_id = text.rpartition(":")[0] or text
        local = self._remote_to_local.get(remote_request_id)
        if local is None:
            return
        request_id, remote_engine = local
        record = self._records.get(request_id)
        if record is None:
            record = TransferRecord(request_id, names.TRANSFER_OK, remote_engine_id=remote_engine)
            self._records[request_id] = record
        record.handles += 1
        if record.first_post_unix is None:
            record.first_post_unix = time.time()
        self._handle_req[handle] = request_id

    @guarded("worker.get_xfer_telemetry")
    def on_telemetry(self, handle: Any, result: Any) -> None:
        request_id = self._handle_req.pop(handle, None)
        if request_id is None or result is None:
            return
        record = self._records.get(request_id)
        if record is None:
            return
        record.bytes += int(result.totalBytes)
        record.descriptors += int(result.descCount)
        record.xfer_s += result.xferDuration / 1e6
        record.post_s += result.postDuration / 1e6
        record.done_unix = time.time()

    @guarded("worker.expiry_decline")
    def on_declined(self, meta: Any) -> None:
        remote = getattr(meta, "remote", None)
        local = self._remote_to_local.get(getattr(remote, "request_id", None) or "")
        if local is not None:
            self._declined.add(local[0])

    @guarded("worker.lease_expiry")
    def on_expired_sends(self, request_ids: set[str]) -> None:
        self._expired_sends |= request_ids

    # ------------------------------------------------------------------ connector hooks

    @guarded("worker.start_load_kv")
    def before_load(self, metadata: Any) -> None:
        reqs = getattr(metadata, "reqs_to_recv", None)
        if not reqs:
            return
        for request_id, meta in reqs.items():
            remote = getattr(meta, "remote", None)
            if remote is None:
                continue
            self._remote_to_local[remote.request_id] = (request_id, remote.engine_id)
            self._local_to_remote[request_id] = remote.request_id
        while len(self._remote_to_local) > _MAX_TRACKED:
            _, (local, _engine) = self._remote_to_local.popitem(last=False)
            self._local_to_remote.pop(local, None)
        while len(self._records) > _MAX_TRACKED:
            self._records.popitem(last=False)

    @guarded("worker.get_transfer_results")
    def after_results(self, results: Any) -> None:
        finished = results.finished_recving
        if not finished:
            return
        failed = results.failed_recving or ()
        for request_id in finished:
            record = self._records.pop(request_id, None) or TransferRecord(request_id, names.TRANSFER_OK)
            if request_id in failed:
                record.outcome = (
                    names.TRANSFER_DECLINED_EXPIRED if request_id in self._declined else names.TRANSFER_FAILED
                )
            self._declined.discard(request_id)
            remote_id = self._local_to_remote.pop(request_id, None)
            if remote_id is not None:
                self._remote_to_local.pop(remote_id, None)
            self._done[request_id] = record

    def take_meta(self, inner: Any) -> OtelKVWorkerMeta | None:
        """This step's records wrapped around the inner connector's worker meta."""
        if not self._done and not self._expired_sends:
            return None if inner is None else OtelKVWorkerMeta(inner=inner)
        meta = OtelKVWorkerMeta(inner=inner, transfers=self._done, expired_sends=self._expired_sends)
        self._done = {}
        self._expired_sends = set()
        return meta
