"""``otelkv doctor``: is every prerequisite of reverse KV reuse in place, and if not, which link is missing.

Each check reads what the fleet did in a window (the turns and engine requests in the
store), the engines' resource attributes (configuration in force) and, when given, their
``/metrics`` (:mod:`otelkv.analysis.engine_probe`), and answers ``pass``, ``warn``,
``fail`` or ``skip`` (not enough evidence in the window) with the evidence and the fix.
The checks are pure (:func:`run_checks`); :func:`doctor` reads the window and returns the
document the CLI prints and the sidecar's API serves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from otelkv import names
from otelkv.analysis import scope, turn_json
from otelkv.analysis.diagnose import READ_EXPIRY_MARGIN_S, in_read_margin
from otelkv.analysis.engine_probe import EngineProbe
from otelkv.analysis.linker import window_turns
from otelkv.analysis.model import SOURCE_SIDECAR, EngineConfig, Turn, engine_config
from otelkv.analysis.sources import SpanSource
from otelkv.analysis.tune.window import quantile
from otelkv.spans import SpanRecord, attr_str, opt_str

PASS_SHARE = 0.9
"""A share-based check passes from this share of the turns up."""
WARN_SHARE = 0.5
"""Below :data:`PASS_SHARE` and from this share up it warns; below it fails."""
MAX_TURNS = 5000
"""Most recent turns of the window the checks read."""
ENGINE_SPAN_LIMIT = 50_000

TITLES: dict[str, str] = {
    names.CHECK_ENGINE_SPANS: "Engines export otelkv spans",
    names.CHECK_TURNS_JOINED: "Engine requests join the sidecar's turns",
    names.CHECK_CONVERSATION_ID: "The conversation id reaches the engines",
    names.CHECK_HANDLE_FORWARDED: "The router forwards the decode handle to the next prefill",
    names.CHECK_DECODE_NOT_STREAMED: "Decode is called non-streaming (vLLM 0.32 streams carry no handle)",
    names.CHECK_BIDIRECTIONAL: "bidirectional_kv_xfer is on on both nodes",
    names.CHECK_ENGINES_AGREE: "Model, block size and KV dtype match across engines",
    names.CHECK_ROUTER_TTL: "The router's handle TTL is within decoder_kv_blocks_ttl",
    names.CHECK_TTL_VS_GAPS: "decoder_kv_blocks_ttl covers the gaps between turns",
    names.CHECK_PREFIX_CACHE: "The prefill node's local prefix cache is on",
    names.CHECK_LOAD_FAILURE_POLICY: "kv_load_failure_policy does not fail or stall requests",
    names.CHECK_CONTINUITY: "Reused KV is verified to belong to the prompt",
}


@dataclass(frozen=True)
class Check:
    id: str
    status: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": TITLES[self.id],
            "status": self.status,
            "summary": self.summary,
            "evidence": self.evidence,
            "fix": self.fix if self.status in (names.CHECK_WARN, names.CHECK_FAIL) else "",
        }


@dataclass(frozen=True)
class Engine:
    """One engine seen in the window: its configuration and how many requests it reported."""

    key: str
    config: EngineConfig
    requests: int
    continuity: str | None
    """The engine's continuity mode (``observe``), None when it checks nothing."""


@dataclass
class Evidence:
    """Everything the checks read."""

    turns: list[Turn]
    engines: list[Engine]
    engine_requests: list[SpanRecord]
    probes: list[EngineProbe]
    router_handle_ttl_s: float | None = None


# ------------------------------------------------------------------ helpers


def _share_status(share: float) -> str:
    if share >= PASS_SHARE:
        return names.CHECK_PASS
    return names.CHECK_WARN if share >= WARN_SHARE else names.CHECK_FAIL


def _served(ev: Evidence) -> list[Turn]:
    """The sidecar's turns that got an answer (a failed turn may never have reached an engine)."""
    return [t for t in ev.turns if t.source == SOURCE_SIDECAR and t.status == names.TURN_STATUS_OK]


