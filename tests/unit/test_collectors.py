"""collectors/ holds together, checked without the programs it configures.

No otelcol-contrib binary, Tempo, ClickHouse server, Grafana or Docker daemon can run
where this suite runs (docs/collectors.md says what was and was not validated). So these
tests check what can be checked offline, and each can fail:

* the collector configs with :mod:`tools.collectors.validate`: the collector's own rules
  (every pipeline reference defined, every component used, connectors exporter-then-
  receiver between signal types they support) and key tables transcribed from upstream
  ``config.schema.yaml`` files for the pinned release, with value types (durations
  parse); and that the validator rejects broken copies;
* that they speak otelkv's vocabulary: tail-sampling keys, values, span names and OTTL
  paths come from :mod:`otelkv.names`, so a rename there fails here;
* that the files agree with each other (ports, hosts, database and table, datasource uids,
  mounts, env vars, the pinned version) and with what otelkv queries;
* the Prometheus config with the real ``promtool`` and, with a real ``prometheus``, that
  its relabeling yields the ``model_name`` / ``engine_id`` / ``role`` labels the dashboards
  template on.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from otelkv import names
from otelkv.store import DEFAULT_DATABASE, schema
from tools.collectors.components import (
    AGGREGATION_TEMPORALITIES,
    COLLECTOR_VERSION,
    RESOURCE_DETECTORS,
    ROUTING_KEYS,
)
from tools.collectors.validate import (
    ctype,
    env_refs,
    expand,
    ottl_errors,
    parse_duration_s,
    validate_collector,
)

ROOT = Path(__file__).resolve().parents[2]
COLLECTORS = ROOT / "collectors"
DATASOURCES = COLLECTORS / "grafana" / "provisioning" / "datasources" / "otelkv.yaml"

PINNED_VERSION = "0.162.0"
"""The otelcol-contrib release collectors/ targets (and the validator's key tables describe)."""

DATASOURCE_UIDS = {
    "prometheus": "otelkv-prometheus",
    "tempo": "otelkv-tempo",
    "grafana-clickhouse-datasource": "otelkv-clickhouse",
}
"""The uids dashboards/ references, by datasource type."""

REQUIRE_TOOLS = os.environ.get("OTELKV_REQUIRE_FLEET_TESTS") == "1"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# --------------------------------------------------------------------------------------
# Fixtures and shared facts
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway() -> dict[str, Any]:
    return load(COLLECTORS / "gateway.yaml")


@pytest.fixture(scope="module")
def agent() -> dict[str, Any]:
    return load(COLLECTORS / "agent.yaml")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COLLECTORS / "compose.yaml")


@pytest.fixture(scope="module")
def prometheus_config() -> dict[str, Any]:
    return load(COLLECTORS / "prometheus.yml")


@pytest.fixture(scope="module")
def datasources() -> dict[str, Any]:
    return load(DATASOURCES)


ATTRIBUTE_KEYS = {
    value
    for key, value in vars(names).items()
    if key.isupper() and isinstance(value, str) and (value.startswith(("otelkv.", "gen_ai.")))
} - {names.SCOPE_ENGINE, names.SCOPE_FLEET, names.SCOPE_SIDECAR}
"""Every attribute key otelkv emits (names.py), so configs can only reference real ones."""

SPAN_NAMES = (
    {names.engine_request_span_name(role) for role in names.ROLES}
    | {names.transfer_span_name(d) for d in names.DIRECTIONS}
    | {names.retention_span_name(k) for k in names.RETENTION_KINDS}
)
SCOPES = {names.SCOPE_ENGINE, names.SCOPE_FLEET, names.SCOPE_SIDECAR}

VALUES_BY_KEY: dict[str, tuple[str, ...]] = {
    names.PULL_REASON: names.PULL_REASONS,
    names.PULL_DECISION: names.PULL_DECISIONS,
    names.ROUTER_HANDLE: names.ROUTER_HANDLE_STATES,
    names.REQUEST_OUTCOME: names.REQUEST_OUTCOMES,
    names.TRANSFER_OUTCOME: names.TRANSFER_OUTCOMES,
    names.RETENTION_OUTCOME: names.RETENTION_OUTCOMES,
    names.ROLE: names.ROLES,
    names.CONVERSATION_ID_SOURCE: names.CONVERSATION_ID_SOURCES,
}
"""Closed vocabularies: a string policy on one of these keys may only list their values."""

