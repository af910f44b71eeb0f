"""The reuse funnel: placement of constructed turns, the CLI on a real chDB store, the panel's SQL.

Every scenario below is one conversation of two turns whose second turn was built to be
lost at one known step for one known reason (or to reach the end); that construction is
the truth each check compares with: the pure function, ``otelkv funnel`` on a chDB store
holding the same spans, and the dashboard panel's SQL run on that store.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from otelkv import names
from otelkv.analysis.funnel import STEP_TITLES, funnel, funnel_turns, place
from otelkv.analysis.linker import load_turns
from otelkv.analysis.report import diagnosis_context
from otelkv.analysis.sources import InMemorySource
from otelkv.spans import SpanRecord
from tests.schema import assert_valid
from tests.unit.test_diagnose import T0, S, turn_trace
from tests.unit.test_tune_cli import run_cli

END = (None, None)

PULL = {
    names.PULL_DECISION: names.DECISION_PULL,
    names.PULL_REASON: names.REASON_PULLED,
    names.TOKENS_PULLED: 256,
    names.TOKENS_COMPUTED: 44,
    names.TOKENS_REMOTE_REUSABLE: 256,
}
NO_HANDLE = {names.PULL_REASON: names.REASON_NO_DECODE_HANDLE, names.TOKENS_REMOTE_REUSABLE: 0}
MISS = {names.ROUTER_HANDLE: names.ROUTER_HANDLE_MISS}
STALE = {names.ROUTER_HANDLE: names.ROUTER_HANDLE_STALE}
DECLINED = {
    names.PULL_DECISION: names.DECISION_PULL,
    names.PULL_REASON: names.REASON_DECLINED_EXPIRED,
    names.REQUEST_OUTCOME: names.OUTCOME_FAILED_KV_LOAD,
}
EXPIRED = {names.RETENTION_OUTCOME: names.RETENTION_EXPIRED, names.RETENTION_HELD_SECONDS: 12.0}
HELD = 300
"""What a recomputing second turn had at stake: the previous decode request held 300 prompt +
40 output tokens (decode TTL 12 s), capped by the 300 tokens the prefill node computed."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    conv: str
    step: str | None
    reason: str | None
    tokens: int | None
    prev: dict[str, Any] = dataclasses.field(default_factory=dict)
    cur: dict[str, Any] = dataclasses.field(default_factory=dict)
    prev_trace: str | None = None
    pulled: bool = False


