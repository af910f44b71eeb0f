"""Where the query commands get their answers: a running sidecar, a store directory, or ClickHouse.

Only one process can open a chDB directory and the sidecar owns it while it runs, so the
CLI asks the sidecar's HTTP API first (same JSON as the local functions return) and opens
the store itself only when no sidecar answers. Every failure becomes a :class:`QueryError`
with a one-line message and the exit code of :mod:`otelkv.cli.errors` (2 bad input, 3 not
found, 4 unreachable or locked); the top-level handler prints it, never a traceback.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from otelkv import names
from otelkv.cli.errors import NotFoundError, QueryError, UnavailableError

DEFAULT_SIDECAR_URL = "http://127.0.0.1:8801"
ENV_SIDECAR = "OTELKV_SIDECAR"
ENV_STORE = "OTELKV_STORE"
HEALTH_TIMEOUT_S = 0.5
QUERY_TIMEOUT_S = 60.0

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)?\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


class Querier(Protocol):
    """The queries, wherever they run."""

    def slow(self, *, since_ns: int | None, until_ns: int | None, limit: int) -> dict[str, Any]: ...

    def conversation(self, conversation_id: str) -> dict[str, Any]: ...

    def why(self, ref: str) -> dict[str, Any]: ...

    def tune(
        self, *, since_ns: int | None, until_ns: int | None, options: dict[str, Any]
    ) -> dict[str, Any]: ...

    def doctor(
        self,
        *,
        since_ns: int | None,
        until_ns: int | None,
        probes: list[dict[str, Any]],
        router_handle_ttl_s: float | None,
    ) -> dict[str, Any]: ...

    def funnel(self, *, since_ns: int | None, until_ns: int | None) -> dict[str, Any]: ...

    def close(self) -> None: ...


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``15m``, ``2h``, ``1d``, ``1w`` (a bare number is seconds)."""
    match = _DURATION.match(text or "")
    if not match:
        raise QueryError(f"bad duration {text!r}: use a number with a unit, e.g. 90s, 15m, 2h, 1d")
    return float(match.group(1)) * _UNIT_S[(match.group(2) or "s").lower()]


