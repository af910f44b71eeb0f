"""``otelkv dashboards push`` through the real grafana-client against an in-process fake Grafana.

No Grafana server can be installed here (see docs/dashboards.md), so :class:`FakeGrafana`
implements the endpoints push uses with the semantics Grafana documents
(``docs/sources/developers/http_api/{dashboard,folder,data_source}.md``): Basic and Bearer
auth (401), roles (403: Viewer reads, Editor writes folders and dashboards, Admin writes
datasources), folder uid/title uniqueness (409), datasource name/uid uniqueness (409),
dashboard optimistic locking (412 ``version-mismatch``) and title uniqueness per folder
(412 ``name-exists``), ``/api/health`` without auth and ``/api/frontend/settings`` with it.
The client side - grafana-client, niquests, the HTTP on the wire - is the real thing.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grafana_client", reason="needs the dashboards extra: pip install 'otelkv[dashboards]'")
pytest.importorskip(
    "grafana_foundation_sdk", reason="needs the dashboards extra: pip install 'otelkv[dashboards]'"
)

from otelkv.cli.main import main
from otelkv.dashboards import build, provisioning
from otelkv.dashboards.push import Pusher, PushError, folder_uid, parse_version
from otelkv.dashboards.sources import CLICKHOUSE, PROMETHEUS, TEMPO

ROLES = {"Viewer": 0, "Editor": 1, "Admin": 2}


class FakeGrafana:
    """The part of Grafana's HTTP API that push uses, state in memory."""

    def __init__(self, version: str = "11.6.0") -> None:
        self.version = version
        self.users = {("admin", "secret"): "Admin"}
        self.tokens = {"glsa_admin": "Admin", "glsa_editor": "Editor", "glsa_viewer": "Viewer"}
        self.folders: dict[str, dict[str, Any]] = {}
        self.datasources: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []
        self.before_dashboard_save: Callable[[str], None] | None = None
        self._ids = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    # ------------------------------------------------------------------ HTTP plumbing

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        grafana = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                status, payload = grafana.handle(self.command, self.path.split("?")[0], self.headers, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _serve  # noqa: N815 - http.server's names

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def role(self, headers: Any) -> str | None:
        auth = headers.get("Authorization") or ""
        if auth.startswith("Bearer "):
            return self.tokens.get(auth[7:])
        if auth.startswith("Basic "):
            user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
            return self.users.get((user, password))
        return None

    def handle(self, method: str, path: str, headers: Any, body: Any) -> tuple[int, Any]:
        if method == "GET" and path == "/api/health":
            return 200, {"commit": "abc123", "database": "ok", "version": self.version}
        role = self.role(headers)
        if role is None:
            return 401, {"message": "Unauthorized"}
        needed = (
            "Viewer" if method == "GET" else ("Admin" if path.startswith("/api/datasources") else "Editor")
        )
        if ROLES[role] < ROLES[needed]:
            return 403, {"message": "You'll need additional permissions to perform this action."}
        if method != "GET":
            self.writes.append((method, path))
        parts = path.strip("/").split("/")
        if path == "/api/frontend/settings":
            return 200, {"buildInfo": {"version": self.version, "commit": "abc123", "edition": "Open Source"}}
        if parts[:2] == ["api", "folders"]:
            return self.folder(method, parts[2] if len(parts) > 2 else None, body)
        if parts[:2] == ["api", "datasources"]:
            return self.datasource(method, parts[3] if len(parts) > 3 and parts[2] == "uid" else None, body)
        if path == "/api/dashboards/db" and method == "POST":
            return self.save_dashboard(body)
        if parts[:3] == ["api", "dashboards", "uid"] and method == "GET":
            stored = self.dashboards.get(parts[3])
            if stored is None:
                return 404, {"message": "Dashboard not found"}
            return 200, {"dashboard": stored["dashboard"], "meta": {"folderUid": stored["folderUid"]}}
        return 404, {"message": "Not found"}

    # ------------------------------------------------------------------ folders

    def folder(self, method: str, uid: str | None, body: Any) -> tuple[int, Any]:
        if method == "GET" and uid:
            found = self.folders.get(uid)
            return (200, found) if found else (404, {"message": "folder not found", "status": "not-found"})
        if method == "POST" and uid is None:
            if not body.get("title"):
                return 400, {"message": "folder title cannot be empty"}
            new_uid = body.get("uid") or f"f{self._next_id()}"
            if new_uid in self.folders or any(f["title"] == body["title"] for f in self.folders.values()):
                return 409, {"message": "a folder with the same name or uid already exists"}
            self.folders[new_uid] = {
                "id": self._next_id(),
                "uid": new_uid,
                "title": body["title"],
                "version": 1,
            }
            return 200, self.folders[new_uid]
        if method == "PUT" and uid:
            found = self.folders.get(uid)
            if found is None:
                return 404, {"message": "folder not found", "status": "not-found"}
            if not body.get("overwrite") and body.get("version") != found["version"]:
                return 412, {
                    "message": "the folder has been changed by someone else",
                    "status": "version-mismatch",
                }
            found.update(title=body.get("title", found["title"]), version=found["version"] + 1)
            return 200, found
        return 405, {"message": "method not allowed"}

    # ------------------------------------------------------------------ datasources

    def _stored_datasource(self, model: dict[str, Any], id_: int, version: int) -> dict[str, Any]:
        stored = {k: v for k, v in model.items() if k != "secureJsonData"}
        stored.update(id=id_, orgId=1, version=version, readOnly=False)
        stored["secureJsonFields"] = {k: True for k in model.get("secureJsonData") or {}}
        return stored

    def datasource(self, method: str, uid: str | None, body: Any) -> tuple[int, Any]:
        if method == "GET" and uid:
            found = self.datasources.get(uid)
            return (200, found) if found else (404, {"message": "Data source not found"})
        if method == "POST" and uid is None:
            if any(d["name"] == body["name"] for d in self.datasources.values()):
                return 409, {"message": "data source with the same name already exists"}
            if body.get("uid") in self.datasources:
                return 409, {"message": "data source with the same uid already exists"}
            stored = self._stored_datasource(body, self._next_id(), 1)
            self.datasources[stored["uid"]] = stored
            return 200, {
                "datasource": stored,
                "id": stored["id"],
                "message": "Datasource added",
                "name": body["name"],
            }
        if method == "PUT" and uid:
            found = self.datasources.get(uid)
            if found is None:
                return 404, {"message": "Data source not found"}
            if any(d["name"] == body["name"] and u != uid for u, d in self.datasources.items()):
                return 409, {"message": "data source with the same name already exists"}
            stored = self._stored_datasource({**body, "uid": uid}, found["id"], found["version"] + 1)
            self.datasources[uid] = stored
            return 200, {
                "datasource": stored,
                "id": stored["id"],
                "message": "Datasource updated",
                "name": body["name"],
            }
        return 405, {"message": "method not allowed"}

    # ------------------------------------------------------------------ dashboards

    def save_dashboard(self, body: Any) -> tuple[int, Any]:
        board, folder = dict(body["dashboard"]), body.get("folderUid", "")
        if not board.get("title"):
            return 400, {"message": "Dashboard title cannot be empty", "status": "empty-name"}
        if folder and folder not in self.folders:
            return 400, {"message": "folder not found", "status": "not-found"}
        uid = board.get("uid")
        if self.before_dashboard_save is not None:
            self.before_dashboard_save(uid)
        existing = self.dashboards.get(uid)
        if existing is not None:
            if not body.get("overwrite") and board.get("version") != existing["dashboard"]["version"]:
                return 412, {
                    "message": "The dashboard has been changed by someone else",
                    "status": "version-mismatch",
                }
        elif not body.get("overwrite") and any(
            d["folderUid"] == folder and d["dashboard"]["title"] == board["title"]
            for d in self.dashboards.values()
        ):
            return 412, {
                "message": "A dashboard with the same name in the folder already exists",
                "status": "name-exists",
            }
        version = existing["dashboard"]["version"] + 1 if existing else 1
        board.update(id=existing["dashboard"]["id"] if existing else self._next_id(), version=version)
        self.dashboards[uid] = {"dashboard": board, "folderUid": folder}
        return 200, {
            "id": board["id"],
            "uid": uid,
            "url": f"/d/{uid}/x",
            "status": "success",
            "version": version,
        }

    def __enter__(self) -> FakeGrafana:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    with FakeGrafana() as fake:
        yield fake


BOARDS = [build.to_json(spec.build()) for spec in build.DASHBOARDS]
URLS = {
    "prometheus": "http://prometheus:9090",
    "clickhouse": "clickhouse://reader@clickhouse:9000",
    "tempo": "http://tempo:3200",
}


def push(grafana: FakeGrafana, token: str = "glsa_admin", **kwargs: Any) -> Any:
    kwargs.setdefault("datasource_urls", URLS)
    return Pusher(grafana.url, token=token).push(BOARDS, **kwargs)


# ------------------------------------------------------------------ the happy path


def test_first_push_creates_everything_the_second_changes_nothing(grafana: FakeGrafana) -> None:
    report = push(grafana)
    assert report.grafana_version == "11.6.0"
    assert report.datasources == {s.uid: "created" for s in (PROMETHEUS, CLICKHOUSE, TEMPO)}
    assert report.folder == "otelkv (otelkv) created"
    assert report.dashboards == {b["uid"]: "created" for b in BOARDS}
    stored = grafana.dashboards["otelkv-kv-reuse"]
    assert stored["folderUid"] == "otelkv" and stored["dashboard"]["version"] == 1
    assert grafana.datasources[CLICKHOUSE.uid]["jsonData"]["host"] == "clickhouse"
    assert grafana.datasources[CLICKHOUSE.uid]["jsonData"]["username"] == "reader"

    writes = len(grafana.writes)
    again = push(grafana)
    assert again.datasources == {s.uid: "unchanged" for s in (PROMETHEUS, CLICKHOUSE, TEMPO)}
    assert again.folder.endswith("unchanged")
    assert again.dashboards == {b["uid"]: "unchanged" for b in BOARDS}
    assert len(grafana.writes) == writes  # idempotent: not a single write
    assert grafana.dashboards["otelkv-kv-reuse"]["dashboard"]["version"] == 1


def test_a_changed_dashboard_is_updated_with_the_version_grafana_holds(grafana: FakeGrafana) -> None:
    push(grafana)
    changed = [dict(b, description="new words") if b["uid"] == "otelkv-agent-turns" else b for b in BOARDS]
    report = Pusher(grafana.url, token="glsa_editor").push(changed)
    assert report.dashboards["otelkv-agent-turns"] == "updated"
    assert report.dashboards["otelkv-kv-reuse"] == "unchanged"
    assert report.datasources == {}  # none given: datasources are left alone
    assert grafana.dashboards["otelkv-agent-turns"]["dashboard"]["version"] == 2


def test_a_datasource_edited_by_hand_is_put_back(grafana: FakeGrafana) -> None:
    push(grafana)
    grafana.datasources[PROMETHEUS.uid]["url"] = "http://elsewhere:9090"
    report = push(grafana, datasource_urls={"prometheus": URLS["prometheus"]})
    assert report.datasources == {PROMETHEUS.uid: "updated"}
    assert grafana.datasources[PROMETHEUS.uid]["url"] == URLS["prometheus"]


def test_basic_auth_and_a_custom_folder(grafana: FakeGrafana) -> None:
    report = Pusher(grafana.url, user="admin", password="secret").push(BOARDS, folder_title="Agent SRE")
    assert report.folder == "Agent SRE (agent-sre) created"
    assert {d["folderUid"] for d in grafana.dashboards.values()} == {"agent-sre"}


# ------------------------------------------------------------------ every failure is one clear line


def _fails(match: str, fn: Callable[[], Any]) -> str:
    with pytest.raises(PushError, match=match) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_wrong_token_is_401(grafana: FakeGrafana) -> None:
    message = _fails(r"rejected the credentials \(401\)", lambda: push(grafana, token="glsa_wrong"))
    assert "GRAFANA_TOKEN" in message
    assert grafana.writes == []


def test_missing_permission_is_403(grafana: FakeGrafana) -> None:
    _fails(r"not allowed \(403\) while creating datasource", lambda: push(grafana, token="glsa_viewer"))
    # An editor may save dashboards but not datasources.
    _fails(r"not allowed \(403\) while creating datasource", lambda: push(grafana, token="glsa_editor"))
    report = push(grafana, token="glsa_editor", datasource_urls={})
    assert set(report.dashboards.values()) == {"created"}


def test_too_old_grafana_is_refused_before_any_write() -> None:
    with FakeGrafana(version="10.4.3") as old:
        message = _fails("too old", lambda: push(old))
        assert "Grafana 10.4.3" in message and "11.0" in message
        assert old.writes == []


def test_connection_refused() -> None:
    with FakeGrafana() as fake:
        url = fake.url
    _fails(r"cannot reach Grafana at \S+ \(connection refused\)", lambda: Pusher(url, token="x").push(BOARDS))


def test_not_grafana_is_404(grafana: FakeGrafana) -> None:
    _fails(
        r"not found \(404\) .*root URL",
        lambda: Pusher(grafana.url + "/not-grafana", token="glsa_admin").push(BOARDS),
    )


def test_concurrent_save_is_a_412_version_conflict(grafana: FakeGrafana) -> None:
    push(grafana)

    def someone_saves(uid: str) -> None:
        stored = grafana.dashboards.get(uid)
        if stored is not None:
            stored["dashboard"]["version"] += 1

    grafana.before_dashboard_save = someone_saves
    changed = [dict(b, description="mine") for b in BOARDS]
    _fails(
        r"version conflict \(412\).*--overwrite",
        lambda: Pusher(grafana.url, token="glsa_admin").push(changed),
    )
    report = Pusher(grafana.url, token="glsa_admin").push(changed, overwrite=True)
    assert set(report.dashboards.values()) == {"updated"}


def test_same_title_in_the_folder_is_a_412_name_conflict(grafana: FakeGrafana) -> None:
    push(grafana, datasource_urls={})
    grafana.dashboards.pop("otelkv-kv-reuse")
    grafana.dashboards["someone-elses"] = {
        "dashboard": {"uid": "someone-elses", "title": "otelkv / KV reuse", "version": 3, "id": 99},
        "folderUid": "otelkv",
    }
    _fails(
        r"name conflict \(412\) while saving dashboard otelkv-kv-reuse",
        lambda: push(grafana, datasource_urls={}),
    )


def test_folder_title_taken_by_another_uid_is_a_409(grafana: FakeGrafana) -> None:
    grafana.folders["legacy"] = {"id": 1, "uid": "legacy", "title": "otelkv", "version": 1}
    _fails(r"conflict \(409\) while creating folder 'otelkv'", lambda: push(grafana, datasource_urls={}))


def test_datasource_name_taken_by_another_uid_is_a_409(grafana: FakeGrafana) -> None:
    grafana.datasources["hand-made"] = {
        "uid": "hand-made",
        "name": PROMETHEUS.name,
        "type": "prometheus",
        "id": 7,
    }
    message = _fails(r"conflict \(409\) while creating datasource otelkv-prometheus", lambda: push(grafana))
    assert "same name" in message


def test_unknown_datasource_key(grafana: FakeGrafana) -> None:
    _fails("unknown datasource 'loki'", lambda: push(grafana, datasource_urls={"loki": "http://loki:3100"}))


def test_bad_arguments() -> None:
    _fails("must start with http", lambda: Pusher("grafana:3000"))
    _fails("both --user and --password", lambda: Pusher("http://g:3000", user="admin"))
    _fails("no letters or digits", lambda: folder_uid("!!!"))


def test_helpers() -> None:
    assert parse_version("11.6.0-pre") == (11, 6, 0)
    assert parse_version("v12.0.1+security-01") == (12, 0, 1)
    assert folder_uid("Agent SRE / otelkv") == "agent-sre-otelkv"
    model = provisioning.datasource_model(CLICKHOUSE, "https://u:pw@ch:8443")
    assert model["jsonData"]["protocol"] == "http" and model["jsonData"]["secure"] is True
    assert model["secureJsonData"] == {"password": "pw"}


# ------------------------------------------------------------------ the command line


def test_cli_push_and_its_errors(
    grafana: FakeGrafana, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["dashboards", "push", "--url", grafana.url, "--token", "glsa_admin"]
    assert main([*argv, "--datasource", "prometheus=http://prometheus:9090", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["datasources"] == {PROMETHEUS.uid: "created"}
    assert set(report["dashboards"].values()) == {"created"}

    build.write(tmp_path)
    assert main([*argv, "--from", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "dashboard otelkv-conversation: unchanged" in out

    assert main(["dashboards", "push", "--url", grafana.url, "--token", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("otelkv dashboards: ") and "(401)" in err and err.count("\n") == 1
    assert main([*argv, "--datasource", "prometheus"]) == 2
    assert "expected KEY=URL" in capsys.readouterr().err


def test_cli_reads_credentials_from_the_environment(
    grafana: FakeGrafana, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GRAFANA_URL", grafana.url)
    monkeypatch.setenv("GRAFANA_USER", "admin")
    monkeypatch.setenv("GRAFANA_PASSWORD", "secret")
    assert main(["dashboards", "push"]) == 0
    assert "dashboard otelkv-agent-turns: created" in capsys.readouterr().out
    monkeypatch.delenv("GRAFANA_URL")
    assert main(["dashboards", "push"]) == 2
    assert "no Grafana URL" in capsys.readouterr().err
