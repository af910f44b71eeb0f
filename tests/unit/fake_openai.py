"""A local OpenAI-style upstream for fault, security and load runs: no vLLM, no model.

It runs as its own process (``python -m tests.unit.fake_openai``, prints its port) so its
CPU and GIL never mix with the client's or the sidecar's. Every answer is a pure function
of the request (:func:`expected_body`), so a client can check byte for byte that what the
sidecar relayed is what the upstream sent. Streaming answers are SSE in several chunks,
optionally paced (``X-Fake-Chunk-Delay-Ms``), so a fault can land in the middle of one.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from typing import Any

COMPLETION_MARK = "QUOKKA"
"""Every completion holds this word: a store scan for it finds leaked completion text."""
DEFAULT_CHUNKS = 6
HEADER_CHUNKS = "X-Fake-Chunks"
HEADER_DELAY_MS = "X-Fake-Chunk-Delay-Ms"


def completion_text(body: dict[str, Any]) -> str:
    """The answer to a request: distinctive, and different for every prompt."""
    messages = body.get("messages") or []
    last = str(messages[-1].get("content", "")) if messages and isinstance(messages[-1], dict) else ""
    digest = hashlib.sha256(last.encode()).hexdigest()[:12]
    return f"{COMPLETION_MARK}-{digest} is the answer to that"


def _words(text: str, n: int) -> list[str]:
    """``text`` cut into ``n`` pieces that join back to it (the streamed deltas)."""
    step = max(1, -(-len(text) // n))
    return [text[i : i + step] for i in range(0, len(text), step)]


def expected_body(raw: bytes, chunks: int = DEFAULT_CHUNKS) -> bytes:
    """The exact body the upstream sends for the request body ``raw``."""
    body = json.loads(raw)
    text = completion_text(body)
    model = body.get("model", "m")
    usage = {"prompt_tokens": 10 * len(body.get("messages") or []), "completion_tokens": chunks}
    if not body.get("stream"):
        return json.dumps(
            {
                "id": "fake-1",
                "object": "chat.completion",
                "model": model,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                ],
                "usage": usage,
            }
        ).encode()
    return b"".join(sse_events(model, text, chunks, usage))


def sse_events(model: str, text: str, chunks: int, usage: dict[str, int]) -> list[bytes]:
    events = []
    for piece in _words(text, chunks):
        delta = {"choices": [{"index": 0, "delta": {"content": piece}}]}
        events.append(b"data: " + json.dumps({"id": "fake-1", "model": model, **delta}).encode() + b"\n\n")
    final = {"id": "fake-1", "model": model, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    events.append(b"data: " + json.dumps({**final, "usage": usage}).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


async def _chat(request: Any) -> Any:
    from aiohttp import web

    raw = await request.read()
    chunks = int(request.headers.get(HEADER_CHUNKS, DEFAULT_CHUNKS))
    delay_s = int(request.headers.get(HEADER_DELAY_MS, 0)) / 1000
    body = json.loads(raw)
    if not body.get("stream"):
        return web.Response(body=expected_body(raw, chunks), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    usage = {"prompt_tokens": 10 * len(body.get("messages") or []), "completion_tokens": chunks}
    try:
        for event in sse_events(body.get("model", "m"), completion_text(body), chunks, usage):
            await resp.write(event)
            if delay_s:
                await asyncio.sleep(delay_s)
        await resp.write_eof()
    except ConnectionError:  # the client (or a killed proxy) went away mid-stream
        pass
    return resp


def main(argv: list[str] | None = None) -> int:
    from aiohttp import web

    parser = argparse.ArgumentParser(prog="python -m tests.unit.fake_openai")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", _chat)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", args.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(port, flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(serve())
    except ImportError:
        asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
