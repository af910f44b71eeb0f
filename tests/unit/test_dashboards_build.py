"""The generated dashboards: committed files match the code, and the JSON is what Grafana expects.

Structure checks a reviewer would otherwise do by eye: explicit unique panel ids, every
panel on a datasource variable, units and thresholds, the variables the issue asks for,
and a round trip through grafana-foundation-sdk's own dashboard model.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "grafana_foundation_sdk", reason="needs the dashboards extra: pip install 'otelkv[dashboards]'"
)

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from otelkv.cli.main import main
from otelkv.dashboards import build, inventory, provisioning
from otelkv.dashboards.sources import ALL as SOURCES
from otelkv.dashboards.sources import CLICKHOUSE, PROMETHEUS, TEMPO

BOARDS = {spec.filename: build.to_json(spec.build()) for spec in build.DASHBOARDS}


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels") or [])
    return out


def test_committed_files_equal_freshly_generated() -> None:
    assert build.stale() == [], "run `otelkv dashboards build` and commit dashboards/"
    committed = build.load()
    assert committed == BOARDS


def test_generation_is_deterministic() -> None:
    assert build.render_all() == build.render_all()
    text = build.render_all()["otelkv-kv-reuse.json"]
    assert (
        text.endswith("}\n")
        and json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n" == text
    )


def test_the_three_dashboards_exist_with_stable_uids() -> None:
    uids = {board["uid"]: board["title"] for board in BOARDS.values()}
    assert uids == {
        "otelkv-agent-turns": "otelkv / Agent turns",
        "otelkv-kv-reuse": "otelkv / KV reuse",
        "otelkv-conversation": "otelkv / Conversation",
    }
    for board in BOARDS.values():
        assert board["schemaVersion"] == 41  # Grafana 11.6's, from the pinned SDK line
        assert "otelkv" in board["tags"]


@pytest.mark.parametrize("filename", sorted(BOARDS))
def test_panels_have_explicit_unique_ids_and_a_datasource_variable(filename: str) -> None:
    board = BOARDS[filename]
    ids = [panel.get("id") for panel in _panels(board)]
    assert all(isinstance(i, int) and i > 0 for i in ids), ids
    assert len(ids) == len(set(ids)), ids
    for panel in _panels(board):
        if panel["type"] == "row":
            continue
        ds = panel["datasource"]
        assert ds["uid"] in {f"${{{s.variable}}}" for s in SOURCES}, (panel["title"], ds)
        for target in panel["targets"]:
            assert target["datasource"] == ds, panel["title"]
        assert panel["title"] and panel["description"], panel["id"]
        assert panel["gridPos"]["w"] > 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


@pytest.mark.parametrize("filename", sorted(BOARDS))
def test_units_and_thresholds(filename: str) -> None:
    for panel in _panels(BOARDS[filename]):
        if panel["type"] in ("row",) or panel["datasource"]["type"] == TEMPO.type:
            continue
        defaults = panel["fieldConfig"]["defaults"]
        assert defaults["thresholds"]["steps"][0]["value"] is None, panel["title"]  # base step = -inf
        if panel["type"] != "table":
            assert defaults.get("unit"), f"{panel['title']} has no unit"


def test_variables_for_datasource_model_and_engine() -> None:
    def names_of(board: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {v["name"]: v for v in board["templating"]["list"]}

    for filename in ("otelkv-agent-turns.json", "otelkv-kv-reuse.json"):
        variables = names_of(BOARDS[filename])
        assert {"datasource", "clickhouse", "tempo", "model", "engine"} <= set(variables)
        assert variables["datasource"]["query"] == PROMETHEUS.type
        assert variables["datasource"]["current"]["value"] == PROMETHEUS.uid
        for name in ("model", "engine"):
            assert variables[name]["includeAll"] and variables[name]["multi"]
            assert variables[name]["allValue"] == ".*"
    conversation = names_of(BOARDS["otelkv-conversation.json"])
    assert {"clickhouse", "tempo", "model", "conversation"} <= set(conversation)
    assert conversation["clickhouse"]["query"] == CLICKHOUSE.type


def test_every_panel_has_a_query() -> None:
    for board in BOARDS.values():
        with_targets = {q.panel_id for q in inventory.queries(board) if q.panel_id is not None}
        panels = {p["id"] for p in _panels(board) if p["type"] != "row"}
        assert with_targets == panels


def test_round_trip_through_the_sdk_model() -> None:
    """Grafana's schema, as the SDK encodes it, reads our JSON back unchanged."""
    for filename, board in BOARDS.items():
        again = json.loads(json.dumps(Dashboard.from_json(board), cls=JSONEncoder))
        assert again == board, filename


