"""The span predicates in Python and in SQL give the same answers on the same spans.

The SQL side runs in a real chDB store (``otel_traces`` as the collector's exporter creates
it), so attribute values are read back as strings there and natively here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from otelkv import names
from otelkv.spans import SpanRecord, kinds
from otelkv.spans import sql as span_sql
from otelkv.store.chdb_store import ChdbStore

N = names
NOW = time.time_ns()  # the store's TTL drops old rows


def _span(i: int, name: str, scope: str = N.SCOPE_FLEET, **attrs: object) -> SpanRecord:
    return SpanRecord(
        trace_id=f"{i:032x}",
        span_id=f"{i:016x}",
        parent_span_id="",
        name=name,
        kind="Internal",
        start_ns=NOW + i,
        end_ns=NOW + i + 1000,
        attributes=dict(attrs),
        resource={"service.name": "x"},
        scope_name=scope,
    )


OP = N.GEN_AI_OPERATION_NAME
SPANS = [
    _span(1, "chat m", N.SCOPE_SIDECAR, **{OP: N.OPERATION_CHAT, N.TURN_INDEX: 0}),
    _span(2, "chat m", N.SCOPE_SIDECAR, **{OP: N.OPERATION_TEXT_COMPLETION}),  # no identity: still a turn
    _span(3, "chat m", N.SCOPE_FLEET, **{OP: N.OPERATION_CHAT, N.TURN_INDEX: 2}),  # an agent's turn
    _span(4, "chat m", N.SCOPE_FLEET, **{OP: N.OPERATION_CHAT}),  # an agent's span without index
    _span(5, "chat m", N.SCOPE_SIDECAR, **{OP: N.OPERATION_EXECUTE_TOOL}),
    _span(6, "run grep", **{OP: N.OPERATION_EXECUTE_TOOL}),
    _span(7, "execute_tool grep"),
    _span(8, N.engine_request_span_name(N.ROLE_PREFILL), N.SCOPE_ENGINE, **{N.ROLE: N.ROLE_PREFILL}),
    _span(9, N.engine_request_span_name(N.ROLE_DECODE), N.SCOPE_ENGINE, **{N.ROLE: N.ROLE_DECODE}),
    _span(10, N.engine_request_span_name(N.ROLE_PREFILL), N.SCOPE_ENGINE),  # no role attribute
    _span(11, N.transfer_span_name(N.DIRECTION_D_TO_P), N.SCOPE_ENGINE),
    _span(12, "load", N.SCOPE_ENGINE, **{N.TRANSFER_DIRECTION: N.DIRECTION_LOAD}),
    _span(13, N.retention_span_name(N.RETENTION_DECODE_TTL), N.SCOPE_ENGINE),
    _span(14, "held", N.SCOPE_ENGINE, **{N.RETENTION_KIND: N.RETENTION_PREFILL_LEASE}),
    _span(15, "router chat", **{N.ROUTER_HANDLE: N.ROUTER_HANDLE_HIT}),
    _span(16, N.SPAN_ROUTER_LEG.format(role=N.ROLE_PREFILL)),
    _span(17, "kv_requests_are_not_this"),
    _span(18, "execute_tool"),  # a tool without a name
    _span(19, "execute_toolbox"),
    _span(21, "kvXrequest prefill", N.SCOPE_ENGINE, **{N.ROLE: N.ROLE_PREFILL}),  # "_" is no wildcard
    _span(22, "text_completion m", N.SCOPE_SIDECAR, **{OP: N.OPERATION_TEXT_COMPLETION}),  # not a turn name
]

PAIRS: list[tuple[str, Callable[[SpanRecord], bool], str]] = [
    ("turn", kinds.is_turn_span, span_sql.TURN_SPANS),
    ("sidecar turn", kinds.is_sidecar_turn_span, span_sql.SIDECAR_TURN_SPANS),
    ("agent turn", kinds.is_agent_turn_span, span_sql.AGENT_TURN_SPANS),
    ("tool", kinds.is_tool_span, span_sql.TOOL_SPANS),
    ("engine request", kinds.is_engine_request, span_sql.ENGINE_REQUEST_SPANS),
    ("prefill request", kinds.is_prefill_request, span_sql.PREFILL_SPANS),
    ("transfer", kinds.is_transfer, span_sql.TRANSFER_SPANS),
    ("retention", kinds.is_retention, span_sql.RETENTION_SPANS),
]

EXPECTED = {
    "turn": {1, 2, 3},
    "sidecar turn": {1, 2},
    "agent turn": {3},
    "tool": {5, 6, 7, 18},
    "engine request": {8, 9},
    "prefill request": {8},
    "transfer": {11, 12},
    "retention": {13, 14},
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbStore]:
    s = ChdbStore(Path(tmp_path_factory.mktemp("kinds")) / "traces")
    s.insert_spans(SPANS)
    yield s
    s.close()


@pytest.mark.parametrize(("kind", "predicate", "where"), PAIRS, ids=[p[0] for p in PAIRS])
def test_python_and_sql_agree_with_what_each_span_is(
    store: ChdbStore, kind: str, predicate: Callable[[SpanRecord], bool], where: str
) -> None:
    in_python = {int(s.span_id, 16) for s in SPANS if predicate(s)}
    rows = store.query(f"SELECT SpanId FROM otel.otel_traces WHERE {where}")
    in_sql = {int(r["SpanId"], 16) for r in rows}
    assert in_python == EXPECTED[kind]
    assert in_sql == EXPECTED[kind]


def test_router_span_and_its_legs_stay_apart() -> None:
    by_id = {int(s.span_id, 16): s for s in SPANS}
    assert kinds.is_router_span(by_id[15])
    assert not kinds.is_router_span(by_id[16])
    assert kinds.is_router_span(_span(20, N.SPAN_ROUTER_TURN.format(operation=N.OPERATION_CHAT)))
