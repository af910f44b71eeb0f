"""The span predicates of :mod:`otelkv.spans.kinds` as ClickHouse SQL over ``otel_traces``.

Values are written as quoted literals derived from :mod:`otelkv.names` (Grafana sends raw
SQL, without bound parameters); they are constants, never user input. The store's queries
and the dashboards' panels use these fragments, so "what counts as a turn span" is the
same in ``otelkv slow``, in a Grafana table and in the analysis.
"""

from __future__ import annotations

from otelkv import names
from otelkv.spans import kinds


def lit(value: str) -> str:
    """A ClickHouse string literal (backslash and quote escaped)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def attr(key: str) -> str:
    """A span attribute (every value is a string in the exporter's ``Map(String, String)``)."""
    return f"SpanAttributes[{lit(key)}]"


def has_attr(key: str) -> str:
    return f"mapContains(SpanAttributes, {lit(key)})"


def name_like(prefix: str) -> str:
    """The name is the template's fixed word alone or followed by its variable part
    (:func:`otelkv.spans.kinds.named`). ``startsWith``, not ``LIKE``: ``_`` in ``kv_request``
    would be a LIKE wildcard."""
    return f"(SpanName = {lit(prefix.rstrip())} OR startsWith(SpanName, {lit(prefix)}))"


def _in(expr: str, values: tuple[str, ...]) -> str:
    return f"{expr} IN ({', '.join(lit(v) for v in values)})"


OPERATION = attr(names.GEN_AI_OPERATION_NAME)

TURN_NAMES = name_like(kinds.TURN_PREFIX)
SIDECAR_TURN_SPANS = (
    f"(ScopeName = {lit(names.SCOPE_SIDECAR)} AND {_in(OPERATION, names.TURN_OPERATIONS)} AND {TURN_NAMES})"
)
"""The sidecar's turn spans (:func:`otelkv.spans.kinds.is_sidecar_turn_span`)."""
AGENT_TURN_SPANS = (
    f"(ScopeName != {lit(names.SCOPE_SIDECAR)} AND {OPERATION} = {lit(names.OPERATION_CHAT)}"
    f" AND {TURN_NAMES} AND {attr(names.TURN_INDEX)} != '')"
)
"""An agent's own turn spans (:func:`otelkv.spans.kinds.is_agent_turn_span`)."""
TURN_SPANS = f"({SIDECAR_TURN_SPANS} OR {AGENT_TURN_SPANS})"
"""Every turn span (:func:`otelkv.spans.kinds.is_turn_span`)."""
_TURN_TOTAL = f"toFloat64OrZero({attr(names.TURN_TOTAL_SECONDS)})"
TURN_LATENCY_S = f"if({_TURN_TOTAL} > 0, {_TURN_TOTAL}, Duration / 1e9)"
"""A turn span's latency in seconds, as ``otelkv slow`` ranks turns: ``otelkv.turn.total_s``,
else (absent or 0) the span's duration."""
TOOL_SPANS = f"({OPERATION} = {lit(names.OPERATION_EXECUTE_TOOL)} OR {name_like(kinds.TOOL_PREFIX)})"
ENGINE_REQUEST_SPANS = f"({name_like(kinds.ENGINE_REQUEST_PREFIX)} AND {has_attr(names.ROLE)})"
PREFILL_SPANS = f"({ENGINE_REQUEST_SPANS} AND {attr(names.ROLE)} = {lit(names.ROLE_PREFILL)})"
_COMPUTED = f"toFloat64OrZero({attr(names.TOKENS_COMPUTED)})"
_WAIT_S = f"toFloat64OrZero({attr(names.REMOTE_KV_WAIT_SECONDS)})"
_COMPUTE_S = f"(Duration / 1e9 - greatest({_WAIT_S}, 0))"
COMPUTE_MEASURING_SPANS = (
    f"({PREFILL_SPANS} AND {attr(names.REQUEST_OUTCOME)} = {lit(names.OUTCOME_FINISHED)}"
    f" AND isFinite({_COMPUTED}) AND isFinite({_WAIT_S})"
    f" AND {_COMPUTED} >= {kinds.MIN_COMPUTED_TOKENS} AND {_COMPUTE_S} > 0)"
)
"""Prefill requests that measure compute: those :func:`otelkv.analysis.model.request_compute_rate`
prices (finished, :data:`otelkv.spans.kinds.MIN_COMPUTED_TOKENS` computed, finite values,
some time left after the KV wait). Values as the exporter writes numbers; forms Python's
``float`` also takes (surrounding spaces, ``1_000``) read as 0 here."""
COMPUTE_RATE_S = f"{_COMPUTE_S} / {_COMPUTED}"
"""Seconds per computed prompt token of a :data:`COMPUTE_MEASURING_SPANS` span, as
:func:`otelkv.analysis.model.request_compute_rate` computes it."""
TRANSFER_SPANS = f"({has_attr(names.TRANSFER_DIRECTION)} OR {name_like(kinds.TRANSFER_PREFIX)})"
RETENTION_SPANS = f"({has_attr(names.RETENTION_KIND)} OR {name_like(kinds.RETENTION_PREFIX)})"
