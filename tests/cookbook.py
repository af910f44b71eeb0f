"""The queries of ``docs/queries.md``, read from the page itself, ready to run.

The unit test (``tests/unit/test_queries_doc.py``) and the real-fleet test
(``tests/fleet/test_gallery.py``) both take the queries from the page, so what they check is
what a reader pastes. A query is named by the ``###`` heading it sits under; SQL goes through
Grafana's ClickHouse substitutions (``tools.grafana_expand``) for a chosen time range.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tools import grafana_expand as expand

PAGE = Path(__file__).resolve().parents[1] / "docs" / "queries.md"

CONVERSATION_LINE = re.compile(r"^(\s*)'([^']*)' AS wanted,$", re.MULTILINE)
"""The line where a reader puts the conversation id (``'research-agent' AS wanted,``)."""


@dataclass(frozen=True)
class Query:
    heading: str
    language: str
    text: str


def queries(page: Path = PAGE) -> list[Query]:
    """Every fenced ``sql`` and ``traceql`` block, in page order, with its heading."""
    found: list[Query] = []
    heading = ""
    block: list[str] | None = None
    language = ""
    for line in page.read_text().splitlines():
        if block is not None:
            if line.strip() == "```":
                found.append(Query(heading, language, "\n".join(block)))
                block = None
            else:
                block.append(line)
        elif line.startswith("### "):
            heading = line[4:].strip()
        elif line.startswith("```") and line[3:].strip() in ("sql", "traceql"):
            language = line[3:].strip()
            block = []
    return found


def of(language: str, page: Path = PAGE) -> list[Query]:
    return [q for q in queries(page) if q.language == language]


def sql(heading: str, page: Path = PAGE) -> str:
    """The one SQL block under ``heading``."""
    (query,) = [q.text for q in of("sql", page) if q.heading == heading]
    return query


def runnable(text: str, start: datetime, end: datetime, *, conversation: str | None = None) -> str:
    """The SQL as Grafana sends it for the range ``start``..``end`` (and, for a query with a
    ``'...' AS wanted`` line, with ``conversation`` put there)."""
    if conversation is not None:
        quoted = conversation.replace("\\", "\\\\").replace("'", "\\'")
        text, count = CONVERSATION_LINE.subn(lambda m: f"{m.group(1)}'{quoted}' AS wanted,", text)
        assert count == 1, "the query has no conversation line to fill"
    return expand.clickhouse(text, expand.Context(start=start, end=end, interval_s=15.0))
