"""The sidecar's query API: what ``otelkv slow / conversation / why / tune`` print, as JSON.

Only one process can open a chDB directory, and the sidecar holds it, so the CLI asks
here. The answers are exactly the dicts of :mod:`otelkv.analysis.report`. Queries run in
a worker thread: a slow query never stalls the receiver or the proxy.

Each query first settles what the sidecar has received (``settle``: turns the proxy has
finished and spans waiting in the store writer's queue are written, within the bound the
sidecar gives), so an answer includes every turn whose response was sent before the query
was asked, however long the writer's flush interval: ``otelkv why`` right after a slow turn
finds it. A store too far behind to catch up within that bound answers from what it has.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

logger = logging.getLogger("otelkv.sidecar")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def token_guard(token: str | None) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """aiohttp middleware: with a token set, every route but health and metrics needs it."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token and request.path not in ("/api/v1/health", "/metrics"):
            sent = request.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
                return web.json_response(
                    {"error": "missing or wrong bearer token (OTELKV_TOKEN)"}, status=401
                )
        return await handler(request)

    return middleware


MAX_PROBES = 64
"""Most engine probes a doctor request may carry."""


class QueryApi:
    def __init__(
        self,
        source: Any | None,
        describe: str,
        *,
        engine_urls: tuple[str, ...] = (),
        router_handle_ttl_s: float | None = None,
        settle: Callable[[], object] | None = None,
    ) -> None:
        self.source = source
        """An ``otelkv.analysis.sources.SpanSource`` over the store (None: no store)."""
        self.describe = describe
        self.engine_urls = engine_urls
        """Engines the sidecar was told about (``--engine``): the doctor reads their /metrics."""
        self.router_handle_ttl_s = router_handle_ttl_s
        self.settle = settle
        """Called (in the query's worker thread) before every query; bounded by its caller,
        and a failure in it only costs the answer its freshest spans."""

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/api/v1/health", self.health),
            web.get("/api/v1/slow", self.slow),
            web.get("/api/v1/conversations/{conversation_id}", self.conversation),
            web.get("/api/v1/why/{ref}", self.why),
            web.get("/api/v1/tune", self.tune),
            web.get("/api/v1/doctor", self.doctor),
            web.post("/api/v1/doctor", self.doctor),
            web.get("/api/v1/funnel", self.funnel),
        ]

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "store": self.describe})

    async def _run(self, fn: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> web.Response:
        from otelkv.analysis.report import BadRef, NotFound
        from otelkv.store.base import StoreError

        if self.source is None:
            return web.json_response({"error": "this sidecar runs without a store (--no-store)"}, status=503)
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                None, lambda: self._settled(fn, *args, **kwargs)
            )
        except NotFound as exc:
            return web.json_response({"error": str(exc)}, status=404)
        except BadRef as exc:  # a malformed or ambiguous reference: the caller's input
            return web.json_response({"error": str(exc)}, status=400)
        except StoreError as exc:
            # The store is down (closed, disk gone): say so; a traceback per query says no more.
            logger.warning("otelkv sidecar: query failed: %s", exc)
            return web.json_response({"error": f"trace store unavailable: {exc}"}, status=503)
        except Exception as exc:
            logger.exception("otelkv sidecar: query failed")
            return web.json_response({"error": f"query failed: {type(exc).__name__}: {exc}"}, status=500)
        return web.json_response(result)

    def _settled(self, fn: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``fn`` over the source, once what the sidecar received has been written."""
        if self.settle is not None:
            try:
                self.settle()
            except Exception:  # the query still answers, from what is stored
                logger.warning("otelkv sidecar: writing received spans before a query failed", exc_info=True)
        return fn(self.source, *args, **kwargs)

    async def slow(self, request: web.Request) -> web.Response:
        from otelkv.analysis import report

        try:
            since = _opt_int(request.query.get("since_ns"))
            until = _opt_int(request.query.get("until_ns"))
            limit = min(max(_opt_int(request.query.get("limit")) or 10, 1), 1000)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return await self._run(report.slow, since_ns=since, until_ns=until, limit=limit)

    async def conversation(self, request: web.Request) -> web.Response:
        from otelkv.analysis import report

        return await self._run(report.conversation, request.match_info["conversation_id"])

    async def why(self, request: web.Request) -> web.Response:
        from otelkv.analysis import report

        return await self._run(report.why, request.match_info["ref"])

    async def tune(self, request: web.Request) -> web.Response:
        from otelkv.analysis.tune.window import options_from_dict, tune

        try:
            since = _opt_int(request.query.get("since_ns"))
            until = _opt_int(request.query.get("until_ns"))
            options = options_from_dict(
                {k: v for k, v in request.query.items() if k not in ("since_ns", "until_ns")}
            )
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return await self._run(tune, since_ns=since, until_ns=until, options=options)

    async def funnel(self, request: web.Request) -> web.Response:
        from otelkv.analysis.funnel import funnel

        try:
            since = _opt_int(request.query.get("since_ns"))
            until = _opt_int(request.query.get("until_ns"))
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return await self._run(funnel, since_ns=since, until_ns=until)

    async def doctor(self, request: web.Request) -> web.Response:
        """GET: the window of the query string and the sidecar's own ``--engine`` probes. POST
        (what ``otelkv doctor`` sends): a JSON body with the window, probes the caller made
        itself (the sidecar never fetches a URL a caller names) and the router's handle TTL."""
        from otelkv.analysis.doctor import doctor
        from otelkv.analysis.engine_probe import EngineProbe, probe

        try:
            if request.method == "POST":
                body = await request.json()
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
            else:
                body = dict(request.query)
            since = _opt_int(body.get("since_ns"))
            until = _opt_int(body.get("until_ns"))
            ttl = body.get("router_handle_ttl_s")
            ttl = float(ttl) if ttl not in (None, "") else self.router_handle_ttl_s
            if ttl is not None and not (math.isfinite(ttl) and ttl >= 0):
                raise ValueError("router_handle_ttl_s must be a number of seconds >= 0")
            sent = body.get("probes") or []
            if not isinstance(sent, list) or len(sent) > MAX_PROBES:
                raise ValueError(f"'probes' must be a list of at most {MAX_PROBES}")
            probes = [EngineProbe.from_dict(p) for p in sent]
        except (ValueError, TypeError, RecursionError) as exc:
            return web.json_response({"error": f"bad doctor request: {exc}"[:300]}, status=400)
        loop = asyncio.get_running_loop()
        own = await asyncio.gather(
            *(
                loop.run_in_executor(None, probe, url)
                for url in self.engine_urls
                if url not in {p.url for p in probes}
            )
        )
        return await self._run(
            doctor, since_ns=since, until_ns=until, probes=[*probes, *own], router_handle_ttl_s=ttl
        )


def _opt_int(value: Any) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"not an integer: {str(value)[:40]!r}")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"not an integer: {value[:40]!r}") from None
    if not 0 <= number < 2**63:
        raise ValueError(f"out of range (0 to 2**63 - 1 nanoseconds): {str(value)[:40]!r}")
    return number