def engines_of(spans: Iterable[SpanRecord]) -> list[Engine]:
    """One entry per engine (its ``otelkv.engine_id``, else its service and pid), with the
    configuration its latest request stated (spans come oldest first)."""
    latest: dict[str, SpanRecord] = {}
    counts: dict[str, int] = {}
    for span in spans:
        res = span.resource
        key = attr_str(res, names.ENGINE_ID) or f"{span.service_name}/{res.get('process.pid', '?')}"
        latest[key] = span
        counts[key] = counts.get(key, 0) + 1
    out = []
    for key, span in sorted(latest.items()):
        config = engine_config(span.resource)
        if config.role is None:  # the resource normally says; the request span always does
            config.role = attr_str(span.attributes, names.ROLE) or None
        out.append(Engine(key, config, counts[key], opt_str(span.resource, names.CONTINUITY_VERIFY)))
    return out


# ------------------------------------------------------------------ the checks


def check_engine_spans(ev: Evidence) -> Check:
    roles = sorted({attr_str(s.attributes, names.ROLE) for s in ev.engine_requests} - {""})
    probe_errors = [f"{p.url}: {p.error}" for p in ev.probes if p.error]
    with_connector = [p.url for p in ev.probes if p.otelkv_metrics]
    evidence: dict[str, Any] = {
        "engine_requests": len(ev.engine_requests),
        "roles": roles,
        "engines_with_otelkv_metrics": with_connector,
        "probe_errors": probe_errors,
    }
    exporter_fix = (
        "Set OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (or vLLM's --otlp-traces-endpoint) on every engine to "
        "the sidecar's OTLP receiver (http://SIDECAR:8801/v1/traces, with "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf) or your collector."
    )
    if not ev.engine_requests:
        if with_connector:
            return Check(
                names.CHECK_ENGINE_SPANS,
                names.CHECK_FAIL,
                f"{len(with_connector)} engine(s) run otelkv's connector (otelkv_* on /metrics) but no "
                "engine span arrived in the window",
                evidence,
                exporter_fix,
            )
        if not ev.turns:
            return Check(names.CHECK_ENGINE_SPANS, names.CHECK_SKIP, "no traffic in the window", evidence)
        return Check(
            names.CHECK_ENGINE_SPANS,
            names.CHECK_FAIL,
            f"{len(ev.turns)} turns and not one engine span in the window",
            evidence,
            'Load otelkv\'s connector on every engine (kv_connector_module_path "otelkv.engine.nixl" in '
            "--kv-transfer-config) and " + exporter_fix[0].lower() + exporter_fix[1:],
        )
    missing = {names.ROLE_PREFILL, names.ROLE_DECODE} - set(roles)
    if missing and names.ROLE_UNIFIED not in roles:
        return Check(
            names.CHECK_ENGINE_SPANS,
            names.CHECK_WARN,
            f"{len(ev.engine_requests)} engine requests, none from a {'/'.join(sorted(missing))} node",
            evidence,
            "Load otelkv's connector and the OTLP exporter settings on the "
            f"{'/'.join(sorted(missing))} engines too.",
        )
    if probe_errors:
        return Check(
            names.CHECK_ENGINE_SPANS,
            names.CHECK_WARN,
            f"{len(ev.engine_requests)} engine requests from {', '.join(roles)} nodes; "
            f"{len(probe_errors)} engine /metrics could not be read",
            evidence,
            "Check the --engine URLs (each engine's HTTP address; /metrics is appended).",
        )
    return Check(
        names.CHECK_ENGINE_SPANS,
        names.CHECK_PASS,
        f"{len(ev.engine_requests)} engine requests from {', '.join(roles)} nodes",
        evidence,
    )


