"""Which turns count in a view over a window: the one rule every verb applies.

The reference fleet (:mod:`otelkv.fleet`) sends a warm-up conversation
(:data:`otelkv.names.FLEET_WARMUP_CONVERSATION`) before any workload, so that the first
requests' one-off costs (NIXL handshake, cold caches, first compiles) stay out of what is
measured. Those turns are the harness's, not the agents': ``slow``, ``tune``, ``doctor``,
``funnel`` and ``compare`` leave them out alike, so they count the same turns of a store.
A view asked for one conversation or one turn by name (``conversation ID``, ``why REF``)
still answers for them: nothing is hidden from a user who asks for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from otelkv import names
from otelkv.spans import SpanRecord, attr_str

LEFT_OUT_CONVERSATIONS: frozenset[str] = frozenset({names.FLEET_WARMUP_CONVERSATION})
"""Conversation ids whose turns no view over a window counts."""

_T = TypeVar("_T")


def counted(conversation_id: str | None) -> bool:
    """Whether the turns of this conversation count in views over a window (the rule)."""
    return conversation_id not in LEFT_OUT_CONVERSATIONS


def counted_spans(spans: Iterable[SpanRecord]) -> list[SpanRecord]:
    """The turn spans of :func:`counted` conversations, in their order."""
    return [s for s in spans if counted(attr_str(s.attributes, names.GEN_AI_CONVERSATION_ID))]


def counted_turns(turns: Iterable[_T]) -> list[_T]:
    """The turns (anything with ``conversation_id``) of :func:`counted` conversations, in order."""
    return [t for t in turns if counted(getattr(t, "conversation_id", None))]
