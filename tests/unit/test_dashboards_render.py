"""The README picture's renderer: it draws a panel from what the panel's own queries return
(expanded as Grafana would), and reports a panel whose queries returned nothing."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from otelkv.dashboards import build
from tools import grafana_expand as expand
from tools.dashboard_picture import legend, render

pytest.importorskip("matplotlib")

END = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
CTX = expand.Context(
    start=END - timedelta(minutes=5),
    end=END,
    interval_s=5,
    scrape_interval_s=1,
    variables={
        "model": expand.Variable(expand.ALL, options=["m"], all_value=".*"),
        "engine": expand.Variable(expand.ALL, options=["e:1"], all_value=".*"),
        "conversation": expand.Variable("c-1"),
    },
)


def _boards() -> dict[str, Any]:
    return {board["uid"]: board for board in build.load().values()}


def test_legend_follows_grafana_legend_format() -> None:
    assert legend("{{phase}} on {{model}}", {"phase": "tool_wait", "model": "m"}) == "tool_wait on m"
    assert legend("", {"__name__": "x", "b": "2", "a": "1"}) == "a=1, b=2"


def test_panels_drawn_from_their_own_expanded_queries(tmp_path: Path) -> None:
    boards = _boards()
    turns, conversation = boards["otelkv-agent-turns"], boards["otelkv-conversation"]
    seen: list[str] = []

    def prom_range(expr: str) -> list[dict[str, Any]]:
        seen.append(expr)
        assert "$" not in expr  # variables and Grafana globals are expanded first
        t0 = CTX.start.timestamp()
        return [
            {"metric": {"phase": p}, "values": [[t0 + i, str(v + i)] for i in range(10)]}
            for p, v in (("input_processing", 1.0), ("generation", 2.0))
        ]

    def prom_instant(expr: str) -> list[dict[str, Any]]:
        return [{"metric": {"turn_index": "0"}, "value": [END.timestamp(), "0.5"]}]

    def sql_rows(sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        assert "$__" not in sql and "toDateTime(" in sql  # the plugin's macros expanded
        return ["turn", "input", "generation"], [("#0", 0.2, 0.4), ("#1", 0.1, 0.5)]

    out = tmp_path / "panels.png"
    drawn = render(
        out,
        [(turns, 9), (turns, 15), (conversation, 3)],
        CTX,
        prom_range=prom_range,
        prom_instant=prom_instant,
        sql_rows=sql_rows,
        title="test",
    )
    assert [d.points for d in drawn] == [20, 2, 4]
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert seen and all("otelkv_turn_phase_seconds" in e for e in seen)


def test_a_panel_whose_queries_return_nothing_draws_nothing(tmp_path: Path) -> None:
    turns = _boards()["otelkv-agent-turns"]
    drawn = render(
        tmp_path / "empty.png",
        [(turns, 9)],
        CTX,
        prom_range=lambda e: [],
        prom_instant=lambda e: [],
        sql_rows=lambda s: ([], []),
    )
    assert drawn[0].points == 0


def test_unknown_panel_and_undrawable_type_are_errors(tmp_path: Path) -> None:
    turns = _boards()["otelkv-agent-turns"]
    none: Any = lambda *_: []  # noqa: E731
    with pytest.raises(KeyError):
        render(tmp_path / "x.png", [(turns, 999)], CTX, prom_range=none, prom_instant=none, sql_rows=none)
    with pytest.raises(ValueError, match="not drawn"):
        render(tmp_path / "x.png", [(turns, 18)], CTX, prom_range=none, prom_instant=none, sql_rows=none)
