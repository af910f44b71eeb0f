"""The agent driver's interrupted requests, against a real local HTTP server that streams slowly.

A user who presses stop closes the connection mid-stream; the server must see that (its
writes stop before the answer is complete), the driver must keep the text it got, mark
the turn interrupted but not failed, and carry on with the partial answer in the history.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from otelkv.fleet.agent import AgentDriver, Conversation, Turn

CHUNKS = 40
CHUNK_DELAY_S = 0.02


class FakeUpstream:
    """An OpenAI-like endpoint: JSON answers, or SSE one token per chunk, slowly."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.streams: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        tokens = [f"tok{i} " for i in range(CHUNKS)]
        if not body.get("stream"):
            return web.json_response(
                {
                    "choices": [{"message": {"content": "".join(tokens[:3])}}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 3},
                }
            )
        record = {"written": 0, "finished": False}
        self.streams.append(record)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            for token in tokens:
                chunk = {"choices": [{"index": 0, "delta": {"content": token}}]}
                await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
                record["written"] += 1
                await asyncio.sleep(CHUNK_DELAY_S)
            await out.write(b"data: [DONE]\n\n")
            record["finished"] = True
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return out


async def _run(conversation: Conversation) -> tuple[FakeUpstream, list[Any]]:
    fake = FakeUpstream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        results = await AgentDriver(f"http://127.0.0.1:{port}", "tiny").run_many([conversation])
        await asyncio.sleep(CHUNK_DELAY_S * 5)  # the server notices the hang-up on its next write
    finally:
        await runner.cleanup()
    return fake, results[0]


def test_interrupt_after_n_chunks_hangs_up_and_keeps_the_partial_answer() -> None:
    conversation = Conversation(
        "c-int",
        [Turn("hello", 3), Turn("tell me everything", CHUNKS, interrupt_after=3), Turn("go on", 3)],
    )
    fake, results = asyncio.run(_run(conversation))

    assert [r.ok for r in results] == [True, True, True]
    assert [r.interrupted for r in results] == [False, True, False]
    cut = results[1]
    assert cut.text == "tok0 tok1 tok2 " and cut.ttft_s is not None
    # Only the interrupted turn streamed, and the server never got to the end of it.
    assert [r["stream"] for r in fake.requests] == [False, True, False]
    assert "stream_options" in fake.requests[1]
    (stream,) = fake.streams
    assert not stream["finished"] and 3 <= stream["written"] < CHUNKS
    # The next turn carries the partial answer, as a chat client keeps a stopped reply.
    messages = fake.requests[2]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[4]["content"] == "tok0 tok1 tok2 " and messages[5]["content"] == "go on"


def test_a_stream_read_to_the_end_is_not_interrupted() -> None:
    conversation = Conversation("c-full", [Turn("all of it", CHUNKS)], stream=True)
    fake, (result,) = asyncio.run(_run(conversation))
    assert result.ok and not result.interrupted
    assert result.text == "".join(f"tok{i} " for i in range(CHUNKS))
    assert fake.streams[0]["finished"]


def test_a_turn_that_rewrites_history_sends_the_edited_first_message_under_the_same_id() -> None:
    """``rewrite_first_user``: the app edits its history (compaction, an edited message); the
    request carries the new first user message and the rest of the history as it was."""
    conversation = Conversation(
        "c-rewrite", [Turn("first question", 3), Turn("next", 3, rewrite_first_user="edited question")]
    )
    fake, results = asyncio.run(_run(conversation))
    assert [r.ok for r in results] == [True, True]
    first, second = (r["messages"] for r in fake.requests)
    assert first[1]["content"] == "first question"
    assert [m["content"] for m in second[1:]] == ["edited question", "tok0 tok1 tok2 ", "next"]


def test_the_driver_records_its_kernels_send_and_receive_times() -> None:
    """The client's own clock for the phase checks: its kernel's send and last-receive times of
    each request (``TCP_INFO``), inside what its process saw (within the kernel's jiffy), and
    the pause before a turn on its process clock."""
    conversation = Conversation(
        "c-clock", [Turn("hello", 3), Turn("all of it", CHUNKS, pause_s=0.2)], stream=True
    )
    _, results = asyncio.run(_run(conversation))
    jiffy = 0.011
    for r in results:
        assert r.sent_kernel_unix is not None and r.done_kernel_unix is not None
        assert r.started_unix - jiffy <= r.sent_kernel_unix <= r.done_kernel_unix <= r.done_unix + jiffy
    # A streamed answer of 40 chunks 20 ms apart: the last byte came at least 0.8 s after the send.
    assert results[1].done_kernel_unix - results[1].sent_kernel_unix >= CHUNKS * CHUNK_DELAY_S  # type: ignore[operator]
    assert results[0].pause_unix is None
    began, ended = results[1].pause_unix  # type: ignore[misc]
    assert results[0].done_unix <= began and ended - began >= 0.2 and ended <= results[1].started_unix