def check_turns_joined(ev: Evidence) -> Check:
    served = _served(ev)
    if not served:
        return Check(names.CHECK_TURNS_JOINED, names.CHECK_SKIP, "no answered sidecar turn in the window")
    trace = sum(1 for t in served if t.join and t.join.method == names.JOIN_TRACE)
    inferred = sum(1 for t in served if t.join and t.join.method == names.JOIN_INFERRED)
    n = len(served)
    evidence = {
        "turns": n,
        "joined_by_trace": trace,
        "joined_by_inference": inferred,
        "unjoined": n - trace - inferred,
    }
    if trace / n >= PASS_SHARE:
        return Check(
            names.CHECK_TURNS_JOINED,
            names.CHECK_PASS,
            f"{trace} of {n} turns carry their engine requests",
            evidence,
        )
    status = names.CHECK_WARN if (trace + inferred) / n >= WARN_SHARE else names.CHECK_FAIL
    return Check(
        names.CHECK_TURNS_JOINED,
        status,
        f"{trace} of {n} turns carry their engine requests in their trace, {inferred} were joined by "
        f"inference only, {n - trace - inferred} not at all",
        evidence,
        "The turn's identity does not reach the engines: keep the body's vllm_xargs (the sidecar writes "
        "otelkv_traceparent there) when the router rebuilds the body, or forward traceparent to both legs "
        "and start vLLM with --otlp-traces-endpoint. Inferred joins need the turn's usage "
        "(stream_options.include_usage on streams) and leave look-alike concurrent turns unjoined.",
    )


def check_conversation_id(ev: Evidence) -> Check:
    legs = [
        (t, leg) for t in _served(ev) if t.conversation_id for leg in (t.prefill, t.decode) if leg is not None
    ]
    if not legs:
        return Check(names.CHECK_CONVERSATION_ID, names.CHECK_SKIP, "no engine request joined to a turn")
    reached = sum(1 for t, leg in legs if leg.conversation_id == t.conversation_id)
    share = reached / len(legs)
    status = _share_status(share)
    return Check(
        names.CHECK_CONVERSATION_ID,
        status,
        f"{reached} of {len(legs)} engine requests saw their turn's conversation id",
        {"engine_requests": len(legs), "with_conversation_id": reached},
        "Forward X-Session-ID to both legs, or keep the body's vllm_xargs.session_id (the sidecar writes "
        "it): vLLM sets the request's session_id from either and stamps it on KV events.",
    )


def _follow_ups(ev: Evidence) -> list[Turn]:
    """Answered turns whose previous turn's decode handed back a handle within the TTL."""
    out = []
    for t in _served(ev):
        prev = t.previous
        if prev is None or prev.decode is None or not prev.decode.kv_params_returned or t.prefill is None:
            continue
        ttl = t.decoder_ttl_s()
        if ttl is not None and in_read_margin(t.gap_s, ttl):
            continue  # the handle had lapsed: dropping it is right
        if t.router is not None and t.router.handle == names.ROUTER_HANDLE_STALE:
            continue
        out.append(t)
    return out


def check_handle_forwarded(ev: Evidence) -> Check:
    follow = _follow_ups(ev)
    if not follow:
        return Check(
            names.CHECK_HANDLE_FORWARDED,
            names.CHECK_SKIP,
            "no follow-up turn whose previous decode handed back a live handle",
        )
    # A prefill that did not say why (an older recorder) is no evidence either way.
    follow = [t for t in follow if t.prefill is not None and t.prefill.reason is not None]
    if not follow:
        return Check(
            names.CHECK_HANDLE_FORWARDED,
            names.CHECK_SKIP,
            "no follow-up prefill request stated its pull reason",
        )
    carried = sum(
        1 for t in follow if t.prefill is not None and t.prefill.reason != names.REASON_NO_DECODE_HANDLE
    )
    return Check(
        names.CHECK_HANDLE_FORWARDED,
        _share_status(carried / len(follow)),
        f"{carried} of {len(follow)} follow-up turns reached prefill with the previous decode's handle",
        {"follow_up_turns": len(follow), "with_handle": carried},
        "Keep each decode response's kv_transfer_params per conversation and send them with the next "
        "turn's prefill request (with do_remote_decode=true); without them every later turn recomputes.",
    )


