"""The diagnosis catalogue and the turn model, on hand-built spans (native and stored-string attributes)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest

from otelkv import names
from otelkv.analysis.diagnose import Context, diagnose, suggest_ttl
from otelkv.analysis.linker import load_turns
from otelkv.analysis.model import SOURCE_AGENT, SOURCE_ENGINE, SOURCE_SIDECAR, Turn, build_turn
from otelkv.analysis.sources import InMemorySource
from otelkv.analysis.turn_json import diagnosis_object, turn_object
from otelkv.spans import SpanRecord, attr_map

S = 1_000_000_000
T0 = 1_700_000_000 * S
_ids = itertools.count(1)


def _sid() -> str:
    return f"{next(_ids):016x}"


def trace_id(conv: str, index: int) -> str:
    return f"{abs(hash((conv, index))) % (1 << 120):032x}"


def engine_resource(role: str, **config: Any) -> dict[str, Any]:
    res = {
        "service.name": f"vllm-{role}",
        names.ENGINE_ID: f"{role}-0",
        names.KV_RECOMPUTE_THRESHOLD: 64,
        names.DECODER_KV_BLOCKS_TTL: 12.0,
        names.BIDIRECTIONAL_KV_XFER: True,
        names.KV_LOAD_FAILURE_POLICY: "fail",
    }
    res.update(config)
    return res


def turn_trace(
    conv: str = "conv-1",
    index: int = 1,
    *,
    start_s: float = 100.0,
    request_s: float = 1.0,
    gap_s: float = 2.0,
    tool_wait_s: float | None = None,
    stream: bool = True,
    ttft_s: float = 0.4,
    prev_trace: str = "",
    turn: dict[str, Any] | None = None,
    router: dict[str, Any] | None = None,
    prefill: dict[str, Any] | None = None,
    prefill_transfer: dict[str, Any] | None = None,
    prefill_transfer_s: float = 0.02,
    prefill_span: tuple[float, float] = (0.05, 0.3),
    prefill_resource: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
    decode_transfer: dict[str, Any] | None = None,
    decode_transfer_s: float = 0.02,
    decode_resource: dict[str, Any] | None = None,
    retention: dict[str, Any] | None = None,
    engines: bool = True,
    turn_scope: str = names.SCOPE_SIDECAR,
    status: str = "Unset",
) -> list[SpanRecord]:
    """One turn's trace: sidecar turn span, router span, prefill and decode kv_request spans."""
    tid = trace_id(conv, index)
    start = T0 + int(start_s * S)
    end = start + int(request_s * S)
    first = index == 0
    tool_wait = (0.0 if first else gap_s) if tool_wait_s is None else tool_wait_s
    attrs: dict[str, Any] = {
        names.GEN_AI_OPERATION_NAME: "chat",
        names.GEN_AI_REQUEST_MODEL: "tiny",
        names.GEN_AI_CONVERSATION_ID: conv,
        names.CONVERSATION_ID_SOURCE: "header_conversation_id",
        names.CONVERSATION_INFERRED: False,
        names.TURN_INDEX: index,
        names.TURN_STREAM: stream,
        names.TURN_LAST_TOKEN_SECONDS: request_s,
        names.GEN_AI_USAGE_INPUT_TOKENS: 300,
        names.GEN_AI_USAGE_OUTPUT_TOKENS: 40,
        names.TURN_RESPONSE_KV_PARAMS: False,
        names.TURN_ASKED_TOOLS: True,
        names.TURN_TOOL_RESULTS: 0 if first else 1,
        names.TURN_PREVIOUS_TRACE_ID: prev_trace,
        names.TURN_GAP_SECONDS: 0.0 if first else gap_s,
        names.TURN_GAP_SOURCE: names.GAP_SOURCE_NONE if first else names.GAP_SOURCE_MESSAGES,
        names.TURN_TOOL_WAIT_SECONDS: tool_wait,
        names.TURN_APP_WORK_SECONDS: (0.0 if first else gap_s) - tool_wait,
        names.TURN_INPUT_PROCESSING_SECONDS: ttft_s if stream else request_s,
        names.TURN_GENERATION_SECONDS: request_s - ttft_s if stream else 0.0,
        names.TURN_TOTAL_SECONDS: request_s + (0.0 if first else gap_s),
        names.TURN_TTFT_SOURCE: names.TTFT_SOURCE_STREAM if stream else names.TTFT_SOURCE_RESPONSE,
        names.HTTP_STATUS: 200,
    }
    if stream:
        attrs[names.TURN_TTFT_SECONDS] = ttft_s
    attrs.update(turn or {})
    root = SpanRecord(
        tid,
        _sid(),
        "",
        "chat tiny",
        "Server",
        start,
        end,
        attrs,
        {"service.name": "otelkv-sidecar"},
        scope_name=turn_scope,
        status_code=status,
    )
    spans = [root]
    if router is not None or engines:
        r_attrs = {
            names.ROUTER_HANDLE: names.ROUTER_HANDLE_HIT,
            names.ROUTER_HANDLE_AGE_SECONDS: gap_s,
            names.ROUTER_DECODE_STREAMED: False,
            names.HTTP_STATUS: 200,
        }
        r_attrs.update(router or {})
        spans.append(
            SpanRecord(
                tid,
                _sid(),
                root.span_id,
                "router chat",
                "Server",
                start + S // 100,
                end - S // 100,
                r_attrs,
                {"service.name": "router"},
                scope_name=names.SCOPE_FLEET,
            )
        )
    if not engines:
        return spans
    router_span = spans[-1]
    p_attrs: dict[str, Any] = {
        names.ROLE: names.ROLE_PREFILL,
        names.REQUEST_ID: f"req-{conv}-{index}-p",
        names.REQUEST_OUTCOME: names.OUTCOME_FINISHED,
        names.GEN_AI_USAGE_INPUT_TOKENS: 300,
        names.TOKENS_LOCAL_CACHE_HIT: 0,
        names.TOKENS_PULLED: 0,
        names.TOKENS_COMPUTED: 300,
        names.PULL_DECISION: names.DECISION_RECOMPUTE,
        names.PULL_REASON: names.REASON_NO_DECODE_HANDLE if first else names.REASON_PULLED,
        names.KV_RECOMPUTE_THRESHOLD: 64,
        names.TOKENS_REMOTE_REUSABLE: 0,
    }
    p_attrs.update(prefill or {})
    p_start, p_end = start + int(prefill_span[0] * S), start + int(prefill_span[1] * S)
    p_span = SpanRecord(
        tid,
        _sid(),
        router_span.span_id,
        "kv_request prefill",
        "Internal",
        p_start,
        p_end,
        p_attrs,
        engine_resource("prefill", **(prefill_resource or {})),
        scope_name=names.SCOPE_ENGINE,
        status_code="Error" if p_attrs[names.REQUEST_OUTCOME] != names.OUTCOME_FINISHED else "Unset",
    )
    spans.append(p_span)
    if prefill_transfer is not None:
        t_attrs = {
            names.TRANSFER_DIRECTION: names.DIRECTION_D_TO_P,
            names.TRANSFER_OUTCOME: names.TRANSFER_OK,
            names.TRANSFER_BYTES: 1 << 20,
            names.TRANSFER_XFER_SECONDS: 0.01,
            names.TRANSFER_WAIT_SECONDS: 0.02,
            names.TRANSFER_BACKEND: "UCX",
            names.TRANSFER_TOKENS: 256,
        }
        t_attrs.update(prefill_transfer)
        spans.append(
            SpanRecord(
                tid,
                _sid(),
                p_span.span_id,
                "kv_transfer D->P",
                "Internal",
                p_start,
                p_start + int(prefill_transfer_s * S),
                t_attrs,
                p_span.resource,
                scope_name=names.SCOPE_ENGINE,
            )
        )
    d_attrs: dict[str, Any] = {
        names.ROLE: names.ROLE_DECODE,
        names.REQUEST_ID: f"req-{conv}-{index}-d",
        names.REQUEST_OUTCOME: names.OUTCOME_FINISHED,
        names.GEN_AI_USAGE_INPUT_TOKENS: 300,
        names.GEN_AI_USAGE_OUTPUT_TOKENS: 40,
        names.KV_PARAMS_RETURNED: True,
    }
    d_attrs.update(decode or {})
    d_span = SpanRecord(
        tid,
        _sid(),
        router_span.span_id,
        "kv_request decode",
        "Internal",
        p_end,
        end - S // 50,
        d_attrs,
        engine_resource("decode", **(decode_resource or {})),
        scope_name=names.SCOPE_ENGINE,
    )
    spans.append(d_span)
    dt = {
        names.TRANSFER_DIRECTION: names.DIRECTION_P_TO_D,
        names.TRANSFER_OUTCOME: names.TRANSFER_OK,
        names.TRANSFER_BYTES: 2 << 20,
        names.TRANSFER_XFER_SECONDS: 0.01,
        names.TRANSFER_WAIT_SECONDS: 0.02,
        names.TRANSFER_BACKEND: "UCX",
    }
    dt.update(decode_transfer or {})
    spans.append(
        SpanRecord(
            tid,
            _sid(),
            d_span.span_id,
            "kv_transfer P->D",
            "Internal",
            p_end,
            p_end + int(decode_transfer_s * S),
            dt,
            d_span.resource,
            scope_name=names.SCOPE_ENGINE,
        )
    )
    if retention is not None:
        ret = {
            names.RETENTION_KIND: names.RETENTION_DECODE_TTL,
            names.RETENTION_BLOCKS: 10,
            names.RETENTION_BYTES: 10 << 16,
            names.RETENTION_TTL_SECONDS: 12.0,
            names.RETENTION_OUTCOME: names.RETENTION_CONSUMED,
            names.RETENTION_HELD_SECONDS: gap_s,
        }
        ret.update(retention)
        spans.append(
            SpanRecord(
                tid,
                _sid(),
                d_span.span_id,
                "kv_retention decode_ttl",
                "Internal",
                end,
                end + int(float(ret[names.RETENTION_HELD_SECONDS]) * S),
                ret,
                d_span.resource,
                scope_name=names.SCOPE_ENGINE,
            )
        )
    return spans


