"""Scheduler-side spans and counters, driven hook by hook in vLLM's call order.

A fresh in-memory exporter per test; requests are plain objects with the attributes
vLLM's ``Request`` has. The fleet tests cover the same paths against real engines.
"""

from __future__ import annotations

import base64
import time
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from vllm.v1.outputs import KVConnectorOutput

from otelkv import names
from otelkv.engine.config import EngineSettings
from otelkv.engine.guard import ErrorLedger
from otelkv.engine.messages import OtelKVWorkerMeta, TransferRecord
from otelkv.engine.scheduler_observer import SchedulerObserver, base_request_id, engine_resource_attributes
from otelkv.engine.span_export import InProcessWriter
from tests.unit import fakes
from tests.unit.prom_exposition import exposed

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
HANDLE = fakes.DECODE_HANDLE


def make_observer(**settings: Any) -> tuple[SchedulerObserver, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    defaults: dict[str, Any] = {
        "engine_id": "prefill-0",
        "kv_role": "kv_producer",
        "model": "tiny",
        "bidirectional": True,
        "recompute_threshold": 64,
        "decoder_ttl_s": 12.0,
        "block_size": fakes.BLOCK_SIZE,
        "prefix_hash_algo": "sha256",
    }
    defaults.update(settings)
    observer = SchedulerObserver(
        EngineSettings(**defaults),
        ErrorLedger(),
        InProcessWriter(exporter),
        connector_name="NixlPullConnector",
        bytes_per_block=65536,
    )
    return observer, exporter


def make_request(
    params: dict[str, Any] | None, *, prompt: int = 150, rid: str = "chatcmpl-abc-12345678"
) -> Any:
    return fakes.TokenRequest(
        request_id=rid,
        kv_transfer_params=dict(params) if params else None,
        trace_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        session_id="conv-1",
        num_prompt_tokens=prompt,
        num_output_tokens=1,
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
    )


def spans_by_name(exporter: InMemorySpanExporter) -> dict[str, Any]:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_base_request_id_strips_only_vllms_suffix() -> None:
    assert base_request_id("chatcmpl-abc-12345678") == "chatcmpl-abc"
    assert base_request_id("cmpl-abc-0-b513301f") == "cmpl-abc-0"
    assert base_request_id("no-suffix-here") == "no-suffix-here"
    assert base_request_id("chatcmpl-abc-XYZ45678") == "chatcmpl-abc-XYZ45678"


def test_reverse_pull_is_recorded_on_request_and_transfer_spans() -> None:
    observer, exporter = make_observer()
    req = make_request(HANDLE)
    observer.on_new_request(req)
    observer.on_matched(req, 32, (98, True))
    observer.on_alloc(req, 98)
    observer.on_alloc(req, 0)  # vLLM's second call after the load: ignored
    record = TransferRecord(
        req.request_id, "ok", bytes=262144, descriptors=2, handles=1, xfer_s=0.012, post_s=0.001
    )
    output = KVConnectorOutput(finished_recving={req.request_id})
    observer.on_output(output, OtelKVWorkerMeta(transfers={req.request_id: record}))
    observer.on_finished(req, [[1, 2, 3, 4, 5]], (True, None))

    spans = spans_by_name(exporter)
    request = spans["kv_request prefill"]
    transfer = spans["kv_transfer D->P"]
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert format(request.parent.span_id, "016x") == PARENT_ID
    assert transfer.parent.span_id == request.context.span_id
    a = request.attributes
    assert a[names.PULL_DECISION] == names.DECISION_PULL
    assert a[names.PULL_REASON] == names.REASON_PULLED
    assert (a[names.TOKENS_LOCAL_CACHE_HIT], a[names.TOKENS_PULLED], a[names.TOKENS_COMPUTED]) == (32, 98, 20)
    assert a[names.TOKENS_REMOTE_REUSABLE] == 98
    assert a[names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 130
    assert a[names.REMOTE_REQUEST_ID] == "chatcmpl-prev-0badf00d"
    assert a[names.GEN_AI_CONVERSATION_ID] == "conv-1"
    assert a[names.GEN_AI_REQUEST_ID] == "chatcmpl-abc"
    assert names.ENGINE_ID not in a  # engine-wide: on the resource
    assert a[names.REQUEST_OUTCOME] == names.OUTCOME_FINISHED
    t = transfer.attributes
    assert (t[names.TRANSFER_BYTES], t[names.TRANSFER_DESCRIPTORS], t[names.TRANSFER_OUTCOME]) == (
        262144,
        2,
        "ok",
    )
    assert t[names.TRANSFER_XFER_SECONDS] == 0.012

    payload = observer.take_payload()
    assert payload is not None
    m = exposed(payload)
    assert m.value("otelkv_pull_decisions_total", decision="pull", reason="pulled") == 1
    assert m.value("otelkv_kv_transfer_bytes_total", direction="D->P", backend="UCX") == 262144
    assert m.value("otelkv_prefill_tokens_total", role="prefill", source="pulled") == 98
    assert m.value("otelkv_prefill_tokens_total", role="prefill", source="computed") == 20
    assert m.value("otelkv_kv_transfer_seconds_count", direction="D->P", backend="UCX") == 1
    assert m.value("otelkv_kv_transfer_seconds_sum", direction="D->P", backend="UCX") == 0.012
    # The prefill node keeps its prompt for the decode node: a lease retention is open.
    assert m.value("otelkv_kv_retained_blocks", kind="prefill_lease") == 5
    assert observer.take_payload() is None


def test_declined_expired_read_fails_the_request_with_the_reason() -> None:
    observer, exporter = make_observer()
    req = make_request(HANDLE)
    observer.on_new_request(req)
    observer.on_matched(req, 32, (98, True))
    observer.on_alloc(req, 98)
    # vLLM fails the request (FINISHED_ERROR) before it reports the failed load.
    req.status = SimpleNamespace(name="FINISHED_ERROR")
    observer.on_finished(req, [[1, 2, 3]], (False, None))
    assert exporter.get_finished_spans() == ()
    record = TransferRecord(req.request_id, names.TRANSFER_DECLINED_EXPIRED)
    output = KVConnectorOutput(finished_recving={req.request_id}, failed_recving={req.request_id})
    observer.on_output(output, OtelKVWorkerMeta(transfers={req.request_id: record}))

    spans = spans_by_name(exporter)
    request = spans["kv_request prefill"]
    assert request.attributes[names.PULL_REASON] == names.REASON_DECLINED_EXPIRED
    assert request.attributes[names.REQUEST_OUTCOME] == names.OUTCOME_FAILED_KV_LOAD
    assert request.attributes[names.TOKENS_PULLED] == 0
    assert request.status.status_code.name == "ERROR"
    assert "declined_expired" in request.status.description
    assert spans["kv_transfer D->P"].attributes[names.TRANSFER_OUTCOME] == names.TRANSFER_DECLINED_EXPIRED
    payload = observer.take_payload()
    assert payload is not None
    m = exposed(payload)
    assert m.value("otelkv_pull_decisions_total", decision="pull", reason="declined_expired") == 1
    assert m.value("otelkv_requests_total", role="prefill", outcome="failed_kv_load") == 1


def test_a_request_waiting_too_long_for_remote_kv_is_reported_stuck_once() -> None:
    observer, exporter = make_observer(stuck_after_s=0.05, bidirectional=False)
    req = make_request(HANDLE)
    observer.on_new_request(req)
    observer.on_matched(req, 0, (130, True))
    observer.on_alloc(req, 130)
    observer.on_step()
    assert exporter.get_finished_spans() == ()
    time.sleep(0.08)
    observer.on_step()
    spans = spans_by_name(exporter)
    request = spans["kv_request prefill"]
    assert request.attributes[names.REQUEST_OUTCOME] == names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV
    assert request.attributes[names.PULL_REASON] == names.REASON_BIDIRECTIONAL_OFF
    assert spans["kv_transfer D->P"].attributes[names.TRANSFER_OUTCOME] == names.TRANSFER_STUCK
    # The client eventually gives up: vLLM aborts the request. Nothing ends twice.
    req.status = SimpleNamespace(name="FINISHED_ABORTED")
    observer.on_finished(req, [[1]], (False, None))
    observer.on_step()
    assert len(exporter.get_finished_spans()) == 2


def test_decode_retention_ends_consumed_or_expired() -> None:
    observer, exporter = make_observer(engine_id="decode-0", kv_role="kv_consumer")
    read, lapsed = (
        make_request({"do_remote_prefill": True}, rid=f"chatcmpl-{n}-12345678") for n in ("read", "lapsed")
    )
    for req in (read, lapsed):
        observer.on_new_request(req)
        observer.on_matched(req, 0, (150, True))
        observer.on_alloc(req, 150)
        observer.on_output(KVConnectorOutput(finished_recving={req.request_id}), None)
    now = time.perf_counter()
    observer.on_finished(read, [[1, 2, 3, 4]], (True, {"remote_blocks_expiry_time": now + 12.0}))
    observer.on_finished(lapsed, [[5, 6]], (True, {"remote_blocks_expiry_time": now + 12.0}))
    gauges = observer.take_payload()
    assert gauges is not None and gauges["g"]["otelkv_kv_retained_blocks|decode_ttl"] == 6
    assert gauges["g"]["otelkv_kv_retained_bytes|decode_ttl"] == 6 * 65536
    observer.on_output(KVConnectorOutput(finished_sending={read.request_id}), None)
    observer.on_output(
        KVConnectorOutput(finished_sending={lapsed.request_id}),
        OtelKVWorkerMeta(expired_sends={lapsed.request_id}),
    )
    retentions = [s for s in exporter.get_finished_spans() if s.name == "kv_retention decode_ttl"]
    outcomes = {s.attributes[names.REQUEST_ID]: s.attributes[names.RETENTION_OUTCOME] for s in retentions}
    assert outcomes == {read.request_id: names.RETENTION_CONSUMED, lapsed.request_id: names.RETENTION_EXPIRED}
    assert all(abs(s.attributes[names.RETENTION_TTL_SECONDS] - 12.0) < 0.1 for s in retentions)
    payload = observer.take_payload()
    assert payload is not None
    m = exposed(payload)
    assert m.value("otelkv_kv_retentions_total", kind="decode_ttl", outcome="consumed") == 1
    assert m.value("otelkv_kv_retentions_total", kind="decode_ttl", outcome="expired") == 1
    assert m.value("otelkv_kv_retained_blocks", kind="decode_ttl") == 0
    decode_spans = [s for s in exporter.get_finished_spans() if s.name == "kv_request decode"]
    assert {s.attributes[names.KV_PARAMS_RETURNED] for s in decode_spans} == {True}


def test_decode_without_bidirectional_records_the_missing_handle() -> None:
    observer, exporter = make_observer(engine_id="decode-0", kv_role="kv_consumer", bidirectional=False)
    req = make_request({"do_remote_prefill": True})
    observer.on_new_request(req)
    observer.on_matched(req, 0, (150, True))
    observer.on_alloc(req, 150)
    observer.on_output(KVConnectorOutput(finished_recving={req.request_id}), None)
    observer.on_finished(req, [[1, 2]], (False, None))
    (request,) = [s for s in exporter.get_finished_spans() if s.name == "kv_request decode"]
    assert request.attributes[names.KV_PARAMS_RETURNED] is False
    # Configuration in force is stated once per engine, on the resource.
    assert (
        engine_resource_attributes(observer.settings, "NixlPullConnector")[names.BIDIRECTIONAL_KV_XFER]
        is False
    )
    assert names.BIDIRECTIONAL_KV_XFER not in request.attributes
    assert not [s for s in exporter.get_finished_spans() if s.name.startswith("kv_retention")]


def test_shutdown_ends_open_retentions_as_dropped() -> None:
    observer, exporter = make_observer(engine_id="decode-0", kv_role="kv_consumer")
    req = make_request({"do_remote_prefill": True})
    observer.on_new_request(req)
    observer.on_finished(req, [[1, 2]], (True, {"remote_blocks_expiry_time": time.perf_counter() + 60}))
    observer.shutdown()
    (retention,) = [s for s in exporter.get_finished_spans() if s.name.startswith("kv_retention")]
    assert retention.attributes[names.RETENTION_OUTCOME] == names.RETENTION_DROPPED


def test_untraced_requests_still_count() -> None:
    observer, exporter = make_observer()
    req = make_request(None)
    req.trace_headers = None
    observer.on_new_request(req)
    observer.on_matched(req, 64, (0, False))
    observer.on_alloc(req, 0)
    observer.on_finished(req, [[1]], (False, None))
    (span,) = exporter.get_finished_spans()
    assert span.name == "kv_request unified"
    assert span.parent is None
    assert names.PULL_DECISION not in span.attributes
    payload = observer.take_payload()
    assert payload is not None
    m = exposed(payload)
    assert m.value("otelkv_prefill_tokens_total", role="unified", source="local_cache") == 64
    assert m.total("otelkv_pull_decisions_total") == 0


def _finish_one(observer: Any, req: Any) -> None:
    observer.on_new_request(req)
    observer.on_matched(req, 0, (0, False))
    observer.on_alloc(req, 0)
    observer.on_finished(req, [[1]], (False, None))


@pytest.mark.parametrize(
    ("headers", "xargs", "parent", "source", "counted"),
    [
        # vLLM tracing off or headers dropped by the router: the body's context is the parent.
        (None, {"otelkv_traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, PARENT_ID, "body", "used"),
        # Headers win over the body (nothing read from it, nothing counted).
        (
            {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
            {"otelkv_traceparent": f"00-{'1' * 32}-{'2' * 16}-01"},
            PARENT_ID,
            "headers",
            None,
        ),
        (None, {"otelkv_traceparent": "00-zz-yy-01"}, None, "none", "malformed"),
        (None, {"otelkv_traceparent": 42}, None, "none", "malformed"),
        (
            None,
            {"otelkv_traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01" + "x" * 200},
            None,
            "none",
            "malformed",
        ),
        (None, {"other": "x"}, None, "none", None),
        (None, None, None, "none", None),
    ],
)
def test_trace_context_from_the_body_when_the_headers_have_none(
    headers: Any, xargs: Any, parent: str | None, source: str, counted: str | None
) -> None:
    observer, exporter = make_observer()
    req = make_request(None)
    req.trace_headers = headers
    req.sampling_params = SimpleNamespace(extra_args=xargs)
    _finish_one(observer, req)
    (span,) = exporter.get_finished_spans()
    assert span.attributes[names.TRACE_CONTEXT_SOURCE] == source
    if parent is None:
        assert span.parent is None
    else:
        assert format(span.parent.span_id, "016x") == parent
        assert format(span.context.trace_id, "032x") == TRACE_ID
    m = exposed(observer.take_payload() or {})
    for outcome in names.BODY_CONTEXT_OUTCOMES:
        expected = 1 if outcome == counted else 0
        assert m.value("otelkv_body_trace_context_total", outcome=outcome) == expected


@pytest.mark.parametrize(("kind", "streamed"), [("DELTA", True), ("FINAL_ONLY", False), (None, None)])
def test_whether_the_request_streamed_is_recorded(kind: str | None, streamed: bool | None) -> None:
    observer, exporter = make_observer()
    req = make_request(None)
    req.sampling_params = SimpleNamespace(
        extra_args=None, output_kind=SimpleNamespace(name=kind) if kind else None
    )
    _finish_one(observer, req)
    (span,) = exporter.get_finished_spans()
    assert span.attributes.get(names.REQUEST_STREAMED) is streamed


def test_a_mismatch_with_the_connector_is_counted_not_published() -> None:
    observer, exporter = make_observer()
    req = make_request(HANDLE)
    observer.on_new_request(req)
    observer.on_matched(req, 32, (0, False))  # a future vLLM that decided differently
    observer.on_alloc(req, 0)
    observer.on_finished(req, [[1]], (False, None))
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "kv_request prefill"]
    assert names.PULL_REASON not in span.attributes
    assert observer.errors.total["decision_mismatch"] == 1


@pytest.mark.parametrize("hook", ["on_new_request", "on_matched", "on_alloc", "on_finished", "on_output"])
def test_observer_errors_are_swallowed_and_counted(hook: str) -> None:
    observer, _ = make_observer()
    broken = object()  # has none of the attributes a vLLM Request has
    args: dict[str, tuple[Any, ...]] = {
        "on_new_request": (broken,),
        "on_matched": (broken, 0, (0, False)),
        "on_alloc": (broken, 0),
        "on_finished": (broken, [], (False, None)),
        "on_output": (broken, None),
    }
    sites = {
        "on_new_request": "on_new_request",
        "on_matched": "get_num_new_matched_tokens",
        "on_alloc": "update_state_after_alloc",
        "on_finished": "request_finished",
        "on_output": "update_connector_output",
    }
    assert getattr(observer, hook)(*args[hook]) is None
    assert dict(observer.errors.total) == {sites[hook]: 1}


def test_decode_hands_back_a_digest_and_prefill_checks_the_prompt_against_it() -> None:
    """The decode node's returned handle carries the digest of the tokens its KV covers; the
    next prefill request records how much of its prompt those tokens match."""
    from otelkv.engine import continuity

    decode, _ = make_observer(engine_id="decode-0", kv_role="kv_consumer")
    held = list(range(100, 244))  # 128 prompt tokens and 16 generated
    d_req = make_request({"do_remote_prefill": True}, prompt=128, rid="chatcmpl-prev-0badf00d")
    d_req.all_token_ids = [*held, 9]  # the last generated token has no KV yet
    d_req.num_computed_tokens = len(held)
    decode.on_new_request(d_req)
    returned = {
        "do_remote_decode": True,
        "remote_block_ids": [[1, 2, 3, 4, 5]],
        "remote_num_tokens": len(held),
    }
    decode.on_finished(d_req, [[1, 2, 3, 4, 5]], (True, returned))
    written = returned[names.XARG_CONTINUITY]
    assert (written["n"], written["prompt"]) == (144, 128)  # the KV's tokens, not the last one
    parsed = continuity.parse(written)
    assert parsed is not None and (parsed.n, parsed.prompt, parsed.hashing) == (
        144,
        128,
        fakes.block_hashing(),
    )
    # 9 blocks of 16: one hash per 2 blocks (32 tokens), and the last block's.
    assert len(base64.b64decode(parsed.hashes_text)) == 5 * continuity.HASH_BYTES
    # A prefill node's own finished request (its handle for decode) gets no digest.
    p_obs, _ = make_observer()
    p_req = make_request({"do_remote_decode": True}, prompt=128)
    p_req.all_token_ids, p_req.num_computed_tokens = held[:128], 128
    p_obs.on_new_request(p_req)
    p_returned = {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3, 4]]}
    p_obs.on_finished(p_req, [[1, 2, 3, 4]], (True, p_returned))
    assert names.XARG_CONTINUITY not in p_returned

    prefill, exporter = make_observer()
    handle = {
        **HANDLE,
        "remote_num_tokens": len(held),
        names.XARG_CONTINUITY: returned[names.XARG_CONTINUITY],
    }
    rewritten = make_request(handle, prompt=180)
    rewritten.prompt_token_ids = held[:7] + list(range(900, 1073))  # history rewritten
    prefill.on_new_request(rewritten)
    prefill.on_matched(rewritten, 0, (144, True))
    prefill.on_alloc(rewritten, 144)
    prefill.on_output(KVConnectorOutput(finished_recving={rewritten.request_id}), None)
    prefill.on_finished(rewritten, [[1]], (False, None))
    a = spans_by_name(exporter)["kv_request prefill"].attributes
    assert a[names.CONTINUITY_DIGEST] is True
    assert (a[names.CONTINUITY_OFFERED], a[names.CONTINUITY_MATCHING]) == (144, 0)
    assert (a[names.CONTINUITY_FIRST_MISMATCH], a[names.CONTINUITY_MISMATCH_IN]) == (
        0,
        names.CONTINUITY_IN_HISTORY,
    )
    payload = prefill.take_payload()
    assert payload is not None
    assert exposed(payload).value("otelkv_continuity_tokens_total", outcome="mismatch") == 144

    plain, exporter = make_observer()
    old_handle = make_request(HANDLE, prompt=150)  # a handle from an engine without otelkv
    old_handle.prompt_token_ids = list(range(150))
    plain.on_new_request(old_handle)
    plain.on_matched(old_handle, 0, (0, False))
    plain.on_alloc(old_handle, 0)
    plain.on_finished(old_handle, [[1]], (False, None))
    a = spans_by_name(exporter)["kv_request prefill"].attributes
    assert a[names.CONTINUITY_DIGEST] is False and names.CONTINUITY_OFFERED not in a


def _handle_for(tokens: list[int], prompt: int) -> dict[str, Any]:
    """A decode handle for KV computed over ``tokens``, with the digest otelkv's decode node writes."""

    return {
        **HANDLE,
        "remote_num_tokens": len(tokens),
        names.XARG_CONTINUITY: fakes.decode_digest(tokens, prompt),
    }


def test_guard_mode_refuses_a_handle_whose_kv_belongs_to_other_tokens() -> None:
    """Guard mode's verdict, and the span and counters of a refused handle: vLLM recomputes
    (the connector matched 0), the reason says why, nothing counts as an instrumentation error."""
    observer, exporter = make_observer(continuity=names.CONTINUITY_MODE_GUARD)
    assert observer.guarding
    held = list(range(100, 244))
    req = make_request(_handle_for(held, 128), prompt=180)
    req.prompt_token_ids = held[:40] + list(range(900, 1040))  # rewritten from token 40 on
    observer.on_new_request(req)
    assert observer.refuses(req) is True
    observer.on_matched(req, 0, (0, False), refused=True)
    observer.on_alloc(req, 0)
    observer.on_finished(req, [[1]], (False, None))
    a = spans_by_name(exporter)["kv_request prefill"].attributes
    assert (a[names.PULL_DECISION], a[names.PULL_REASON]) == (
        names.DECISION_RECOMPUTE,
        names.REASON_CONTINUITY_MISMATCH,
    )
    assert a[names.TOKENS_PULLED] == 0 and a[names.TOKENS_REMOTE_REUSABLE] == 144
    assert (a[names.CONTINUITY_FIRST_MISMATCH], a[names.CONTINUITY_MATCHING]) == (32, 32)
    payload = observer.take_payload()
    assert payload is not None
    m = exposed(payload)
    assert m.value("otelkv_pull_decisions_total", decision="recompute", reason="continuity_mismatch") == 1
    assert m.value("otelkv_continuity_tokens_total", outcome="refused") == 144
    assert m.value("otelkv_continuity_tokens_total", outcome="mismatch") == 0
    assert dict(observer.errors.total) == {}


@pytest.mark.parametrize(
    "case",
    ["matching", "no digest", "decode role", "unknown request"],
)
def test_guard_mode_refuses_only_a_proven_mismatch(case: str) -> None:
    """A handle that matches, one without a digest (an engine without otelkv wrote it), a
    decode-role request and a request otelkv never saw are all loaded as vLLM would."""
    held = list(range(100, 244))
    observer, _ = make_observer(continuity=names.CONTINUITY_MODE_GUARD)
    handle = _handle_for(held, 128) if case != "no digest" else dict(HANDLE)
    if case == "decode role":
        handle = {"do_remote_prefill": True}
    req = make_request(handle, prompt=180)
    req.prompt_token_ids = [*held, *range(900, 936)]  # extends the held tokens
    if case == "no digest":
        req.prompt_token_ids = list(range(180))
    if case != "unknown request":
        observer.on_new_request(req)
    assert observer.refuses(req) is False
    assert dict(observer.errors.total) == {}


def test_observe_mode_is_the_default_and_says_so_on_the_resource() -> None:
    observer, _ = make_observer()
    assert not observer.guarding
    settings = EngineSettings(continuity=names.CONTINUITY_MODE_GUARD)
    resource = engine_resource_attributes(settings, "NixlPullConnector")
    assert resource[names.CONTINUITY_VERIFY] == names.CONTINUITY_MODE_GUARD
