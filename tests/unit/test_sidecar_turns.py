"""The proxy process's turn bookkeeping and its hand-over to the main process, as pure logic:
trace context in and out, what a finished turn record says, how the main process turns it
into the turn span, the channel framing between the two, and the collector forwarder's
re-wrapping of a record as an SDK span.
"""

from __future__ import annotations

import json
import pickle

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from otelkv import names
from otelkv.sidecar import channel
from otelkv.sidecar.forward import readable_span
from otelkv.sidecar.identity import IdPolicy, hashed_id
from otelkv.sidecar.metrics import SidecarMetrics
from otelkv.sidecar.otlp import decode_protobuf
from otelkv.sidecar.recorder import TurnRecorder
from otelkv.sidecar.relay import Request
from otelkv.sidecar.tool_spans import ToolSpanIndex
from otelkv.sidecar.turn_watch import TurnRecord, TurnWatcher, parse_traceparent
from otelkv.spans import SpanRecord

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
S = 1_000_000_000


def _request(
    body: dict | bytes, *, path: bytes = b"/v1/chat/completions", headers=(), method=b"POST"
) -> Request:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Request(method=method, url=path, headers=list(headers), body=raw)


def _chat(**extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


# ------------------------------------------------------------------ trace context


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (f"00-{TRACE}-{PARENT}-01", True),
        (f"00-{TRACE.upper()}-{PARENT}-00", True),  # case-insensitive, unsampled is still a parent
        (f"01-{TRACE}-{PARENT}-01-future", True),  # later versions may append fields
        (f"00-{TRACE}-{PARENT}-01-extra", False),  # version 00 may not
        (f"ff-{TRACE}-{PARENT}-01", False),
        (f"00-{'0' * 32}-{PARENT}-01", False),
        (f"00-{TRACE}-{'0' * 16}-01", False),
        (f"00-{TRACE[:-1]}-{PARENT}-01", False),
        ("", False),
        (None, False),
    ],
)
def test_traceparent_follows_w3c_rules(value: str | None, ok: bool) -> None:
    parent = parse_traceparent(value, "vendor=1")
    assert (parent is not None) is ok
    if parent is not None:
        assert parent.trace_id == TRACE and parent.span_id == PARENT and parent.trace_state == "vendor=1"


def test_watcher_ignores_what_is_not_a_completion() -> None:
    records: list[TurnRecord] = []
    watcher = TurnWatcher(records.append)
    for req in (
        _request(_chat(), method=b"GET"),
        _request(_chat(), path=b"/v1/models"),
        _request(_chat(), path=b"/v1/embeddings"),
    ):
        exchange, extra, body = watcher.begin(req)
        assert exchange is None and extra == [] and body == req.body


def test_turn_joins_the_client_trace_and_replaces_its_context_upstream() -> None:
    records: list[TurnRecord] = []
    watcher = TurnWatcher(records.append)
    req = _request(
        _chat(),
        path=b"/v1/chat/completions?x=1",
        headers=[
            (b"Content-Type", b"application/json"),
            (b"traceparent", f"00-{TRACE}-{PARENT}-01".encode()),
            (b"tracestate", b"vendor=1"),
            (b"X-Conversation-Id", b"conv-1"),
        ],
    )
    exchange, extra, body = watcher.begin(req)
    assert exchange is not None
    sent = dict(extra)
    version, trace_id, span_id, flags = sent[b"traceparent"].decode().split("-")
    assert (version, trace_id, flags) == ("00", TRACE, "01") and span_id != PARENT
    # The same context and the conversation id in the body, for routers that drop headers.
    assert json.loads(body) == {
        **json.loads(req.body),
        "vllm_xargs": {"otelkv_traceparent": sent[b"traceparent"].decode(), "session_id": "conv-1"},
    }
    assert sent[b"tracestate"] == b"vendor=1"
    assert sent[b"X-Session-ID"] == b"conv-1"
    exchange.response_head(200, [(b"Content-Type", b"application/json")])
    exchange.response_body(b'{"id":"r1","choices":[{"message":{"content":"ok"},"finish_reason":"stop"}],')
    exchange.response_body(b'"usage":{"prompt_tokens":3,"completion_tokens":1}}')
    exchange.finish(200, None)
    (rec,) = records
    assert rec.trace_id == TRACE and rec.span_id == span_id and rec.parent is not None
    assert rec.parent.span_id == PARENT and rec.path == "/v1/chat/completions"
    assert rec.identity is not None and rec.identity.conversation_id == "conv-1"
    assert rec.start is not None and rec.start.index == 0
    assert (
        rec.response is not None
        and rec.response.prompt_tokens == 3
        and rec.response.finish_reasons == ["stop"]
    )
    assert rec.status == 200 and rec.error is None and rec.end_ns >= rec.arrival_ns
    pickle.loads(pickle.dumps(rec))  # it crosses a process boundary