def stored(spans: list[SpanRecord]) -> list[SpanRecord]:
    """The spans as the store returns them: every attribute value a string."""
    return [replace(s, attributes=attr_map(s.attributes), resource=attr_map(s.resource)) for s in spans]


def pair(prev_kw: dict[str, Any] | None = None, **kw: Any) -> tuple[list[SpanRecord], list[SpanRecord]]:
    """(turn 0 trace, turn 1 trace) of one conversation, turn 1 after turn 0's end plus the gap."""
    conv = kw.pop("conv", "conv-1")
    prev = turn_trace(conv, 0, start_s=100.0, **(prev_kw or {}))
    gap = kw.get("gap_s", 2.0)
    cur = turn_trace(conv, 1, start_s=101.0 + gap, prev_trace=prev[0].trace_id, **kw)
    return prev, cur


def linked(prev: list[SpanRecord], cur: list[SpanRecord], tools: list[SpanRecord] | None = None) -> Turn:
    p = build_turn(prev)
    turn = build_turn(cur, previous=p, tool_spans=tools or [])
    assert turn is not None
    return turn


def built(spans: list[SpanRecord]) -> Turn:
    """The turn the spans make; a test whose spans make none fails here instead of checking an
    empty stand-in."""
    turn = build_turn(spans)
    assert turn is not None
    return turn


def ids(turn: Turn, ctx: Context | None = None) -> list[str]:
    return [d.id for d in diagnose(turn, ctx)]


FORMS = pytest.mark.parametrize("form", [lambda s: s, stored], ids=["native", "stored"])


# ------------------------------------------------------------------ model


@FORMS
def test_turn_model_reads_every_leg(form: Any) -> None:
    prev, cur = pair(
        prev_kw={"retention": {names.RETENTION_OUTCOME: names.RETENTION_CONSUMED}},
        prefill={
            names.PULL_DECISION: names.DECISION_PULL,
            names.TOKENS_PULLED: 256,
            names.TOKENS_COMPUTED: 44,
            names.TOKENS_REMOTE_REUSABLE: 256,
        },
        prefill_transfer={},
    )
    turn = linked(form(prev), form(cur))
    assert turn.source == SOURCE_SIDECAR
    assert (turn.conversation_id, turn.index, turn.stream) == ("conv-1", 1, True)
    assert turn.previous is not None and turn.previous.decode is not None
    assert turn.previous.decode.retention is not None
    assert turn.previous.decode.retention.outcome == names.RETENTION_CONSUMED
    p = turn.prefill
    assert p is not None and (p.pulled, p.computed, p.remote_reusable, p.threshold) == (256, 44, 256, 64)
    assert p.transfer is not None and p.transfer.bytes == 1 << 20 and p.transfer.xfer_s == pytest.approx(0.01)
    assert p.config.bidirectional is True and p.config.decoder_ttl_s == 12.0
    assert turn.decode is not None and turn.decode.kv_params_returned is True
    assert turn.router is not None and turn.router.handle == names.ROUTER_HANDLE_HIT
    assert turn.total_s == pytest.approx(3.0)
    assert turn.phases is not None and turn.phases.input_processing_s == pytest.approx(0.4)
    assert turn.phases.tool_wait_s == pytest.approx(2.0)
    assert turn.decoder_ttl_s() == 12.0
    assert ids(turn) == [names.DIAG_TOOL_WAIT_DOMINATES]  # nothing wrong in the fleet
    assert turn_object(turn)["prefill"]["tokens"]["pulled"] == 256


@FORMS
def test_agent_tool_spans_override_message_split(form: Any) -> None:
    prev, cur = pair(gap_s=10.0)
    gap_start = T0 + 101 * S
    tool = SpanRecord(
        "f" * 32,
        _sid(),
        "",
        "execute_tool search",
        "Internal",
        gap_start + 1 * S,
        gap_start + 5 * S,
        {
            names.GEN_AI_OPERATION_NAME: "execute_tool",
            names.GEN_AI_TOOL_NAME: "search",
            names.GEN_AI_CONVERSATION_ID: "conv-1",
        },
        {},
    )
    other = replace(
        tool, span_id=_sid(), attributes={**tool.attributes, names.GEN_AI_CONVERSATION_ID: "other"}
    )
    turn = linked(form(prev), form(cur), form([tool, other]))
    assert turn.phases is not None
    assert turn.phases.gap_source == names.GAP_SOURCE_AGENT_SPANS
    assert turn.phases.tool_wait_s == pytest.approx(4.0)
    assert turn.phases.app_work_s == pytest.approx(6.0)
    assert turn.phases.total_s == pytest.approx(11.0)
    # Without tool spans the sidecar's message-based split stands.
    plain = linked(form(prev), form(cur))
    assert plain.phases is not None and plain.phases.gap_source == names.GAP_SOURCE_MESSAGES
    assert plain.phases.tool_wait_s == pytest.approx(10.0)


@FORMS
def test_non_streaming_first_token_bounded_by_prefill_span(form: Any) -> None:
    # The decode node's first token follows its read of the prefill KV (ends 0.72 s in).
    cur = turn_trace(index=0, stream=False, request_s=2.0, prefill_span=(0.1, 0.7))
    turn = build_turn(form(cur))
    assert turn is not None and turn.phases is not None
    assert turn.phases.ttft_source == names.TTFT_SOURCE_ENGINE
    assert turn.phases.input_processing_s == pytest.approx(0.72)
    assert turn.phases.generation_s == pytest.approx(1.28)
    assert turn.ttft_s == pytest.approx(0.72)
    # A hand-off that waited (the read of an idle prefill node) is input processing too.
    slow = turn_trace(index=0, stream=False, request_s=31.0, prefill_span=(0.1, 0.3), decode_transfer_s=30.0)
    slow_turn = build_turn(form(slow))
    assert slow_turn is not None and slow_turn.phases is not None
    assert slow_turn.phases.input_processing_s == pytest.approx(30.3)
    assert slow_turn.phases.generation_s == pytest.approx(0.7)
    no_engines = build_turn(form(turn_trace(index=0, stream=False, request_s=2.0, engines=False)))
    assert no_engines is not None and no_engines.phases is not None
    assert no_engines.phases.ttft_source == names.TTFT_SOURCE_RESPONSE
    assert no_engines.phases.input_processing_s == pytest.approx(2.0)


