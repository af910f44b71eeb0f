"""TraceQL text for the Tempo panels, with attribute keys from :mod:`otelkv.names`.

Tempo stores the same spans the trace store holds (the collector exports to both), so the
Tempo panels ask the same questions by span attribute. Dotted keys such as
``gen_ai.conversation.id`` need no quoting in TraceQL (``span.gen_ai.conversation.id``);
values are TraceQL strings. A template variable is interpolated by Grafana before Tempo
parses the query, so a value goes in through Grafana's ``doublequote`` format
(:func:`string_var`), which quotes it and escapes its ``"``: a conversation id containing
a quote then still yields a valid query instead of a syntax error.
"""

from __future__ import annotations

import json
from collections.abc import Sequence


def span(key: str) -> str:
    """A span-scoped attribute reference."""
    return f"span.{key}"


def string(value: str) -> str:
    """A TraceQL string literal (double-quoted; ``$var`` inside stays for Grafana)."""
    return json.dumps(value)


def string_var(name: str) -> str:
    """A TraceQL string holding dashboard variable ``name``'s value, quoted by Grafana.

    ``"$name"`` would break on a value containing ``"``; ``${name:doublequote}`` makes
    Grafana write ``"value"`` with each ``"`` escaped as ``\\"``.
    """
    return "${" + name + ":doublequote}"


def spanset(*conditions: str) -> str:
    """``{ a && b }``: spans matching every condition."""
    return "{ " + " && ".join(conditions) + " }"


def select(query: str, keys: Sequence[str]) -> str:
    """Add the columns a span table shows."""
    return f"{query} | select({', '.join(span(k) for k in keys)})"


def child(parent: str, children: str) -> str:
    """Spans of ``children`` whose direct parent matches ``parent``."""
    return f"{parent} > {children}"
