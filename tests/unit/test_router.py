"""The reference router decides what a prefill engine can reuse: which decode handle it
forwards, and to whom. A stale or misrouted handle would make otelkv report reverse pulls
that never could have happened, so the cache and the legs' requests are pinned exactly.
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from otelkv import names
from otelkv.fleet.router import HandleCache, PDRouter, conversation_id_of

# ------------------------------------------------------------------ HandleCache


def test_take_is_single_use() -> None:
    cache = HandleCache(ttl_s=10.0)
    cache.put("c1", {"remote_engine_id": "d0"}, now=100.0)
    assert len(cache) == 1
    assert cache.take("c1", now=103.5) == (names.ROUTER_HANDLE_HIT, {"remote_engine_id": "d0"}, 3.5)
    assert cache.take("c1", now=103.5) == (names.ROUTER_HANDLE_MISS, None, 0.0)
    assert len(cache) == 0
    assert HandleCache(ttl_s=None).take("nobody", now=0.0) == ("miss", None, 0.0)


def test_ttl_boundary_and_stale() -> None:
    cache = HandleCache(ttl_s=30.0)
    cache.put("at", {"h": 1}, now=0.0)
    cache.put("past", {"h": 2}, now=0.0)
    assert cache.take("at", now=30.0) == ("hit", {"h": 1}, 30.0)  # age == ttl still hits
    assert cache.take("past", now=30.25) == ("stale", None, 30.25)
    assert len(cache) == 0  # a stale handle is consumed too


def test_no_ttl_never_expires() -> None:
    cache = HandleCache(ttl_s=None)
    cache.put("c", {"h": 1}, now=0.0)
    assert cache.take("c", now=1e9) == ("hit", {"h": 1}, 1e9)


def test_put_replaces_and_restarts_age() -> None:
    cache = HandleCache(ttl_s=10.0)
    cache.put("c", {"h": 1}, now=0.0)
    cache.put("c", {"h": 2}, now=8.0)
    assert len(cache) == 1
    assert cache.take("c", now=12.0) == ("hit", {"h": 2}, 4.0)


def test_capacity_evicts_least_recently_put() -> None:
    cache = HandleCache(ttl_s=None, capacity=2)
    cache.put("a", {"h": "a"}, now=0.0)
    cache.put("b", {"h": "b"}, now=1.0)
    cache.put("a", {"h": "a2"}, now=2.0)  # re-put makes "a" the most recent
    cache.put("c", {"h": "c"}, now=3.0)
    assert len(cache) == 2
    assert cache.take("b", now=4.0)[0] == "miss"
    assert cache.take("a", now=4.0) == ("hit", {"h": "a2"}, 2.0)
    assert cache.take("c", now=4.0) == ("hit", {"h": "c"}, 1.0)


# ------------------------------------------------------------------ conversation_id_of


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({"X-Conversation-Id": "h1", "X-Session-ID": "h2"}, {"conversation_id": "b1"}, "h1"),
        ({"X-Session-ID": "h2"}, {"conversation_id": "b1", "session_id": "b2"}, "h2"),
        ({}, {"conversation_id": "b1", "session_id": "b2"}, "b1"),
        ({}, {"session_id": "b2"}, "b2"),
        ({"X-Conversation-Id": ""}, {"session_id": "b2"}, "b2"),
        ({}, {"conversation_id": 42, "session_id": "b2"}, "b2"),
        ({}, {"conversation_id": ["x"], "session_id": {"y": 1}}, None),
        ({}, {"conversation_id": ""}, None),
        ({}, {}, None),
    ],
)
def test_conversation_id_precedence(
    headers: dict[str, str], body: dict[str, Any], expected: str | None
) -> None:
    assert conversation_id_of(headers, body) == expected


# ------------------------------------------------------------------ PDRouter end to end


class FakeEngine:
    """A stdlib HTTP server that records each request and answers with a fixed JSON body."""

    def __init__(self, reply: dict[str, Any], status: int = 200) -> None:
        self.reply = reply
        self.status = status
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                return

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.requests.append((self.path, dict(self.headers.items()), body))
                out = json.dumps(engine.reply).encode()
                self.send_response(engine.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


P_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
        "remote_request_id": "p-req", "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.5",
        "remote_port": 5600}  # fmt: skip
D_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "decode-0",
        "remote_request_id": "d-req", "remote_block_ids": [[7, 8, 9]], "remote_host": "10.0.0.6",
        "remote_port": 5601, "remote_num_tokens": 48}  # fmt: skip
EMPTY_HANDLE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
CHOICE = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny", "choices": [CHOICE],
          "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}  # fmt: skip
TRACEPARENT = "00-5b8efff798038103d269b633813fc60c-eee19b7ec3c1b174-01"


@contextlib.contextmanager
def running(
    prefill_reply: dict[str, Any], status: int = 200
) -> Iterator[tuple[FakeEngine, FakeEngine, PDRouter]]:
    prefill = FakeEngine(prefill_reply, status)
    decode = FakeEngine({**ANSWER, "kv_transfer_params": D_KV})
    router = PDRouter(prefill.url, decode.url, handle_ttl_s=60.0).start()
    try:
        yield prefill, decode, router
    finally:
        router.stop()
        prefill.close()
        decode.close()


@pytest.fixture
def fleet() -> Iterator[tuple[FakeEngine, FakeEngine, PDRouter]]:
    with running({**ANSWER, "kv_transfer_params": P_KV}) as engines:
        yield engines


def chat(router: PDRouter, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, str, bytes]:
    req = urllib.request.Request(
        f"{router.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers.get_content_type(), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get_content_type(), err.read()


def test_two_turns_forward_the_decode_handle(fleet: tuple[FakeEngine, FakeEngine, PDRouter]) -> None:
    prefill, decode, router = fleet
    body = {"model": "tiny", "messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 9}
    headers = {"X-Conversation-Id": "conv-1", "traceparent": TRACEPARENT}

    status, ctype, raw = chat(router, body, headers)
    assert (status, ctype) == (200, "application/json")
    assert json.loads(raw) == ANSWER  # kv_transfer_params stripped

    _, p_headers, p_body = prefill.requests[0]
    assert p_body == {
        "model": "tiny",
        "messages": body["messages"],
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": EMPTY_HANDLE,
    }
    path, d_headers, d_body = decode.requests[0]
    assert path == "/v1/chat/completions"
    assert d_body == {**body, "stream": False, "kv_transfer_params": {**P_KV, "remote_host": "127.0.0.1"}}
    for leg in (p_headers, d_headers):
        assert leg["X-Session-ID"] == "conv-1"
        assert leg["traceparent"] == TRACEPARENT  # no tracer: the caller's context passes through
    assert p_headers["X-Request-Id"] == d_headers["X-Request-Id"]
    assert len(p_headers["X-Request-Id"]) == 32

    chat(router, body, headers)
    _, p2_headers, p2_body = prefill.requests[1]
    reverse = {**D_KV, "remote_host": "127.0.0.1", "do_remote_decode": True, "do_remote_prefill": False}
    assert p2_body["kv_transfer_params"] == reverse
    assert p2_headers["X-Request-Id"] == decode.requests[1][1]["X-Request-Id"] != p_headers["X-Request-Id"]
    assert (router.stats.requests, router.stats.handle_misses, router.stats.handle_hits) == (2, 1, 1)
    assert router.stats.handles_stored == 2


def test_body_conversation_id_is_used_then_removed(fleet: tuple[FakeEngine, FakeEngine, PDRouter]) -> None:
    prefill, decode, router = fleet
    chat(router, {"model": "tiny", "messages": [], "conversation_id": "conv-b"}, {})
    for engine in (prefill, decode):
        _, headers, body = engine.requests[0]
        assert headers["X-Session-ID"] == "conv-b"
        assert "conversation_id" not in body
    assert len(router.handles) == 1


def test_no_conversation_stores_no_handle(fleet: tuple[FakeEngine, FakeEngine, PDRouter]) -> None:
    prefill, _decode, router = fleet
    status, _, _ = chat(router, {"model": "tiny", "messages": []}, {})
    assert status == 200
    assert "X-Session-ID" not in prefill.requests[0][1]
    assert (router.stats.no_conversation, len(router.handles)) == (1, 0)


def test_streaming_client_gets_sse(fleet: tuple[FakeEngine, FakeEngine, PDRouter]) -> None:
    prefill, decode, router = fleet
    body = {"model": "tiny", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    status, ctype, raw = chat(router, body, {"X-Session-ID": "conv-s"})
    assert (status, ctype) == (200, "text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}],
        [{"index": 0, "finish_reason": "stop", "delta": {}}],
        [],
    ]
    assert chunks[2]["usage"] == ANSWER["usage"]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert "kv_transfer_params" not in raw.decode()
    assert "stream_options" not in prefill.requests[0][2]
    assert decode.requests[0][2]["stream"] is False
    assert "stream_options" not in decode.requests[0][2]


def test_prefill_error_is_returned_and_decode_skipped() -> None:
    with running({"error": {"message": "boom"}}, status=500) as (_prefill, decode, router):
        status, _, raw = chat(router, {"model": "tiny", "messages": []}, {"X-Session-ID": "c"})
        assert (status, json.loads(raw)) == (500, {"error": {"message": "boom"}})
        assert decode.requests == []
        assert (router.stats.prefill_errors, router.stats.decode_errors, len(router.handles)) == (1, 0, 0)