def test_fallbacks_agent_span_and_engine_only() -> None:
    agent = turn_trace(index=0, turn_scope=names.SCOPE_FLEET)
    turn = build_turn(agent)
    assert turn is not None and turn.source == SOURCE_AGENT and turn.index == 0
    engine_only = [s for s in turn_trace(index=2) if s.name.startswith("kv_") or s.name.startswith("router")]
    turn = build_turn(engine_only)
    assert turn is not None and turn.source == SOURCE_ENGINE and turn.index is None
    assert turn.prefill is not None and turn.decode is not None
    assert build_turn([]) is None
    assert build_turn([SpanRecord("a" * 32, "1", "", "other", "Internal", 0, 1, {}, {})]) is None


def test_the_linker_links_by_previous_trace_id() -> None:
    prev, cur = pair(retention={names.RETENTION_OUTCOME: names.RETENTION_EXPIRED})
    source = InMemorySource(prev + cur)
    turns = load_turns(source, source.turn_spans(limit=None, slowest_first=False))
    assert [t.index for t in turns] == [0, 1]
    assert turns[1].previous is not None and turns[1].previous.trace_id == turns[0].trace_id


# ------------------------------------------------------------------ diagnoses


@FORMS
def test_ttl_lapsed(form: Any) -> None:
    prev, cur = pair(
        gap_s=20.0,
        prev_kw={
            "retention": {
                names.RETENTION_OUTCOME: names.RETENTION_EXPIRED,
                names.RETENTION_HELD_SECONDS: 12.0,
            }
        },
        prefill={names.PULL_REASON: names.REASON_NO_DECODE_HANDLE},
        router={names.ROUTER_HANDLE: names.ROUTER_HANDLE_STALE},
    )
    turn = linked(form(prev), form(cur))
    found = {d.id: d for d in diagnose(turn, Context(per_token_s=0.001))}
    d = found[names.DIAG_TTL_LAPSED]
    assert d.evidence["gap_s"] == 20.0 and d.evidence["decoder_kv_blocks_ttl_s"] == 12.0
    assert d.evidence["over_by_s"] == 8.0 and d.evidence["previous_retention_outcome"] == "expired"
    assert "20.0s gap" in d.summary and "12s" in d.summary
    assert "decoder_kv_blocks_ttl" in d.fix and "35s" in d.fix  # covers the gap plus the 5 s read margin
    assert d.cost_s == pytest.approx(0.3)
    assert names.DIAG_ROUTER_HANDLE_EXPIRED not in found  # the KV really was gone
    # Declined-expired read alone also says so.
    _, cur2 = pair(prefill={names.PULL_REASON: names.REASON_DECLINED_EXPIRED})
    assert names.DIAG_TTL_LAPSED in ids(built(form(cur2)))
    # A declined read 2 s into a 12 s TTL with no wait to time (no kv_transfer span): neither
    # "exceeded" nor "within the read margin"; no negative overrun.
    ttl12 = {
        f"{role}_resource": engine_resource(role, **{names.DECODER_KV_BLOCKS_TTL: 12.0})
        for role in (names.ROLE_PREFILL, names.ROLE_DECODE)
    }
    _, cur3 = pair(gap_s=2.0, prefill={names.PULL_REASON: names.REASON_DECLINED_EXPIRED}, **ttl12)
    d3 = {x.id: x for x in diagnose(built(form(cur3)))}[names.DIAG_TTL_LAPSED]
    assert "no longer readable after the 2.0s gap" in d3.summary, d3.summary
    assert "exceeded" not in d3.summary and "margin" not in d3.summary
    assert d3.evidence["over_by_s"] is None


@FORMS
def test_ttl_not_lapsed_when_consumed(form: Any) -> None:
    prev, cur = pair(prev_kw={"retention": {names.RETENTION_OUTCOME: names.RETENTION_CONSUMED}})
    assert names.DIAG_TTL_LAPSED not in ids(linked(form(prev), form(cur)))
    first = build_turn(form(turn_trace(index=0, prefill={names.PULL_REASON: names.REASON_DECLINED_EXPIRED})))
    assert first is not None and names.DIAG_TTL_LAPSED not in ids(first)


@FORMS
def test_router_dropped_handle(form: Any) -> None:
    prev, cur = pair(
        gap_s=5.0,
        prev_kw={"retention": {names.RETENTION_OUTCOME: names.RETENTION_CONSUMED}},
        router={names.ROUTER_HANDLE: names.ROUTER_HANDLE_STALE, names.ROUTER_HANDLE_AGE_SECONDS: 5.0},
        prefill={names.PULL_REASON: names.REASON_NO_DECODE_HANDLE},
    )
    found = {d.id: d for d in diagnose(linked(form(prev), form(cur)))}
    assert found[names.DIAG_ROUTER_HANDLE_EXPIRED].evidence["handle_age_s"] == 5.0
    assert names.DIAG_TTL_LAPSED not in found
    _, hit = pair()
    assert names.DIAG_ROUTER_HANDLE_EXPIRED not in ids(built(form(hit)))


@FORMS
def test_below_threshold(form: Any) -> None:
    _, cur = pair(
        prefill={
            names.PULL_REASON: names.REASON_BELOW_THRESHOLD,
            names.TOKENS_REMOTE_REUSABLE: 40,
            names.TOKENS_COMPUTED: 40,
            names.TOKENS_LOCAL_CACHE_HIT: 260,
        }
    )
    turn = build_turn(form(cur))
    assert turn is not None
    d = next(d for d in diagnose(turn) if d.id == names.DIAG_BELOW_THRESHOLD)
    assert d.evidence["remote_reusable_tokens"] == 40 and d.evidence["kv_recompute_threshold"] == 64
    assert "40" in d.summary and "64" in d.summary
    _, pulled = pair()
    assert names.DIAG_BELOW_THRESHOLD not in ids(built(form(pulled)))


@FORMS
def test_no_conversation_id(form: Any) -> None:
    _, cur = pair(turn={names.CONVERSATION_INFERRED: True, names.CONVERSATION_ID_SOURCE: "fingerprint"})
    turn = build_turn(form(cur))
    assert turn is not None and turn.conversation_inferred is True
    d = next(d for d in diagnose(turn) if d.id == names.DIAG_NO_CONVERSATION_ID)
    assert "X-Conversation-Id" in d.fix and d.evidence["conversation_id_source"] == "fingerprint"
    _, routed = pair(router={names.ROUTER_HANDLE: names.ROUTER_HANDLE_NO_CONVERSATION})
    assert names.DIAG_NO_CONVERSATION_ID in ids(built(form(routed)))
    _, ok = pair()
    assert names.DIAG_NO_CONVERSATION_ID not in ids(built(form(ok)))


@FORMS
def test_decode_returned_no_handle(form: Any) -> None:
    prev, cur = pair(
        prev_kw={"decode": {names.KV_PARAMS_RETURNED: False}, "router": {names.ROUTER_DECODE_STREAMED: True}},
        prefill={names.PULL_REASON: names.REASON_NO_DECODE_HANDLE},
        router={names.ROUTER_HANDLE: names.ROUTER_HANDLE_MISS},
    )
    found = {d.id: d for d in diagnose(linked(form(prev), form(cur)))}
    d = found[names.DIAG_DECODE_NO_HANDLE]
    assert d.evidence["previous_kv_params_returned"] is False and d.evidence["decode_streamed"] is True
    # Previous decode did return a handle: something else lost it.
    prev2, cur2 = pair(prefill={names.PULL_REASON: names.REASON_NO_DECODE_HANDLE})
    assert names.DIAG_DECODE_NO_HANDLE not in ids(linked(form(prev2), form(cur2)))


