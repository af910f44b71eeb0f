"""``otelkv doctor`` and joins by inference over span lists shaped like what real routers leave.

The real-engine checks (tests/fleet/test_third_party_router.py, test_sidecar.py) run the
doctor behind each router; these pin each check's thresholds and wording on hand-made spans.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from typing import Any

import pytest

from otelkv import names
from otelkv.analysis import doctor as doc
from otelkv.analysis.engine_probe import EngineProbe, parse
from otelkv.analysis.report import conversation, why
from otelkv.analysis.sources import InMemorySource
from otelkv.cli.doctor_cmd import show_doctor
from otelkv.spans import SpanRecord, is_engine_request, is_router_span
from tests.schema import assert_valid
from tests.unit.test_diagnose import stored, turn_trace

FORMS = pytest.mark.parametrize("form", [lambda s: s, stored], ids=["native", "stored"])


def conversation_spans(conv: str = "conv-d", turns: int = 3, **kw: Any) -> list[SpanRecord]:
    """A conversation whose engines got the turn's identity (headers or body)."""
    out: list[SpanRecord] = []
    prev = ""
    for i in range(turns):
        trace = turn_trace(
            conv,
            i,
            start_s=100.0 + 3 * i,
            gap_s=1.0,
            prev_trace=prev,
            prefill={
                names.GEN_AI_CONVERSATION_ID: conv,
                names.TRACE_CONTEXT_SOURCE: names.TRACE_CONTEXT_BODY,
                names.GEN_AI_REQUEST_ID: f"chatcmpl-{conv}-{i}",
            },
            decode={
                names.GEN_AI_CONVERSATION_ID: conv,
                names.TRACE_CONTEXT_SOURCE: names.TRACE_CONTEXT_BODY,
                names.GEN_AI_REQUEST_ID: f"chatcmpl-{conv}-{i}",
                names.REQUEST_STREAMED: False,
            },
            **kw,
        )
        prev = trace[0].trace_id
        out += trace
    return out


def orphaned(spans: list[SpanRecord]) -> list[SpanRecord]:
    """What a router that rebuilds the body and forwards no header leaves: no router span, each
    engine request in a trace of its own without a conversation id, the turn's response id
    being the decode request's id."""
    out: list[SpanRecord] = []
    by_span = {s.span_id: s for s in spans}
    for s in spans:
        if is_router_span(s):
            continue
        if is_engine_request(s):
            attrs = {
                k: v
                for k, v in s.attributes.items()
                if k not in (names.GEN_AI_CONVERSATION_ID, names.TRACE_CONTEXT_SOURCE)
            }
            attrs[names.TRACE_CONTEXT_SOURCE] = names.TRACE_CONTEXT_NONE
            out.append(replace(s, trace_id=f"{int(s.span_id, 16):032x}", parent_span_id="", attributes=attrs))
        elif s.parent_span_id in by_span and is_engine_request(by_span[s.parent_span_id]):
            out.append(replace(s, trace_id=f"{int(s.parent_span_id, 16):032x}"))
        else:
            out.append(s)
    for i, s in enumerate(out):  # the sidecar saw the decode's id in the response
        if s.scope_name == names.SCOPE_SIDECAR:
            index = s.attributes[names.TURN_INDEX]
            conv = s.attributes[names.GEN_AI_CONVERSATION_ID]
            out[i] = replace(
                s, attributes={**s.attributes, names.GEN_AI_RESPONSE_ID: f"chatcmpl-{conv}-{index}"}
            )
    return out


def run(spans: list[SpanRecord], **kw: Any) -> dict[str, Any]:
    return assert_valid(doc.doctor(InMemorySource(spans), since_ns=None, until_ns=None, **kw))


def status(answer: dict[str, Any]) -> dict[str, str]:
    return {c["id"]: c["status"] for c in answer["checks"]}


# ------------------------------------------------------------------ joins by inference