SCENARIOS = (
    Scenario("pull-paid-off", *END, 256, cur={"prefill": PULL, "prefill_transfer": {}}, pulled=True),
    Scenario(
        "fingerprinted",
        names.FUNNEL_CONVERSATION_ID,
        names.DIAG_NO_CONVERSATION_ID,
        256,
        cur={
            "turn": {names.CONVERSATION_INFERRED: True, names.CONVERSATION_ID_SOURCE: "fingerprint"},
            "prefill": PULL,
            "prefill_transfer": {},
        },
        pulled=True,
    ),
    Scenario(
        "streamed-decode",
        names.FUNNEL_DECODE_HANDLE,
        names.DIAG_DECODE_NO_HANDLE,
        HELD,
        prev={
            "router": {names.ROUTER_DECODE_STREAMED: True},
            "decode": {names.KV_PARAMS_RETURNED: False, names.REQUEST_STREAMED: True},
        },
        cur={"router": MISS, "prefill": NO_HANDLE},
    ),
    Scenario(
        "decode-bidirectional-off",
        names.FUNNEL_DECODE_HANDLE,
        names.DIAG_BIDIRECTIONAL_OFF,
        HELD,
        prev={"decode_resource": {names.BIDIRECTIONAL_KV_XFER: False}},
        cur={"router": MISS, "prefill": NO_HANDLE},
    ),
    Scenario(
        "previous-unseen",
        names.FUNNEL_DECODE_HANDLE,
        names.FUNNEL_LOST_PREVIOUS_DECODE_UNSEEN,
        None,
        cur={"router": MISS, "prefill": NO_HANDLE},
        prev_trace="f" * 32,
    ),
    Scenario(
        "ttl-lapsed",
        names.FUNNEL_KV_HELD,
        names.DIAG_TTL_LAPSED,
        HELD,
        prev={"retention": EXPIRED},
        cur={"gap_s": 20.0, "router": STALE, "prefill": NO_HANDLE},
    ),
    Scenario(
        "ttl-lapsed-read-declined",
        names.FUNNEL_KV_HELD,
        names.DIAG_TTL_LAPSED,
        HELD,
        cur={
            "gap_s": 11.0,
            "prefill": DECLINED,
            "prefill_transfer": {names.TRANSFER_OUTCOME: "declined_expired"},
        },
    ),
    Scenario(
        "router-dropped",
        names.FUNNEL_KV_HELD,
        names.DIAG_ROUTER_HANDLE_EXPIRED,
        HELD,
        prev={"retention": EXPIRED},
        cur={"router": STALE, "prefill": NO_HANDLE},
    ),
    Scenario(
        "router-kept-none",
        names.FUNNEL_KV_HELD,
        names.DIAG_ROUTER_KEPT_NO_HANDLE,
        HELD,
        cur={"router": MISS, "prefill": NO_HANDLE},
    ),
    Scenario(
        "no-engines", names.FUNNEL_KV_HELD, names.FUNNEL_LOST_NO_PREFILL_REQUEST, None, cur={"engines": False}
    ),
    Scenario(
        "below-threshold",
        names.FUNNEL_ABOVE_THRESHOLD,
        names.REASON_BELOW_THRESHOLD,
        40,
        cur={"prefill": {names.PULL_REASON: names.REASON_BELOW_THRESHOLD, names.TOKENS_REMOTE_REUSABLE: 40}},
    ),
    Scenario(
        "local-hit",
        names.FUNNEL_ABOVE_THRESHOLD,
        names.REASON_NOTHING_BEYOND_LOCAL_HIT,
        0,
        cur={
            "prefill": {
                names.PULL_REASON: names.REASON_NOTHING_BEYOND_LOCAL_HIT,
                names.TOKENS_LOCAL_CACHE_HIT: 300,
                names.TOKENS_COMPUTED: 0,
            }
        },
    ),
    Scenario(
        "read-late",
        names.FUNNEL_PULLED,
        names.DIAG_KV_READ_STARTED_LATE,
        HELD,
        cur={"prefill": DECLINED, "prefill_transfer": {names.TRANSFER_OUTCOME: "declined_expired"}},
    ),
    Scenario(
        "load-failed",
        names.FUNNEL_PULLED,
        names.DIAG_EXPIRED_READ_FAILED,
        256,
        cur={"prefill": {**PULL, names.REQUEST_OUTCOME: names.OUTCOME_FAILED_KV_LOAD}},
    ),
    Scenario(
        "stuck",
        names.FUNNEL_PULLED,
        names.DIAG_STUCK_WAITING_FOR_REMOTE_KV,
        256,
        cur={
            "prefill": {**PULL, names.REQUEST_OUTCOME: names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV},
            "prefill_transfer": {names.TRANSFER_OUTCOME: names.TRANSFER_STUCK},
        },
    ),
    Scenario(
        "transfer-failed",
        names.FUNNEL_PULLED,
        names.DIAG_TRANSFER_FAILED,
        HELD,
        cur={
            "prefill": {names.PULL_REASON: names.REASON_TRANSFER_FAILED},
            "prefill_transfer": {names.TRANSFER_OUTCOME: names.TRANSFER_FAILED},
        },
    ),
    Scenario(
        "guard-refused",
        names.FUNNEL_PULLED,
        names.REASON_CONTINUITY_MISMATCH,
        HELD,
        cur={"prefill": {names.PULL_REASON: names.REASON_CONTINUITY_MISMATCH}},
    ),
    Scenario(
        "invalid-handle",
        names.FUNNEL_PULLED,
        names.REASON_INVALID_HANDLE,
        HELD,
        cur={"prefill": {names.PULL_REASON: names.REASON_INVALID_HANDLE}},
    ),
    Scenario(
        "prefill-bidirectional-off",
        names.FUNNEL_PULLED,
        names.REASON_BIDIRECTIONAL_OFF,
        HELD,
        cur={"prefill": {names.PULL_REASON: names.REASON_BIDIRECTIONAL_OFF}},
    ),
    Scenario(
        "pulled-nothing",
        names.FUNNEL_PULLED,
        names.FUNNEL_LOST_UNEXPLAINED,
        HELD,
        cur={"prefill": {names.PULL_REASON: names.REASON_PULLED, names.TOKENS_PULLED: 0}},
    ),
    Scenario(
        "other-tokens",
        names.FUNNEL_FASTER,
        names.DIAG_KV_FOR_OTHER_TOKENS,
        256,
        cur={
            "prefill": {
                **PULL,
                names.CONTINUITY_DIGEST: True,
                names.CONTINUITY_OFFERED: 256,
                names.CONTINUITY_MATCHING: 64,
                names.CONTINUITY_FIRST_MISMATCH: 64,
                names.CONTINUITY_MISMATCH_IN: names.CONTINUITY_IN_HISTORY,
            },
            "prefill_transfer": {},
        },
        pulled=True,
    ),
    Scenario(
        "slow-pull",
        names.FUNNEL_FASTER,
        names.DIAG_PULL_SLOWER_THAN_RECOMPUTE,
        256,
        # 0.5 s for 256 tokens; recomputing them takes about 0.2 s at the other turns' rate.
        cur={
            "prefill": PULL,
            "prefill_transfer": {names.TRANSFER_WAIT_SECONDS: 0.5},
            "prefill_span": (0.05, 1.0),
        },
        pulled=True,
    ),
)