@FORMS
@pytest.mark.parametrize("where", [names.CONTINUITY_IN_HISTORY, names.CONTINUITY_IN_ANSWER])
def test_kv_reused_for_different_tokens(form: Any, where: str) -> None:
    pulled = {
        names.PULL_DECISION: names.DECISION_PULL,
        names.TOKENS_LOCAL_CACHE_HIT: 32,
        names.TOKENS_PULLED: 112,
        names.TOKENS_COMPUTED: 156,
        names.CONTINUITY_DIGEST: True,
        names.CONTINUITY_OFFERED: 144,
        names.CONTINUITY_MATCHING: 64,
        names.CONTINUITY_FIRST_MISMATCH: 64,
        names.CONTINUITY_MISMATCH_IN: where,
    }
    prev, cur = pair(prefill=pulled, prefill_transfer={})
    found = {d.id: d for d in diagnose(linked(form(prev), form(cur)))}
    d = found[names.DIAG_KV_FOR_OTHER_TOKENS]
    assert d.evidence["wrong_tokens"] == 32 + 112 - 64 and d.evidence["mismatch_in"] == where
    assert ids(linked(form(prev), form(cur)))[0] == names.DIAG_KV_FOR_OTHER_TOKENS  # a failure: first
    assert ("rewritten" in d.summary) is (where == names.CONTINUITY_IN_HISTORY)
    # Below the threshold vLLM loads nothing: the mismatch is recorded, no KV of other tokens used.
    skipped = {**pulled, names.PULL_DECISION: names.DECISION_RECOMPUTE, names.TOKENS_PULLED: 0}
    _, fine = pair(prefill={**skipped, names.PULL_REASON: names.REASON_BELOW_THRESHOLD})
    assert names.DIAG_KV_FOR_OTHER_TOKENS not in ids(linked(form(prev), form(fine)))


@FORMS
def test_bidirectional_off(form: Any) -> None:
    _, cur = pair(
        prefill={names.PULL_REASON: names.REASON_BIDIRECTIONAL_OFF},
        prefill_resource={names.BIDIRECTIONAL_KV_XFER: False},
    )
    d = next(d for d in diagnose(built(form(cur))) if d.id == names.DIAG_BIDIRECTIONAL_OFF)
    assert d.evidence["prefill_bidirectional_kv_xfer"] is False and "prefill" in d.summary
    _, dec_off = pair(
        prefill={names.PULL_REASON: names.REASON_NO_DECODE_HANDLE},
        decode_resource={names.BIDIRECTIONAL_KV_XFER: False},
    )
    assert names.DIAG_BIDIRECTIONAL_OFF in ids(built(form(dec_off)))
    _, on = pair()
    assert names.DIAG_BIDIRECTIONAL_OFF not in ids(built(form(on)))


@FORMS
def test_pull_slower_than_recompute(form: Any) -> None:
    pulled = {
        names.PULL_DECISION: names.DECISION_PULL,
        names.PULL_REASON: names.REASON_PULLED,
        names.TOKENS_PULLED: 256,
        names.TOKENS_COMPUTED: 44,
    }
    _, cur = pair(prefill=pulled, prefill_transfer={names.TRANSFER_WAIT_SECONDS: 0.5})
    turn = build_turn(form(cur))
    assert turn is not None
    d = next(
        d for d in diagnose(turn, Context(per_token_s=0.001)) if d.id == names.DIAG_PULL_SLOWER_THAN_RECOMPUTE
    )
    assert d.evidence["pull_s"] == 0.5 and d.evidence["recompute_estimate_s"] == pytest.approx(0.256)
    assert d.cost_s == pytest.approx(0.244)
    assert names.DIAG_PULL_SLOWER_THAN_RECOMPUTE not in ids(turn, Context(per_token_s=0.01))
    assert names.DIAG_PULL_SLOWER_THAN_RECOMPUTE not in ids(turn, Context())


@FORMS
def test_expired_read_failed(form: Any) -> None:
    _, cur = pair(
        gap_s=15.0,
        prefill={
            names.REQUEST_OUTCOME: names.OUTCOME_FAILED_KV_LOAD,
            names.PULL_REASON: names.REASON_DECLINED_EXPIRED,
            names.PULL_DECISION: names.DECISION_PULL,
        },
        prefill_transfer={names.TRANSFER_OUTCOME: names.TRANSFER_DECLINED_EXPIRED},
        status="Error",
        turn={names.HTTP_STATUS: 500},
    )
    turn = build_turn(form(cur))
    assert turn is not None and turn.status == "error"
    found = diagnose(turn)
    assert found[0].id == names.DIAG_EXPIRED_READ_FAILED
    assert "handle TTL at least vLLM's 5s read margin below" in found[0].fix
    assert "recompute is no way out" in found[0].fix  # it hangs the request on vLLM 0.32
    assert found[0].evidence["kv_load_failure_policy"] == "fail"
    assert names.DIAG_TTL_LAPSED in [d.id for d in found]
    assert names.DIAG_TRANSFER_FAILED not in [d.id for d in found]


@FORMS
def test_kv_read_started_late(form: Any) -> None:
    # The demo's case: a 1.1 s gap at TTL 15 s, the prefill node's read tried 15.1 s after the
    # request reached it and declined as expired. "The gap exceeded the TTL" would be wrong.
    declined = {
        names.PULL_REASON: names.REASON_DECLINED_EXPIRED,
        names.PULL_DECISION: names.DECISION_PULL,
    }
    late = {names.TRANSFER_OUTCOME: names.TRANSFER_DECLINED_EXPIRED, names.TRANSFER_WAIT_SECONDS: 15.09}
    ttl15 = {
        f"{role}_resource": engine_resource(role, **{names.DECODER_KV_BLOCKS_TTL: 15.0})
        for role in (names.ROLE_PREFILL, names.ROLE_DECODE)
    }
    # The read was declined 15.09 s after the turn arrived: 0.05 s to reach the prefill
    # node's scheduler, 15.04 s there before the read.
    prev, cur = pair(
        gap_s=1.1,
        request_s=16.0,
        prefill_span=(0.05, 15.2),
        prefill_transfer_s=15.04,
        prev_kw={
            "retention": {
                names.RETENTION_OUTCOME: names.RETENTION_EXPIRED,
                names.RETENTION_HELD_SECONDS: 15.0,
            },
            **ttl15,
        },
        prefill={**declined, names.REQUEST_OUTCOME: names.OUTCOME_FAILED_KV_LOAD},
        prefill_transfer=late,
        status="Error",
        turn={names.HTTP_STATUS: 500},
        **ttl15,
    )
    found = {d.id: d for d in diagnose(linked(form(prev), form(cur)))}
    assert names.DIAG_TTL_LAPSED not in found
    d = found[names.DIAG_KV_READ_STARTED_LATE]
    assert d.evidence["wait_before_read_s"] == pytest.approx(15.09) and d.evidence["gap_s"] == 1.1
    assert d.evidence["before_engine_s"] == pytest.approx(0.05)
    assert d.evidence["decoder_kv_blocks_ttl_s"] == 15.0 and d.cost_s == pytest.approx(15.09)
    assert "only tried the read 15.1s later" in d.summary and "the request failed" in d.summary
    failed = found[names.DIAG_EXPIRED_READ_FAILED]
    assert "15.1s after the turn arrived" in failed.summary and "gap was only 1.1s" in failed.summary
    assert failed.evidence["wait_before_read_s"] == pytest.approx(15.09)
    # A declined read whose request did not fail (spans as a recompute would leave them): still
    # named, no failure.
    _, recomputed = pair(gap_s=1.1, prefill=declined, prefill_transfer=late, **ttl15)
    found2 = {d.id: d for d in diagnose(built(form(recomputed)))}
    assert "recomputed" in found2[names.DIAG_KV_READ_STARTED_LATE].summary
    assert names.DIAG_EXPIRED_READ_FAILED not in found2 and names.DIAG_TTL_LAPSED not in found2
    # A gap that does reach the TTL's margin is the gap's fault: ttl_lapsed_during_gap, not this.
    _, gap = pair(gap_s=11.0, prefill=declined, prefill_transfer=late, **ttl15)
    found3 = ids(built(form(gap)))
    assert names.DIAG_TTL_LAPSED in found3 and names.DIAG_KV_READ_STARTED_LATE not in found3