def check_decode_not_streamed(ev: Evidence) -> Check:
    decodes = [t.decode for t in _served(ev) if t.decode is not None and t.decode.streamed is not None]
    if not decodes:
        return Check(
            names.CHECK_DECODE_NOT_STREAMED, names.CHECK_SKIP, "no decode request says how it was called"
        )
    streamed = sum(1 for leg in decodes if leg.streamed)
    share = streamed / len(decodes)
    status = (
        names.CHECK_PASS if streamed == 0 else names.CHECK_FAIL if share >= WARN_SHARE else names.CHECK_WARN
    )
    return Check(
        names.CHECK_DECODE_NOT_STREAMED,
        status,
        f"{streamed} of {len(decodes)} decode requests were streamed",
        {"decode_requests": len(decodes), "streamed": streamed},
        "vLLM 0.32 puts no kv_transfer_params on a streamed response: call the decode node with "
        "stream=false and stream to the client yourself, so the router gets the handle.",
    )


def check_bidirectional(ev: Evidence) -> Check:
    known = [e for e in ev.engines if e.config.bidirectional is not None]
    if not known:
        return Check(names.CHECK_BIDIRECTIONAL, names.CHECK_SKIP, "no engine stated bidirectional_kv_xfer")
    off = [e.key for e in known if not e.config.bidirectional]
    evidence = {e.key: e.config.bidirectional for e in known}
    if off:
        return Check(
            names.CHECK_BIDIRECTIONAL,
            names.CHECK_FAIL,
            f"bidirectional_kv_xfer is off on {', '.join(off)}",
            evidence,
            'Set "bidirectional_kv_xfer": true in kv_connector_extra_config on the prefill and the '
            "decode engines.",
        )
    roles = {e.config.role for e in known}
    if names.ROLE_UNIFIED not in roles and not {names.ROLE_PREFILL, names.ROLE_DECODE} <= roles:
        seen = "/".join(sorted(r for r in roles if r)) or "unknown-role"
        return Check(
            names.CHECK_BIDIRECTIONAL,
            names.CHECK_SKIP,
            f"on on the {seen} engines; no engine of the other role stated it",
            evidence,
        )
    return Check(names.CHECK_BIDIRECTIONAL, names.CHECK_PASS, f"on on all {len(known)} engines", evidence)


def check_engines_agree(ev: Evidence) -> Check:
    facts: dict[str, dict[str, Any]] = {}
    for e in ev.engines:
        facts[e.key] = {
            "model": e.config.model,
            "block_size": e.config.block_size,
            "kv_cache_dtype": e.config.kv_cache_dtype,
        }
    # /metrics of the engines named with --engine are compared too; an engine seen both in
    # spans and on /metrics is one engine, so the count comes from whichever saw more.
    probed = 0
    for p in ev.probes:
        if p.cache:
            dtype = p.cache.get("cache_dtype")
            block = p.cache.get("block_size", "")
            facts[p.url] = {
                "block_size": int(block) if block.isascii() and block.isdecimal() else None,
                "kv_cache_dtype": dtype if dtype and dtype != "auto" else None,
            }
            probed += 1
    count = max(len(ev.engines), probed)
    if count < 2:
        return Check(
            names.CHECK_ENGINES_AGREE, names.CHECK_SKIP, f"{count} engine seen: nothing to compare", facts
        )
    differ = []
    for key in ("model", "block_size", "kv_cache_dtype"):
        values = {f.get(key) for f in facts.values()} - {None, ""}
        if len(values) > 1:
            differ.append(f"{key} ({', '.join(sorted(map(str, values)))})")
    if differ:
        return Check(
            names.CHECK_ENGINES_AGREE,
            names.CHECK_FAIL,
            "engines differ in " + "; ".join(differ),
            facts,
            "Serve the same model with the same --block-size and --dtype/--kv-cache-dtype on prefill "
            "and decode: KV computed under one layout cannot be read under another.",
        )
    return Check(names.CHECK_ENGINES_AGREE, names.CHECK_PASS, f"{count} engines agree", facts)


