"""``otelkv dashboards push``: create or update datasources, the folder and the dashboards.

Idempotent: a second push with nothing changed changes nothing on the server (datasources
and the folder are compared before they are written; a dashboard equal to what Grafana
holds is left alone, so its version does not move). Every failure becomes a
:class:`PushError` whose message is one line an operator can act on.

The order matters: Grafana is reached and its version checked first (``/api/health``, then
``/api/frontend/settings``, which also proves the credentials), so an old Grafana or a bad
token fails before anything is written. Dashboards are saved with the version Grafana
holds (optimistic locking): if someone saves the same dashboard in between, Grafana answers
412 and the push stops instead of silently discarding their change; ``overwrite`` skips
that check.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import niquests
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaException, GrafanaTimeoutError

from otelkv.dashboards import provisioning
from otelkv.dashboards.sources import BY_KEY, CLICKHOUSE, Datasource

MIN_VERSION = (11, 0)
"""The JSON is generated for Grafana 11.6 (schemaVersion 41, grafana-foundation-sdk's 11.6
line). Grafana migrates dashboards forward, never back: a Grafana 10 would load panels whose
options it does not know."""

MESSAGE = "otelkv dashboards push"


class PushError(Exception):
    """A push failed; ``str()`` is one line saying what happened and what to do.

    ``unreachable`` is True when the failure is on Grafana's side (not reachable, too slow,
    a 5xx, a conflict with what is stored there) rather than in the arguments (a malformed
    URL, rejected credentials, not Grafana's root URL): the CLI exits 4 for the one, 2 for
    the other.
    """

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


@dataclass
class PushReport:
    """What the push did, per object: ``created``, ``updated`` or ``unchanged``."""

    grafana_version: str = ""
    folder: str = ""
    datasources: dict[str, str] = field(default_factory=dict)
    dashboards: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"Grafana {self.grafana_version}", f"folder: {self.folder}"]
        out += [f"datasource {uid}: {status}" for uid, status in self.datasources.items()]
        out += [f"dashboard {uid}: {status}" for uid, status in self.dashboards.items()]
        return out


def folder_uid(title: str) -> str:
    """A stable uid for a folder title (Grafana uids: letters, digits, ``-``, ``_``; <= 40)."""
    uid = re.sub(r"[^a-z0-9_-]+", "-", title.lower()).strip("-")[:40]
    if not uid:
        raise PushError(f"folder title {title!r} has no letters or digits to make a uid from")
    return uid


def parse_version(text: str) -> tuple[int, ...]:
    """``11.6.0-pre`` -> ``(11, 6, 0)``; unknown parts count as 0."""
    numbers = []
    for part in re.split(r"[.+-]", text.strip().lstrip("v"))[:3]:
        numbers.append(int(part) if part.isdigit() else 0)
    return tuple(numbers)


class Pusher:
    """One Grafana and the credentials to write to it."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        if not re.match(r"^https?://[^/]", url):
            raise PushError(f"Grafana URL {url!r} must start with http:// or https://")
        credential: str | tuple[str, str] | None = None
        if token:
            credential = token
        elif user is not None and password is not None:
            credential = (user, password)
        elif user is not None or password is not None:
            raise PushError("give both --user and --password (or a --token)")
        self.url = url.rstrip("/")
        self.api = GrafanaApi.from_url(self.url, credential=credential, timeout=timeout_s)

    # ------------------------------------------------------------------ errors

    def _fail(self, exc: BaseException, doing: str) -> PushError:
        """One line for an exception raised while ``doing`` something."""
        if isinstance(exc, GrafanaTimeoutError) or isinstance(exc, niquests.exceptions.Timeout):
            return PushError(f"Grafana at {self.url} did not answer in time while {doing}", unreachable=True)
        if isinstance(exc, niquests.exceptions.ConnectionError):
            reason = "connection refused" if "refused" in str(exc).lower() else str(exc).splitlines()[0]
            return PushError(
                f"cannot reach Grafana at {self.url} ({reason}): is the URL right and Grafana up?",
                unreachable=True,
            )
        if isinstance(exc, GrafanaException):
            code = exc.status_code
            body = exc.response if isinstance(exc.response, Mapping) else {}
            detail = str(body.get("message") or exc.message or "").strip()
            if code == 401:
                return PushError(
                    f"Grafana at {self.url} rejected the credentials (401) while {doing}: check --token "
                    "(or GRAFANA_TOKEN), or --user/--password (GRAFANA_USER/GRAFANA_PASSWORD)"
                )
            if code == 403:
                return PushError(
                    f"not allowed (403) while {doing}: the credentials need the Editor role for folders "
                    f"and dashboards and Admin for datasources ({detail})"
                )
            if code == 404:
                return PushError(
                    f"not found (404) while {doing}: is {self.url} Grafana's root URL? ({detail})"
                )
            if code == 409:
                return PushError(f"conflict (409) while {doing}: {detail}", unreachable=True)
            if code == 412:
                status = body.get("status", "")
                if status == "version-mismatch":
                    return PushError(
                        f"version conflict (412) while {doing}: someone saved it since this push read "
                        "it; push again, or pass --overwrite to replace their change",
                        unreachable=True,
                    )
                if status == "name-exists":
                    return PushError(
                        f"name conflict (412) while {doing}: another dashboard in the folder has this "
                        "title; rename or move it",
                        unreachable=True,
                    )
                return PushError(
                    f"precondition failed (412, {status or 'no status'}) while {doing}: {detail}",
                    unreachable=True,
                )
            if code is not None and int(code) >= 500:
                return PushError(
                    f"Grafana at {self.url} failed ({code}) while {doing}: {detail}", unreachable=True
                )
            return PushError(f"Grafana answered {code} while {doing}: {detail}")
        return PushError(f"{type(exc).__name__} while {doing}: {exc}", unreachable=True)

    def _call(self, doing: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (GrafanaException, niquests.exceptions.RequestException) as exc:
            raise self._fail(exc, doing) from None

    def _get_or_none(self, doing: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, or None when Grafana answers 404."""
        try:
            return fn(*args)
        except GrafanaException as exc:
            if exc.status_code == 404:
                return None
            raise self._fail(exc, doing) from None
        except niquests.exceptions.RequestException as exc:
            raise self._fail(exc, doing) from None

    # ------------------------------------------------------------------ steps

    def check_version(self) -> str:
        """Grafana's version; raises unless reachable, authenticated and new enough."""
        health = self._call("checking /api/health", self.api.client.GET, "/health")
        if not isinstance(health, Mapping) or "database" not in health:
            raise PushError(f"{self.url} does not look like Grafana (/api/health said {health!r})")
        version = self._call("reading the Grafana version (/api/frontend/settings)", lambda: self.api.version)
        if not version:
            version = str(health.get("version") or "")
        if not version:
            raise PushError(f"Grafana at {self.url} did not say its version; cannot check it is >= 11.0")
        if parse_version(version)[:2] < MIN_VERSION:
            raise PushError(
                f"Grafana {version} at {self.url} is too old: otelkv's dashboards are generated for "
                f"Grafana 11.6 and need {'.'.join(map(str, MIN_VERSION))} or newer"
            )
        return version

    def datasource(self, source: Datasource, url: str, *, password: str | None = None) -> str:
        model = provisioning.datasource_model(source, url, password=password)
        existing = self._get_or_none(
            f"reading datasource {source.uid}", self.api.datasource.get_datasource_by_uid, source.uid
        )
        if existing is None:
            self._call(
                f"creating datasource {source.uid} ({source.name})",
                self.api.datasource.create_datasource,
                model,
            )
            return "created"
        # A password cannot be read back to compare: with one, the datasource is rewritten.
        comparable = {k: v for k, v in model.items() if k != "secureJsonData"}
        if all(existing.get(k) == v for k, v in comparable.items()) and "secureJsonData" not in model:
            return "unchanged"
        self._call(
            f"updating datasource {source.uid}",
            self.api.datasource.update_datasource_by_uid,
            source.uid,
            model,
        )
        return "updated"

    def folder(self, title: str) -> tuple[str, str]:
        """(uid, status) of the folder the dashboards go to."""
        uid = folder_uid(title)
        existing = self._get_or_none(f"reading folder {uid}", self.api.folder.get_folder, uid)
        if existing is None:
            self._call(f"creating folder {title!r}", self.api.folder.create_folder, title, uid=uid)
            return uid, "created"
        if existing.get("title") == title:
            return uid, "unchanged"
        self._call(f"renaming folder {uid}", self.api.folder.update_folder, uid, title=title, overwrite=True)
        return uid, "updated"

    def dashboard(self, board: Mapping[str, Any], folder: str, *, overwrite: bool = False) -> str:
        uid = str(board["uid"])
        doing = f"saving dashboard {uid}"
        current = self._get_or_none(f"reading dashboard {uid}", self.api.dashboard.get_dashboard, uid)
        payload = {k: v for k, v in board.items() if k not in ("id", "version")}
        if current is not None:
            held = current.get("dashboard") or {}
            same_folder = (current.get("meta") or {}).get("folderUid") == folder
            if same_folder and {k: v for k, v in held.items() if k not in ("id", "version")} == payload:
                return "unchanged"
            if not overwrite:
                payload["version"] = held.get("version")
        body = {
            "dashboard": {**payload, "id": None},
            "folderUid": folder,
            "overwrite": overwrite,
            "message": MESSAGE,
        }
        self._call(doing, self.api.dashboard.update_dashboard, body)
        return "created" if current is None else "updated"

    def push(
        self,
        boards: Sequence[Mapping[str, Any]],
        *,
        folder_title: str = provisioning.FOLDER_TITLE,
        datasource_urls: Mapping[str, str] | None = None,
        clickhouse_password: str | None = None,
        overwrite: bool = False,
    ) -> PushReport:
        """Everything, in order: version, datasources (those given), folder, dashboards."""
        report = PushReport(grafana_version=self.check_version())
        for key, url in (datasource_urls or {}).items():
            source = BY_KEY.get(key)
            if source is None:
                raise PushError(f"unknown datasource {key!r}: use {', '.join(BY_KEY)}")
            password = clickhouse_password if source is CLICKHOUSE else None
            report.datasources[source.uid] = self.datasource(source, url, password=password)
        uid, status = self.folder(folder_title)
        report.folder = f"{folder_title} ({uid}) {status}"
        for board in boards:
            report.dashboards[str(board["uid"])] = self.dashboard(board, uid, overwrite=overwrite)
        return report