@FORMS
def test_transfer_failed(form: Any) -> None:
    _, cur = pair(
        prefill={
            names.REQUEST_OUTCOME: names.OUTCOME_FAILED_KV_LOAD,
            names.PULL_REASON: names.REASON_TRANSFER_FAILED,
        },
        prefill_transfer={names.TRANSFER_OUTCOME: names.TRANSFER_FAILED},
    )
    found = ids(built(form(cur)))
    assert names.DIAG_TRANSFER_FAILED in found and names.DIAG_EXPIRED_READ_FAILED not in found
    _, ok = pair(prefill_transfer={})
    assert names.DIAG_TRANSFER_FAILED not in ids(built(form(ok)))


@FORMS
def test_forward_transfer_failed_with_the_prefill_node_gone(form: Any) -> None:
    # The prefill engine died after answering: its spans never arrived, decode's read failed.
    spans = turn_trace(
        index=0,
        stream=False,
        decode={names.REQUEST_OUTCOME: names.OUTCOME_FAILED_KV_LOAD},
        decode_transfer={names.TRANSFER_OUTCOME: names.TRANSFER_FAILED},
        status="Error",
    )
    spans = [s for s in spans if s.name != "kv_request prefill"]
    assert names.DIAG_TRANSFER_FAILED in ids(built(form(spans)))


@FORMS
def test_stuck_waiting_for_remote_kv(form: Any) -> None:
    _, cur = pair(
        request_s=40.0,
        ttft_s=39.0,
        decode={
            names.REQUEST_OUTCOME: names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV,
            names.REMOTE_KV_WAIT_SECONDS: 30.0,
        },
        decode_transfer={names.TRANSFER_OUTCOME: names.TRANSFER_STUCK},
    )
    turn = build_turn(form(cur))
    assert turn is not None
    d = diagnose(turn)[0]
    assert d.id == names.DIAG_STUCK_WAITING_FOR_REMOTE_KV and d.evidence["remote_kv_wait_s"] == 30.0
    _, ok = pair()
    assert names.DIAG_STUCK_WAITING_FOR_REMOTE_KV not in ids(built(form(ok)))


@FORMS
def test_slow_kv_handoff(form: Any) -> None:
    # The fleet's case: decode's read of an idle prefill node blocked in posting for 30 s.
    slow = turn_trace(
        index=0,
        stream=False,
        request_s=31.0,
        prefill_span=(0.1, 0.3),
        decode_transfer_s=30.0,
        decode_transfer={
            names.TRANSFER_WAIT_SECONDS: 30.02,
            names.TRANSFER_XFER_SECONDS: 30.021,
            names.TRANSFER_POST_SECONDS: 30.01,
            names.TRANSFER_BYTES: 65536,
        },
    )
    turn = built(form(slow))
    found = diagnose(turn)
    assert found[0].id == names.DIAG_SLOW_KV_HANDOFF, [d.id for d in found]
    d = found[0]
    assert d.cost_s == pytest.approx(30.02)
    assert d.evidence["post_s"] == pytest.approx(30.01) and d.evidence["bytes"] == 65536
    assert "waited 30.02s for 64 KiB" in d.summary and "posting the read alone took 30.01s" in d.summary
    # The wait is explained input processing, so it is not queueing as well.
    assert names.DIAG_QUEUEING not in [x.id for x in found]
    # Under a second, or a small share of a long request: not a diagnosis.
    fast = turn_trace(
        index=0, stream=False, request_s=2.0, decode_transfer={names.TRANSFER_WAIT_SECONDS: 0.9}
    )
    assert names.DIAG_SLOW_KV_HANDOFF not in ids(built(form(fast)))
    small = turn_trace(
        index=0, stream=False, request_s=20.0, decode_transfer={names.TRANSFER_WAIT_SECONDS: 1.5}
    )
    assert names.DIAG_SLOW_KV_HANDOFF not in ids(built(form(small)))


@FORMS
def test_queueing(form: Any) -> None:
    # 3 s to first token, engines account for 0.25 s prefill + 0.02 s hand-off.
    _, cur = pair(request_s=4.0, ttft_s=3.0)
    d = next(d for d in diagnose(built(form(cur))) if d.id == names.DIAG_QUEUEING)
    assert d.evidence["unexplained_s"] == pytest.approx(2.73, abs=0.01)
    _, fast = pair(ttft_s=0.35)
    assert names.DIAG_QUEUEING not in ids(built(form(fast)))


@FORMS
def test_tool_wait_and_app_work_dominate(form: Any) -> None:
    _, tool = pair(gap_s=30.0)
    found = diagnose(built(form(tool)))
    assert found[0].id == names.DIAG_TOOL_WAIT_DOMINATES and found[0].cost_s == pytest.approx(30.0)
    _, app = pair(gap_s=30.0, tool_wait_s=0.0)
    top = diagnose(built(form(app)))[0]
    assert top.id == names.DIAG_APP_WORK_DOMINATES and "30.0s" in top.summary
    _, short = pair(gap_s=0.5)
    assert not {names.DIAG_TOOL_WAIT_DOMINATES, names.DIAG_APP_WORK_DOMINATES} & set(ids(built(form(short))))


def test_ranking_by_cost_and_json() -> None:
    prev, cur = pair(
        gap_s=30.0,
        prev_kw={"retention": {names.RETENTION_OUTCOME: names.RETENTION_EXPIRED}},
        prefill={names.PULL_REASON: names.REASON_NO_DECODE_HANDLE},
    )
    found = diagnose(linked(prev, cur), Context(per_token_s=0.001))
    assert [d.id for d in found] == [names.DIAG_TOOL_WAIT_DOMINATES, names.DIAG_TTL_LAPSED]
    assert [d.cost_s for d in found] == sorted((d.cost_s for d in found), reverse=True)
    assert found[0].id == names.DIAG_TOOL_WAIT_DOMINATES
    as_dict = diagnosis_object(found[1])
    assert set(as_dict) == {"id", "title", "failure", "summary", "evidence", "fix", "cost_s"}


def _without_router(spans: list[SpanRecord]) -> list[SpanRecord]:
    return [s for s in spans if not s.name.startswith("router")]


@pytest.mark.parametrize("stream", [False, True])
def test_no_handle_behind_a_router_without_spans(stream: bool) -> None:
    """A router otelkv did not write: the decode engine handed back a handle, the next prefill
    request carried none. Decode not streamed: the router kept none; streamed: vLLM 0.32 gave
    the router none (the decode request says which, as otelkv.request.streamed)."""
    decode = {names.KV_PARAMS_RETURNED: True, names.REQUEST_STREAMED: stream}
    prefill = {names.PULL_REASON: names.REASON_NO_DECODE_HANDLE, names.PULL_DECISION: "recompute"}
    prev, cur = pair(prev_kw={"stream": stream, "decode": decode}, prefill=prefill)
    turn = linked(_without_router(prev), _without_router(cur))
    found = {d.id: d for d in diagnose(turn, Context(per_token_s=0.001))}
    if stream:
        assert names.DIAG_ROUTER_KEPT_NO_HANDLE not in found
        d = found[names.DIAG_DECODE_NO_HANDLE]
        assert (d.evidence["decode_streamed"], d.evidence["decode_streamed_source"]) == (
            True,
            "decode_request",
        )
    else:
        assert names.DIAG_DECODE_NO_HANDLE not in found
        d = found[names.DIAG_ROUTER_KEPT_NO_HANDLE]
        assert d.evidence["previous_kv_params_returned"] is True and d.evidence["router_span"] is False
        assert d.evidence["tokens_recomputed"] > 0 and d.cost_s > 0
    # With the router's spans the router speaks for itself.
    with_router = {d.id: d for d in diagnose(linked(prev, cur))}
    assert names.DIAG_ROUTER_KEPT_NO_HANDLE not in with_router
    assert names.DIAG_DECODE_NO_HANDLE not in with_router  # its span: a hit, not streamed
    # A client stream alone says nothing about the decode call (routers re-emit streams).
    client_only = {names.KV_PARAMS_RETURNED: True}
    prev_c, cur_c = pair(prev_kw={"stream": True, "decode": client_only}, prefill=prefill)
    found_c = ids(linked(_without_router(prev_c), _without_router(cur_c)))
    assert names.DIAG_DECODE_NO_HANDLE not in found_c and names.DIAG_ROUTER_KEPT_NO_HANDLE not in found_c
    # A decode node that returned nothing, or a turn that pulled, is not the router's doing.
    prev_none, cur_none = pair(
        prev_kw={"decode": {names.KV_PARAMS_RETURNED: False, names.REQUEST_STREAMED: False}}, prefill=prefill
    )
    assert names.DIAG_ROUTER_KEPT_NO_HANDLE not in ids(
        linked(_without_router(prev_none), _without_router(cur_none))
    )
    prev_ok, cur_ok = pair(prev_kw={"decode": decode})
    assert names.DIAG_ROUTER_KEPT_NO_HANDLE not in ids(
        linked(_without_router(prev_ok), _without_router(cur_ok))
    )