def _decode_ttl(ev: Evidence) -> float | None:
    ttls = [e.config.decoder_ttl_s for e in ev.engines if e.config.decoder_ttl_s is not None]
    decode = [
        e.config.decoder_ttl_s
        for e in ev.engines
        if e.config.role == names.ROLE_DECODE and e.config.decoder_ttl_s is not None
    ]
    pool = decode or ttls
    return min(pool) if pool else None


def check_router_ttl(ev: Evidence) -> Check:
    router_ttl = ev.router_handle_ttl_s
    source = "--router-handle-ttl"
    if router_ttl is None:
        seen = [
            t.router.handle_ttl_s
            for t in ev.turns
            if t.router is not None and t.router.handle_ttl_s is not None
        ]
        router_ttl, source = (max(seen), "router spans") if seen else (None, "")
    ttl = _decode_ttl(ev)
    if router_ttl is None or ttl is None:
        what = "the router's handle TTL" if router_ttl is None else "decoder_kv_blocks_ttl"
        return Check(
            names.CHECK_ROUTER_TTL,
            names.CHECK_SKIP,
            f"{what} is unknown (a router without otelkv's spans does not say; "
            "pass --router-handle-ttl SECONDS)",
        )
    limit = ttl - READ_EXPIRY_MARGIN_S
    evidence = {"router_handle_ttl_s": router_ttl, "from": source, "decoder_kv_blocks_ttl_s": ttl}
    if router_ttl <= limit:
        return Check(
            names.CHECK_ROUTER_TTL,
            names.CHECK_PASS,
            f"{router_ttl:g}s <= {ttl:g}s - {READ_EXPIRY_MARGIN_S:g}s",
            evidence,
        )
    return Check(
        names.CHECK_ROUTER_TTL,
        names.CHECK_FAIL,
        f"the router keeps handles {router_ttl:g}s, past what decode holds ({ttl:g}s, reads declined from "
        f"{READ_EXPIRY_MARGIN_S:g}s before)",
        evidence,
        f"Drop a handle after at most {limit:g}s in the router: a later read is declined and, with "
        "kv_load_failure_policy=fail, fails the request.",
    )


def check_ttl_vs_gaps(ev: Evidence) -> Check:
    gaps = [t.gap_s for t in _served(ev) if t.previous is not None or (t.index or 0) > 0]
    ttl = _decode_ttl(ev)
    if not gaps or ttl is None:
        what = "no follow-up turn" if not gaps else "decoder_kv_blocks_ttl is unknown"
        return Check(names.CHECK_TTL_VS_GAPS, names.CHECK_SKIP, what)
    p50, p90 = quantile(gaps, 0.5), quantile(gaps, 0.9)
    evidence = {
        "follow_up_turns": len(gaps),
        "gap_p50_s": round(p50, 3),
        "gap_p90_s": round(p90, 3),
        "decoder_kv_blocks_ttl_s": ttl,
    }
    if not in_read_margin(p90, ttl):
        return Check(
            names.CHECK_TTL_VS_GAPS,
            names.CHECK_PASS,
            f"gaps p90 {p90:.1f}s within the {ttl:g}s TTL",
            evidence,
        )
    status = names.CHECK_WARN if not in_read_margin(p50, ttl) else names.CHECK_FAIL
    return Check(
        names.CHECK_TTL_VS_GAPS,
        status,
        f"gaps between turns p50 {p50:.1f}s / p90 {p90:.1f}s against a {ttl:g}s TTL: "
        f"{'some' if status == names.CHECK_WARN else 'most'} follow-ups arrive after the KV is freed",
        evidence,
        "`otelkv tune` prices a longer decoder_kv_blocks_ttl (memory held against recompute saved).",
    )