HIGH_CARDINALITY = {
    names.GEN_AI_CONVERSATION_ID, names.GEN_AI_REQUEST_ID, names.REQUEST_ID, names.REMOTE_REQUEST_ID,
    names.GEN_AI_RESPONSE_ID, names.TURN_PREVIOUS_TRACE_ID, names.GEN_AI_TOOL_CALL_ID, names.TURN_INDEX,
}  # fmt: skip


def policies(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every tail-sampling policy, sub-policies of and/drop/not/composite included."""
    out: list[dict[str, Any]] = []

    def walk(items: list[dict[str, Any]]) -> None:
        for p in items:
            out.append(p)
            body = p.get(p.get("type", ""), {}) or {}
            for key in ("and_sub_policy", "drop_sub_policy", "composite_sub_policy"):
                walk(body.get(key) or [])
            if isinstance(body.get("not_sub_policy"), dict):
                walk([body["not_sub_policy"]])

    walk(config["processors"]["tail_sampling"]["policies"])
    return out


def header_version(path: Path) -> str:
    match = re.search(r"^# otelcol-contrib-version: (\S+)$", path.read_text(), re.MULTILINE)
    assert match, f"{path.name} does not say which collector release it targets"
    return match.group(1)


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


# --------------------------------------------------------------------------------------
# The collector configs
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gateway.yaml", "agent.yaml"])
def test_collector_config_passes_the_validator(name: str) -> None:
    assert validate_collector(load(COLLECTORS / name)) == []


def test_configs_and_compose_pin_one_collector_release(compose: dict[str, Any]) -> None:
    assert COLLECTOR_VERSION == PINNED_VERSION
    assert header_version(COLLECTORS / "gateway.yaml") == PINNED_VERSION
    assert header_version(COLLECTORS / "agent.yaml") == PINNED_VERSION
    for service in ("otel-gateway", "otel-agent"):
        assert (
            compose["services"][service]["image"] == f"otel/opentelemetry-collector-contrib:{PINNED_VERSION}"
        )


def _break(config: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> list[str]:
    broken = copy.deepcopy(config)
    edit(broken)
    return validate_collector(broken)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = config
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def _delete(section: str, cid: str) -> Callable[[dict[str, Any]], None]:
    return lambda c: c[section].pop(cid)


def _policy(name: str, path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set ``path`` (dotted; empty: the whole policy) inside the top-level policy ``name``."""

    def edit(config: dict[str, Any]) -> None:
        items = config["processors"]["tail_sampling"]["policies"]
        index = next(i for i, p in enumerate(items) if p["name"] == name)
        if path:
            _set(path, value)(items[index])
        else:
            items[index] = value

    return edit


BREAKAGES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "undefined exporter": (_delete("exporters", "clickhouse"), "'clickhouse' is not defined"),
    "unused exporter": (
        _set("service.pipelines.traces/sampled.exporters", ["clickhouse"]),
        "otlp_grpc/tempo: defined but used by no pipeline",
    ),
    "connector only exported to": (
        _set("service.pipelines.metrics/spans.receivers", ["servicegraph"]),
        "span_metrics: must be an exporter in one pipeline and a receiver in another",
    ),
    "connector between wrong signals": (
        _set("service.pipelines.traces/sampled.receivers", ["span_metrics"]),
        "cannot connect a traces pipeline to a traces pipeline",
    ),
    "tail_sampling on metrics": (
        _set("service.pipelines.metrics/spans.processors", ["tail_sampling"]),
        "'tail_sampling' does not handle metrics",
    ),
    "memory_limiter not first": (
        _set("service.pipelines.traces/in.processors", []),
        "memory_limiter must be the first processor",
    ),
    "unknown key": (_set("exporters.clickhouse.table", "otel_traces"), "unknown key 'table'"),
    "bad duration": (_set("processors.tail_sampling.decision_wait", "30"), "'30' is not a valid duration"),
    "policy sub-key of another type": (
        _policy(
            "errors", "", {"name": "e", "type": "status_code", "string_attribute": {"key": "k", "values": []}}
        ),
        "needs its 'status_code' section",
    ),
    "unknown policy type": (_policy("errors", "type", "status"), "unknown policy type 'status'"),
    "bad status code": (
        _policy("errors", "status_code.status_codes", ["Error"]),
        "status codes must be among",
    ),
    "ottl map typo": (
        _policy("slow-turns", "ottl_condition.span", ['atributes["otelkv.turn.ttft_s"] > 1.0']),
        "'atributes' cannot be indexed",
    ),
    "ottl path typo": (
        _policy("slow-turns", "ottl_condition.span", ['nmae == "kv_request prefill"']),
        "unknown span path 'nmae'",
    ),
    "ottl half a comparison": (
        _policy(
            "slow-turns", "ottl_condition.span", ['name == "kv_request prefill" and end_time_unix_nano >']
        ),
        "not a chain of comparisons",
    ),
    "ottl unbalanced quote": (
        _policy("slow-turns", "ottl_condition.span", ['name == "kv_request prefill']),
        "cannot read",
    ),
    "string where a number goes": (
        _set("processors.tail_sampling.num_traces", "100000"),
        "'100000' is not a valid int",
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_the_validator_rejects_a_broken_gateway(gateway: dict[str, Any], case: str) -> None:
    edit, expected = BREAKAGES[case]
    assert validate_collector(gateway) == []
    errors = _break(gateway, edit)
    assert any(expected in e for e in errors), errors


def test_span_metrics_see_every_span_before_tail_sampling(gateway: dict[str, Any]) -> None:
    """The pipeline that feeds span_metrics does not sample and hands the same spans to the
    one that does, through a forward connector."""
    pipes = gateway["service"]["pipelines"]
    feeding = [p for p, body in pipes.items() if "span_metrics" in body["exporters"]]
    sampling = [p for p, body in pipes.items() if "tail_sampling" in body.get("processors", [])]
    assert len(feeding) == 1 and len(sampling) == 1
    entry, sampled = pipes[feeding[0]], pipes[sampling[0]]
    assert "tail_sampling" not in entry.get("processors", [])
    assert any(r in gateway["receivers"] for r in entry["receivers"])
    bridge = [e for e in entry["exporters"] if ctype(e) == "forward"]
    assert bridge and set(bridge) & set(sampled["receivers"])
    assert "servicegraph" in entry["exporters"]
    stored = set(sampled["exporters"])
    assert {"clickhouse", "otlp_grpc/tempo"} <= stored


def test_tail_sampling_references_only_what_otelkv_emits(gateway: dict[str, Any]) -> None:
    for policy in policies(gateway):
        body = policy.get(policy["type"]) or {}
        if "key" in body:
            assert body["key"] in ATTRIBUTE_KEYS, f"{policy['name']}: {body['key']} is not in otelkv.names"
        if policy["type"] == "string_attribute" and body["key"] in VALUES_BY_KEY:
            unknown = set(body["values"]) - set(VALUES_BY_KEY[body["key"]])
            assert not unknown, f"{policy['name']}: {unknown} not in the vocabulary of {body['key']}"
        for condition in body.get("span") or []:
            assert ottl_errors(condition) == []
            for key in re.findall(r'attributes\["([^"]+)"\]', condition):
                assert key in ATTRIBUTE_KEYS, f"{policy['name']}: {key}"
            for span_name in re.findall(r'(?<![.\w])name == "([^"]+)"', condition):
                assert span_name in SPAN_NAMES, f"{policy['name']}: no otelkv span is named {span_name!r}"
            for scope in re.findall(r'instrumentation_scope\.name == "([^"]+)"', condition):
                assert scope in SCOPES


REUSE_NOT_LOST = {names.REASON_PULLED, names.REASON_NOTHING_BEYOND_LOCAL_HIT}
REUSE_LOST_AFTER_FIRST_TURN = {names.REASON_NO_DECODE_HANDLE}


def test_every_pull_reason_is_either_kept_or_deliberately_not(gateway: dict[str, Any]) -> None:
    """A pull reason added to names.py must be placed: a lost reuse (kept) or not."""
    kept: set[str] = set()
    after_first_turn: set[str] = set()
    by_name = {p["name"]: p for p in policies(gateway)}
    for policy in gateway["processors"]["tail_sampling"]["policies"]:
        body = policy.get(policy["type"]) or {}
        if policy["type"] == "string_attribute" and body["key"] == names.PULL_REASON:
            kept |= set(body["values"])
        if policy["type"] == "and":
            subs = body["and_sub_policy"]
            reasons = [s for s in subs if (s.get("string_attribute") or {}).get("key") == names.PULL_REASON]
            turns = [s for s in subs if (s.get("numeric_attribute") or {}).get("key") == names.TURN_INDEX]
            if reasons and turns:
                assert turns[0]["numeric_attribute"]["min_value"] == 1
                after_first_turn |= set(reasons[0]["string_attribute"]["values"])
    assert after_first_turn == REUSE_LOST_AFTER_FIRST_TURN
    assert kept == set(names.PULL_REASONS) - REUSE_NOT_LOST - REUSE_LOST_AFTER_FIRST_TURN
    assert by_name["errors"]["status_code"]["status_codes"] == ["ERROR"]
    assert by_name["kv-for-other-tokens"]["string_attribute"] == {
        "key": names.CONTINUITY_MISMATCH_IN,
        "values": [names.CONTINUITY_IN_HISTORY, names.CONTINUITY_IN_ANSWER],
    }
    assert set(by_name["router-lost-handle"]["string_attribute"]["values"]) == {
        names.ROUTER_HANDLE_STALE,
        names.ROUTER_HANDLE_NO_CONVERSATION,
    }


def test_slow_turn_policy_reads_the_sidecar_turn_span(gateway: dict[str, Any]) -> None:
    slow = next(p for p in policies(gateway) if p["name"] == "slow-turns")["ottl_condition"]["span"]
    on_turn = [c for c in slow if f'instrumentation_scope.name == "{names.SCOPE_SIDECAR}"' in c]
    assert any("end_time_unix_nano - start_time_unix_nano" in c for c in on_turn)
    assert any(f'attributes["{names.TURN_INPUT_PROCESSING_SECONDS}"]' in c for c in on_turn)
    assert any(f'name == "{names.engine_request_span_name(names.ROLE_PREFILL)}"' in c for c in slow)


def test_span_metrics_dimensions_are_bounded_otelkv_keys(gateway: dict[str, Any]) -> None:
    span_metrics = gateway["connectors"]["span_metrics"]
    dims = [d["name"] for d in span_metrics["dimensions"]]
    assert set(dims) <= ATTRIBUTE_KEYS
    assert not set(dims) & HIGH_CARDINALITY, "conversation, request and trace ids are never labels"
    assert not set(gateway["connectors"]["servicegraph"]["dimensions"]) & HIGH_CARDINALITY
    assert span_metrics["aggregation_temporality"] in AGGREGATION_TEMPORALITIES
    assert span_metrics["histogram"]["unit"] in ("ms", "s")
    buckets = [parse_duration_s(b) for b in span_metrics["histogram"]["explicit"]["buckets"]]
    assert buckets == sorted(buckets) and len(set(buckets)) == len(buckets)
    # retention spans last up to the decode TTL (vLLM's default 480 s): they must fit
    assert buckets[-1] >= 480


def test_tail_sampling_waits_and_remembers_long_enough(gateway: dict[str, Any]) -> None:
    ts = gateway["processors"]["tail_sampling"]
    assert parse_duration_s(ts["decision_wait_after_root_received"]) < parse_duration_s(ts["decision_wait"])
    # late retention spans follow their trace's decision only while it is cached
    assert ts["decision_cache"]["sampled_cache_size"] >= ts["num_traces"]
    assert ts["decision_cache"]["non_sampled_cache_size"] >= ts["num_traces"]


def test_clickhouse_exporter_writes_what_otelkv_queries(gateway: dict[str, Any]) -> None:
    ch = expand(gateway)["exporters"]["clickhouse"]
    scheme = urllib.parse.urlsplit(ch["endpoint"]).scheme
    assert scheme in ("tcp", "clickhouse", "http", "https"), ch["endpoint"]
    assert ch["database"] == DEFAULT_DATABASE
    assert ch["traces_table_name"] == schema.TRACES_TABLE
    assert ch["create_schema"] is True
    assert parse_duration_s(ch["ttl"]) > 0
    assert "CLICKHOUSE_PASSWORD" in env_refs(gateway)


def test_agent_routes_whole_traces_to_the_gateway(agent: dict[str, Any], gateway: dict[str, Any]) -> None:
    lb = expand(agent)["exporters"]["load_balancing"]
    assert lb["routing_key"] == "traceID" and lb["routing_key"] in ROUTING_KEYS
    gateway_grpc = expand(gateway)["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert int(lb["resolver"]["dns"]["port"]) == port_of(gateway_grpc)
    detectors = expand(agent)["processors"]["resource_detection"]["detectors"]
    assert set(detectors) <= RESOURCE_DETECTORS
    assert expand(agent)["processors"]["resource_detection"]["override"] is False


# --------------------------------------------------------------------------------------
# Prometheus
# --------------------------------------------------------------------------------------


def _tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        if REQUIRE_TOOLS:
            pytest.fail(f"{name} is missing: apt-get install -y --no-install-recommends prometheus")
        pytest.skip(f"{name} not installed (Debian package prometheus)")
    return path


def test_prometheus_config_passes_promtool() -> None:
    promtool = _tool("promtool")
    result = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"],
        cwd=COLLECTORS,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_tempo_datasource_promql_parses(tmp_path: Path, datasources: dict[str, Any]) -> None:
    """The trace-to-metrics queries, with Grafana's ``$__tags`` filled in, pass promtool."""
    promtool = _tool("promtool")
    tempo = next(d for d in datasources["datasources"] if d["type"] == "tempo")
    queries = [q["query"] for q in tempo["jsonData"]["tracesToMetrics"]["queries"]]
    rules = {
        "groups": [
            {
                "name": "tempo-datasource",
                "rules": [
                    {
                        "record": f"otelkv:check_{i}",
                        "expr": q.replace("$$__tags", 'service_name="otelkv-sidecar"'),
                    }
                    for i, q in enumerate(queries)
                ],
            }
        ]
    }
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_what_the_stack_exposes(
    prometheus_config: dict[str, Any], gateway: dict[str, Any], agent: dict[str, Any], compose: dict[str, Any]
) -> None:
    jobs = {job["job_name"]: job for job in prometheus_config["scrape_configs"]}
    targets = {
        name: [t for sc in job.get("static_configs", []) for t in sc["targets"]] for name, job in jobs.items()
    }
    g = expand(gateway)
    telemetry_port = g["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"][
        "port"
    ]
    agent_port = expand(agent)["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"][
        "prometheus"
    ]["port"]
    assert targets["otel-gateway-spanmetrics"] == [
        f"otel-gateway:{port_of(g['exporters']['prometheus']['endpoint'])}"
    ]
    assert set(targets["otel-collectors"]) == {f"otel-gateway:{telemetry_port}", f"otel-agent:{agent_port}"}
    sidecar_cmd = compose["services"]["sidecar"]["command"]
    admin = next(a.split("=", 1)[1] for a in sidecar_cmd if a.startswith("--admin-listen="))
    assert targets["otelkv-sidecar"] == [f"sidecar:{port_of(admin)}"]
    for host in {t.rsplit(":", 1)[0] for ts in targets.values() for t in ts} - {"localhost"}:
        assert host in compose["services"], f"{host} is not a compose service"
    file_sd = jobs["vllm"]["file_sd_configs"][0]["files"]
    assert any(p.name.startswith("engines") for pattern in file_sd for p in COLLECTORS.glob(pattern))
    assert jobs["vllm"]["honor_labels"] is True


class _Exposition(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        payload = self.body
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - overrides the base signature
        pass


def _serve(text: str) -> ThreadingHTTPServer:
    handler = type("Handler", (_Exposition,), {"body": text.encode()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def exporters() -> Iterator[dict[str, ThreadingHTTPServer]]:
    """Fake /metrics endpoints with the label sets vLLM, the sidecar and the gateway expose."""
    engine = (
        'vllm:num_requests_running{model_name="tiny",engine="0"} 1\n'
        'otelkv_requests_total{model_name="tiny",engine="0",role="decode",outcome="finished"} 3\n'
    )
    servers = {
        "prefill": _serve(engine),
        "no_engine_id": _serve(engine),
        "sidecar": _serve('otelkv_turns_total{model_name="tiny",status="ok",stream="false"} 2\n'),
        "spans": _serve(
            'traces_span_metrics_calls_total{gen_ai_request_model="tiny",otelkv_role="prefill",'
            'span_name="kv_request prefill",service_name="vllm-prefill"} 5\n'
        ),
    }
    yield servers
    for server in servers.values():
        server.shutdown()
        server.server_close()


def _addr(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"{host}:{port}"


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        return list(json.load(response)["data"]["result"])


def test_prometheus_relabeling_gives_the_dashboards_their_labels(
    tmp_path: Path, prometheus_config: dict[str, Any], exporters: dict[str, ThreadingHTTPServer]
) -> None:
    """The real relabel rules of prometheus.yml, run by a real Prometheus against fake targets."""
    binary = _tool("prometheus")
    (tmp_path / "engines.yml").write_text(
        yaml.safe_dump(
            [
                {"targets": [_addr(exporters["prefill"])], "labels": {"role": "prefill", "engine_id": "p-0"}},
                {"targets": [_addr(exporters["no_engine_id"])], "labels": {"role": "decode"}},
            ]
        )
    )
    config = copy.deepcopy(prometheus_config)
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    local = {"otelkv-sidecar": "sidecar", "otel-gateway-spanmetrics": "spans"}
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] == "vllm":
            job["file_sd_configs"] = [{"files": [str(tmp_path / "engines.yml")], "refresh_interval": "1s"}]
        elif job["job_name"] in local:
            job["static_configs"] = [{"targets": [_addr(exporters[local[job["job_name"]]])]}]
        else:
            continue
        jobs.append(job)
    config["scrape_configs"] = jobs
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("wb"),
    )
    base = f"http://127.0.0.1:{port}"
    wanted = {
        "vllm": 'vllm:num_requests_running{job="vllm"}',
        "requests": 'otelkv_requests_total{job="vllm"}',
        "sidecar": "otelkv_turns_total",
        "spans": "traces_span_metrics_calls_total",
    }
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            try:
                results = {k: _query(base, expr) for k, expr in wanted.items()}
            except OSError:
                results = {}
            if (
                results
                and len(results["vllm"]) == 2
                and len(results["requests"]) == 2
                and all(results.values())
            ):
                break
            time.sleep(0.5)
        else:
            log = (tmp_path / "prometheus.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"Prometheus did not scrape every target in 45 s: {results}\n{log}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    series = {k: [r["metric"] for r in v] for k, v in results.items()}
    prefill_addr, plain_addr = _addr(exporters["prefill"]), _addr(exporters["no_engine_id"])
    by_instance = {m["instance"]: m for m in series["vllm"]}
    assert by_instance[prefill_addr]["engine_id"] == "p-0"
    assert by_instance[prefill_addr]["role"] == "prefill"
    assert by_instance[plain_addr]["engine_id"] == plain_addr  # no engine_id given: host:port
    assert by_instance[plain_addr]["role"] == "decode"
    assert all(m["model_name"] == "tiny" for m in series["vllm"])
    # a series' own role (the request's) wins over the target's, and is not renamed away
    requests = {m["instance"]: m for m in series["requests"]}
    assert requests[prefill_addr]["role"] == "decode" and requests[prefill_addr]["engine_id"] == "p-0"
    assert not any("exported_role" in m for m in series["requests"])
    assert series["sidecar"][0]["model_name"] == "tiny" and "model" not in series["sidecar"][0]
    assert series["spans"][0]["model_name"] == "tiny" and series["spans"][0]["role"] == "prefill"


# --------------------------------------------------------------------------------------
# Grafana datasources, Tempo, compose
# --------------------------------------------------------------------------------------


def test_grafana_datasources_have_the_uids_dashboards_use(datasources: dict[str, Any]) -> None:
    assert datasources["apiVersion"] == 1
    listed = datasources["datasources"]
    uids = [d["uid"] for d in listed]
    assert len(set(uids)) == len(uids) and len({d["name"] for d in listed}) == len(listed)
    assert {d["type"]: d["uid"] for d in listed} == DATASOURCE_UIDS
    assert sum(1 for d in listed if d.get("isDefault")) == 1


def test_grafana_datasources_point_at_each_other_and_the_otel_schema(datasources: dict[str, Any]) -> None:
    by_type = {d["type"]: d for d in datasources["datasources"]}
    uids = set(DATASOURCE_UIDS.values())
    tempo = by_type["tempo"]["jsonData"]
    assert tempo["tracesToMetrics"]["datasourceUid"] == DATASOURCE_UIDS["prometheus"]
    assert tempo["serviceMap"]["datasourceUid"] == DATASOURCE_UIDS["prometheus"]
    assert uids == {d["uid"] for d in datasources["datasources"]}
    for query in tempo["tracesToMetrics"]["queries"]:
        # `$` is env expansion in provisioning files: Grafana's own macros are written `$$`
        assert "$$__tags" in query["query"]
        assert re.search(r"(?<!\$)\$(?!\$)", query["query"].replace("$$", "")) is None
        assert "traces_span_metrics_" in query["query"]
    ch = by_type["grafana-clickhouse-datasource"]["jsonData"]
    assert ch["defaultDatabase"] == ch["traces"]["defaultDatabase"] == DEFAULT_DATABASE
    assert ch["traces"]["defaultTable"] == schema.TRACES_TABLE and ch["traces"]["otelEnabled"] is True
    assert ch["protocol"] in ("native", "http")


def _grafana_env_refs(node: Any) -> set[str]:
    """``$VAR`` / ``${VAR}`` in the values of a provisioning file (``$$`` is a literal ``$``)."""
    if isinstance(node, dict):
        return set().union(*(_grafana_env_refs(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(_grafana_env_refs(v) for v in node)) if node else set()
    if isinstance(node, str):
        return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", node.replace("$$", "")))
    return set()


def test_grafana_reaches_the_compose_services(datasources: dict[str, Any], compose: dict[str, Any]) -> None:
    tempo_cfg = load(COLLECTORS / "tempo.yaml")
    by_type = {d["type"]: d for d in datasources["datasources"]}
    prom = urllib.parse.urlsplit(by_type["prometheus"]["url"])
    tempo = urllib.parse.urlsplit(by_type["tempo"]["url"])
    assert prom.hostname in compose["services"] and prom.port == 9090
    assert tempo.hostname in compose["services"] and tempo.port == tempo_cfg["server"]["http_listen_port"]
    assert by_type["grafana-clickhouse-datasource"]["jsonData"]["host"] in compose["services"]
    grafana_env = compose["services"]["grafana"]["environment"]
    for var in _grafana_env_refs(datasources):
        assert var in grafana_env, f"{var} is expanded by the datasource file but not set for grafana"
    assert "grafana-clickhouse-datasource@" in grafana_env["GF_PLUGINS_PREINSTALL_SYNC"]


def test_tempo_receives_what_the_gateway_sends(gateway: dict[str, Any]) -> None:
    tempo = load(COLLECTORS / "tempo.yaml")
    grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    sent_to = expand(gateway)["exporters"]["otlp_grpc/tempo"]["endpoint"]
    assert port_of(grpc) == port_of(sent_to) and sent_to.startswith("tempo:")
    assert tempo["storage"]["trace"]["backend"] == "local"


def _mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        out.append((source, target))
    return out


def test_compose_pins_images_and_mounts_files_that_exist(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        image = service.get("image", "")
        if "build" in service:
            dockerfile = COLLECTORS / service["build"]["context"] / service["build"]["dockerfile"]
            assert dockerfile.exists()
            base = re.search(r"^FROM (\S+)", dockerfile.read_text(), re.MULTILINE)
            assert base and re.search(r":\d", base.group(1)), f"{name}: unpinned base image"
            continue
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and re.match(r"v?\d", tag), (
            f"{name}: unpinned image {image!r}"
        )
    dashboards_present = (ROOT / "dashboards").is_dir()
    for name, service in services.items():
        for source, _target in _mounts(service):
            if not source.startswith("."):
                assert source in compose["volumes"], f"{name}: named volume {source} not declared"
                continue
            path = (COLLECTORS / source).resolve()
            if path.is_relative_to(ROOT / "dashboards") and not dashboards_present:
                continue  # built by the dashboards work; checked once dashboards/ exists
            assert path.exists(), f"{name}: {source} does not exist"


def test_compose_runs_each_collector_with_its_config(compose: dict[str, Any]) -> None:
    for service, config in (("otel-gateway", "gateway.yaml"), ("otel-agent", "agent.yaml")):
        body = compose["services"][service]
        target = dict(_mounts(body))[f"./{config}"]
        assert body["command"] == [f"--config={target}"]
        env = body.get("environment", {})
        for var, default in env_refs(load(COLLECTORS / config)).items():
            assert default is not None or var in env, f"{service}: {var} has no default and is not set"
    agent_ports = {p.rsplit(":", 2)[-1] for p in compose["services"]["otel-agent"]["ports"]}
    assert {"4317", "4318"} <= agent_ports
    assert compose["services"]["otel-agent"]["environment"]["OTELKV_GATEWAY_HOST"] in compose["services"]


def test_compose_sidecar_sends_turn_spans_into_the_collectors(compose: dict[str, Any]) -> None:
    sidecar = compose["services"]["sidecar"]
    endpoint = urllib.parse.urlsplit(sidecar["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
    agent_http = expand(load(COLLECTORS / "agent.yaml"))["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert endpoint.hostname == "otel-agent" and endpoint.port == port_of(agent_http)
    # its own store stays off: with one, every turn span would be in ClickHouse twice
    assert "--no-store" in sidecar["command"]
    assert not any(a.startswith("--clickhouse") for a in sidecar["command"])


def test_dashboard_provisioning_mount_matches_the_provider(compose: dict[str, Any]) -> None:
    """compose mounts dashboards/ where the provider file (the dashboards' side) looks."""
    mounts = dict(_mounts(compose["services"]["grafana"]))
    assert mounts["../dashboards/provisioning/dashboards"] == "/etc/grafana/provisioning/dashboards"
    assert mounts["./grafana/provisioning/datasources"] == "/etc/grafana/provisioning/datasources"
    providers_dir = ROOT / "dashboards" / "provisioning" / "dashboards"
    for provider_file in sorted(providers_dir.glob("*.y*ml")) if providers_dir.is_dir() else []:
        for provider in load(provider_file).get("providers", []):
            assert provider["options"]["path"].startswith(mounts["../dashboards"]), provider_file


def test_dashboards_preselect_these_datasources(datasources: dict[str, Any]) -> None:
    """Each dashboard's datasource variables default to a datasource provisioned here."""
    provisioned = {d["type"]: (d["uid"], d["name"]) for d in datasources["datasources"]}
    # a second datasources file generated on the dashboards' side must name them alike
    for other in sorted((ROOT / "dashboards" / "provisioning" / "datasources").glob("*.y*ml")):
        listed = {d["type"]: (d["uid"], d["name"]) for d in load(other)["datasources"]}
        assert listed == provisioned, other
    for board in sorted((ROOT / "dashboards").glob("*.json")):
        for variable in json.loads(board.read_text()).get("templating", {}).get("list", []):
            if variable.get("type") != "datasource":
                continue
            current = variable.get("current") or {}
            assert (current.get("value"), current.get("text")) == provisioned[variable["query"]], board.name