def test_new_root_without_parent_and_orphan_tracestate_dropped() -> None:
    watcher = TurnWatcher(lambda r: None)
    _, extra, _ = watcher.begin(_request(_chat(), headers=[(b"tracestate", b"orphan=1")]))
    sent = dict(extra)
    _, trace_id, span_id, _ = sent[b"traceparent"].decode().split("-")
    assert len(trace_id) == 32 and trace_id != "0" * 32 and len(span_id) == 16
    assert b"tracestate" in sent and sent[b"tracestate"] is None  # None: removed upstream


def test_hashed_client_session_header_is_replaced_by_its_hash() -> None:
    """Over the cap or in hash mode, vLLM gets the id the turn span carries, never the raw one."""
    for policy, raw in ((IdPolicy(), "s" * 300), (IdPolicy(hash_all=True), "s-9")):
        watcher = TurnWatcher(lambda r: None, id_policy=policy)
        turn, extra, _ = watcher.begin(_request(_chat(), headers=[(b"X-Session-ID", raw.encode())]))
        assert turn is not None and turn.identity is not None
        assert turn.identity.conversation_id == hashed_id(raw)
        assert dict(extra)[b"X-Session-ID"] == hashed_id(raw).encode()
    # A hashed X-Conversation-Id leaves the client's own X-Session-ID alone.
    watcher = TurnWatcher(lambda r: None, id_policy=IdPolicy(hash_all=True))
    headers = [(b"X-Conversation-Id", b"c"), (b"X-Session-ID", b"s")]
    _, extra, _ = watcher.begin(_request(_chat(), headers=headers))
    assert b"X-Session-ID" not in dict(extra)


def test_session_header_kept_and_body_injection_when_configured() -> None:
    watcher = TurnWatcher(lambda r: None, inject_body_conversation_id=True)
    _, extra, body = watcher.begin(_request(_chat(session_id="s-9"), headers=[(b"x-session-id", b"s-9")]))
    assert b"X-Session-ID" not in dict(extra)  # the client's own header is not doubled
    assert json.loads(body)["conversation_id"] == "s-9"
    _, _, body = watcher.begin(_request(_chat(conversation_id="c-1")))
    assert json.loads(body)["conversation_id"] == "c-1"  # never overwritten


def test_unparsable_body_still_a_turn_and_forwarded_unchanged() -> None:
    records: list[TurnRecord] = []
    watcher = TurnWatcher(records.append)
    exchange, _, body = watcher.begin(_request(b"{not json", headers=[(b"X-Session-ID", b"z")]))
    assert exchange is not None and body == b"{not json"
    exchange.finish(400, None)
    assert records[0].request.model == "" and records[0].status == 400


def test_turn_order_and_previous_trace_across_turns() -> None:
    records: list[TurnRecord] = []
    watcher = TurnWatcher(records.append)
    for _ in range(3):
        exchange, _, _ = watcher.begin(_request(_chat(), headers=[(b"X-Session-ID", b"c")]))
        assert exchange is not None
        exchange.finish(200, None)
    assert [r.start.index for r in records if r.start] == [0, 1, 2]
    assert records[2].start is not None and records[2].start.previous_trace_id == records[1].trace_id
    assert records[2].start.gap_start_ns == records[1].end_ns


# ------------------------------------------------------------------ the main process's side


