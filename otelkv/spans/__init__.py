"""The span core every layer reads: the record, its attribute getters and what a span is.

It depends only on :mod:`otelkv.names`. The store writes and reads :class:`SpanRecord`,
the analysis builds turns from it, the sidecar decodes OTLP into it; none of them defines
a span kind or reads an attribute another way.
"""

from otelkv.spans.attrs import (
    attr_bool,
    attr_float,
    attr_int,
    attr_map,
    attr_str,
    attr_value,
    opt_bool,
    opt_float,
    opt_int,
    opt_str,
)
from otelkv.spans.kinds import (
    is_agent_turn_span,
    is_engine_request,
    is_prefill_request,
    is_retention,
    is_router_span,
    is_sidecar_turn_span,
    is_tool_span,
    is_transfer,
    is_turn_span,
)
from otelkv.spans.record import SpanRecord

__all__ = [
    "SpanRecord",
    "attr_bool",
    "attr_float",
    "attr_int",
    "attr_map",
    "attr_str",
    "attr_value",
    "is_agent_turn_span",
    "is_engine_request",
    "is_prefill_request",
    "is_retention",
    "is_router_span",
    "is_sidecar_turn_span",
    "is_tool_span",
    "is_transfer",
    "is_turn_span",
    "opt_bool",
    "opt_float",
    "opt_int",
    "opt_str",
]