def check_prefix_cache(ev: Evidence) -> Check:
    known = {
        e.key: e.config.prefix_caching
        for e in ev.engines
        if e.config.role == names.ROLE_PREFILL and e.config.prefix_caching is not None
    }
    # Not from /metrics: a probe does not say whether its engine is a prefill or a decode node.
    if not known:
        return Check(
            names.CHECK_PREFIX_CACHE, names.CHECK_SKIP, "no prefill engine stated its prefix caching"
        )
    off = [k for k, v in known.items() if not v]
    if off:
        return Check(
            names.CHECK_PREFIX_CACHE,
            names.CHECK_WARN,
            f"prefix caching is off on {', '.join(off)}",
            known,
            "Keep vLLM's prefix caching on (drop --no-enable-prefix-caching): it is the production baseline; "
            "without it every token not pulled is recomputed, and gains measured against it are overstated.",
        )
    return Check(names.CHECK_PREFIX_CACHE, names.CHECK_PASS, f"on on {len(known)} engine(s)", known)


def check_load_failure_policy(ev: Evidence) -> Check:
    policies = {e.key: e.config.load_failure_policy for e in ev.engines if e.config.load_failure_policy}
    failed = sum(
        1
        for s in ev.engine_requests
        if attr_str(s.attributes, names.REQUEST_OUTCOME) == names.OUTCOME_FAILED_KV_LOAD
    )
    evidence = {"policies": policies, "failed_kv_load_requests": failed}
    if not policies:
        return Check(
            names.CHECK_LOAD_FAILURE_POLICY, names.CHECK_SKIP, "no engine stated kv_load_failure_policy"
        )
    if failed:
        return Check(
            names.CHECK_LOAD_FAILURE_POLICY,
            names.CHECK_FAIL,
            f"{failed} requests failed because their KV read failed or was declined",
            evidence,
            "Keep the router's handle TTL below decoder_kv_blocks_ttl minus 5 s (`otelkv why` on one of them "
            "names the cause).",
        )
    recompute = [k for k, v in policies.items() if v == "recompute"]
    if recompute:
        return Check(
            names.CHECK_LOAD_FAILURE_POLICY,
            names.CHECK_WARN,
            f"kv_load_failure_policy=recompute on {', '.join(recompute)}: on vLLM 0.32 a request whose read "
            "is declined as expired then waits forever",
            evidence,
            "Use kv_load_failure_policy=fail and keep the router's handle TTL within decoder_kv_blocks_ttl "
            "so declined reads do not happen.",
        )
    return Check(names.CHECK_LOAD_FAILURE_POLICY, names.CHECK_PASS, "no request failed a KV load", evidence)


