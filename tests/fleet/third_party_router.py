"""A P/D router written the way public examples write one, not the way otelkv would like.

Modelled on the toy proxies that ship with P/D examples: it copies the client's JSON body
to both legs (adding only what P/D needs: ``max_tokens=1`` and ``kv_transfer_params`` for
prefill, prefill's ``kv_transfer_params`` for decode), forwards no client header (no
``traceparent``, no ``X-Session-ID``), sends its own ``X-Request-Id`` to both legs, and
streams the decode leg's bytes straight back to the client. With ``keep_handles`` it keeps
the decode node's handle per conversation, keyed on the client's ``X-Conversation-Id``
(read, not forwarded); without it, every turn's prefill starts without a handle.

With ``rebuild_body`` it is the other common kind: it builds each leg's body afresh from the
OpenAI fields it knows (model, messages or prompt, sampling settings), so anything else the
client or a proxy put in the body (``vllm_xargs``, ``session_id``) is gone, and it calls the
decode node non-streaming to get its handle.

Nothing in it knows about otelkv: it is the fleet otelkv has to work behind.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import aiohttp
from aiohttp import web

KNOWN_FIELDS = (
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "n",
    "tools",
    "tool_choice",
)
"""What a body-rebuilding router copies; the rest of the client's body is dropped."""

EMPTY_HANDLE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class ThirdPartyRouter:
    def __init__(
        self, prefill_url: str, decode_url: str, *, keep_handles: bool = False, rebuild_body: bool = False
    ) -> None:
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.keep_handles = keep_handles
        self.rebuild_body = rebuild_body
        self.handles: dict[str, dict[str, Any]] = {}
        self.legs: list[tuple[str, dict[str, str]]] = []
        """(role, headers sent) of every leg, for tests."""
        self.routed: list[tuple[str, str]] = []
        """(the client's X-Conversation-Id, the X-Request-Id used) of every request, in order."""
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int = 0) -> ThirdPartyRouter:
        self._thread = threading.Thread(target=self._serve, args=(port,), daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("third-party router did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(15)

    def _serve(self, port: int) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self._setup(port))
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._teardown())
        loop.close()

    async def _setup(self, port: int) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=60))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def _teardown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.json()
        if self.rebuild_body:
            body = {k: body[k] for k in KNOWN_FIELDS if k in body}
        headers = {"X-Request-Id": uuid.uuid4().hex}  # its own id, nothing of the client's
        key = request.headers.get("X-Conversation-Id", "")
        self.routed.append((key, headers["X-Request-Id"]))
        handle = self.handles.get(key) if self.keep_handles and key else None
        prefill = dict(body)
        prefill.pop("stream_options", None)
        prefill.update(
            stream=False,
            max_tokens=1,
            kv_transfer_params=dict(handle, do_remote_decode=True, do_remote_prefill=False)
            if handle
            else dict(EMPTY_HANDLE),
        )
        self.legs.append(("prefill", dict(headers)))
        async with self._session.post(self.prefill_url + request.path, json=prefill, headers=headers) as resp:
            answer = await resp.json()
            if resp.status != 200:
                return web.json_response(answer, status=resp.status)
        decode = dict(body)
        decode["kv_transfer_params"] = answer.get("kv_transfer_params")
        self.legs.append(("decode", dict(headers)))
        async with self._session.post(self.decode_url + request.path, json=decode, headers=headers) as resp:
            if self.keep_handles and key and not body.get("stream"):
                raw = await resp.read()
                handle = json.loads(raw).get("kv_transfer_params") if resp.status == 200 else None
                if handle:
                    self.handles[key] = handle
                return web.Response(body=raw, status=resp.status, content_type=resp.content_type)
            out = web.StreamResponse(
                status=resp.status, headers={"Content-Type": resp.headers["Content-Type"]}
            )
            await out.prepare(request)
            async for chunk in resp.content.iter_any():  # straight back, as it comes
                await out.write(chunk)
            await out.write_eof()
            return out
