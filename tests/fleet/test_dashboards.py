"""The dashboards against a real run: every query returns data from a real fleet.

One fleet (decoder_kv_blocks_ttl=36 s, a router that forwards handles of any age, the
sidecar in front, a decode node that runs two requests at a time, otelkv's continuity guard
on) runs agent
conversations chosen so that every panel has something to show: streamed turns that pull
the previous turn's KV (TTFT by turn index, D->P transfers), tool waits measured from
agent spans and from messages, a conversation without id, turns below the recompute
threshold, two tool waits longer than the TTL, some seconds apart, whose next turns vLLM
fails (declined_expired, failed_kv_load, expired retentions, error turns), two
conversations that rewrite their history under the same id (guard refusals), and a burst
of long answers that queues on the decode node (requests waiting).

A real Prometheus (Debian's ``/usr/bin/prometheus``, 1 s scrapes, its own temporary
storage) scrapes both engines' ``/metrics`` and the sidecar's admin ``/metrics`` during the
run. Then every PromQL expression of every dashboard, with Grafana's variables substituted
("All" and the run's actual model and engines), must return a non-empty result over the
run's window, every variable query must offer values, every ClickHouse SQL panel must
return rows from the run's own chDB store, and every TraceQL query, with the run's
conversation ids filled in, must parse.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

pytest.importorskip(
    "grafana_foundation_sdk", reason="needs the dashboards extra: pip install 'otelkv[dashboards]'"
)

from otelkv import names
from otelkv.dashboards import build, inventory, vllm_metrics
from otelkv.dashboards import promql as q
from otelkv.dashboards.frame import CONVERSATION_VAR
from otelkv.fleet import metrics as prom_text
from otelkv.fleet.agent import Conversation, Turn, TurnResult
from otelkv.fleet.engines import free_port
from otelkv.fleet.fleet import Fleet, FleetConfig
from tests.fleet.conftest import fleet_fixture
from tests.fleet.spans import children, engine_request, in_trace, wait_for_turn
from tests.unit.dashboards_tools import require_tool, traceql_parse
from tools import grafana_expand as expand

pytestmark = pytest.mark.fleet

TTL_S = 36.0
"""Long enough that short tool waits on a busy 2-core machine stay well inside the window
in which vLLM still serves a read (it declines from 5 s before the deadline): reads of an
idle engine's KV have stalled up to 30 s here (the prefill lease), and a CI run failed a
0.6 s-gap turn at TTL 15 s."""
SCRAPE_S = 1.0
MODEL = "tiny-llama"

REUSE_TURNS = [
    Turn("find the flaky test in the nightly build log", 80),
    Turn("test_cache times out after thirty seconds", 80, pause_s=1.0, tool="read_log"),
    Turn("now propose a fix", 64, pause_s=0.8),
    Turn("the fix passes locally", 48, pause_s=0.6, tool="run_tests"),
]
REUSE = Conversation("dash-reuse", REUSE_TURNS, stream=True)
REUSE_AGAIN = Conversation("dash-reuse-again", REUSE_TURNS, stream=True)
LAPSE = Conversation(
    "dash-lapse",
    [Turn("plan the release of version two", 80), Turn("ci is green", 32, pause_s=TTL_S + 1.5, tool="ci")],
)
LAPSE_AGAIN = Conversation(
    "dash-lapse-again",
    [
        Turn("draft the changelog for the release", 64),
        Turn("approved", 16, pause_s=TTL_S + 1.5, tool="review"),
    ],
)
AGAIN_AFTER_S = 10.0
"""Every rare event happens twice: the second time a few scrapes after Prometheus saw the
first. A series is created by its first event and first scraped with that count already
in it, so ``rate()`` and ``increase()`` cannot see that event (a Prometheus property, see
docs/dashboards.md); the panels are held to the second. A fleet that has been serving a
while is in that state for every series. 10 s apart, not less: turns on this 2-core
machine can stall for seconds, and two failures inside one scrape are one event to rate()
(a CI run had every failure series at 0 with 4 s)."""
ANONYMOUS = Conversation(
    "dash-anonymous",
    [Turn("list the open pull requests", 64), Turn("three are open", 48, pause_s=0.6, tool="github")],
    send_conversation_id=False,
    stream=True,
)


def _rewrite_turns(topic: str) -> list[Turn]:
    """A turn, then one whose app first replaced the turn's user message (a compacted history)."""
    return [
        Turn(f"review the pull request for the {topic} module and list every issue", 80),
        Turn("now answer", 16, pause_s=0.6, rewrite_first_user=f"summarize the {topic} module review"),
    ]