@FORMS
def test_orphan_engine_requests_join_their_turns_by_inference(form: Any) -> None:
    source = InMemorySource(form(orphaned(conversation_spans())))
    answer = assert_valid(conversation(source, "conv-d"))
    for turn in answer["turns"]:
        assert turn["engine_join"]["method"] == names.JOIN_INFERRED
        assert names.EVIDENCE_RESPONSE_ID in turn["engine_join"]["evidence"]
        assert turn["prefill"]["request_id"] == f"req-conv-d-{turn['turn_index']}-p"
        assert turn["decode"]["request_id"] == f"req-conv-d-{turn['turn_index']}-d"
    # The previous turn's retention travels with its inferred decode leg.
    one = assert_valid(why(source, "conv-d#1"))["turn"]
    assert one["engine_join"]["method"] == names.JOIN_INFERRED
    found = {d["id"]: d for d in one["diagnoses"]}
    assert found[names.DIAG_ROUTER_FORWARDS_NO_IDENTITY]["evidence"]["engines_without_conversation_id"] == [
        "prefill",
        "decode",
    ]


def test_engines_that_got_the_identity_join_by_trace_and_raise_no_identity_diagnosis() -> None:
    turn = assert_valid(why(InMemorySource(conversation_spans()), "conv-d#1"))["turn"]
    assert turn["engine_join"] == {"method": names.JOIN_TRACE, "evidence": []}
    assert names.DIAG_ROUTER_FORWARDS_NO_IDENTITY not in {d["id"] for d in turn["diagnoses"]}


# ------------------------------------------------------------------ the checks


def test_a_fleet_with_everything_in_place_passes_but_continuity() -> None:
    cache = {names.PREFIX_CACHING: True, names.KV_BLOCK_SIZE: 32}
    answer = run(
        conversation_spans(
            router={names.ROUTER_HANDLE_TTL_SECONDS: 6.0}, prefill_resource=cache, decode_resource=cache
        )
    )
    got = status(answer)
    assert got.pop(names.CHECK_CONTINUITY) == names.CHECK_WARN
    assert set(got.values()) == {names.CHECK_PASS}, answer["checks"]
    assert answer["verdict"] == names.CHECK_WARN
    assert [c["id"] for c in answer["checks"]] == list(names.CHECKS)
    assert all(c["fix"] == "" for c in answer["checks"] if c["status"] == names.CHECK_PASS)


def test_a_rebuilding_router_fails_the_conversation_id_and_warns_on_joins() -> None:
    got = status(run(orphaned(conversation_spans())))
    assert got[names.CHECK_CONVERSATION_ID] == names.CHECK_FAIL
    assert got[names.CHECK_TURNS_JOINED] == names.CHECK_WARN
    assert got[names.CHECK_ROUTER_TTL] == names.CHECK_SKIP  # no router span says it


def test_missing_handles_and_streamed_decodes_fail() -> None:
    spans = conversation_spans()
    # Every prefill without a handle, every decode streamed.
    spans = [
        replace(
            s,
            attributes={
                **s.attributes,
                **(
                    {names.PULL_REASON: names.REASON_NO_DECODE_HANDLE}
                    if s.attributes.get(names.ROLE) == names.ROLE_PREFILL
                    else {names.REQUEST_STREAMED: True}
                    if s.attributes.get(names.ROLE) == names.ROLE_DECODE
                    else {}
                ),
            },
        )
        for s in spans
    ]
    answer = run(spans)
    got = status(answer)
    assert got[names.CHECK_HANDLE_FORWARDED] == names.CHECK_FAIL
    assert got[names.CHECK_DECODE_NOT_STREAMED] == names.CHECK_FAIL
    checks = {c["id"]: c for c in answer["checks"]}
    assert checks[names.CHECK_HANDLE_FORWARDED]["evidence"] == {"follow_up_turns": 2, "with_handle": 0}
    assert "stream=false" in checks[names.CHECK_DECODE_NOT_STREAMED]["fix"]


