"""Every query of every dashboard, checked by the tool that will run it.

* PromQL: ``promtool check rules`` (Prometheus' own parser) after Grafana's substitutions,
  and every metric and matcher label exists in what otelkv's engines and sidecar export.
* TraceQL: ``@grafana/lezer-traceql``, the grammar Grafana's Tempo editor parses with.
* ClickHouse SQL: expanded the way the ClickHouse plugin does, then run on chDB against
  an ``otel_traces`` store filled with realistic turn traces; each must return rows.

Each checker is first shown to reject a broken query, so a green run means something.
The real-data version of these checks is ``tests/fleet/test_dashboards.py``.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "grafana_foundation_sdk", reason="needs the dashboards extra: pip install 'otelkv[dashboards]'"
)

from otelkv import names
from otelkv.analysis.phases import Phases
from otelkv.dashboards import build, inventory, vllm_metrics
from otelkv.dashboards import promql as q
from otelkv.dashboards.frame import CONVERSATION_VAR
from otelkv.sidecar.metrics import SidecarMetrics
from otelkv.spans import SpanRecord
from otelkv.store.base import StoreError
from otelkv.store.chdb_store import ChdbStore
from tests.unit.dashboards_tools import promtool_check, traceql_parse
from tests.unit.test_diagnose import T0, S, turn_trace
from tests.unit.test_report import lapse_conversation, quick_conversation
from tools import grafana_expand as expand

QUERIES = inventory.all_queries({spec.filename: build.to_json(spec.build()) for spec in build.DASHBOARDS})
NOW = datetime.now(timezone.utc)


def contexts(conversation: str = "conv-lapse") -> list[expand.Context]:
    """Variables at "All" (with the custom all value) and at concrete values."""
    common = {"start": NOW - timedelta(hours=3), "end": NOW + timedelta(minutes=5), "interval_s": 15.0}
    return [
        expand.Context(
            variables={
                q.MODEL_VAR: expand.Variable(expand.ALL, options=["tiny"], all_value=".*"),
                q.ENGINE_VAR: expand.Variable(expand.ALL, options=["10.0.0.1:8000"], all_value=".*"),
                CONVERSATION_VAR: expand.Variable(conversation),
            },
            **common,
        ),
        expand.Context(
            variables={
                q.MODEL_VAR: expand.Variable(["tiny"]),
                q.ENGINE_VAR: expand.Variable(["10.0.0.1:8000", "10.0.0.2:8000"]),
                CONVERSATION_VAR: expand.Variable(conversation),
            },
            **common,
        ),
    ]


def test_there_is_something_to_check() -> None:
    counts = {
        kind: len(inventory.of_kind(QUERIES, kind)) for kind in ("promql", "sql", "traceql", "label_values")
    }
    assert (
        counts["promql"] >= 30
        and counts["sql"] >= 10
        and counts["traceql"] >= 5
        and counts["label_values"] >= 2
    )


# ------------------------------------------------------------------ PromQL


def _promql_texts() -> list[str]:
    texts = []
    for ctx in contexts():
        texts += [expand.promql(query.text, ctx) for query in inventory.of_kind(QUERIES, "promql")]
        for query in inventory.of_kind(QUERIES, "label_values"):
            selector, _ = expand.label_values(query.text, ctx)
            assert selector is not None
            texts.append(selector)
    return texts


def test_promtool_rejects_a_broken_expression() -> None:
    done = promtool_check(["sum(rate(otelkv_turns_total[1m])"])
    assert done.returncode != 0 and "parse error" in done.stdout + done.stderr


def test_every_promql_expression_passes_promtool() -> None:
    texts = _promql_texts()
    done = promtool_check(texts)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(texts)} rules found" in done.stdout


def test_grafana_substitution_leaves_no_variable_behind() -> None:
    for text in _promql_texts():
        assert "$" not in text, text
    chosen = expand.promql('x{instance=~"$engine", model_name=~"$model"}[$__rate_interval]', contexts()[1])
    # Grafana's prometheusSpecialRegexEscape: the regex escape is escaped again for the string.
    assert chosen == r'x{instance=~"(10\\.0\\.0\\.1:8000|10\\.0\\.0\\.2:8000)", model_name=~"tiny"}[60s]'


def _exported_families() -> dict[str, set[str]]:
    """Metric name (as scraped) -> the label names it carries, from otelkv's own exporters."""
    vllm_labels = {"model_name", "engine"}
    families: dict[str, set[str]] = {}
    prom = pytest.importorskip("otelkv.engine.prom")  # needs vLLM's metric classes
    for name, spec in prom.METRICS.items():
        kind, labels = spec.kind, vllm_labels | set(spec.labels)
        if kind == "counter":
            families[q.counter(name)] = labels
        elif kind == "gauge":
            families[name] = labels
        else:
            families[q.bucket(name)] = labels | {q.LE}
            families[q.hist_sum(name)] = labels
            families[q.hist_count(name)] = labels
    sidecar = SidecarMetrics()
    phases = Phases(
        tool_wait_s=1.0,
        app_work_s=0.5,
        input_processing_s=0.2,
        generation_s=0.3,
        gap_source=names.GAP_SOURCE_AGENT_SPANS,
        ttft_source=names.TTFT_SOURCE_STREAM,
    )
    sidecar.observe_turn(
        model="tiny",
        phases=phases,
        ttft_s=0.2,
        turn_index=1,
        ok=True,
        stream=True,
        conversation_id="c1",
        start_ns=1,
        end_ns=2,
    )
    sidecar.expire_tasks(10**19)  # the conversation is long finished: its task time is observed
    sidecar.received.labels("otlp").inc()
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(sidecar.exposition().decode()):
        for sample in family.samples:
            families.setdefault(sample.name, set()).update(sample.labels)
    return families