def test_slowest_turns_link_to_traces_and_conversations() -> None:
    board = BOARDS["otelkv-agent-turns.json"]
    (table,) = [p for p in _panels(board) if p["type"] == "table" and p["title"] == "Slowest turns"]
    links = {
        o["matcher"]["options"]: [
            link["url"] for prop in o["properties"] if prop["id"] == "links" for link in prop["value"]
        ]
        for o in table["fieldConfig"]["overrides"]
    }
    assert any(
        "/explore?" in url and "${__value.raw:percentencode}" in url and "${tempo:percentencode}" in url
        for url in links["trace_id"]
    )
    assert any(url.startswith("/d/otelkv-conversation/") for url in links["conversation"])
    explore = links["trace_id"][0]
    # Grafana fills the variables in (percent-encoded), the browser decodes the parameter: the
    # pane is then valid JSON naming the trace, even for a value with URL syntax in it (a trace
    # id is hex; percentencode does not JSON-escape, so a quote would still end the string).
    hostile = "a&b%c d#e+f"
    filled = (
        explore.replace("${__value.raw:percentencode}", urllib.parse.quote(hostile, safe=""))
        .replace("${tempo:percentencode}", "tempo")
        .replace("${__from}", "1")
        .replace("${__to}", "2")
    )
    pane = urllib.parse.parse_qs(urllib.parse.urlsplit(filled).query)["panes"][0]
    assert json.loads(pane)["trace"]["queries"][0]["query"] == hostile
    conversation = links["conversation"][0].replace(
        "${__data.fields.conversation:percentencode}", urllib.parse.quote("id with &var-x=1#", safe="")
    )
    assert urllib.parse.parse_qs(urllib.parse.urlsplit(conversation).query)["var-conversation"] == [
        "id with &var-x=1#"
    ]


def test_every_link_variable_is_percent_encoded() -> None:
    """Data links carry ids into URLs: every variable in them is percent-encoded, except
    Grafana's own time range (already a query string) and the epoch milliseconds."""
    plain = {"${__url_time_range}", "${__from}", "${__to}"}
    found = 0
    for board in BOARDS.values():
        for url in re.findall(r'"url": "([^"]*)"', json.dumps(board)):
            found += 1
            for variable in re.findall(r"\$\{[^}]*\}", url):
                assert variable in plain or variable.endswith(":percentencode}"), (url, variable)
    assert found >= 5


def test_provisioning_files() -> None:
    import yaml

    files = provisioning.render_all()
    datasources = yaml.safe_load(files["provisioning/datasources/otelkv.yaml"])
    assert datasources["apiVersion"] == 1
    by_uid = {d["uid"]: d for d in datasources["datasources"]}
    assert set(by_uid) == {s.uid for s in SOURCES}
    assert by_uid[CLICKHOUSE.uid]["jsonData"]["traces"]["defaultTable"] == "otel_traces"
    assert by_uid[CLICKHOUSE.uid]["secureJsonData"] == {"password": "${CLICKHOUSE_PASSWORD}"}
    assert [d["isDefault"] for d in datasources["datasources"] if d.get("isDefault")] == [True]
    providers = yaml.safe_load(files["provisioning/dashboards/otelkv.yaml"])["providers"]
    assert providers[0]["folderUid"] == provisioning.FOLDER_UID
    assert providers[0]["options"]["path"] == provisioning.DASHBOARDS_PATH


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("clickhouse://default@ch:9000", ("ch", 9000, "native", False, "default", None)),
        ("clickhouses://u:p%40ss@ch", ("ch", 9440, "native", True, "u", "p@ss")),
        ("http://ch", ("ch", 8123, "http", False, "default", None)),
        ("https://ch:9443", ("ch", 9443, "http", True, "default", None)),
    ],
)
def test_clickhouse_url(url: str, expected: tuple[Any, ...]) -> None:
    a = provisioning.parse_clickhouse_url(url)
    assert (a.host, a.port, a.protocol, a.secure, a.username, a.password) == expected