def check_continuity(ev: Evidence) -> Check:
    """Prefill engines check handles against prompts, and the handles reach them with the digest."""
    prefill = [e for e in ev.engines if e.config.role in (names.ROLE_PREFILL, names.ROLE_UNIFIED)]
    if not prefill:
        return Check(names.CHECK_CONTINUITY, names.CHECK_SKIP, "no prefill engine in the window")
    # Decode engines write the digest, prefill engines check it: both must run otelkv's check.
    unverified = [e.key for e in ev.engines if not e.continuity]
    if unverified:
        return Check(
            names.CHECK_CONTINUITY,
            names.CHECK_WARN,
            f"{len(unverified)} engine(s) do not check that the KV a decode handle names was computed for "
            "the prompt (vLLM 0.32 trusts the handle; otelkv's connector of this version checks it)",
            {"unverified": unverified},
            "Run this otelkv version's connector on every prefill and decode engine; until then give a "
            "conversation whose history was rewritten (compaction, an edited message) a new id.",
        )
    checks = [t.prefill.continuity for t in _served(ev) if t.prefill is not None and t.prefill.continuity]
    with_digest = sum(1 for c in checks if c.digest)
    mismatched = sum(1 for c in checks if c.first_mismatch is not None)
    evidence = {
        "modes": {e.key: e.continuity for e in prefill},
        "handles": len(checks),
        "with_digest": with_digest,
        "with_mismatch": mismatched,
    }
    if checks and with_digest / len(checks) < PASS_SHARE:
        return Check(
            names.CHECK_CONTINUITY,
            names.CHECK_WARN,
            f"{len(checks) - with_digest} of {len(checks)} decode handles reached prefill without "
            "otelkv's continuity digest",
            evidence,
            "A handle loses its digest when the router rebuilds kv_transfer_params (pass them on whole: "
            "otelkv adds otelkv_continuity), when the decode node runs no or an older otelkv, or when its "
            "KV covers more than 32,768 tokens; such a handle cannot be checked.",
        )
    return Check(
        names.CHECK_CONTINUITY,
        names.CHECK_PASS,
        f"checked on {len(prefill)} prefill engine(s): {len(checks)} handles, {mismatched} with tokens "
        "that differ from the prompt (`otelkv why` names them)",
        evidence,
    )


CHECK_FUNCTIONS: tuple[Callable[[Evidence], Check], ...] = (
    check_engine_spans,
    check_turns_joined,
    check_conversation_id,
    check_handle_forwarded,
    check_decode_not_streamed,
    check_bidirectional,
    check_engines_agree,
    check_router_ttl,
    check_ttl_vs_gaps,
    check_prefix_cache,
    check_load_failure_policy,
    check_continuity,
)


def run_checks(ev: Evidence) -> list[Check]:
    """Every check, in :data:`otelkv.names.CHECKS` order."""
    return [fn(ev) for fn in CHECK_FUNCTIONS]


def verdict(checks: Iterable[Check]) -> str:
    """The worst status; ``skip`` only when every check skipped (no evidence at all)."""
    statuses = {c.status for c in checks}
    for status in (names.CHECK_FAIL, names.CHECK_WARN, names.CHECK_PASS):
        if status in statuses:
            return status
    return names.CHECK_SKIP


def doctor(
    source: SpanSource,
    *,
    since_ns: int | None,
    until_ns: int | None,
    probes: Sequence[EngineProbe] = (),
    router_handle_ttl_s: float | None = None,
    max_turns: int = MAX_TURNS,
) -> dict[str, Any]:
    """The doctor's document for a window: every check, the engines seen, the probes."""
    turns, total = window_turns(source, since_ns=since_ns, until_ns=until_ns, max_turns=max_turns)
    # The engine requests of the same stretch as the turns read (the newest, when some were left out).
    first = min((t.start_ns for t in turns), default=since_ns or 0) if total > len(turns) else since_ns or 0
    spans = source.engine_requests(
        since_ns=first, until_ns=until_ns if until_ns is not None else 2**62, limit=ENGINE_SPAN_LIMIT
    )
    spans = scope.counted_spans(spans)  # the warm-up's engine requests, like its turns, do not count
    ev = Evidence(turns, engines_of(spans), spans, list(probes), router_handle_ttl_s)
    checks = run_checks(ev)
    return turn_json.document(
        "doctor",
        **turn_json.window(since_ns, until_ns),
        verdict=verdict(checks),
        turn_count=len(turns),
        turns_left_out=total - len(turns),
        engine_request_count=len(spans),
        engines=[
            {
                "key": e.key,
                "role": e.config.role,
                "requests": e.requests,
                "continuity_mode": e.continuity,
                **turn_json.config_object(e.config),
            }
            for e in ev.engines
        ],
        probes=[p.as_dict() for p in ev.probes],
        checks=[c.as_dict() for c in checks],
    )
