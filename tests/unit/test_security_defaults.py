"""Security defaults, checked on real sidecar processes (docs/security.md, "Defaults").

(a) every listener binds 127.0.0.1 unless told otherwise; (b) with ``OTELKV_TOKEN`` set the
OTLP receiver and the query API answer 401 without the bearer token and 200 with it;
(c) no prompt or completion text reaches the store (a scan of every row of every table)
or /metrics - otelkv has no setting that records content, so there is no "on" case;
(d) hostile conversation ids are query parameters, never SQL.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import psutil

from otelkv import names
from otelkv.cli.main import build_parser
from otelkv.sidecar.app import SidecarConfig
from tests.unit import fake_openai
from tests.unit import sidecar_harness as h

TOKEN = "s3cret-token"
HOSTILE = "x' OR 1=1 --"
EMPTY_EXPORT = b'{"resourceSpans": []}'


def listening(pid: int) -> set[str]:
    return {
        c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
    }


def test_defaults_name_localhost() -> None:
    config = SidecarConfig(upstream="http://u:1")
    assert (config.host, config.admin_host) == ("127.0.0.1", "127.0.0.1")
    args = build_parser().parse_args(["sidecar", "--upstream", "http://u:1"])
    assert (args.listen, args.admin_listen) == ("127.0.0.1:8800", "127.0.0.1:8801")


def test_every_listener_binds_localhost_unless_configured(fake_upstream: str) -> None:
    sc = h.start_cli(fake_upstream, None)
    try:
        assert listening(sc.main_pid) == {"127.0.0.1"}
        assert listening(sc.proxy_pid) == {"127.0.0.1"}
    finally:
        assert sc.stop() == 0
    wide = h.start_runner(fake_upstream, None, host="0.0.0.0")
    try:
        assert listening(wide.proxy_pid) == {"0.0.0.0"}  # told otherwise: as told
        assert listening(wide.main_pid) == {"127.0.0.1"}
    finally:
        assert wide.stop() == 0


def test_token_is_required_by_the_otlp_receiver_and_the_query_api(fake_upstream: str, tmp_path: Path) -> None:
    sc = h.start_runner(fake_upstream, tmp_path / "store", {names.ENV_SIDECAR_TOKEN: TOKEN})
    try:
        otlp = f"{sc.admin_url}/v1/traces"
        json_type = {"Content-Type": "application/json"}
        good = {"Authorization": f"Bearer {TOKEN}"}
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            assert h.http_status(otlp, data=EMPTY_EXPORT, headers={**json_type, **auth}) == 401
            assert h.http_status(f"{sc.admin_url}/api/v1/slow", headers=auth) == 401
        assert h.http_status(otlp, data=EMPTY_EXPORT, headers={**json_type, **good}) == 200
        assert h.http_status(f"{sc.admin_url}/api/v1/slow", headers=good) in (200, 404)
        # Liveness and scraping stay open (they carry no span data); documented.
        assert h.http_status(f"{sc.admin_url}/api/v1/health") == 200
        assert h.http_status(f"{sc.admin_url}/metrics") == 200
        # The CLI sends the token from the environment, and says what is missing without it.
        cli = [sys.executable, "-m", "otelkv.cli.main", "slow", "--sidecar", sc.admin_url, "--json"]
        refused = subprocess.run(cli, capture_output=True, text=True, env=h._env(), timeout=60)
        assert refused.returncode == 2 and names.ENV_SIDECAR_TOKEN in refused.stderr
        allowed = subprocess.run(
            cli, capture_output=True, text=True, env=h._env({names.ENV_SIDECAR_TOKEN: TOKEN}), timeout=60
        )
        assert names.ENV_SIDECAR_TOKEN not in allowed.stderr, allowed.stderr
    finally:
        assert sc.stop() == 0


STORE_DUMP = r"""
import json, sys
from otelkv.store import open_store
store = open_store(path=sys.argv[1])
out = {}
for t in store.query("SELECT database, name FROM system.tables WHERE database NOT IN "
                     "('system', 'INFORMATION_SCHEMA', 'information_schema')"):
    if t["name"].startswith(".inner"):
        continue
    name = "`%s`.`%s`" % (t["database"], t["name"])
    out[name] = [json.dumps(r) for r in store.query("SELECT * FROM " + name)]
store.close()
print(json.dumps(out))
"""


def test_no_prompt_or_completion_text_is_stored(fake_upstream: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    sc = h.start_runner(fake_upstream, store)
    try:
        results = h.run_turns(sc.proxy_url, "sec", 3, 3)
        assert not h.failures(results)
        # Positive control: the completions that crossed the sidecar carry the mark.
        assert all(fake_openai.COMPLETION_MARK.encode() in r.body for r in results)
        sc.command("flush")
        metrics = sc.metrics()
    finally:
        assert sc.stop() == 0
    dump = subprocess.run(
        [sys.executable, "-c", STORE_DUMP, str(store)],
        capture_output=True,
        text=True,
        env=h._env(),
        timeout=120,
    )
    assert dump.returncode == 0, dump.stderr[-2000:]
    tables: dict[str, list[str]] = json.loads(dump.stdout.strip().splitlines()[-1])
    assert "`otel`.`otel_traces`" in tables and len(tables) >= 2
    rows = [row for table in tables.values() for row in table]
    # The scan sees every column, maps included: the conversation ids (attributes) are there.
    assert sum('"sec-0"' in row for row in rows) >= 3
    for mark in (h.PROMPT_MARK, fake_openai.COMPLETION_MARK):
        leaked = [row[:200] for row in rows if mark in row]
        assert not leaked, leaked
        assert mark not in metrics


def test_hostile_conversation_id_is_a_parameter_not_sql(fake_upstream: str, tmp_path: Path) -> None:
    sc = h.start_runner(fake_upstream, tmp_path / "store")
    try:
        for cid in (HOSTILE, "plain-1", "plain-2"):
            assert h.chat(sc.proxy_url, cid, 0, stream=False).ok
        sc.command("flush")
        api = f"{sc.admin_url}/api/v1/conversations/"
        found = json.loads(
            urllib.request.urlopen(api + urllib.parse.quote(HOSTILE, safe=""), timeout=30).read()
        )
        assert found["conversation_id"] == HOSTILE and found["turn_count"] == 1  # only its own turn
        for probe in ("y' OR 1=1 --", "'; DROP TABLE otel.otel_traces; --", "\\' OR ''='"):
            assert h.http_status(api + urllib.parse.quote(probe, safe="")) == 404
            cli = [sys.executable, "-m", "otelkv.cli.main", "conversation", probe, "--sidecar", sc.admin_url]
            out = subprocess.run(cli, capture_output=True, text=True, env=h._env(), timeout=60)
            assert out.returncode != 0 and "no turns for conversation" in out.stderr, out.stderr
        # Nothing broke: the other conversations are still there and answer.
        assert h.http_status(api + "plain-2") == 200
    finally:
        assert sc.stop() == 0
    assert h.stored_conversations(tmp_path / "store") == {HOSTILE: 1, "plain-1": 1, "plain-2": 1}