def test_clickhouse_url_rejects_what_the_plugin_cannot_use() -> None:
    with pytest.raises(ValueError, match="expected clickhouse://"):
        provisioning.parse_clickhouse_url("postgres://db:5432")


def test_cli_build_writes_and_check_detects_stale_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dashboards", "build", "--out", str(tmp_path)]) == 0
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.*")) == sorted(
        build.render_all()
    )
    assert main(["dashboards", "build", "--out", str(tmp_path), "--check"]) == 0
    edited = tmp_path / "otelkv-kv-reuse.json"
    edited.write_text(edited.read_text().replace("KV reuse", "KV reuse (edited)"))
    (tmp_path / "provisioning" / "dashboards" / "otelkv.yaml").unlink()
    capsys.readouterr()
    assert main(["dashboards", "build", "--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "otelkv-kv-reuse.json" in err and "provisioning/dashboards/otelkv.yaml" in err
    assert "otelkv-agent-turns.json" not in err


def test_docs_list_every_panel() -> None:
    """docs/dashboards.md names every panel of every dashboard (by id and title)."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "dashboards.md").read_text()
    for board in BOARDS.values():
        for panel in _panels(board):
            if panel["type"] != "row":
                assert f"| {panel['id']} | {panel['title']} |" in docs, (board["uid"], panel["title"])


def test_the_compose_stacks_datasources_keep_the_dashboards_uids() -> None:
    """collectors/ provisions its own datasources; the dashboards only work if uids agree."""
    import yaml

    path = Path(__file__).resolve().parents[2] / "collectors" / "grafana" / "provisioning" / "datasources"
    files = sorted(path.glob("*.yaml"))
    assert files, f"no datasource provisioning in {path}"
    provisioned = {d["uid"]: d["type"] for f in files for d in yaml.safe_load(f.read_text())["datasources"]}
    assert provisioned == {s.uid: s.type for s in SOURCES}


def test_each_phase_has_one_colour_on_every_panel_that_draws_it() -> None:
    """A panel draws phases when a query's legend is ``{{phase}}`` or its SQL names a column
    after a phase; each such panel fixes all four colours, and a phase's colour is the same on
    every panel of every dashboard, and differs from the other phases'."""
    phases = ("input_processing", "generation", "tool_wait", "app_work")
    seen: dict[str, set[str]] = {p: set() for p in phases}
    drawing = 0
    for board in BOARDS.values():
        for panel in _panels(board):
            if panel["type"] in ("row", "table"):
                continue
            text = json.dumps(panel.get("targets", []))
            if "{{phase}}" not in text and not any(re.search(rf"AS {p}\b", text) for p in phases):
                continue
            drawing += 1
            colours = {}
            for override in panel["fieldConfig"]["overrides"]:
                option = override["matcher"]["options"]
                for prop in override["properties"]:
                    if prop["id"] == "color":
                        phase = next(p for p in phases if option == p or option.endswith(f"{p}$"))
                        colours[phase] = prop["value"]["fixedColor"]
            assert set(colours) == set(phases), panel["title"]
            for phase, colour in colours.items():
                seen[phase].add(colour)
    assert drawing >= 4
    assert all(len(colours) == 1 for colours in seen.values()), seen
    assert len({next(iter(c)) for c in seen.values()}) == len(phases)


def test_counts_over_the_range_are_whole_numbers() -> None:
    """A stat or bar gauge counting events over the range rounds increase() and shows 0 decimals."""
    found = 0
    for board in BOARDS.values():
        for panel in _panels(board):
            if panel["type"] not in ("stat", "bargauge"):
                continue
            exprs = [t.get("expr", "") for t in panel.get("targets", [])]
            if panel["fieldConfig"]["defaults"].get("unit") == "short" and any(
                "increase(" in e and "$__range" in e for e in exprs
            ):
                found += 1
                assert panel["fieldConfig"]["defaults"].get("decimals") == 0, panel["title"]
                assert all(e.startswith("round(") for e in exprs), panel["title"]
    assert found >= 3