def test_a_router_that_dropped_an_expired_handle_is_not_blamed() -> None:
    decode = {names.KV_PARAMS_RETURNED: True, names.REQUEST_STREAMED: False}
    prefill = {names.PULL_REASON: names.REASON_NO_DECODE_HANDLE, names.PULL_DECISION: "recompute"}
    prev, cur = pair(
        gap_s=50.0,
        prev_kw={"decode": decode, "retention": {names.RETENTION_OUTCOME: names.RETENTION_EXPIRED}},
        prefill=prefill,
    )
    found = ids(linked(_without_router(prev), _without_router(cur)), Context(per_token_s=0.001))
    assert names.DIAG_TTL_LAPSED in found and names.DIAG_ROUTER_KEPT_NO_HANDLE not in found


def test_kv_that_expired_after_the_next_turn_arrived_did_not_lapse_in_the_gap() -> None:
    """A handle the router did not keep leaves the decode node's blocks unread: they expire in
    the end, whatever the gap. Looked at after that, the turn must still say the router kept
    no handle, not that the TTL lapsed (the KV was held when the turn arrived)."""
    decode = {names.KV_PARAMS_RETURNED: True, names.REQUEST_STREAMED: False}
    prefill = {names.PULL_REASON: names.REASON_NO_DECODE_HANDLE, names.PULL_DECISION: "recompute"}
    prev, cur = pair(
        gap_s=0.5,
        prev_kw={"decode": decode, "retention": {names.RETENTION_OUTCOME: names.RETENTION_EXPIRED}},
        prefill=prefill,
    )
    found = ids(linked(_without_router(prev), _without_router(cur)), Context(per_token_s=0.001))
    assert names.DIAG_ROUTER_KEPT_NO_HANDLE in found and names.DIAG_TTL_LAPSED not in found


@pytest.mark.parametrize(
    ("ttft_s", "prefill_span", "fires"),
    [
        (0.33, (0.0, 0.05), True),  # 0.26 s unexplained, 79 % of input processing
        (0.31, (0.0, 0.05), False),  # 0.24 s: under QUEUEING_MIN_S (0.25 s) however large its share
        (0.56, (0.05, 0.3), True),  # 0.29 s unexplained, 52 % of input processing
        (0.53, (0.05, 0.3), False),  # 0.26 s: over the minimum, but 49 % (under QUEUEING_MIN_SHARE)
    ],
)
def test_queueing_thresholds(ttft_s: float, prefill_span: tuple[float, float], fires: bool) -> None:
    """Pins the documented thresholds: at least 0.25 s, and at least half of input processing,
    that the engines (prefill span + P->D wait of 0.02 s) do not account for."""
    _, cur = pair(ttft_s=ttft_s, prefill_span=prefill_span)
    assert (names.DIAG_QUEUEING in ids(built(cur))) is fires


@pytest.mark.parametrize(
    ("gap_s", "request_s", "fires"),
    [
        (1.05, 0.2, True),  # over DOMINATES_MIN_S (1 s) and 84 % of the turn
        (0.9, 0.2, False),  # 82 % of the turn, but under a second
        (2.1, 2.0, True),  # 51 % of the turn
        (1.9, 2.0, False),  # 49 %: not more than DOMINATES_SHARE
    ],
)
def test_tool_wait_and_app_work_thresholds(gap_s: float, request_s: float, fires: bool) -> None:
    """Pins the documented thresholds of both: more than half the turn, and at least 1 s."""
    _, tool = pair(gap_s=gap_s, request_s=request_s, ttft_s=0.1)
    assert (names.DIAG_TOOL_WAIT_DOMINATES in ids(built(tool))) is fires
    _, app = pair(gap_s=gap_s, request_s=request_s, ttft_s=0.1, tool_wait_s=0.0)
    assert (names.DIAG_APP_WORK_DOMINATES in ids(built(app))) is fires


def test_bidirectional_off_in_the_config_is_silent_when_the_turn_pulled_or_is_the_first() -> None:
    """A decode engine that says bidirectional off while this turn still pulled (another decode
    engine served the previous turn) is not the cause; nor on a first turn, which has nothing to
    read back."""
    off = {names.BIDIRECTIONAL_KV_XFER: False}
    pulled = {names.PULL_DECISION: names.DECISION_PULL, names.PULL_REASON: names.REASON_PULLED}
    _, cur = pair(prefill=pulled | {names.TOKENS_PULLED: 96}, decode_resource=off)
    assert names.DIAG_BIDIRECTIONAL_OFF not in ids(built(cur))
    first = turn_trace("conv-1", 0, decode_resource=off)
    assert names.DIAG_BIDIRECTIONAL_OFF not in ids(built(first))
    _, recomputed = pair(prefill={names.PULL_REASON: names.REASON_NO_DECODE_HANDLE}, decode_resource=off)
    assert names.DIAG_BIDIRECTIONAL_OFF in ids(built(recomputed))


# ------------------------------------------------------------------ boundaries of the numeric rules


@pytest.mark.parametrize(
    ("wait_s", "request_s", "fires"),
    [
        (0.99, 2.0, False),  # under SLOW_HANDOFF_MIN_S (1 s), though half the request
        (1.0, 2.0, True),  # exactly the minimum
        (1.01, 2.0, True),
        (1.5, 6.1, False),  # over the minimum, but 24.6 % of the request: under SLOW_HANDOFF_SHARE
        (1.5, 6.0, True),  # exactly a quarter of the request
        (1.5, 5.9, True),
    ],
)
def test_slow_handoff_thresholds(wait_s: float, request_s: float, fires: bool) -> None:
    """Pins the documented thresholds: a P->D wait of at least 1 s and at least a quarter of the
    request (arrival to last token)."""
    spans = turn_trace(
        index=0, stream=False, request_s=request_s, decode_transfer={names.TRANSFER_WAIT_SECONDS: wait_s}
    )
    assert (names.DIAG_SLOW_KV_HANDOFF in ids(built(spans))) is fires


@pytest.mark.parametrize(
    ("transfer_outcome", "request_outcome", "slow"),
    [
        (names.TRANSFER_OK, names.OUTCOME_FINISHED, True),
        (names.TRANSFER_FAILED, names.OUTCOME_FAILED_KV_LOAD, False),  # kv_transfer_failed's
        (names.TRANSFER_FAILED, names.OUTCOME_FINISHED, False),
    ],
)
def test_a_failed_handoff_is_not_a_slow_one(transfer_outcome: str, request_outcome: str, slow: bool) -> None:
    """A 30 s P->D wait of a 31 s request qualifies on its numbers; a transfer that failed is
    kv_transfer_failed's, however long it waited."""
    spans = turn_trace(
        index=0,
        stream=False,
        request_s=31.0,
        decode={names.REQUEST_OUTCOME: request_outcome},
        decode_transfer={names.TRANSFER_OUTCOME: transfer_outcome, names.TRANSFER_WAIT_SECONDS: 30.0},
    )
    found = ids(built(spans))
    assert (names.DIAG_SLOW_KV_HANDOFF in found) is slow
    assert (names.DIAG_TRANSFER_FAILED in found) is not slow


def _ttl_resources(ttl_s: float) -> dict[str, dict[str, Any]]:
    """turn_trace keywords: both engines configured with decoder_kv_blocks_ttl=ttl_s."""
    return {
        f"{role}_resource": {names.DECODER_KV_BLOCKS_TTL: ttl_s}
        for role in (names.ROLE_PREFILL, names.ROLE_DECODE)
    }