def _record(**kw: object) -> TurnRecord:
    watcher_records: list[TurnRecord] = []
    watcher = TurnWatcher(watcher_records.append)
    exchange, _, _ = watcher.begin(_request(_chat(stream=True), headers=[(b"X-Session-ID", b"c")]))
    assert exchange is not None
    exchange.response_head(200, [(b"content-type", b"text/event-stream")])
    exchange.response_body(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
    exchange.response_body(b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    exchange.finish(int(kw.pop("status", 200)), kw.pop("error", None))  # type: ignore[arg-type]
    return watcher_records[0]


def _recorder() -> tuple[TurnRecorder, list[SpanRecord], SidecarMetrics]:
    spans: list[SpanRecord] = []
    metrics = SidecarMetrics()
    rec = TurnRecorder(
        metrics=metrics, tools=ToolSpanIndex(), resource={"service.name": "s"}, accept=spans.extend
    )
    return rec, spans, metrics


def test_turn_span_from_record_adds_up_and_carries_its_ids() -> None:
    recorder, spans, _ = _recorder()
    rec = _record()
    recorder.record([rec])
    (span,) = spans
    a = span.attributes
    assert (span.trace_id, span.span_id, span.parent_span_id) == (rec.trace_id, rec.span_id, "")
    assert span.name == "chat m" and span.kind == "Server" and span.scope_name == names.SCOPE_SIDECAR
    assert (span.start_ns, span.end_ns) == (rec.arrival_ns, rec.end_ns)
    assert a[names.GEN_AI_CONVERSATION_ID] == "c" and a[names.TURN_INDEX] == 0
    assert a[names.TURN_TTFT_SOURCE] == names.TTFT_SOURCE_STREAM
    total = sum(a[k] for k in (names.TURN_INPUT_PROCESSING_SECONDS, names.TURN_GENERATION_SECONDS))
    assert total == pytest.approx((rec.end_ns - rec.arrival_ns) / S)
    assert span.status_code == "Unset"


def test_failed_turn_is_an_error_span_and_a_bad_record_is_skipped() -> None:
    recorder, spans, _ = _recorder()
    recorder.record([_record(status=0, error="client disconnected"), "not a record", _record(status=502)])  # type: ignore[list-item]
    assert [s.status_code for s in spans] == ["Error", "Error"]
    assert spans[0].attributes[names.ERROR_TYPE] == "client_disconnected"
    assert spans[1].attributes[names.ERROR_TYPE] == "502" and "502" in spans[1].status_message


def test_channel_frames_survive_any_split() -> None:
    messages = [("turns", [_record()], {"upstream_errors": 1}), ("ack", 7), ("ready", 8800)]
    data = b"".join(channel.encode(m) for m in messages)
    for step in (1, 3, 64, len(data)):
        decoder = channel.Decoder()
        out = []
        for i in range(0, len(data), step):
            out += decoder.feed(data[i : i + step])
        assert [m[0] for m in out] == ["turns", "ack", "ready"] and out[1] == ("ack", 7)


def test_channel_refuses_an_absurd_frame() -> None:
    with pytest.raises(ValueError, match="bytes"):
        channel.Decoder().feed(b"\xff\xff\xff\xff" + b"x")


def test_forwarded_span_encodes_to_the_same_span() -> None:
    recorder, spans, _ = _recorder()
    recorder.record([_record(status=503)])
    (span,) = spans
    span.parent_span_id = PARENT
    span.trace_state = "vendor=1"
    (back,) = decode_protobuf(encode_spans([readable_span(span)]).SerializeToString())
    assert (back.trace_id, back.span_id, back.parent_span_id) == (span.trace_id, span.span_id, PARENT)
    assert (back.start_ns, back.end_ns, back.name, back.kind) == (
        span.start_ns,
        span.end_ns,
        span.name,
        "Server",
    )
    assert back.status_code == "Error" and back.trace_state == "vendor=1"
    assert back.attributes[names.GEN_AI_CONVERSATION_ID] == "c"
    assert back.scope_name == names.SCOPE_SIDECAR and back.resource["service.name"] == "s"


def test_body_context_is_spliced_replaces_otelkv_keys_and_keeps_the_clients() -> None:
    from otelkv.sidecar.turn_watch import body_with_context

    tp = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    raw = b'{"model": "m", "prompt": "caf\\u00e9"}  \n'
    out = body_with_context(raw, json.loads(raw), traceparent=tp, session_id="c1")
    assert out.startswith(b'{"model": "m", "prompt": "caf\\u00e9",')
    assert json.loads(out)["vllm_xargs"] == {"otelkv_traceparent": tp, "session_id": "c1"}
    assert json.loads(body_with_context(b"{ }", {}, traceparent=tp, session_id=None)) == {
        "vllm_xargs": {"otelkv_traceparent": tp}
    }
    # A client's own xargs stay; its otelkv_* keys are replaced; its session id wins.
    client = {
        "vllm_xargs": {"otelkv_traceparent": "forged", "otelkv_x": 1, "top_k_hint": 3, "session_id": "s"}
    }
    out = json.loads(body_with_context(json.dumps(client).encode(), client, traceparent=tp, session_id="c1"))
    assert out["vllm_xargs"] == {"top_k_hint": 3, "session_id": "s", "otelkv_traceparent": tp}
    body = {"session_id": "body-s", "vllm_xargs": None}
    out = json.loads(body_with_context(json.dumps(body).encode(), body, traceparent=tp, session_id="c1"))
    assert out == {"session_id": "body-s", "vllm_xargs": {"otelkv_traceparent": tp}}
    # Not an object: left for vLLM to refuse, byte for byte.
    odd = b'{"vllm_xargs": [1]}'
    assert body_with_context(odd, json.loads(odd), traceparent=tp, session_id="c1") is odd


def test_body_context_is_utf8_json_whatever_the_clients_encoding() -> None:
    from otelkv.sidecar.turn_watch import body_with_context

    tp = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    parsed = {"model": "m", "prompt": "ünï ✓"}
    for raw in (json.dumps(parsed).encode("utf-16"), b"\xef\xbb\xbf" + json.dumps(parsed).encode()):
        out = body_with_context(raw, parsed, traceparent=tp, session_id=None)
        assert json.loads(out.removeprefix(b"\xef\xbb\xbf").decode("utf-8")) == {
            **parsed,
            "vllm_xargs": {"otelkv_traceparent": tp},
        }
    with_xargs = {"prompt": "ünï", "vllm_xargs": {}}
    out = body_with_context(json.dumps(with_xargs).encode(), with_xargs, traceparent=tp, session_id=None)
    assert "ünï".encode() in out  # re-encoded as UTF-8, not as \\u escapes


def _sent(watcher: TurnWatcher, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[dict, bytes]:
    _, extra, sent = watcher.begin(_request(body, path=b"/v1/chat/completions", headers=headers))
    return dict(extra), sent


def test_body_context_follows_the_session_header_and_the_content_type() -> None:
    body = json.dumps(_chat()).encode()
    json_ct = (b"Content-Type", b"application/json; charset=utf-8")
    # The session id in the body is the one the forwarded X-Session-ID carries.
    _, sent = _sent(
        TurnWatcher(lambda r: None), [json_ct, (b"X-Session-ID", b"A"), (b"X-Conversation-Id", b"B")], body
    )
    assert json.loads(sent)["vllm_xargs"]["session_id"] == "A"
    extra, sent = _sent(TurnWatcher(lambda r: None), [json_ct, (b"X-Conversation-Id", b"B")], body)
    assert json.loads(sent)["vllm_xargs"]["session_id"] == "B" == extra[b"X-Session-ID"].decode()
    # No session header injected: no session id in the body either; the context still goes.
    _, sent = _sent(
        TurnWatcher(lambda r: None, inject_session_header=False),
        [json_ct, (b"X-Conversation-Id", b"B")],
        body,
    )
    assert "session_id" not in json.loads(sent)["vllm_xargs"]
    # Not JSON by its Content-Type: vLLM refuses it, so it goes on untouched.
    for ct in ([(b"Content-Type", b"text/plain")], []):
        extra, sent = _sent(TurnWatcher(lambda r: None), [*ct, (b"X-Conversation-Id", b"B")], body)
        assert sent == body and b"Content-Type" not in extra


def test_a_client_that_closes_after_done_completed_its_turn() -> None:
    """Clients that stop reading at ``data: [DONE]`` close before the chunked body's last
    chunk: the relay sees the client go, but the turn was answered whole. Before [DONE] it
    is an interruption."""
    assert _record(status=200, error=names.CLIENT_DISCONNECTED).error is None
    records: list[TurnRecord] = []
    watcher = TurnWatcher(records.append)
    exchange, _, _ = watcher.begin(_request(_chat(stream=True), headers=[(b"X-Session-ID", b"c")]))
    assert exchange is not None
    exchange.response_head(200, [(b"content-type", b"text/event-stream")])
    exchange.response_body(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
    exchange.finish(200, names.CLIENT_DISCONNECTED)
    assert records[0].error == names.CLIENT_DISCONNECTED