def _instant_ns(text: str, now_ns: int) -> int:
    """A point in time: an ISO 8601 timestamp (``2026-12-01T22:00:00Z``; no zone means UTC)
    or a duration before now (:func:`parse_duration`)."""
    if _DURATION.match(text or ""):
        seconds = parse_duration(text)
        if seconds * 1e9 >= now_ns:
            raise QueryError(f"{text[:40]!r} reaches back before 1970: use a shorter duration")
        return now_ns - int(seconds * 1e9)
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except (ValueError, OverflowError):
        raise QueryError(
            f"bad time {text!r}: use a duration before now (90s, 15m, 2h, 1d) or an ISO 8601 time "
            "(2026-12-01T22:00:00Z)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    ns = int(when.timestamp()) * 1_000_000_000 + when.microsecond * 1000
    if not 0 <= ns < 2**63:
        raise QueryError(f"{text[:40]!r} is outside 1970-2262, the range of nanosecond timestamps")
    return ns


def window_ns(since: str | None, until: str | None, *, now_ns: int | None = None) -> tuple[int, int | None]:
    """(since_ns, until_ns) for ``--since``/``--until``: durations before now or ISO 8601 times."""
    now = time.time_ns() if now_ns is None else now_ns
    since_ns = _instant_ns(since or "1h", now)
    until_ns = _instant_ns(until, now) if until else None
    if until_ns is not None and until_ns <= since_ns:
        raise QueryError(f"--until {until} is not after --since {since}: nothing in between")
    return since_ns, until_ns


# ------------------------------------------------------------------ sidecar over HTTP


class SidecarClient:
    """The sidecar's query API (``/api/v1/...``), stdlib only."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = QUERY_TIMEOUT_S) -> None:
        self.url = check_url(url, "--sidecar").rstrip("/")
        self.token = token if token is not None else os.environ.get(names.ENV_SIDECAR_TOKEN) or None
        self.timeout_s = timeout_s

    def _request(
        self, path: str, query: dict[str, Any] | None = None, *, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        request = urllib.request.Request(url, headers={"Accept": "application/json"})
        if body is not None:  # a POST: what the CLI measured itself goes along
            request.data = json.dumps(body).encode()
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            raise self._http_error(exc) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
            raise UnavailableError(
                f"sidecar at {self.url} is unreachable ({reason}); is `otelkv sidecar` running?"
            ) from None
        try:
            data = json.loads(body)
        except ValueError:
            raise UnavailableError(
                f"sidecar at {self.url} answered {path} with something that is not JSON: is it an otelkv "
                "sidecar's admin address (default :8801)?"
            ) from None
        if not isinstance(data, dict):
            raise UnavailableError(f"sidecar at {self.url} answered {path} with unexpected JSON")
        return data

    def _http_error(self, exc: urllib.error.HTTPError) -> QueryError:
        """404 is "not there" (3); 400, 401 and 403 are the caller's input or token (2); the
        rest (503 no store, 500 query failed, a proxy's 502) are the sidecar's side (4)."""
        detail = ""
        try:
            payload = json.loads(exc.read() or b"{}")
            detail = (
                str(payload.get("error") or payload.get("message") or "") if isinstance(payload, dict) else ""
            )
        except (ValueError, OSError):
            detail = ""
        if exc.code in (401, 403):
            return QueryError(
                f"sidecar at {self.url} refused the request ({exc.code}): "
                f"set {names.ENV_SIDECAR_TOKEN} to its token"
            )
        if exc.code == 404:
            return NotFoundError(detail or f"not found ({exc.url}): is {self.url} an otelkv sidecar?")
        if exc.code == 400 and detail:  # the sidecar's own words about the input, as a local query says them
            return QueryError(detail)
        message = f"sidecar at {self.url} failed ({exc.code}){': ' + detail if detail else ''}"
        return QueryError(message) if exc.code == 400 else UnavailableError(message)

    def slow(self, *, since_ns: int | None, until_ns: int | None, limit: int) -> dict[str, Any]:
        return self._request("/api/v1/slow", {"since_ns": since_ns, "until_ns": until_ns, "limit": limit})

    def conversation(self, conversation_id: str) -> dict[str, Any]:
        return self._request("/api/v1/conversations/" + urllib.parse.quote(conversation_id, safe=""))

    def why(self, ref: str) -> dict[str, Any]:
        return self._request("/api/v1/why/" + urllib.parse.quote(ref, safe=""))

    def tune(self, *, since_ns: int | None, until_ns: int | None, options: dict[str, Any]) -> dict[str, Any]:
        query = {k: ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v for k, v in options.items()}
        return self._request("/api/v1/tune", {"since_ns": since_ns, "until_ns": until_ns, **query})

    def doctor(
        self,
        *,
        since_ns: int | None,
        until_ns: int | None,
        probes: list[dict[str, Any]],
        router_handle_ttl_s: float | None,
    ) -> dict[str, Any]:
        body = {
            "since_ns": since_ns,
            "until_ns": until_ns,
            "probes": probes,
            "router_handle_ttl_s": router_handle_ttl_s,
        }
        return self._request("/api/v1/doctor", body=body)

    def funnel(self, *, since_ns: int | None, until_ns: int | None) -> dict[str, Any]:
        return self._request("/api/v1/funnel", {"since_ns": since_ns, "until_ns": until_ns})

    def close(self) -> None:
        return None


def check_url(url: str, flag: str) -> str:
    """``url`` when it is an ``http(s)://HOST[:PORT]`` URL, else a :class:`QueryError` naming ``flag``
    (urllib would otherwise fail later with "unknown url type")."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise QueryError(f"{flag} wants an http(s)://HOST:PORT URL, got {url[:200]!r}")
    return url


def sidecar_answers(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether a sidecar answers ``/api/v1/health`` at ``url`` within the timeout."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/api/v1/health", timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return False


# ------------------------------------------------------------------ local store


class LocalQuerier:
    """The analysis functions run in this process over a :class:`SpanSource`."""

    def __init__(self, source: Any, *, closer: Any = None) -> None:
        self.source = source
        self._closer = closer

    def _run(self, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``fn(source, ...)``; "not there" becomes :class:`NotFoundError`, a store that fails
        (ClickHouse unreachable, a query error) :class:`UnavailableError`."""
        from otelkv.analysis.report import BadRef, NotFound
        from otelkv.store.base import StoreError

        try:
            return fn(self.source, *args, **kwargs)  # type: ignore[no-any-return]
        except NotFound as exc:
            raise NotFoundError(str(exc)) from None
        except BadRef as exc:
            raise QueryError(str(exc)) from None
        except StoreError as exc:
            raise UnavailableError(" ".join(str(exc).split())[:500]) from None

    def slow(self, *, since_ns: int | None, until_ns: int | None, limit: int) -> dict[str, Any]:
        from otelkv.analysis import report

        return self._run(report.slow, since_ns=since_ns, until_ns=until_ns, limit=limit)

    def conversation(self, conversation_id: str) -> dict[str, Any]:
        from otelkv.analysis import report

        return self._run(report.conversation, conversation_id)

    def why(self, ref: str) -> dict[str, Any]:
        from otelkv.analysis import report

        return self._run(report.why, ref)

    def tune(self, *, since_ns: int | None, until_ns: int | None, options: dict[str, Any]) -> dict[str, Any]:
        from otelkv.analysis.tune.window import options_from_dict, tune

        return self._run(tune, since_ns=since_ns, until_ns=until_ns, options=options_from_dict(options))

    def doctor(
        self,
        *,
        since_ns: int | None,
        until_ns: int | None,
        probes: list[dict[str, Any]],
        router_handle_ttl_s: float | None,
    ) -> dict[str, Any]:
        from otelkv.analysis.doctor import doctor
        from otelkv.analysis.engine_probe import EngineProbe

        return self._run(
            doctor,
            since_ns=since_ns,
            until_ns=until_ns,
            probes=[EngineProbe.from_dict(p) for p in probes],
            router_handle_ttl_s=router_handle_ttl_s,
        )

    def funnel(self, *, since_ns: int | None, until_ns: int | None) -> dict[str, Any]:
        from otelkv.analysis.funnel import funnel

        return self._run(funnel, since_ns=since_ns, until_ns=until_ns)

    def close(self) -> None:
        if self._closer is not None:
            try:
                self._closer()
            except Exception:  # noqa: BLE001 - closing a read-only store must not mask the answer
                pass


def default_store_dir() -> Path:
    env = os.environ.get(ENV_STORE)
    return Path(env).expanduser() if env else Path.home() / ".local" / "share" / "otelkv" / "store"


def _is_lock_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "lock" in text or "already in use" in text or "busy" in text


def check_store_dir(path: str, *, asked: bool = True) -> None:
    """Refuse a store directory that is not there (:class:`NotFoundError`) or not a store
    (a file: :class:`QueryError`; a directory without chDB's ``metadata/``: NotFoundError)
    before chDB opens it: chDB would create a new, empty store in any directory it is given.
    ``asked`` is False for the default directory, tried because no sidecar answered."""
    if not path.strip():
        raise QueryError("--store wants a directory, got an empty string")
    where = Path(path).expanduser()
    if not where.exists():
        if asked:
            raise NotFoundError(
                f"no store at {path}: pass the directory `otelkv sidecar --store DIR` writes to, "
                "or ask a running sidecar with --sidecar URL"
            )
        raise NotFoundError(
            f"no sidecar answered and there is no store at {path}: start `otelkv sidecar`, or pass "
            "--sidecar URL, --store DIR or --clickhouse URL"
        )
    if not where.is_dir():
        raise QueryError(f"{path} is a file, not a store directory: pass the directory the sidecar writes to")
    if not (where / "metadata").is_dir():
        raise NotFoundError(
            f"{path} is not an otelkv store (no chDB files in it): pass the directory "
            "`otelkv sidecar --store DIR` writes to"
        )


def open_local(
    *, path: str | None = None, clickhouse_url: str | None = None, asked: bool = True
) -> LocalQuerier:
    """Open the store directory (or a ClickHouse URL) in this process.

    Errors: :class:`NotFoundError` (no store there), :class:`QueryError` (not a directory, a
    malformed URL), :class:`UnavailableError` (locked by a sidecar, unreadable, chDB missing).
    ``asked`` as in :func:`check_store_dir`.
    """
    from otelkv.analysis.sources import StoreSource

    where = clickhouse_url or str(path)
    if clickhouse_url is not None:
        check_url(clickhouse_url, "--clickhouse")
    elif path is not None:
        check_store_dir(path, asked=asked)
    try:
        from otelkv.store import open_store

        store = (
            open_store(clickhouse_url=clickhouse_url, create_schema=False)
            if clickhouse_url
            else open_store(path=path)
        )
    except ImportError as exc:
        raise UnavailableError(f"cannot open the store here ({exc}); pip install 'otelkv[sidecar]'") from None
    except Exception as exc:  # noqa: BLE001 - any open failure is reported as one line
        if _is_lock_error(exc):
            raise UnavailableError(
                f"store {where} is locked by a running sidecar; ask it instead: --sidecar URL "
                f"(or set {ENV_SIDECAR})"
            ) from None
        detail = " ".join(str(exc).split())[:300]
        raise UnavailableError(f"cannot open the store {where}: {detail}") from None
    return LocalQuerier(StoreSource(store), closer=getattr(store, "close", None))


def resolve(
    *, sidecar: str | None = None, store: str | None = None, clickhouse: str | None = None
) -> Querier:
    """The querier for the given options; with none, a sidecar that answers, else the default store."""
    if sidecar is not None:
        return SidecarClient(sidecar)
    if store is not None:
        return open_local(path=store)
    if clickhouse is not None:
        return open_local(clickhouse_url=clickhouse)
    url = os.environ.get(ENV_SIDECAR) or DEFAULT_SIDECAR_URL
    if sidecar_answers(url):
        return SidecarClient(url)
    return open_local(path=str(default_store_dir()), asked=False)