REWRITE = Conversation("dash-rewrite", _rewrite_turns("cache"))
"""The app compacts its history under the same id: guard mode refuses the decode handle."""
REWRITE_AGAIN = Conversation("dash-rewrite-again", _rewrite_turns("index"))
"""Other words: the prefill node's prefix cache would otherwise hold the whole rewritten prompt
from the first time (nothing beyond the local hit, no refusal)."""
SHORT = Conversation("dash-short", [Turn("yes or no", 8), Turn("why", 8, pause_s=0.5)])
TAIL = Conversation("dash-tail", [Turn("one more question after the lapse", 16)])
"""Sent after each lapse: vLLM frees expired blocks on the decode node's next step, so the
expired retention ends (span, counter, gauge) only once decode runs again."""
TAIL_AGAIN = Conversation("dash-tail-again", [Turn("and one after the second lapse", 16)])
LAPSES = (LAPSE.conversation_id, LAPSE_AGAIN.conversation_id)
DECODE_SLOTS = 2
BURST = [
    Conversation(f"dash-burst-{i}", [Turn("write the long weekly build report", 512)]) for i in range(10)
]
"""Ten long answers at once on a decode node with two slots: eight wait at least a whole
answer (2-3 s here) and two of them four, so ``vllm:num_requests_waiting`` is above 0 for
several 1 s scrapes even when the prefill node hands them over one by one. Without it
nothing on a quiet fleet waits long enough for a scrape to see it (five 384-token answers
once left no scrape seeing a wait on an idle machine, and six 512-token answers did once
in a fresh-clone run)."""

ALLOWED_ZERO = {
    "sum(rate(otelkv_sidecar_upstream_errors_total{}[$__rate_interval]))": "the router never went away",
}
"""Expressions that may be zero throughout the run (they still must return data), and why."""