@pytest.mark.parametrize(
    ("resource", "check", "expected"),
    [
        ({names.BIDIRECTIONAL_KV_XFER: False}, names.CHECK_BIDIRECTIONAL, names.CHECK_FAIL),
        ({names.KV_BLOCK_SIZE: 16}, names.CHECK_ENGINES_AGREE, names.CHECK_FAIL),
        ({names.KV_LOAD_FAILURE_POLICY: "recompute"}, names.CHECK_LOAD_FAILURE_POLICY, names.CHECK_WARN),
        ({names.PREFIX_CACHING: False}, names.CHECK_PREFIX_CACHE, names.CHECK_WARN),
        ({names.CONTINUITY_VERIFY: names.CONTINUITY_MODE_OBSERVE}, names.CHECK_CONTINUITY, names.CHECK_PASS),
    ],
)
def test_engine_configuration_checks(resource: dict[str, Any], check: str, expected: str) -> None:
    base = {names.KV_BLOCK_SIZE: 32, names.PREFIX_CACHING: True}
    both = {k: v for k, v in resource.items() if k == names.CONTINUITY_VERIFY}  # decode writes the digest
    spans = conversation_spans(prefill_resource={**base, **resource}, decode_resource={**base, **both})
    assert status(run(spans))[check] == expected


@pytest.mark.parametrize(
    ("router_ttl", "expected"), [(6.9, names.CHECK_PASS), (7.1, names.CHECK_FAIL), (None, names.CHECK_SKIP)]
)
def test_router_ttl_against_the_decode_ttl_less_the_read_margin(
    router_ttl: float | None, expected: str
) -> None:
    # decoder_kv_blocks_ttl 12 s; vLLM declines a read from 5 s before the deadline.
    assert (
        status(run(conversation_spans(), router_handle_ttl_s=router_ttl))[names.CHECK_ROUTER_TTL] == expected
    )


@pytest.mark.parametrize(("gap_s", "expected"), [(1.0, names.CHECK_PASS), (8.0, names.CHECK_FAIL)])
def test_ttl_against_the_gaps(gap_s: float, expected: str) -> None:
    spans = []
    prev = ""
    for i in range(3):
        trace = turn_trace("conv-g", i, start_s=100.0 + (gap_s + 1) * i, gap_s=gap_s, prev_trace=prev)
        prev = trace[0].trace_id
        spans += trace
    answer = run(spans)
    assert status(answer)[names.CHECK_TTL_VS_GAPS] == expected
    ev = {c["id"]: c for c in answer["checks"]}[names.CHECK_TTL_VS_GAPS]["evidence"]
    assert ev["gap_p50_s"] == gap_s and ev["follow_up_turns"] == 2


def test_no_traffic_skips_and_connector_without_spans_fails() -> None:
    empty = run([])
    assert set(status(empty).values()) == {names.CHECK_SKIP}
    assert empty["verdict"] == names.CHECK_SKIP
    probe = EngineProbe("http://p:8000", otelkv_metrics=True)
    got = run([], probes=[probe])
    assert got["checks"][0]["status"] == names.CHECK_FAIL
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in got["checks"][0]["fix"]


def test_probe_reads_connector_nixl_and_cache_config() -> None:
    text = (
        "# HELP otelkv_pull_decisions_total x\n# TYPE otelkv_pull_decisions_total counter\n"
        'otelkv_pull_decisions_total{decision="pull",reason="pulled"} 2.0\n'
        "# HELP vllm:cache_config_info x\n# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0"} 1.0\n'
    )
    p = parse("http://p:8000", text)
    assert p.otelkv_metrics and not p.nixl_metrics and p.error is None
    assert p.cache == {"block_size": "32", "cache_dtype": "auto", "enable_prefix_caching": "True"}
    assert EngineProbe.from_dict(json.loads(json.dumps(p.as_dict()))) == p
    with pytest.raises(ValueError):
        EngineProbe.from_dict({"url": 3})