def test_every_metric_and_label_a_dashboard_reads_is_exported() -> None:
    families = _exported_families()
    scrape_labels = {"instance", "job"}
    selector = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
    seen: set[str] = set()
    for query in inventory.of_kind(QUERIES, "promql", "label_values"):
        for metric, matchers in selector.findall(query.text):
            seen.add(metric)
            if metric.startswith("vllm:"):
                assert any(metric.startswith(v) for v in vllm_metrics.ALL), (str(query), metric)
                continue
            assert metric in families, f"{query}: {metric} is not exported by otelkv"
            for label in re.findall(r"(\w+)\s*[=!]~?", matchers):
                assert label in families[metric] | scrape_labels, f"{query}: {metric} has no label {label}"
    assert any(m.startswith("otelkv_turn") for m in seen) and any(m.startswith("otelkv_kv") for m in seen)


def test_vllm_metric_names_exist_in_the_installed_vllm() -> None:
    vllm = pytest.importorskip("vllm")
    root = Path(vllm.__file__).parent
    sources = "".join(
        p.read_text(errors="replace")
        for sub in ("v1/metrics", "distributed/kv_transfer/kv_connector/v1")
        for p in (root / sub).rglob("*.py")
    )
    for name in vllm_metrics.ALL:
        assert f'"{name}"' in sources, name


# ------------------------------------------------------------------ TraceQL


def test_traceql_parser_rejects_a_broken_query() -> None:
    code, results = traceql_parse(["{ span.gen_ai.conversation.id = }", '{ name = "ok" }'])
    assert code == 1
    assert results[0]["errors"] and not results[1]["errors"]


def test_every_traceql_query_parses_once_interpolated_even_with_quotes_in_the_id() -> None:
    found = inventory.of_kind(QUERIES, "traceql")
    assert all(f"${{{CONVERSATION_VAR}:doublequote}}" in query.text for query in found)
    texts = []
    for conversation in ("conv-lapse", 'agent "alpha" #3'):
        texts += [expand.traceql(query.text, contexts(conversation)[0]) for query in found]
    code, results = traceql_parse(texts)
    assert code == 0, [r for r in results if r["errors"]]
    assert len(results) == len(texts)
    assert r'span.gen_ai.conversation.id = "agent \"alpha\" #3"' in texts[-1]


# ------------------------------------------------------------------ ClickHouse SQL


