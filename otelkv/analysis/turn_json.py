"""The one JSON shape of a turn, and the envelope every answer comes in.

``otelkv slow``, ``conversation``, ``why``, ``tune`` and ``compare`` (and the sidecar's
query API, which returns the same documents) all describe turns with :func:`turn_object`
and wrap their answer with :func:`document`. The shape is a file in the package,
``turn.schema.json`` (JSON Schema 2020-12): a consumer can validate against it, and the
tests validate real output of every verb with it. Conventions, so a field is found
without reading the schema:

* durations end in ``_s`` (seconds, float); times are ``*_ns`` (Unix nanoseconds) with an
  ISO 8601 UTC string of the same instant beside them (``start_ns`` and ``start``);
* token counts sit in ``tokens`` objects keyed by source (``computed``, ``local_cache``,
  ``pulled``), as the metric labels of the same name;
* settings use vLLM's names with their unit (``decoder_kv_blocks_ttl_s``,
  ``kv_recompute_threshold``);
* diagnoses are always objects: ``id``, ``title``, ``failure`` (a failed or hung request,
  ranked first), ``summary``, ``cost_s``, ``evidence``, ``fix``.

``schema_version`` changes when a field is renamed or removed or changes meaning. A field
added comes with the schema file of the same release, which declares every field
(``additionalProperties: false``): validate a document with the schema of the otelkv that
wrote it.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from functools import cache
from importlib import resources
from typing import Any

from otelkv import names
from otelkv.analysis.diagnose import REGISTRY, Diagnosis, pull_seconds
from otelkv.analysis.model import (
    EngineConfig,
    History,
    Leg,
    ResumedFrom,
    Retention,
    RouterInfo,
    Transfer,
    Turn,
)

SCHEMA_VERSION = 1
SCHEMA_FILE = "turn.schema.json"

OUTCOME_OK = "ok"
OUTCOME_INTERRUPTED = "interrupted"
"""The client hung up mid-response (its first token, hence its TTFT, still counts)."""
OUTCOME_ERROR = "error"


def schema() -> dict[str, Any]:
    """The JSON Schema of every document this module writes."""
    return dict(_schema())


@cache
def _schema() -> dict[str, Any]:
    text = resources.files("otelkv.analysis").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    return json.loads(text)  # type: ignore[no-any-return]


def iso(ns: int | None) -> str | None:
    """Unix nanoseconds as ISO 8601 UTC, truncated to microseconds (``2026-12-01T18:32:21.123456Z``)."""
    if ns is None:
        return None
    seconds, rest = divmod(int(ns), 1_000_000_000)
    second = datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{second}.{rest // 1000:06d}Z"


def r6(value: float | None) -> float | None:
    """Seconds rounded to the microsecond (the precision every duration is shown at)."""
    return None if value is None else round(float(value), 6)


def document(kind: str, **fields: Any) -> dict[str, Any]:
    """An answer: ``schema_version`` and ``kind`` first, then the verb's own fields."""
    return {"schema_version": SCHEMA_VERSION, "kind": kind, **fields}


def window(since_ns: int | None, until_ns: int | None) -> dict[str, Any]:
    """A time window as ``since_ns``/``since`` and ``until_ns``/``until`` (None: open)."""
    return {"since_ns": since_ns, "since": iso(since_ns), "until_ns": until_ns, "until": iso(until_ns)}


def diagnosis_object(diagnosis: Diagnosis) -> dict[str, Any]:
    return {
        "id": diagnosis.id,
        "title": diagnosis.title,
        "failure": REGISTRY[diagnosis.id].failure if diagnosis.id in REGISTRY else False,
        "summary": diagnosis.summary,
        "cost_s": r6(diagnosis.cost_s),
        "evidence": dict(diagnosis.evidence),
        "fix": diagnosis.fix,
    }


def turn_outcome(turn: Turn) -> str:
    """``ok``, ``interrupted`` (the client hung up mid-response) or ``error``."""
    if turn.status == names.TURN_STATUS_OK:
        return OUTCOME_OK
    return OUTCOME_INTERRUPTED if turn.status_message == names.CLIENT_DISCONNECTED else OUTCOME_ERROR


def config_object(config: EngineConfig) -> dict[str, Any]:
    """An engine's configuration in force."""
    return {
        "engine_id": config.engine_id,
        "kv_recompute_threshold": config.recompute_threshold,
        "decoder_kv_blocks_ttl_s": config.decoder_ttl_s,
        "bidirectional_kv_xfer": config.bidirectional,
        "kv_load_failure_policy": config.load_failure_policy,
        "model": config.model,
        "block_size": config.block_size,
        "kv_cache_dtype": config.kv_cache_dtype,
        "prefix_caching": config.prefix_caching,
    }


def _transfer(t: Transfer | None) -> dict[str, Any] | None:
    if t is None:
        return None
    return {
        "direction": t.direction,
        "outcome": t.outcome,
        "bytes": t.bytes,
        "tokens": t.tokens,
        "backend": t.backend,
        "xfer_s": r6(t.xfer_s),
        "post_s": r6(t.post_s),
        "wait_s": r6(t.wait_s),
        "start_ns": t.start_ns,
        "start": iso(t.start_ns),
        "end_ns": t.end_ns,
        "end": iso(t.end_ns),
    }