def test_text_rendering_names_each_check_and_the_fix() -> None:
    answer = run(orphaned(conversation_spans()))
    out = io.StringIO()
    show_doctor(answer, out)
    text = out.getvalue()
    assert "[FAIL] The conversation id reaches the engines" in text
    assert "fix: Forward X-Session-ID" in text and text.rstrip().endswith("verdict: fail")


# ------------------------------------------------------------------ CLI and the sidecar's API


@pytest.fixture
def api() -> Any:
    """The sidecar's real query API over a conversation whose router rebuilt the bodies, with
    one configured engine: a local server answering /metrics like an engine with otelkv."""
    import asyncio
    import threading

    from aiohttp import web

    from otelkv.sidecar.api import QueryApi

    exposition = (
        "# HELP otelkv_pull_decisions_total x\n# TYPE otelkv_pull_decisions_total counter\n"
        'otelkv_pull_decisions_total{decision="pull",reason="pulled"} 2.0\n'
    )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=exposition, content_type="text/plain")

    loop = asyncio.new_event_loop()
    runners = []

    def serve(app: web.Application) -> str:
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    engine = web.Application()
    engine.router.add_get("/metrics", metrics)
    engine_url = serve(engine)
    app = web.Application()
    source = InMemorySource(orphaned(conversation_spans()))
    app.add_routes(QueryApi(source, "memory", engine_urls=(engine_url,)).routes())
    url = serve(app)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield url, engine_url
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        for runner in runners:
            loop.run_until_complete(runner.cleanup())
        loop.close()


