"""Property-based fuzzing of every parser that reads client, upstream or exporter input.

Each property says what the parser may do with anything at all (return, or raise only its
documented error) and, where a valid input has a meaning, that the meaning survives
(round trip). Examples are bounded so the whole file runs in seconds.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otelkv.sidecar import relay as relay_module
from otelkv.sidecar.identity import HASH_PREFIX, MAX_ID_CHARS, IdPolicy, baggage_value, clean_id, identify
from otelkv.sidecar.otlp import OtlpDecodeError, decode_traces
from otelkv.sidecar.relay import Relay, Request
from otelkv.sidecar.response import ResponseObserver
from otelkv.sidecar.turn_watch import TurnRecord, TurnWatcher, parse_traceparent

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any text, lone surrogates and line separators included (hypothesis leaves surrogates
# out of st.text() by default, which is how the surrogate-id bug went unnoticed).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=300)
hex_id = st.binary(min_size=1, max_size=16).map(bytes.hex)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=25,
)


def _encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ------------------------------------------------------------------ trace context, baggage, ids


@FUZZ
@given(value=any_text | st.none(), state=any_text | st.none())
def test_traceparent_never_raises(value: str | None, state: str | None) -> None:
    parent = parse_traceparent(value, state)
    if parent is not None:
        assert len(parent.trace_id) == 32 and len(parent.span_id) == 16 and len(parent.trace_state) <= 512


@FUZZ
@given(
    trace=st.binary(min_size=16, max_size=16).filter(any),
    span=st.binary(min_size=8, max_size=8).filter(any),
    flags=st.integers(0, 255),
    upper=st.booleans(),
)
def test_traceparent_round_trip(trace: bytes, span: bytes, flags: int, upper: bool) -> None:
    header = f"00-{trace.hex()}-{span.hex()}-{flags:02x}"
    parent = parse_traceparent(header.upper() if upper else header, None)
    assert parent is not None and (parent.trace_id, parent.span_id) == (trace.hex(), span.hex())


@FUZZ
@given(header=any_text | st.none())
def test_baggage_never_raises(header: str | None) -> None:
    value = baggage_value(header)
    assert value is None or isinstance(value, str)


@FUZZ
@given(
    value=st.text(min_size=1, max_size=100),
    noise=st.lists(st.from_regex(r"[a-z]{1,8}=[a-z0-9]{0,8}", fullmatch=True), max_size=5),
)
def test_baggage_round_trip(value: str, noise: list[str]) -> None:
    header = ",".join([*noise, f"gen_ai.conversation.id={quote(value, safe='')};ttl=1"])
    assert baggage_value(header) == value


@FUZZ
@given(
    raw=any_text | st.integers() | json_values,
    max_chars=st.integers(1, 400),
    hash_all=st.booleans(),
)
def test_clean_id_is_bounded_encodable_and_stable(raw: Any, max_chars: int, hash_all: bool) -> None:
    policy = IdPolicy(max_chars, hash_all)
    value = clean_id(raw, policy)
    if value is None:
        return
    assert _encodable(value) and not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in value)
    assert len(value) <= max(max_chars, len(HASH_PREFIX) + 32)
    assert value == clean_id(raw, policy)  # stable: the same id keys the same conversation
    if hash_all:
        assert value.startswith(HASH_PREFIX) and len(value) == len(HASH_PREFIX) + 32


@FUZZ
@given(
    headers=st.dictionaries(st.sampled_from(["X-Conversation-Id", "X-Session-ID", "baggage"]), any_text),
    body=json_values,
)
def test_identify_gives_encodable_ids(headers: dict[str, str], body: Any) -> None:
    identity = identify(headers, body if isinstance(body, dict) else None)
    if identity is not None:
        assert _encodable(identity.conversation_id) and len(identity.conversation_id) <= MAX_ID_CHARS


# ------------------------------------------------------------------ request bodies (turn watcher)


@FUZZ
@given(
    body=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()),
    headers=st.lists(
        st.tuples(
            st.sampled_from([b"x-conversation-id", b"x-session-id", b"baggage", b"traceparent"]),
            st.binary(max_size=80),
        ),
        max_size=4,
    ),
    inject_body=st.booleans(),
    inject_context=st.booleans(),
)
def test_turn_watcher_never_raises_and_sends_encodable_headers(
    body: bytes, headers: list[tuple[bytes, bytes]], inject_body: bool, inject_context: bool
) -> None:
    records: list[TurnRecord] = []
    watcher = TurnWatcher(
        records.append, inject_body_conversation_id=inject_body, inject_body_context=inject_context
    )
    turn, extra, sent = watcher.begin(
        Request(
            method=b"POST",
            url=b"/v1/chat/completions",
            headers=[(b"content-type", b"application/json"), *headers],
            body=body,
        )
    )
    assert turn is not None
    for name, value in extra:
        assert value is None or (b"\r" not in value and b"\n" not in value), (name, value)
    if not inject_body and not inject_context:
        assert sent == body
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        parsed = None
    if inject_context and isinstance(parsed, dict) and isinstance(parsed.get("vllm_xargs", {}), dict | None):
        # A JSON object whose vllm_xargs (if any) is an object: the turn's context went in.
        xargs = json.loads(sent)["vllm_xargs"]
        assert xargs["otelkv_traceparent"] == dict(extra)[b"traceparent"].decode()
    turn.response_head(200, [(b"content-type", b"application/json")])
    turn.response_body(body)
    turn.finish(200, None)
    assert len(records) == 1
    assert len(watcher.tracker) <= 1


# ------------------------------------------------------------------ responses (SSE and JSON)


@FUZZ
@given(events=st.lists(json_values, max_size=8), cuts=st.lists(st.integers(0, 2000), max_size=6))
def test_sse_of_arbitrary_json_never_raises_and_splitting_changes_nothing(
    events: list[Any], cuts: list[int]
) -> None:
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    whole = ResponseObserver(streaming=True)
    whole.feed(stream, 1)
    split = ResponseObserver(streaming=True)
    points = sorted({min(c, len(stream)) for c in cuts})
    for start, end in zip([0, *points], [*points, len(stream)], strict=True):
        split.feed(stream[start:end], 1)
    assert whole.finish(2) == split.finish(2)


@FUZZ
@given(body=json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=300))
def test_json_response_never_raises(body: bytes) -> None:
    observer = ResponseObserver(streaming=False)
    observer.feed(body, 1)
    facts = observer.finish(2)
    assert facts.parsed in (True, False)


# ------------------------------------------------------------------ OTLP decoding


def _valid_export() -> bytes:
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = b"\x01" * 16, b"\x02" * 8, "s"
    kv = span.attributes.add()
    kv.key, kv.value.string_value = "k", "v"
    return request.SerializeToString()


VALID = _valid_export()


@FUZZ
@given(
    body=st.binary(max_size=400),
    ctype=st.sampled_from(["application/x-protobuf", "application/json", "text/plain", None]),
)
def test_otlp_garbage_only_raises_decode_error(body: bytes, ctype: str | None) -> None:
    try:
        decode_traces(body, ctype, None)
    except OtlpDecodeError as exc:
        assert exc.status in (400, 413, 415) and str(exc)


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_otlp_mutated_protobuf_only_raises_decode_error(flips: list[tuple[int, int]]) -> None:
    body = bytearray(VALID)
    for index, byte in flips:
        body[index] = byte
    try:
        for record in decode_traces(bytes(body), "application/x-protobuf", None):
            assert len(record.trace_id) in (0, 32) and len(record.span_id) in (0, 16)
    except OtlpDecodeError as exc:
        assert exc.status == 400


@FUZZ
@given(doc=json_values | st.fixed_dictionaries({"resourceSpans": st.lists(json_values, max_size=3)}))
def test_otlp_json_of_any_shape_only_raises_decode_error(doc: Any) -> None:
    try:
        decode_traces(json.dumps(doc).encode(), "application/json", None)
    except OtlpDecodeError as exc:
        assert exc.status == 400


attr_values = st.one_of(
    st.text(max_size=20).map(lambda s: (s, {"stringValue": s})),
    st.booleans().map(lambda b: (b, {"boolValue": b})),
    st.integers(-(2**63), 2**63 - 1).map(lambda i: (i, {"intValue": str(i)})),
    st.floats(allow_nan=False).map(lambda f: (f, {"doubleValue": f})),
    st.binary(max_size=8).map(lambda b: (b.hex(), {"bytesValue": base64.b64encode(b).decode()})),
)


@FUZZ
@given(
    trace=st.binary(min_size=16, max_size=16),
    span=st.binary(min_size=8, max_size=8),
    start=st.integers(0, 2**63 - 1),
    attrs=st.dictionaries(st.text(max_size=10), attr_values, max_size=5),
    name=st.text(max_size=30),
)
def test_otlp_json_round_trip(
    trace: bytes, span: bytes, start: int, attrs: dict[str, Any], name: str
) -> None:
    doc = {
        "resourceSpans": [
            {
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": trace.hex(),
                                "spanId": span.hex(),
                                "name": name,
                                "startTimeUnixNano": str(start),
                                "endTimeUnixNano": start,
                                "attributes": [{"key": k, "value": v[1]} for k, v in attrs.items()],
                            }
                        ]
                    }
                ]
            }
        ]
    }
    (record,) = decode_traces(json.dumps(doc).encode(), "application/json", None)
    assert (record.trace_id, record.span_id, record.name) == (trace.hex(), span.hex(), name)
    assert (record.start_ns, record.end_ns) == (start, start)
    assert record.attributes == {k: v[0] for k, v in attrs.items()}


# ------------------------------------------------------------------ the relay's request parsing


class _Transport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class _Parsed(relay_module._Client):
    """The relay's client protocol with the upstream side replaced by a list."""

    def __init__(self, relay: Relay) -> None:
        super().__init__(relay)
        self.requests: list[Request] = []

    def _next(self) -> None:
        self.requests.append(self.queue.popleft())