def scenario_spans(base_s: float = 0.0) -> list[SpanRecord]:
    """Two turns per scenario, conversations 100 s apart, starting ``base_s`` after T0."""
    spans: list[SpanRecord] = []
    for i, sc in enumerate(SCENARIOS):
        start = base_s + 100.0 * i
        prev = turn_trace(sc.conv, 0, start_s=start, **sc.prev)
        cur_kw = dict(sc.cur)
        gap = cur_kw.pop("gap_s", 2.0)
        cur = turn_trace(
            sc.conv,
            1,
            start_s=start + 1.0 + gap,
            gap_s=gap,
            prev_trace=sc.prev_trace or prev[0].trace_id,
            **cur_kw,
        )
        spans += cur if sc.prev_trace else prev + cur
    return spans


def expected_counts() -> tuple[Counter[str], Counter[tuple[str, str]], int]:
    """Turns reaching each step, turns lost per (step, reason), turns reaching the end: from the
    scenarios' construction."""
    order = {step: i for i, step in enumerate(names.FUNNEL_STEPS)}
    reached: Counter[str] = Counter()
    lost: Counter[tuple[str, str]] = Counter()
    for sc in SCENARIOS:
        at = order[sc.step] if sc.step is not None else len(order)
        for step, i in order.items():
            if at > i:
                reached[step] += 1
        if sc.step is not None and sc.reason is not None:
            lost[(sc.step, sc.reason)] += 1
    return reached, lost, sum(1 for sc in SCENARIOS if sc.step is None)


# ------------------------------------------------------------------ the pure function


def _turns(spans: list[SpanRecord]) -> list:
    source = InMemorySource(spans)
    return load_turns(source, source.turn_spans(limit=None, slowest_first=False))


def test_every_step_and_reason_is_covered() -> None:
    """The scenarios cover every step a turn can be lost at and every reason the funnel names."""
    steps = {sc.step for sc in SCENARIOS}
    assert steps == set(names.FUNNEL_STEPS[1:]) - {names.FUNNEL_FOLLOW_UP} | {None}
    reasons = {sc.reason for sc in SCENARIOS}
    assert {
        names.FUNNEL_LOST_PREVIOUS_DECODE_UNSEEN,
        names.FUNNEL_LOST_NO_PREFILL_REQUEST,
        names.FUNNEL_LOST_UNEXPLAINED,
        names.DIAG_NO_CONVERSATION_ID,
        names.DIAG_DECODE_NO_HANDLE,
        names.DIAG_ROUTER_KEPT_NO_HANDLE,
        names.DIAG_ROUTER_HANDLE_EXPIRED,
        names.DIAG_TTL_LAPSED,
        names.REASON_BELOW_THRESHOLD,
        names.DIAG_TRANSFER_FAILED,
        names.REASON_CONTINUITY_MISMATCH,
        names.DIAG_PULL_SLOWER_THAN_RECOMPUTE,
    } <= reasons


@pytest.mark.parametrize("sc", SCENARIOS, ids=[sc.conv for sc in SCENARIOS])
def test_each_turn_is_placed_where_it_was_built_to_be_lost(sc: Scenario) -> None:
    turns = _turns(scenario_spans())
    ctx = diagnosis_context(turns)
    from otelkv.analysis.diagnose import diagnose

    (turn,) = [t for t in turns if t.conversation_id == sc.conv and t.index == 1]
    placed = place(turn, (d.id for d in diagnose(turn, ctx)), ctx)
    assert (placed.step, placed.reason) == (sc.step, sc.reason)
    assert placed.tokens == sc.tokens
    assert placed.pulled == sc.pulled