_DECLINED = {names.PULL_REASON: names.REASON_DECLINED_EXPIRED, names.PULL_DECISION: names.DECISION_PULL}
_LATE_READ = {names.TRANSFER_OUTCOME: names.TRANSFER_DECLINED_EXPIRED, names.TRANSFER_WAIT_SECONDS: 15.09}


@pytest.mark.parametrize(
    ("gap_s", "late"),
    [
        (9.99, True),  # gap + 5 s = 14.99 s, inside the 15 s TTL: the read started late
        (10.0, False),  # gap + READ_EXPIRY_MARGIN_S (5 s) reaches the TTL: the gap's fault
        (10.1, False),
    ],
)
def test_read_expiry_margin(gap_s: float, late: bool) -> None:
    """Pins READ_EXPIRY_MARGIN_S: a read declined as expired is kv_read_started_late while the
    gap plus vLLM's 5 s margin stays under decoder_kv_blocks_ttl, ttl_lapsed_during_gap from
    there on; never both."""
    _, cur = pair(gap_s=gap_s, prefill=_DECLINED, prefill_transfer=_LATE_READ, **_ttl_resources(15.0))
    found = {d.id: d for d in diagnose(built(cur))}
    assert (names.DIAG_KV_READ_STARTED_LATE in found) is late
    assert (names.DIAG_TTL_LAPSED in found) is not late
    if not late:
        # Declined inside the margin, not past the TTL: the summary must not claim the gap
        # exceeded it, and the suggested TTL covers the gap plus the margin.
        lapsed = found[names.DIAG_TTL_LAPSED]
        assert "within vLLM's 5s read margin of decoder_kv_blocks_ttl=15s" in lapsed.summary
        assert "exceeded" not in lapsed.summary and "to about 20s" in lapsed.fix


@pytest.mark.parametrize(
    ("gap_s", "lapsed"),
    [
        (11.9, False),  # the retention ended expired, but after the turn arrived
        (12.0, True),  # the gap reached the retention's 12 s TTL
        (12.1, True),
    ],
)
def test_an_expired_retention_lapsed_in_the_gap_only_from_its_ttl(gap_s: float, lapsed: bool) -> None:
    """Pins _Lapse.expired: an expired retention is a TTL lapse only when the gap reached its
    ttl_s; short of that the router kept no handle (no router span, decode not streamed)."""
    decode = {names.KV_PARAMS_RETURNED: True, names.REQUEST_STREAMED: False}
    prefill = {names.PULL_REASON: names.REASON_NO_DECODE_HANDLE, names.PULL_DECISION: "recompute"}
    retention = {names.RETENTION_OUTCOME: names.RETENTION_EXPIRED, names.RETENTION_TTL_SECONDS: 12.0}
    prev, cur = pair(gap_s=gap_s, prev_kw={"decode": decode, "retention": retention}, prefill=prefill)
    found = ids(linked(_without_router(prev), _without_router(cur)), Context(per_token_s=0.001))
    assert (names.DIAG_TTL_LAPSED in found) is lapsed
    assert (names.DIAG_ROUTER_KEPT_NO_HANDLE in found) is not lapsed


@pytest.mark.parametrize(
    ("gap_s", "dropped"),
    [
        (11.9, True),  # under the decode node's 12 s TTL: the router dropped a live handle
        (12.0, False),  # the gap reached decoder_kv_blocks_ttl: the KV was gone, stale was right
        (12.1, False),
    ],
)
def test_router_dropped_handle_only_under_the_decoder_ttl(gap_s: float, dropped: bool) -> None:
    """Pins _Lapse.over (gap >= decoder_kv_blocks_ttl) as check_router_dropped and
    check_ttl_lapsed read it. The previous decode recorded no retention, so the gap alone decides."""
    prev, cur = pair(
        gap_s=gap_s,
        router={names.ROUTER_HANDLE: names.ROUTER_HANDLE_STALE, names.ROUTER_HANDLE_AGE_SECONDS: gap_s},
        prefill={names.PULL_REASON: names.REASON_NO_DECODE_HANDLE},
    )
    turn = linked(prev, cur)
    assert turn.previous is not None and turn.previous.decode is not None
    assert turn.previous.decode.retention is None and turn.decoder_ttl_s() == 12.0
    found = ids(turn)
    assert (names.DIAG_ROUTER_HANDLE_EXPIRED in found) is dropped
    assert (names.DIAG_TTL_LAPSED in found) is not dropped


@pytest.mark.parametrize(
    ("reason", "fires"),
    [
        (names.REASON_BELOW_THRESHOLD, True),
        (names.REASON_NOTHING_BEYOND_LOCAL_HIT, False),
        (names.REASON_NO_DECODE_HANDLE, False),
        (names.REASON_PULLED, False),
    ],
)
def test_below_threshold_only_for_its_reason(reason: str, fires: bool) -> None:
    """Only a prefill leg whose pull reason is below_threshold; the evidence is the leg's own
    reusable tokens and threshold (the request's 48, not the engine's default 64)."""
    prefill = {
        names.PULL_REASON: reason,
        names.TOKENS_REMOTE_REUSABLE: 32,
        names.TOKENS_COMPUTED: 40,
        names.TOKENS_LOCAL_CACHE_HIT: 260,
        names.KV_RECOMPUTE_THRESHOLD: 48,
    }
    _, cur = pair(prefill=prefill)
    found = {d.id: d for d in diagnose(built(cur), Context(per_token_s=0.001))}
    assert (names.DIAG_BELOW_THRESHOLD in found) is fires
    if fires:
        d = found[names.DIAG_BELOW_THRESHOLD]
        assert d.evidence["remote_reusable_tokens"] == 32 and d.evidence["kv_recompute_threshold"] == 48
        assert d.evidence["tokens_computed"] == 40
        assert "Only 32 reusable tokens" in d.summary and "kv_recompute_threshold=48" in d.summary
        assert d.cost_s == pytest.approx(0.032)


_PER_TOKEN_S = 2.0**-10
"""Seconds per computed token: 256 tokens recompute in exactly 0.25 s (no float rounding)."""
_PULLED_256 = {
    names.PULL_DECISION: names.DECISION_PULL,
    names.PULL_REASON: names.REASON_PULLED,
    names.TOKENS_PULLED: 256,
    names.TOKENS_COMPUTED: 44,
}


@pytest.mark.parametrize(
    ("pull_s", "fires"),
    [
        (0.2499, False),
        (0.25, False),  # exactly the recompute estimate (256 x per_token_s): not slower
        (0.2501, True),
    ],
)
def test_pull_slower_than_recompute_boundary(pull_s: float, fires: bool) -> None:
    """Pins the rule: a pull counts only when it took longer than recomputing the pulled tokens."""
    _, cur = pair(prefill=_PULLED_256, prefill_transfer={names.TRANSFER_WAIT_SECONDS: pull_s})
    found = {d.id: d for d in diagnose(built(cur), Context(per_token_s=_PER_TOKEN_S))}
    assert (names.DIAG_PULL_SLOWER_THAN_RECOMPUTE in found) is fires
    if fires:
        d = found[names.DIAG_PULL_SLOWER_THAN_RECOMPUTE]
        assert d.evidence["recompute_estimate_s"] == 0.25 and d.cost_s == pytest.approx(0.0001)


def test_pull_slower_than_recompute_needs_a_compute_rate_and_a_transfer_that_worked() -> None:
    """The just-slower pull of the boundary test: no diagnosis without a per-token compute
    time, nor when its transfer did not end ok."""
    slow = {names.TRANSFER_WAIT_SECONDS: 0.2501}
    _, cur = pair(prefill=_PULLED_256, prefill_transfer=slow)
    turn = built(cur)
    assert names.DIAG_PULL_SLOWER_THAN_RECOMPUTE in ids(turn, Context(per_token_s=_PER_TOKEN_S))
    assert names.DIAG_PULL_SLOWER_THAN_RECOMPUTE not in ids(turn, Context())
    assert names.DIAG_PULL_SLOWER_THAN_RECOMPUTE not in ids(turn, Context(per_token_s=0.0))
    for outcome in names.TRANSFER_OUTCOMES:
        if outcome == names.TRANSFER_OK:
            continue
        _, bad = pair(prefill=_PULLED_256, prefill_transfer={**slow, names.TRANSFER_OUTCOME: outcome})
        found = ids(built(bad), Context(per_token_s=_PER_TOKEN_S))
        assert names.DIAG_PULL_SLOWER_THAN_RECOMPUTE not in found, outcome