def test_cli_doctor_through_the_sidecar_exits_1_on_a_failed_prerequisite(
    api: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from otelkv.cli.main import main

    url, engine_url = api
    # The spans lie in 2023; an unroutable --engine is read by the CLI (and reported), never by the sidecar.
    code = main(["doctor", "--sidecar", url, "--since", "1000w", "--engine", "http://127.0.0.1:9", "--json"])
    answer = assert_valid(json.loads(capsys.readouterr().out))
    assert code == 1 and answer["verdict"] == names.CHECK_FAIL
    probes = {p["url"]: p for p in answer["probes"]}
    assert probes["http://127.0.0.1:9"]["error"].startswith("GET http://127.0.0.1:9/metrics failed")
    assert probes[engine_url]["otelkv_metrics"] is True  # the sidecar's own --engine
    assert main(["doctor", "--sidecar", url, "--since", "1000w"]) == 1
    assert "verdict: fail" in capsys.readouterr().out


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1, 2]",
        b'{"since_ns": "soon"}',
        b'{"since_ns": true}',
        b'{"router_handle_ttl_s": "long"}',
        b'{"router_handle_ttl_s": NaN}',
        b'{"router_handle_ttl_s": -1}',
        b'{"probes": {"url": "x"}}',
        b'{"probes": [{"url": 3}]}',
        b'{"probes": [{"url": "x", "cache": {"block_size": 32}}]}',
        b'{"probes": [' + b",".join([b'{"url": "x"}'] * 65) + b"]}",
    ],
)
def test_bad_doctor_requests_get_a_400_with_one_line(api: Any, body: bytes) -> None:
    import urllib.error
    import urllib.request

    url, _ = api
    request = urllib.request.Request(
        url + "/api/v1/doctor", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 400
    message = json.loads(caught.value.read())["error"]
    assert message.startswith("bad doctor request") and "\n" not in message


def test_legs_with_their_own_request_ids_both_join_their_turn() -> None:
    """The prefill and decode requests carry different ids: each is matched on its own and the
    turn gets both (the response id names the decode request)."""
    spans = orphaned(conversation_spans())
    spans = [
        replace(s, attributes={**s.attributes, names.GEN_AI_REQUEST_ID: "chatcmpl-other-" + s.span_id})
        if s.attributes.get(names.ROLE) == names.ROLE_PREFILL
        else s
        for s in spans
    ]
    answer = assert_valid(conversation(InMemorySource(spans), "conv-d"))
    for turn in answer["turns"]:
        assert turn["prefill"] is not None and turn["decode"] is not None, turn["engine_join"]
        assert turn["engine_join"]["method"] == names.JOIN_INFERRED


def test_a_bare_sidecar_turn_with_nothing_matching_stays_unjoined() -> None:
    spans = orphaned(conversation_spans())
    # Usage that matches no engine request (the router answered from somewhere else).
    spans = [
        replace(
            s,
            attributes={**s.attributes, names.GEN_AI_USAGE_INPUT_TOKENS: 999, names.GEN_AI_RESPONSE_ID: "x"},
        )
        if s.scope_name == names.SCOPE_SIDECAR
        else s
        for s in spans
    ]
    answer = assert_valid(conversation(InMemorySource(spans), "conv-d"))
    assert all(t["engine_join"] is None and t["prefill"] is None for t in answer["turns"])
    assert status(run(spans))[names.CHECK_TURNS_JOINED] == names.CHECK_FAIL


def test_bidirectional_needs_both_roles_and_probes_do_not_double_count_engines() -> None:
    decode_only = [s for s in conversation_spans() if s.attributes.get(names.ROLE) != names.ROLE_PREFILL]
    assert status(run(decode_only))[names.CHECK_BIDIRECTIONAL] == names.CHECK_SKIP
    one = [s for s in decode_only if s.scope_name != names.SCOPE_SIDECAR]
    probe = EngineProbe("http://d:8000", cache={"block_size": "32", "cache_dtype": "auto"})
    assert status(run(one, probes=[probe]))[names.CHECK_ENGINES_AGREE] == names.CHECK_SKIP
    odd = EngineProbe("http://p:8000", cache={"block_size": "²", "cache_dtype": "auto"})
    assert status(run(one, probes=[probe, odd]))[names.CHECK_ENGINES_AGREE] == names.CHECK_PASS


def test_an_unexpected_failure_is_one_line_and_exit_4(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from otelkv.cli import doctor_cmd
    from otelkv.cli.main import main

    def broken(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("store went away\nsecond line")

    monkeypatch.setattr(doctor_cmd, "run_query", broken)
    assert main(["doctor", "--store", "/nonexistent"]) == 4  # a failure at run time (here: a bug)
    err = capsys.readouterr().err
    assert err.startswith("otelkv doctor: unexpected error (RuntimeError: store went away second line)")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_continuity_warns_when_handles_arrive_without_the_digest() -> None:
    observe = {names.CONTINUITY_VERIFY: names.CONTINUITY_MODE_OBSERVE}
    spans = conversation_spans(prefill_resource=observe, decode_resource=observe)
    # Turns 1 and 2 reached prefill with a handle; one carried the digest, one did not.
    marks = {"req-conv-d-1-p": True, "req-conv-d-2-p": False}
    stripped = [
        replace(
            s, attributes={**s.attributes, names.CONTINUITY_DIGEST: marks[s.attributes[names.REQUEST_ID]]}
        )
        if s.attributes.get(names.REQUEST_ID) in marks
        else s
        for s in spans
    ]
    answer = run(stripped)
    check = {c["id"]: c for c in answer["checks"]}[names.CHECK_CONTINUITY]
    assert check["status"] == names.CHECK_WARN
    assert (check["evidence"]["handles"], check["evidence"]["with_digest"]) == (2, 1)
    assert "pass them on whole" in check["fix"]
    all_there = [
        replace(s, attributes={**s.attributes, names.CONTINUITY_DIGEST: True})
        if s.attributes.get(names.REQUEST_ID) in marks
        else s
        for s in spans
    ]
    assert status(run(all_there))[names.CHECK_CONTINUITY] == names.CHECK_PASS
    # A decode engine that writes no digest: warned before any handle is looked at.
    assert (
        status(run(conversation_spans(prefill_resource=observe)))[names.CHECK_CONTINUITY] == names.CHECK_WARN
    )