def realistic_spans() -> list[SpanRecord]:
    """Turn traces as the sidecar and engines record them, shifted to the last hour.

    A conversation whose second turn came back after the TTL and whose third pulled, a
    quick one, and one whose turn failed reading expired KV (declined, failed_kv_load).
    """
    model = {names.GEN_AI_REQUEST_MODEL: "tiny"}
    kept = turn_trace(
        "conv-failed",
        0,
        start_s=284.0,
        prefill=model,
        retention={names.RETENTION_OUTCOME: names.RETENTION_EXPIRED, names.RETENTION_HELD_SECONDS: 12.0},
    )
    failed = turn_trace(
        "conv-failed",
        1,
        start_s=300.0,
        gap_s=15.0,
        prev_trace=kept[0].trace_id,
        status="Error",
        prefill={
            **model,
            names.PULL_DECISION: names.DECISION_PULL,
            names.PULL_REASON: names.REASON_DECLINED_EXPIRED,
            names.REQUEST_OUTCOME: names.OUTCOME_FAILED_KV_LOAD,
        },
    )
    spans = lapse_conversation() + quick_conversation() + kept + failed
    shift = time.time_ns() - T0 - 3600 * S
    return [dataclasses.replace(s, start_ns=s.start_ns + shift, end_ns=s.end_ns + shift) for s in spans]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbStore]:
    st = ChdbStore(tmp_path_factory.mktemp("dash") / "store")
    try:
        st.insert_spans(realistic_spans())
        yield st
    finally:
        st.close()


def test_a_broken_panel_query_fails_on_chdb(store: ChdbStore) -> None:
    with pytest.raises(StoreError, match=r"Syntax error|UNKNOWN_IDENTIFIER|Missing columns|Unknown"):
        store.query(
            expand.clickhouse(
                "SELECT count( FROM otel.otel_traces WHERE $__timeFilter(Timestamp)", contexts()[0]
            )
        )
    with pytest.raises(ValueError, match="unknown ClickHouse macro"):
        expand.clickhouse("SELECT 1 WHERE $__timeFiltr(Timestamp)", contexts()[0])


@pytest.mark.parametrize("conversation", ["conv-lapse", "conv-failed"])
def test_every_sql_query_returns_rows_on_a_realistic_store(store: ChdbStore, conversation: str) -> None:
    empty = []
    for ctx in contexts(conversation):
        for query in inventory.of_kind(QUERIES, "sql"):
            rows = store.query(expand.clickhouse(query.text, ctx))
            if not rows:
                empty.append(str(query))
    assert not empty, empty


def _panel(title: str) -> inventory.Query:
    (query,) = [x for x in inventory.of_kind(QUERIES, "sql") if f'"{title}"' in x.where]
    return query


def test_sql_answers_are_right_not_just_present(store: ChdbStore) -> None:
    ctx = contexts("conv-lapse")[0]

    def rows(title: str) -> list[dict[str, Any]]:
        return store.query(expand.clickhouse(_panel(title).text, ctx))

    slowest = rows("Slowest turns")
    assert slowest[0]["conversation"] == "conv-lapse" and slowest[0]["turn"] == 1  # the 20 s tool wait
    assert [r["total_s"] for r in slowest] == sorted((r["total_s"] for r in slowest), reverse=True)
    over = rows("Turns that came back after the TTL")
    assert sorted((r["conversation"], r["turn"], r["retention"]) for r in over) == [
        ("conv-failed", 1, names.RETENTION_EXPIRED),
        ("conv-lapse", 1, names.RETENTION_EXPIRED),
    ]
    buckets = {r["gap_vs_ttl"]: r["turns"] for r in rows("Inter-turn gap against the decode TTL")}
    assert buckets["> TTL"] == 2
    (failed,) = rows("Failed or stuck requests, one by one")
    assert (failed["conversation"], failed["outcome"], failed["pull_reason"]) == (
        "conv-failed",
        names.OUTCOME_FAILED_KV_LOAD,
        names.REASON_DECLINED_EXPIRED,
    )
    tokens = {r["turn_label"]: r for r in rows("Prompt tokens by source")}
    assert (
        tokens["turn 2"][names.TOKEN_SOURCE_PULLED] == 256
        and tokens["turn 2"][names.TOKEN_SOURCE_COMPUTED] == 44
    )
    gap = {r["turn"]: r for r in rows("Gap against the TTL")}
    assert gap[1]["previous_retention"] == names.RETENTION_EXPIRED and gap[1]["gap_over_ttl"] > 1
    assert gap[2]["pull_reason"] == names.REASON_PULLED


def test_model_filter_excludes_other_models(store: ChdbStore) -> None:
    other = dataclasses.replace(
        contexts()[1], variables={**contexts()[1].variables, q.MODEL_VAR: expand.Variable(["another-model"])}
    )
    assert store.query(expand.clickhouse(_panel("Slowest turns").text, other)) == []


# ------------------------------------------------------------------ Grafana's substitutions