def test_the_funnel_adds_up_and_matches_the_construction() -> None:
    data = funnel_turns(_turns(scenario_spans()))
    reached, lost, ends = expected_counts()
    n = len(SCENARIOS)
    assert data["turn_count"] == 2 * n - 1  # "previous-unseen" has no turn 0 in the store
    assert data["follow_up_turns"] == n and data["ends"] == ends == 1
    assert data["turns_lost"] + data["ends"] == n
    steps = data["steps"]
    assert [s["id"] for s in steps] == list(names.FUNNEL_STEPS)
    assert [s["title"] for s in steps] == [STEP_TITLES[s] for s in names.FUNNEL_STEPS]
    assert {s["id"]: s["turns"] for s in steps} == {step: reached[step] for step in names.FUNNEL_STEPS}
    got = Counter({(s["id"], row["reason"]): row["turns"] for s in steps for row in s["lost"]})
    assert got == lost
    # Each step keeps the previous step's turns minus those lost at it.
    for before, after in itertools.pairwise(steps):
        assert after["turns"] == before["turns"] - after["lost_turns"]
        assert after["tokens"] == before["tokens"] - sum(r["tokens"] for r in after["lost"])
    assert steps[-1]["turns"] == ends
    assert steps[0]["tokens"] == sum(sc.tokens or 0 for sc in SCENARIOS)
    assert steps[0]["tokens_unknown_turns"] == sum(1 for sc in SCENARIOS if sc.tokens is None)
    fingerprint = next(r for r in steps[1]["lost"] if r["reason"] == names.DIAG_NO_CONVERSATION_ID)
    assert fingerprint["pulled_anyway"] == 1
    # The fastest recompute: 300 tokens in a 0.25 s prefill span that also waited 0.02 s on
    # a failed read ("transfer-failed"). Seconds at stake follow the tokens at that rate.
    per_token = (0.25 - 0.02) / 300
    assert data["per_token_compute_s"] == pytest.approx(per_token)
    assert steps[0]["recompute_s"] == pytest.approx(steps[0]["tokens"] * per_token, abs=1e-5)


def test_no_follow_up_turns() -> None:
    first = turn_trace("alone", 0, start_s=10.0)
    data = funnel_turns(_turns(first))
    assert data["follow_up_turns"] == 0 and data["turn_count"] == 1
    assert all(s["turns"] == 0 and s["share"] is None and not s["lost"] for s in data["steps"])


# ------------------------------------------------------------------ a real store: CLI and SQL


def _recent(spans: list[SpanRecord]) -> list[SpanRecord]:
    """The spans moved to the last hour (dashboards query the time range up to now)."""
    shift = time.time_ns() - T0 - 3600 * S
    return [dataclasses.replace(s, start_ns=s.start_ns + shift, end_ns=s.end_ns + shift) for s in spans]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from otelkv.store.chdb_store import ChdbStore

    path = tmp_path_factory.mktemp("funnel") / "store"
    st = ChdbStore(path)
    try:
        # The reference fleet's warm-up conversation is the harness's: neither the CLI nor the
        # panel counts it (a pull that paid off, were it counted).
        warm_0 = turn_trace(names.FLEET_WARMUP_CONVERSATION, 0, start_s=5000.0)
        warm_1 = turn_trace(
            names.FLEET_WARMUP_CONVERSATION,
            1,
            start_s=5003.0,
            prev_trace=warm_0[0].trace_id,
            prefill=PULL,
            prefill_transfer={},
        )
        st.insert_spans(_recent(scenario_spans() + warm_0 + warm_1))
    finally:
        st.close()
    yield path


def test_cli_funnel_on_a_chdb_store(store_dir: Path) -> None:
    done = run_cli("funnel", "--since", "1d", "--store", str(store_dir), "--json")
    assert done.returncode == 0, done.stderr
    data = assert_valid(json.loads(done.stdout))
    reached, lost, _ = expected_counts()
    assert data["kind"] == "funnel" and data["follow_up_turns"] == len(SCENARIOS)
    assert {s["id"]: s["turns"] for s in data["steps"]} == {
        step: reached[step] for step in names.FUNNEL_STEPS
    }
    got = Counter({(s["id"], row["reason"]): row["turns"] for s in data["steps"] for row in s["lost"]})
    assert got == lost

    done = run_cli("funnel", "--since", "1d", "--store", str(store_dir))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert f"{len(SCENARIOS)} follow-up turns" in lines[0]
    for step in names.FUNNEL_STEPS:
        assert any(line.startswith(STEP_TITLES[step]) for line in lines), step
    lapsed = next(line for line in lines if names.DIAG_TTL_LAPSED in line)
    assert lapsed.split()[:3] == ["lost", "2", names.DIAG_TTL_LAPSED]
    assert "1 pulled anyway" in next(line for line in lines if names.DIAG_NO_CONVERSATION_ID in line)