@pytest.fixture(scope="module")
def relay() -> Iterator[Relay]:
    loop = asyncio.new_event_loop()
    relay = Relay("http://127.0.0.1:9", max_body_bytes=4096)
    relay.loop = loop  # only for the idle timer; never run
    yield relay
    loop.close()


def _feed(relay: Relay, data: bytes, cuts: list[int]) -> _Parsed:
    client = _Parsed(relay)
    transport = _Transport()
    client.connection_made(transport)  # type: ignore[arg-type]
    points = sorted({min(c, len(data)) for c in cuts})
    for start, end in zip([0, *points], [*points, len(data)], strict=True):
        client.data_received(data[start:end])
    client.connection_lost(None)
    return client


@FUZZ
@given(data=st.binary(max_size=600), cuts=st.lists(st.integers(0, 600), max_size=4))
def test_relay_request_parsing_never_raises_and_errors_are_json(
    relay: Relay, data: bytes, cuts: list[int]
) -> None:
    client = _feed(relay, data, cuts)
    out = bytes(client.transport.out)  # type: ignore[union-attr]
    out = out.replace(b"HTTP/1.1 100 Continue\r\n\r\n", b"")
    if out:
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.split(b" ")[1][:1] in (b"4", b"5")
        assert json.loads(body)["error"]["message"]


token = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,15}", fullmatch=True).filter(
    lambda name: name.lower().encode() not in relay_module._HOP_BY_HOP
)
field_value = st.from_regex(r"[!-~]([ -~]{0,40}[!-~])?", fullmatch=True)


@FUZZ
@given(
    method=st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE"]),
    path=st.from_regex(r"/[A-Za-z0-9/_.%?=&-]{0,40}", fullmatch=True),
    headers=st.lists(st.tuples(token, field_value), max_size=6),
    body=st.binary(max_size=300),
    cuts=st.lists(st.integers(0, 800), max_size=4),
)
def test_relay_request_round_trip(
    relay: Relay, method: bytes, path: str, headers: list[tuple[str, str]], body: bytes, cuts: list[int]
) -> None:
    """A valid request parses to its own parts, and the head sent upstream re-parses to them."""
    raw_headers = [(k.encode(), v.encode()) for k, v in headers]
    raw = (
        method + b" " + path.encode() + b" HTTP/1.1\r\nHost: h\r\n"
        + b"".join(k + b": " + v + b"\r\n" for k, v in raw_headers)
        + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip
    client = _feed(relay, raw, cuts)
    assert not client.transport.out  # type: ignore[union-attr]
    (request,) = client.requests
    assert (request.method, request.url, request.body) == (method, path.encode(), body)
    assert request.headers is not None and request.headers[1:-1] == raw_headers

    seen: list[tuple[bytes, bytes]] = []

    class Head:
        def on_header(self, name: bytes, value: bytes) -> None:
            seen.append((name, value))

    parser = httptools.HttpRequestParser(Head())
    parser.feed_data(relay.request_head(request, [], len(body)) + body)
    assert seen[1 : 1 + len(raw_headers)] == raw_headers