def test_conditional_all_and_singlequote() -> None:
    sql = "WHERE $__conditionalAll(m IN (${model:singlequote}), $model) AND c = ${conversation:singlequote}"
    ctx = contexts("it's")[0]
    assert expand.clickhouse(sql, ctx) == "WHERE 1=1 AND c = 'it\\'s'"
    chosen = dataclasses.replace(ctx, variables={**ctx.variables, "model": expand.Variable(["a", "b"])})
    assert expand.clickhouse(sql, chosen) == "WHERE m IN ('a','b') AND c = 'it\\'s'"


def test_clickhouse_macros_match_the_plugin() -> None:
    start = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    ctx = expand.Context(start=start, end=start + timedelta(hours=1), interval_s=30)
    s, e = int(start.timestamp()), int(start.timestamp()) + 3600
    assert expand.clickhouse_macros("$__timeFilter(Timestamp)", ctx) == (
        f"Timestamp >= toDateTime({s}) AND Timestamp <= toDateTime({e})"
    )
    assert (
        expand.clickhouse_macros("$__fromTime - INTERVAL 1 DAY", ctx) == f"toDateTime({s}) - INTERVAL 1 DAY"
    )
    assert expand.clickhouse_macros("$__timeInterval(Timestamp)", ctx) == (
        "toStartOfInterval(toDateTime(Timestamp), INTERVAL 30 second)"
    )
    assert expand.clickhouse_macros("$__timeFilter_ms(t)", ctx) == (
        f"t >= fromUnixTimestamp64Milli({s * 1000}) AND t <= fromUnixTimestamp64Milli({e * 1000})"
    )
    assert (
        expand.clickhouse_macros("$__dateFilter(d)", ctx)
        == "d >= toDate('2026-01-02') AND d <= toDate('2026-01-02')"
    )


def test_rate_interval_follows_grafana() -> None:
    ctx = expand.Context(start=NOW - timedelta(hours=1), end=NOW, interval_s=2, scrape_interval_s=15)
    assert expand.promql("rate(x[$__rate_interval]) $__range", ctx) == "rate(x[60s]) 3600s"
    ctx = expand.Context(start=NOW - timedelta(hours=1), end=NOW, interval_s=30, scrape_interval_s=1)
    assert expand.promql("rate(x[$__rate_interval])", ctx) == "rate(x[31s])"


def test_task_time_is_the_conversations_first_arrival_to_last_end(store: ChdbStore) -> None:
    """The Conversation dashboard's task time against the turn spans the store was filled with."""
    turns = [
        s
        for s in realistic_spans()
        if s.scope_name == names.SCOPE_SIDECAR
        and s.attributes.get(names.GEN_AI_CONVERSATION_ID) == "conv-lapse"
    ]
    expected = (max(s.end_ns for s in turns) - min(s.start_ns for s in turns)) / 1e9
    ctx = contexts("conv-lapse")[1]
    (row,) = store.query(expand.clickhouse(_panel("Task time").text, ctx))
    assert len(turns) >= 2 and abs(row["task_s"] - expected) < 1e-6
    (count,) = store.query(expand.clickhouse(_panel("Turn count").text, ctx))
    assert count["turns"] == len(turns)


BOARD_JSON = {board["uid"]: board for board in (build.to_json(spec.build()) for spec in build.DASHBOARDS)}


def test_table_columns_carry_their_units(store: ChdbStore) -> None:
    """Every seconds column (``*_s``) of a table is shown in ``s``, every bytes column in
    ``bytes``: the columns are the ones the SQL really returns on chDB."""
    ctx = contexts("conv-lapse")[0]
    checked = 0
    for query in inventory.of_kind(QUERIES, "sql"):
        if query.panel_id is None:
            continue
        panel = next(p for p in BOARD_JSON[query.dashboard]["panels"] if p.get("id") == query.panel_id)
        if panel["type"] != "table":
            continue
        rows = store.query(expand.clickhouse(query.text, ctx))
        units = {
            o["matcher"]["options"]: prop["value"]
            for o in panel["fieldConfig"]["overrides"]
            for prop in o["properties"]
            if prop["id"] == "unit"
        }
        for column in rows[0] if rows else {}:
            if column.endswith("_s"):
                assert units.get(column) == "s", (str(query), column)
                checked += 1
            elif column == "bytes" or column.endswith("_bytes"):
                assert units.get(column) == "bytes", (str(query), column)
                checked += 1
    assert checked >= 10