class Prometheus:
    """A real Prometheus server on a random port, scraping the given targets every second."""

    def __init__(self, binary: str, jobs: dict[str, list[str]], workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S:g}s", "scrape_timeout": f"{SCRAPE_S:g}s"},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.expected_targets = sum(len(t) for t in jobs.values())

    def get(self, path: str, **params: Any) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # Prometheus says why in the body (bad_data, ...)
            raise AssertionError(f"prometheus {path} {params}: {exc.code} {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.HTTPError, OSError):
            return False

    def wait_up(self, timeout_s: float = 60.0) -> None:
        """Until every target has been scraped successfully (the first scrape takes ~5 s)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready():  # the API answers 503 until the TSDB is open (slow on a busy host)
            assert self.process.poll() is None, "prometheus exited; see prometheus.log"
            assert time.monotonic() < deadline, "prometheus not ready; see prometheus.log"
            time.sleep(0.2)
        while True:
            assert self.process.poll() is None, "prometheus exited; see prometheus.log"
            try:
                targets = self.get("/api/v1/targets")["activeTargets"]
                if len(targets) == self.expected_targets and all(t["health"] == "up" for t in targets):
                    return
            except OSError:
                targets = []
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus targets not up: {targets}")
            time.sleep(0.3)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.get("/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expr, time=at)["result"]

    def label_values(self, label: str, match: str | None, start: float, end: float) -> list[str]:
        params: dict[str, Any] = {"start": start, "end": end}
        if match:
            params["match[]"] = [match]
        return self.get(f"/api/v1/label/{label}/values", **params)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=5)
        self.log.close()


@dataclass
class Run:
    start: float
    end: float
    results: dict[str, list[TurnResult]]
    instances: list[str]


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    # Checked before the fleet starts: no point spending a minute on engines without it.
    require_tool("node")
    return require_tool("prometheus")


@pytest.fixture(scope="module")
def fleet(prometheus_binary: str, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    config = FleetConfig(
        decoder_ttl_s=TTL_S,
        router_handle_ttl_s=None,
        sidecar=True,
        max_num_seqs_decode=DECODE_SLOTS,
        continuity=names.CONTINUITY_MODE_GUARD,
    )
    yield from fleet_fixture(config, request)


@pytest.fixture(scope="module")
def prometheus(fleet: Fleet, prometheus_binary: str) -> Iterator[Prometheus]:
    assert fleet.prefill is not None and fleet.decode is not None and fleet.sidecar is not None
    engines = [fleet.prefill.url, fleet.decode.url]
    jobs = {
        "vllm": [u.removeprefix("http://") for u in engines],
        "otelkv-sidecar": [str(fleet.sidecar.admin_url).removeprefix("http://")],
    }
    with tempfile.TemporaryDirectory(prefix="otelkv-prom-") as tmp:
        server = Prometheus(prometheus_binary, jobs, Path(tmp))
        try:
            server.wait_up()
            yield server
        finally:
            server.stop()


def _sidecar_turns(fleet: Fleet) -> float:
    assert fleet.sidecar is not None
    with urllib.request.urlopen(f"{fleet.sidecar.admin_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return prom_text.total(text, q.counter(names.METRIC_TURNS))


@pytest.fixture(scope="module")
def run(fleet: Fleet, prometheus: Prometheus) -> Run:
    traced, untraced = fleet.driver(), fleet.driver(traced=False)
    start = time.time() - 2.0

    async def lapse_then_tail(lapse: Conversation, tail: Conversation, session: aiohttp.ClientSession) -> Any:
        return [await traced.run(lapse, session), await traced.run(tail, session)]

    def first_turn_done(conversation: Conversation) -> None:
        assert fleet.sink is not None
        fleet.sink.wait_for(
            lambda spans: any(
                s.name == names.engine_request_span_name(names.ROLE_DECODE)
                and s.attributes.get(names.GEN_AI_CONVERSATION_ID) == conversation.conversation_id
                for s in spans
            ),
            timeout=120,
        )

    async def second_lapse(session: aiohttp.ClientSession) -> Any:
        # Fails (and expires) AGAIN_AFTER_S after the first lapse does.
        await asyncio.to_thread(first_turn_done, LAPSE)
        await asyncio.sleep(AGAIN_AFTER_S)
        return await lapse_then_tail(LAPSE_AGAIN, TAIL_AGAIN, session)

    async def reuse_twice(session: aiohttp.ClientSession) -> Any:
        first = await traced.run(REUSE, session)
        await asyncio.sleep(AGAIN_AFTER_S)
        return first, await traced.run(REUSE_AGAIN, session)

    async def rewrite_twice(session: aiohttp.ClientSession) -> Any:
        first = await traced.run(REWRITE, session)
        await asyncio.sleep(AGAIN_AFTER_S)
        return first, await traced.run(REWRITE_AGAIN, session)

    async def burst(session: aiohttp.ClientSession) -> list[list[TurnResult]]:
        return list(await asyncio.gather(*(traced.run(c, session) for c in BURST)))

    async def main() -> list[list[TurnResult]]:
        async with aiohttp.ClientSession() as session:
            (
                (reuse, reuse_again),
                anonymous,
                short,
                (lapse, tail),
                (lapse_again, tail_again),
                (rewrite, rewrite_again),
                bursts,
            ) = await asyncio.gather(
                reuse_twice(session),
                untraced.run(ANONYMOUS, session),
                traced.run(SHORT, session),
                lapse_then_tail(LAPSE, TAIL, session),
                second_lapse(session),
                rewrite_twice(session),
                burst(session),
            )
            return [
                reuse,
                reuse_again,
                anonymous,
                short,
                lapse,
                tail,
                lapse_again,
                tail_again,
                rewrite,
                rewrite_again,
                *bursts,
            ]

    runs = asyncio.run(main())
    conversations = [
        REUSE,
        REUSE_AGAIN,
        ANONYMOUS,
        SHORT,
        LAPSE,
        TAIL,
        LAPSE_AGAIN,
        TAIL_AGAIN,
        REWRITE,
        REWRITE_AGAIN,
        *BURST,
    ]
    results = {c.conversation_id: r for c, r in zip(conversations, runs, strict=True)}
    for conversation, turns in results.items():
        if conversation in LAPSES:
            statuses = [t.status for t in turns]
            assert statuses == [200, 500], (
                f"{conversation}: the turn after the TTL should fail, got {statuses}",
                fleet.engine_log_lines(),
            )
        else:
            assert all(t.ok for t in turns), (
                conversation,
                [(t.status, t.error) for t in turns],
                fleet.engine_log_lines(),
            )

    # Every span in: the expired retention of each lapse's first turn ends at its tail's step.
    assert fleet.sink is not None
    for conversation in LAPSES:
        first = results[conversation][0]
        decode = engine_request(wait_for_turn(fleet.sink, first.trace_id), names.ROLE_DECODE)
        spans = in_trace(
            fleet.sink.wait_for(lambda s, d=decode: bool(children(s, d, "kv_retention")), timeout=30),
            first.trace_id,
        )
        (retention,) = children(spans, decode, "kv_retention")
        assert retention.attributes[names.RETENTION_OUTCOME] == names.RETENTION_EXPIRED
    for turns in results.values():
        for turn in turns:
            wait_for_turn(fleet.sink, turn.trace_id, decode=turn.ok)
    fleet.flush_store()

    # The run's conversations are over: the sidecar counts their task time once they have been
    # idle for CONVERSATION_IDLE_SECONDS; its clock is moved past that instead of waiting.
    assert fleet.sidecar is not None
    fleet.sidecar.metrics.expire_tasks(time.time_ns() + int(names.CONVERSATION_IDLE_SECONDS * 1e9) + 1)

    # Prometheus has scraped the final counts: the sidecar's turn counter, the engines' expiries
    # and the task times just observed (a scrape that came before expire_tasks has none).
    turns_total = _sidecar_turns(fleet)
    expired = q.sel(q.counter(names.METRIC_RETENTIONS), (), q.eq(q.OUTCOME, names.RETENTION_EXPIRED))
    deadline = time.monotonic() + 20
    while True:
        now = time.time()
        scraped = prometheus.query(f"sum({q.counter(names.METRIC_TURNS)})", now)
        expiries = prometheus.query(f"sum({expired})", now)
        tasks = prometheus.query(f"sum({names.METRIC_CONVERSATION_SECONDS}_count)", now)
        if (
            scraped
            and float(scraped[0]["value"][1]) == turns_total
            and expiries
            and float(expiries[0]["value"][1]) >= len(LAPSES)
            and tasks
            and float(tasks[0]["value"][1]) > 0
        ):
            break
        assert time.monotonic() < deadline, f"prometheus did not catch up: {scraped}"
        time.sleep(0.5)
    end = time.time() + SCRAPE_S
    time.sleep(SCRAPE_S)
    instances = prometheus.label_values(q.INSTANCE, 'up{job="vllm"}', start, end)
    assert len(instances) == 2, instances
    return Run(start=start, end=end, results=results, instances=sorted(instances))


def _boards() -> dict[str, dict[str, Any]]:
    return build.load()


def _contexts(run: Run, *, conversation: str = REUSE.conversation_id) -> list[tuple[str, expand.Context]]:
    """The dashboards as a user would open them on this run: "All", then the actual values."""
    start = datetime.fromtimestamp(run.start, timezone.utc)
    end = datetime.fromtimestamp(run.end, timezone.utc)
    common = {
        "start": start,
        "end": end,
        "interval_s": SCRAPE_S,
        "scrape_interval_s": SCRAPE_S,
    }
    everything = {
        q.MODEL_VAR: expand.Variable(expand.ALL, options=[MODEL], all_value=".*"),
        q.ENGINE_VAR: expand.Variable(expand.ALL, options=run.instances, all_value=".*"),
        CONVERSATION_VAR: expand.Variable(conversation),
    }
    chosen = {
        q.MODEL_VAR: expand.Variable([MODEL]),
        q.ENGINE_VAR: expand.Variable(run.instances),
        CONVERSATION_VAR: expand.Variable(conversation),
    }
    return [
        ("all", expand.Context(variables=everything, **common)),
        ("chosen", expand.Context(variables=chosen, **common)),
    ]


def _finite(values: list[list[Any]]) -> list[float]:
    return [float(v) for _, v in values if math.isfinite(float(v))]


def test_every_promql_expression_returns_data(run: Run, prometheus: Prometheus) -> None:
    found = inventory.of_kind(inventory.all_queries(_boards()), "promql")
    assert len(found) >= 30
    empty, zero, checked = [], set(), 0
    for label, ctx in _contexts(run):
        for query in found:
            expr = expand.promql(query.text, ctx)
            series = prometheus.query_range(expr, run.start, run.end, SCRAPE_S)
            values = [v for s in series for v in _finite(s["values"])]
            if query.instant:
                instant = prometheus.query(expr, run.end)
                values += [v for s in instant for v in _finite([s["value"]])]
            checked += 1
            if not values:
                empty.append(f"[{label}] {query}: {expr}")
            elif all(v == 0 for v in values):
                zero.add(query.text)
    print(f"\n{checked} PromQL evaluations ({len(found)} expressions x 2 variable settings), all non-empty")
    assert not empty, "PromQL with no data for the run:\n" + "\n".join(empty)
    # Data, and not only zeros: the run did everything the panels count (see ALLOWED_ZERO).
    assert zero <= set(ALLOWED_ZERO), "PromQL that stayed 0 throughout the run:\n" + "\n".join(
        sorted(zero - set(ALLOWED_ZERO))
    )


def test_every_variable_offers_the_runs_values(run: Run, prometheus: Prometheus) -> None:
    found = inventory.of_kind(inventory.all_queries(_boards()), "label_values")
    assert found
    _, ctx = _contexts(run)[0]
    for query in found:
        selector, label = expand.label_values(query.text, ctx)
        values = prometheus.label_values(label, selector, run.start, run.end)
        expected = {q.MODEL_NAME: [MODEL], q.INSTANCE: run.instances}[label]
        assert values == expected, (str(query), values)


def test_every_clickhouse_panel_returns_rows(run: Run, fleet: Fleet) -> None:
    assert fleet.sidecar is not None
    store = fleet.sidecar.store
    found = inventory.of_kind(inventory.all_queries(_boards()), "sql")
    assert len(found) >= 10
    empty, checked = [], 0
    # The conversation drill-down for a conversation that pulled, and for one that lapsed.
    for conversation in (REUSE.conversation_id, LAPSE.conversation_id):  # pulled; lapsed and failed
        for label, ctx in _contexts(run, conversation=conversation):
            for query in found:
                rows = store.query(expand.clickhouse(query.text, ctx))
                checked += 1
                if not rows:
                    empty.append(f"[{label}, {conversation}] {query}")
                if query.where == f"variable {CONVERSATION_VAR}":
                    listed = [next(iter(row.values())) for row in rows]
                    assert {REUSE.conversation_id, LAPSE.conversation_id} <= set(listed), listed
    print(f"\n{checked} SQL runs ({len(found)} queries), all on the run's chDB store")
    assert not empty, "SQL panels with no rows for the run:\n" + "\n".join(empty)


def test_traceql_with_the_runs_conversations_parses(run: Run) -> None:
    found = inventory.of_kind(inventory.all_queries(_boards()), "traceql")
    assert found
    queries = [
        expand.traceql(query.text, ctx)
        for conversation in run.results
        for _, ctx in _contexts(run, conversation=conversation)[:1]
        for query in found
    ]
    code, results = traceql_parse(queries)
    assert code == 0, [r for r in results if r["errors"]]


def test_the_run_itself_covers_what_the_panels_are_about(run: Run, prometheus: Prometheus) -> None:
    """Non-empty is only meaningful if the run produced each case; check the key ones by value."""
    at = run.end

    def total(expr: str) -> float:
        result = prometheus.query(expr, at)
        return sum(float(s["value"][1]) for s in result)

    assert (
        total(q.sel(q.counter(names.METRIC_PREFILL_TOKENS), (), q.eq(q.SOURCE, names.TOKEN_SOURCE_PULLED)))
        > 0
    )
    reasons = {
        s["metric"][q.REASON]
        for s in prometheus.query(f"sum by (reason) ({q.counter(names.METRIC_PULL_DECISIONS)})", at)
    }
    assert {
        names.REASON_PULLED,
        names.REASON_NO_DECODE_HANDLE,
        names.REASON_DECLINED_EXPIRED,
        names.REASON_BELOW_THRESHOLD,
        names.REASON_CONTINUITY_MISMATCH,
    } <= reasons
    expired = q.eq(q.OUTCOME, names.RETENTION_EXPIRED)
    assert total(q.sel(q.counter(names.METRIC_RETENTIONS), (), expired)) >= len(LAPSES)
    failed = q.eq(q.OUTCOME, names.OUTCOME_FAILED_KV_LOAD)
    assert total(q.sel(q.counter(names.METRIC_REQUESTS), (), failed)) == len(LAPSES)
    assert total(q.sel(q.counter(names.METRIC_TURNS), (), q.eq(q.STATUS, q.TURN_STATUS_ERROR))) >= len(LAPSES)
    ttft_turns = {
        s["metric"][q.TURN_INDEX] for s in prometheus.query(q.hist_count(names.METRIC_TURN_TTFT_SECONDS), at)
    }
    assert {"0", "1", "2", "3"} <= ttft_turns
    gap_sources = {
        s["metric"][q.SOURCE] for s in prometheus.query(q.hist_count(names.METRIC_TURN_GAP_SECONDS), at)
    }
    assert {names.GAP_SOURCE_AGENT_SPANS, names.GAP_SOURCE_MESSAGES} <= gap_sources
    # The burst queued: some scrape saw requests waiting on the decode node.
    window = f"{math.ceil(run.end - run.start)}s"
    assert total(f"max(max_over_time({vllm_metrics.NUM_REQUESTS_WAITING}[{window}]))") >= 1
    assert run.end - run.start < timedelta(minutes=5).total_seconds()


README_PICTURE = (
    ("otelkv-agent-turns", 9),  # turn time by phase, stacked
    ("otelkv-agent-turns", 15),  # TTFT by turn index
    ("otelkv-kv-reuse", 24),  # prefill seconds saved by pulls: what reuse is worth
    ("otelkv-kv-reuse", 9),  # prefill tokens by source
    ("otelkv-kv-reuse", 11),  # pull decisions by reason
    ("otelkv-kv-reuse", 14),  # KV bytes/s by direction and backend
    ("otelkv-conversation", 3),  # one conversation's turns, phase by phase (SQL)
)


def test_readme_picture_is_drawn_from_the_run(
    run: Run, prometheus: Prometheus, fleet: Fleet, tmp_path: Path
) -> None:
    """The README's picture: seven panels drawn from their own queries on this run's Prometheus
    and store. ``OTELKV_README_PICTURE=docs/img/dashboards.png`` keeps it, and
    ``OTELKV_README_PICTURE_RECORDING=run.json`` the query results, from which
    ``python -m tools.dashboard_picture run.json docs/img/dashboards.png`` draws it again after
    a change of the panels' look. Every panel must have drawn data, so the picture cannot
    silently show an empty panel."""
    from tools.dashboard_picture import recorder, render, save_recording

    assert fleet.sidecar is not None
    store = fleet.sidecar.store
    boards = {board["uid"]: board for board in _boards().values()}
    _, ctx = _contexts(run)[0]  # as opened: every model and engine, the reuse conversation

    def sql_rows(sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        rows = store.query(sql)
        return (list(rows[0]) if rows else []), [tuple(row.values()) for row in rows]

    out = Path(os.environ.get("OTELKV_README_PICTURE") or tmp_path / "dashboards.png")
    prom_range, prom_instant, sql_rows, kept = recorder(
        lambda expr: prometheus.query_range(expr, run.start, run.end, SCRAPE_S),
        lambda expr: prometheus.query(expr, run.end),
        sql_rows,
    )
    title = "otelkv dashboards, drawn from a real 1P1D vLLM run (NIXL over UCX, CPU) through the sidecar"
    try:
        drawn = render(
            out,
            [(boards[uid], panel) for uid, panel in README_PICTURE],
            ctx,
            prom_range=prom_range,
            prom_instant=prom_instant,
            sql_rows=sql_rows,
            title=title,
        )
    finally:
        if os.environ.get("OTELKV_README_PICTURE_RECORDING"):
            save_recording(
                Path(os.environ["OTELKV_README_PICTURE_RECORDING"]), kept, ctx, README_PICTURE, title
            )
    assert all(d.points > 0 for d in drawn), drawn
    assert out.stat().st_size > 50_000