def _retention(r: Retention | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {
        "kind": r.kind,
        "outcome": r.outcome,
        "blocks": r.blocks,
        "bytes": r.bytes,
        "ttl_s": r6(r.ttl_s),
        "held_s": r6(r.held_s),
    }


def leg_object(leg: Leg | None) -> dict[str, Any] | None:
    """What one engine recorded for the turn's request."""
    if leg is None:
        return None
    return {
        "role": leg.role,
        "request_id": leg.request_id,
        "engine_id": leg.engine_id,
        "start_ns": leg.start_ns,
        "start": iso(leg.start_ns),
        "end_ns": leg.end_ns,
        "end": iso(leg.end_ns),
        "duration_s": r6(leg.duration_s),
        "compute_s": r6(leg.compute_s),
        "outcome": leg.outcome,
        "status": leg.status,
        "status_message": leg.status_message,
        "vllm_status": leg.vllm_status,
        "tokens": {
            "prompt": leg.prompt_tokens,
            "computed": leg.computed,
            "local_cache": leg.local_cache,
            "pulled": leg.pulled,
            "remote_reusable": leg.remote_reusable,
            "output": leg.output_tokens,
        },
        "decision": leg.decision,
        "reason": leg.reason,
        "kv_recompute_threshold": leg.threshold,
        "remote_kv_wait_s": r6(leg.remote_kv_wait_s),
        "pull_s": r6(pull_seconds(leg)),
        "kv_params_returned": leg.kv_params_returned,
        "streamed": leg.streamed,
        "context_source": leg.context_source,
        "continuity": (
            {
                "digest": leg.continuity.digest,
                "offered_tokens": leg.continuity.offered,
                "matching_tokens": leg.continuity.matching,
                "first_mismatch": leg.continuity.first_mismatch,
                "mismatch_in": leg.continuity.mismatch_in,
            }
            if leg.continuity
            else None
        ),
        "conversation_id": leg.conversation_id or None,
        "transfer": _transfer(leg.transfer),
        "retention": _retention(leg.retention),
        "config": config_object(leg.config),
    }


def _router(router: RouterInfo | None) -> dict[str, Any] | None:
    if router is None:
        return None
    return {
        "handle": router.handle,
        "handle_age_s": r6(router.handle_age_s),
        "handle_ttl_s": r6(router.handle_ttl_s),
        "decode_streamed": router.decode_streamed,
        "http_status": router.http_status,
        "status": router.status,
        "status_message": router.status_message,
    }


def history_object(history: History | None) -> dict[str, Any] | None:
    """The sidecar's comparison of the request's messages with the conversation's previous request."""
    if history is None:
        return None
    return {
        "previous_messages": history.previous_messages,
        "rewritten_at": history.rewritten_at,
        "id_reused": history.id_reused,
        "previous_answer": history.previous_answer,
    }


def resumed_from_object(resumed: ResumedFrom | None) -> dict[str, Any] | None:
    """The recent turn of another conversation this request continues under a new id."""
    if resumed is None:
        return None
    return {
        "conversation_id": resumed.conversation_id,
        "trace_id": resumed.trace_id or None,
        "gap_s": r6(resumed.gap_s),
        "tokens": resumed.tokens,
        "messages": resumed.messages,
    }


def turn_object(
    turn: Turn, diagnoses: list[Diagnosis] | tuple[Diagnosis, ...] = (), *, offset_s: float | None = None
) -> dict[str, Any]:
    """Everything known about one turn, with its diagnoses (costliest first).

    ``offset_s``: seconds from the conversation's first gap start to this turn's gap start
    (``conversation`` sets it to place turns on one time line; elsewhere it is null).
    """
    phases = turn.phases
    return {
        "trace_id": turn.trace_id,
        "span_id": turn.span_id,
        "source": turn.source,
        "conversation_id": turn.conversation_id,
        "conversation_inferred": turn.conversation_inferred,
        "conversation_id_source": turn.conversation_id_source,
        "turn_index": turn.index,
        "previous_trace_id": turn.previous_trace_id or None,
        "model": turn.model,
        "stream": turn.stream,
        "start_ns": turn.start_ns,
        "start": iso(turn.start_ns),
        "end_ns": turn.end_ns,
        "end": iso(turn.end_ns),
        "offset_s": r6(offset_s),
        "status": turn.status,
        "outcome": turn_outcome(turn),
        "status_message": turn.status_message,
        "http_status": turn.http_status,
        "total_s": r6(turn.total_s),
        "request_s": r6(turn.request_s),
        "gap_s": r6(turn.gap_s),
        "ttft_s": r6(turn.ttft_s),
        "phases": {f"{k}_s": r6(v) for k, v in phases.as_dict().items()} if phases else None,
        "gap_source": phases.gap_source if phases else None,
        "ttft_source": phases.ttft_source if phases else None,
        "usage": {
            "input_tokens": turn.input_tokens,
            "output_tokens": turn.output_tokens,
            "cache_read_input_tokens": turn.cache_read_tokens,
        },
        "finish_reasons": turn.finish_reasons,
        "response_kv_params": turn.response_kv_params,
        "asked_tools": turn.asked_tools,
        "tool_results": turn.tool_results,
        "response_id": turn.response_id,
        "engine_join": {"method": turn.join.method, "evidence": list(turn.join.evidence)}
        if turn.join
        else None,
        "history": history_object(turn.history),
        "resumed_from": resumed_from_object(turn.resumed_from),
        "router": _router(turn.router),
        "prefill": leg_object(turn.prefill),
        "decode": leg_object(turn.decode),
        "diagnoses": [diagnosis_object(d) for d in diagnoses],
    }