@pytest.mark.parametrize(
    ("gap_s", "ttl_s"),
    [
        (8.0, 10),  # 1.25 x the gap = 10 s: a multiple of 5 s stays
        (8.01, 15),  # 10.01 s: the next 5 s
        (48.0, 60),  # 60 s: the last value of the 5 s steps
        (48.04, 90),  # 60.05 s: 30 s steps from there
        (72.0, 90),
        (72.04, 120),
        (480.0, 600),  # 600 s: the last value of the 30 s steps
        (480.04, 900),  # 600.05 s: 300 s steps from there
        (960.0, 1200),
        (960.04, 1500),
    ],
)
def test_suggest_ttl_steps(gap_s: float, ttl_s: int) -> None:
    """Pins suggest_ttl: 1.25 x the gap, rounded up to 5 s up to 60 s, to 30 s up to 600 s,
    to 300 s beyond."""
    assert suggest_ttl(gap_s) == ttl_s


@pytest.mark.parametrize(
    ("role", "request_outcome", "transfer_outcome", "remote_wait_s", "stuck"),
    [
        (names.ROLE_DECODE, names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV, names.TRANSFER_STUCK, 30.0, True),
        # Either signal alone: a request aborted while its read was stuck, a stuck request whose
        # read was abandoned.
        (names.ROLE_DECODE, names.OUTCOME_ABORTED, names.TRANSFER_STUCK, 30.0, True),
        (names.ROLE_PREFILL, names.OUTCOME_STUCK_WAITING_FOR_REMOTE_KV, names.TRANSFER_ABANDONED, None, True),
        # The same long wait that ended: slow, not stuck.
        (names.ROLE_DECODE, names.OUTCOME_FINISHED, names.TRANSFER_OK, 30.0, False),
        (names.ROLE_PREFILL, names.OUTCOME_FINISHED, names.TRANSFER_OK, None, False),
    ],
)
def test_stuck_waiting_for_remote_kv_signals(
    role: str, request_outcome: str, transfer_outcome: str, remote_wait_s: float | None, stuck: bool
) -> None:
    """Stuck on the request's outcome or the transfer's; the wait is the engine's remote-KV wait,
    else the transfer's; the cost at least the whole request."""
    leg: dict[str, Any] = {names.REQUEST_OUTCOME: request_outcome}
    if remote_wait_s is not None:
        leg[names.REMOTE_KV_WAIT_SECONDS] = remote_wait_s
    transfer = {names.TRANSFER_OUTCOME: transfer_outcome, names.TRANSFER_WAIT_SECONDS: 25.0}
    if role == names.ROLE_DECODE:
        _, cur = pair(request_s=40.0, ttft_s=39.0, decode=leg, decode_transfer=transfer)
    else:
        _, cur = pair(request_s=40.0, ttft_s=39.0, prefill={**_PULLED_256, **leg}, prefill_transfer=transfer)
    found = {d.id: d for d in diagnose(built(cur))}
    assert (names.DIAG_STUCK_WAITING_FOR_REMOTE_KV in found) is stuck
    if stuck:
        d = found[names.DIAG_STUCK_WAITING_FOR_REMOTE_KV]
        assert d.evidence["role"] == role and d.evidence["transfer_outcome"] == transfer_outcome
        assert d.evidence["remote_kv_wait_s"] == (remote_wait_s or 25.0)
        assert d.cost_s == pytest.approx(40.0)  # the request, longer than its wait
        assert "VLLM_NIXL_ABORT_REQUEST_TIMEOUT" in d.fix and "side channel" in d.fix


@pytest.mark.parametrize(
    ("policy", "evidence_policy", "text"),
    [
        ("fail", "fail", "kv_load_failure_policy=fail"),
        ("recompute", "recompute", "kv_load_failure_policy=recompute"),
        ("", None, "kv_load_failure_policy=fail"),  # unset: vLLM's default
    ],
)
def test_expired_read_failed_names_the_policy(policy: str, evidence_policy: str | None, text: str) -> None:
    _, cur = pair(
        gap_s=15.0,
        prefill={**_DECLINED, names.REQUEST_OUTCOME: names.OUTCOME_FAILED_KV_LOAD},
        prefill_transfer={names.TRANSFER_OUTCOME: names.TRANSFER_DECLINED_EXPIRED},
        prefill_resource={names.KV_LOAD_FAILURE_POLICY: policy},
        status="Error",
        turn={names.HTTP_STATUS: 500},
    )
    d = diagnose(built(cur))[0]
    assert d.id == names.DIAG_EXPIRED_READ_FAILED
    assert d.evidence["kv_load_failure_policy"] == evidence_policy and text in d.summary
    assert "(gap 15.0s vs TTL 12s)" in d.summary


@pytest.mark.parametrize(
    ("reason", "transfer_outcome", "request_outcome", "expired_read"),
    [
        (names.REASON_DECLINED_EXPIRED, names.TRANSFER_DECLINED_EXPIRED, names.OUTCOME_FAILED_KV_LOAD, True),
        # A read declined as expired that the transfer recorded as failed is still an expired read.
        (names.REASON_DECLINED_EXPIRED, names.TRANSFER_FAILED, names.OUTCOME_FAILED_KV_LOAD, True),
        # A broken transfer failing the request: kv_transfer_failed's.
        (names.REASON_TRANSFER_FAILED, names.TRANSFER_FAILED, names.OUTCOME_FAILED_KV_LOAD, False),
        # The expired read that did not fail the request (it recomputed).
        (names.REASON_DECLINED_EXPIRED, names.TRANSFER_DECLINED_EXPIRED, names.OUTCOME_FINISHED, False),
    ],
)
def test_expired_read_failed_versus_transfer_failed(
    reason: str, transfer_outcome: str, request_outcome: str, expired_read: bool
) -> None:
    _, cur = pair(
        gap_s=15.0,
        prefill={
            names.PULL_DECISION: names.DECISION_PULL,
            names.PULL_REASON: reason,
            names.REQUEST_OUTCOME: request_outcome,
        },
        prefill_transfer={names.TRANSFER_OUTCOME: transfer_outcome},
        status="Error" if request_outcome != names.OUTCOME_FINISHED else "Unset",
    )
    found = ids(built(cur))
    assert (names.DIAG_EXPIRED_READ_FAILED in found) is expired_read
    if reason == names.REASON_TRANSFER_FAILED:
        assert names.DIAG_TRANSFER_FAILED in found


def test_recompute_rate_skips_requests_whose_wait_covered_the_span() -> None:
    """A prefill request whose KV wait is as long as the span measured no compute; its rate of
    0 s/token would otherwise be the fastest and silently price every recompute at nothing."""
    from otelkv.analysis.model import Leg, Transfer, Turn, per_token_compute_s

    def turn(trace: str, duration_s: float, wait_s: float, computed: int) -> Turn:
        end = int(duration_s * 1e9)
        transfer = Transfer(
            direction=names.DIRECTION_D_TO_P, outcome=None, bytes=0, xfer_s=None, wait_s=wait_s,
            post_s=None, tokens=None, backend=None, start_ns=0, end_ns=end,
        )  # fmt: skip
        leg = Leg(role=names.ROLE_PREFILL, start_ns=0, end_ns=end, computed=computed, transfer=transfer)
        return Turn(trace_id=trace, source="test", prefill=leg)

    measured = turn("a", duration_s=0.5, wait_s=0.1, computed=100)  # 0.4 s / 100 tokens
    no_compute = turn("b", duration_s=0.2, wait_s=0.3, computed=100)  # wait longer than the span
    assert per_token_compute_s([measured, no_compute]) == pytest.approx(0.004)
    assert per_token_compute_s([no_compute]) is None