def test_cli_funnel_empty_window_and_bad_input(store_dir: Path) -> None:
    done = run_cli("funnel", "--since", "3d", "--until", "2d", "--store", str(store_dir))
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 1 and done.stdout.startswith("no follow-up turns")
    done = run_cli("funnel", "--since", "yesterday-ish", "--store", str(store_dir))
    assert done.returncode == 2 and "bad time" in done.stderr and "Traceback" not in done.stderr


def test_the_panel_sql_counts_what_was_built(store_dir: Path) -> None:
    pytest.importorskip("grafana_foundation_sdk", reason="needs the dashboards extra")
    from otelkv.analysis.sources import StoreSource
    from otelkv.dashboards import promql as q
    from otelkv.dashboards.funnel_panel import FUNNEL_SQL
    from otelkv.store.chdb_store import ChdbStore
    from tools import grafana_expand as expand

    now = datetime.now(timezone.utc)
    ctx = expand.Context(
        variables={q.MODEL_VAR: expand.Variable(expand.ALL, options=["tiny"], all_value=".*")},
        start=now - timedelta(hours=3),
        end=now + timedelta(minutes=5),
        interval_s=15.0,
    )
    st = ChdbStore(store_dir)
    try:
        rows = st.query(expand.clickhouse(FUNNEL_SQL, ctx))
        cli = funnel(StoreSource(st), since_ns=time.time_ns() - 86400 * S)
    finally:
        st.close()
    reached, lost, _ = expected_counts()
    n = len(SCENARIOS)
    assert [r["step"] for r in rows] == [STEP_TITLES[s] for s in names.FUNNEL_STEPS]
    by_step = dict(zip(names.FUNNEL_STEPS, rows, strict=True))
    for step, row in by_step.items():
        assert row["turns"] == reached[step], step
        assert row["share"] == pytest.approx(reached[step] / n)
        want = sorted((reason, k) for (s, reason), k in lost.items() if s == step)
        got = sorted(
            (part.split(": ")[0], int(part.split(": ")[1].split(" ")[0]))
            for part in row["lost_by_reason"].split(", ")
            if part
        )
        assert got == want, step
        assert row["lost"] == sum(k for _, k in want)
    # The table and the CLI agree on the tokens and seconds at stake, step by step.
    for step, doc in zip(rows, cli["steps"], strict=True):
        assert step["tokens"] == doc["tokens"]
        assert step["recompute_s"] == pytest.approx(doc["recompute_s"], abs=1e-5)


def test_funnel_through_the_sidecar_query_api(capsys: pytest.CaptureFixture[str]) -> None:
    """The sidecar's real ``/api/v1/funnel`` route answers what the CLI prints."""
    import asyncio
    import threading

    from aiohttp import web

    from otelkv.cli.main import main
    from otelkv.sidecar.api import QueryApi

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.add_routes(QueryApi(InMemorySource(scenario_spans()), "memory").routes())
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        assert main(["funnel", "--sidecar", url, "--since", "1000w", "--json"]) == 0
        data = assert_valid(json.loads(capsys.readouterr().out))
        assert data["follow_up_turns"] == len(SCENARIOS) and data["ends"] == 1
        assert main(["funnel", "--sidecar", url, "--since", "1000w"]) == 0
        assert "pull faster than recomputing" in capsys.readouterr().out
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_the_docs_name_every_step_and_reason() -> None:
    """docs/funnel.md's table lists each step in order and every reason the scenarios produce."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "funnel.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(names.FUNNEL_STEPS)
    by_step = {row.split("`")[1]: row for row in rows}
    for sc in SCENARIOS:
        if sc.step is not None:
            assert f"`{sc.reason}`" in by_step[sc.step], (sc.step, sc.reason)
    # The prefill node's own pull reasons the code can return at the pull step, scenario or not.
    for reason in (
        names.REASON_DECLINED_EXPIRED,
        names.REASON_CONTINUITY_MISMATCH,
        names.REASON_INVALID_HANDLE,
        names.REASON_BIDIRECTIONAL_OFF,
    ):
        assert f"`{reason}`" in by_step[names.FUNNEL_PULLED], reason
