"""Draw chosen dashboard panels to a PNG, as Grafana would, from the same queries Grafana sends.

Why: the README shows what the dashboards show, and that picture must come from a real
run, not a mock-up. Without a Grafana server to screenshot, this draws the panels with
matplotlib from the panels' own queries - PromQL expanded as Grafana expands it and sent
to a real Prometheus, ClickHouse SQL expanded as the plugin does and run on the store -
so a panel whose query is wrong draws nothing, and :func:`render` says so.

Everything about a panel's look comes from the committed dashboard JSON, through
:mod:`tools.grafana_style` (and is drawn by :mod:`tools.panel_draw`): each field's colour
(overrides, fixed colours, the classic palette by series index, thresholds), unit and
decimals on the axis, in the legend and on bar gauges; the panel's size from its
``gridPos``; fill opacity, line width, stacking, draw style, thresholds style and legend
options from ``fieldConfig``/``options``; one Grafana theme (dark or light) for everything.
Drawn like Grafana's panels: ``timeseries`` (lines, bars or points; stacked or not; a
missing step is a gap unless the field spans nulls), ``bargauge`` (the instant values as
horizontal gauges with their value text), ``barchart`` (SQL rows as
bars per category, stacked or grouped). Other panel types are refused.

:func:`recorder` keeps every query result a render used; ``python -m tools.dashboard_picture
RECORDING OUT.png`` draws the picture again from such a recording with the dashboards as
committed now, so a change of colours or units reaches the README without a new run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any

from tools import grafana_expand as expand
from tools import grafana_style as gs
from tools import panel_draw as draw

PromRange = Callable[[str], list[dict[str, Any]]]
"""An expanded PromQL expression -> Prometheus ``query_range`` result (``matrix`` series)."""
PromInstant = Callable[[str], list[dict[str, Any]]]
"""An expanded PromQL expression -> Prometheus ``query`` result (``vector`` samples)."""
SqlRows = Callable[[str], tuple[list[str], list[tuple[Any, ...]]]]
"""An expanded SQL query -> (column names, rows)."""

_LEGEND_TEMPLATE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


@dataclass(frozen=True)
class Drawn:
    """What one panel drew: how many points (0 means its queries returned nothing)."""

    title: str
    points: int


def legend(template: str | None, labels: Mapping[str, str]) -> str:
    """A series name the way Grafana's ``legendFormat`` makes it."""
    if not template or template == "__auto":
        inner = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__")
        return inner or "value"
    return _LEGEND_TEMPLATE.sub(lambda m: labels.get(m.group(1), ""), template)


def find_panel(board: Mapping[str, Any], panel_id: int) -> Mapping[str, Any]:
    """The panel with ``id`` ``panel_id``, also inside collapsed rows."""

    def walk(panels: Sequence[Mapping[str, Any]]) -> Any:
        for panel in panels:
            if panel.get("id") == panel_id:
                return panel
            found = walk(panel.get("panels") or [])
            if found is not None:
                return found
        return None

    panel = walk(board.get("panels") or [])
    if panel is None:
        raise KeyError(f"dashboard {board.get('uid')} has no panel {panel_id}")
    return panel  # type: ignore[no-any-return]


# --- data: the fields a panel draws ----------------------------------------------------------


def _targets(panel: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [t for t in panel.get("targets") or [] if not t.get("hide")]


def timeseries_fields(
    panel: Mapping[str, Any], ctx: expand.Context, prom_range: PromRange, step: float
) -> list[draw.Series]:
    """Every series of the panel's range queries, in query then Prometheus order, gaps as NaN.

    ``step`` is the query's step (Grafana's interval); samples closer together than that
    mean a finer step, which is then the one a missing sample is measured against.
    """
    raw: list[tuple[Mapping[str, Any], Mapping[str, Any], list[tuple[float, float]]]] = []
    for target in _targets(panel):
        for series in prom_range(expand.promql(target["expr"], ctx)):
            samples = [(float(t), float(v)) for t, v in series.get("values") or []]
            if samples:
                raw.append((target, series, samples))
    spacing = [b[0] - a[0] for _, _, samples in raw for a, b in pairwise(samples)]
    step = min([step, *(d for d in spacing if d > 0)])
    out: list[draw.Series] = []
    for target, series, samples in raw:
        times, values = gs.with_gaps([t for t, _ in samples], [v for _, v in samples], step)
        name = legend(target.get("legendFormat"), series.get("metric") or {})
        config = gs.field_config(panel, name, ref_id=str(target.get("refId", "")))
        field = gs.Field(gs.display_name(config, name), config, len(out), values)
        out.append(draw.Series(field, times))
    return out


def instant_fields(
    panel: Mapping[str, Any], ctx: expand.Context, prom_instant: PromInstant
) -> list[gs.Field]:
    """Every sample of the panel's instant queries as one field each (a bar gauge's bars)."""
    out: list[gs.Field] = []
    for target in _targets(panel):
        for sample in prom_instant(expand.promql(target["expr"], ctx)):
            value = float(sample["value"][1])
            if math.isnan(value):
                continue
            name = legend(target.get("legendFormat"), sample.get("metric") or {})
            config = gs.field_config(panel, name, ref_id=str(target.get("refId", "")))
            out.append(gs.Field(gs.display_name(config, name), config, len(out), [value]))
    return out


def table_fields(
    panel: Mapping[str, Any], ctx: expand.Context, sql_rows: SqlRows
) -> tuple[list[str], list[gs.Field]]:
    """A bar chart's categories (its x field) and value fields, from its first query with rows."""
    for target in _targets(panel):
        columns, rows = sql_rows(expand.clickhouse(target["rawSql"], ctx))
        if not rows:
            continue
        x_name = (panel.get("options") or {}).get("xField")
        numeric = [
            i
            for i, column in enumerate(columns)
            if column != x_name and all(isinstance(r[i], (int, float)) or r[i] is None for r in rows)
        ]
        x_index = (
            columns.index(x_name)
            if x_name in columns
            else next(i for i in range(len(columns)) if i not in numeric)
        )
        categories = [str(row[x_index]) for row in rows]
        fields = []
        for i in numeric:
            config = gs.field_config(panel, columns[i], ref_id=str(target.get("refId", "")))
            values = [math.nan if r[i] is None else float(r[i]) for r in rows]
            fields.append(gs.Field(gs.display_name(config, columns[i]), config, len(fields), values))
        return categories, fields
    return [], []


def render(
    out: Path,
    panels: Sequence[tuple[Mapping[str, Any], int]],
    ctx: expand.Context,
    *,
    prom_range: PromRange,
    prom_instant: PromInstant,
    sql_rows: SqlRows,
    title: str = "",
    theme: str = "dark",
) -> list[Drawn]:
    """Draw ``panels`` (dashboard JSON, panel id) into ``out``, laid out by their ``gridPos``
    sizes; returns what each drew. The time axis is ``ctx``'s range and a missing step of
    ``ctx.interval_s`` is a gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = gs.THEMES[theme]
    chosen = [(board, find_panel(board, panel_id)) for board, panel_id in panels]
    for _, panel in chosen:
        if panel.get("type") not in ("timeseries", "bargauge", "barchart"):
            raise ValueError(
                f"panel {panel.get('id')} is a {panel.get('type')}: not drawn by otelkv's renderer"
            )
    sizes = [
        (int((p.get("gridPos") or {}).get("w", 12)), int((p.get("gridPos") or {}).get("h", 8)))
        for _, p in chosen
    ]
    cells = gs.layout(sizes)
    title_px = 44.0 if title else 0.0
    pad = 16.0
    col_px = (draw.WIDTH_PX - 2 * pad + draw.MARGIN_PX) / gs.GRID_COLUMNS
    unit_px = draw.ROW_PX + draw.MARGIN_PX
    rows_px = max((c.y + c.h) for c in cells) * unit_px - draw.MARGIN_PX if cells else 0
    height = title_px + 2 * pad + rows_px
    fig = plt.figure(
        figsize=(draw.WIDTH_PX / draw.DPI, height / draw.DPI), dpi=draw.DPI, facecolor=style.canvas
    )
    canvas = draw.Canvas(fig, draw.WIDTH_PX, height)
    if title:
        canvas.text(
            draw.WIDTH_PX / 2, pad + 14, title, color=style.text, fontsize=12, ha="center", va="center"
        )
    step = float(ctx.interval_s)
    drawn = []
    for (board, panel), cell in zip(chosen, cells, strict=True):
        box = draw.Box(
            pad + cell.x * col_px,
            title_px + pad + cell.y * unit_px,
            cell.w * col_px - draw.MARGIN_PX,
            cell.h * unit_px - draw.MARGIN_PX,
        )
        if not panel.get("transparent"):
            canvas.rect(
                box.left,
                box.top,
                box.width,
                box.height,
                facecolor=style.panel,
                edgecolor=style.border,
                zorder=-1,
            )
        # The panel's own title, as Grafana shows it; its dashboard (the picture mixes three)
        # in the header's right corner, where Grafana puts the panel's menu.
        canvas.text(
            box.left + draw.PAD_PX,
            box.top + draw.HEADER_PX / 2,
            str(panel.get("title") or ""),
            color=style.text,
            fontsize=10,
            va="center",
        )
        board_title = str(board.get("title") or "")
        room = box.width - 2 * draw.PAD_PX - draw.text_px(str(panel.get("title") or ""), 10) - 16
        canvas.text(
            box.left + box.width - draw.PAD_PX,
            box.top + draw.HEADER_PX / 2,
            board_title if draw.text_px(board_title) <= room else "",
            color=style.text_secondary,
            fontsize=draw.FONT_PT,
            ha="right",
            va="center",
        )
        content = draw.Box(
            box.left + draw.PAD_PX,
            box.top + draw.HEADER_PX,
            box.width - 2 * draw.PAD_PX,
            box.height - draw.HEADER_PX - draw.PAD_PX,
        )
        kind = panel.get("type")
        if kind == "timeseries":
            points = draw.draw_timeseries(
                canvas, content, panel, timeseries_fields(panel, ctx, prom_range, step), ctx, step, style
            )
        elif kind == "bargauge":
            points = draw.draw_bargauge(
                canvas, content, panel, instant_fields(panel, ctx, prom_instant), style
            )
        else:
            categories, fields = table_fields(panel, ctx, sql_rows)
            points = draw.draw_barchart(canvas, content, panel, categories, fields, style)
        drawn.append(Drawn(str(panel.get("title")), points))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=draw.DPI, facecolor=style.canvas)
    plt.close(fig)
    return drawn


# --- recording and replay --------------------------------------------------------------------


def recorder(
    prom_range: PromRange, prom_instant: PromInstant, sql_rows: SqlRows
) -> tuple[PromRange, PromInstant, SqlRows, dict[str, dict[str, Any]]]:
    """The three query functions, each keeping what it returned in the dict returned last."""
    kept: dict[str, dict[str, Any]] = {"range": {}, "instant": {}, "sql": {}}

    def keep_range(expr: str) -> list[dict[str, Any]]:
        kept["range"][expr] = prom_range(expr)
        return kept["range"][expr]  # type: ignore[no-any-return]

    def keep_instant(expr: str) -> list[dict[str, Any]]:
        kept["instant"][expr] = prom_instant(expr)
        return kept["instant"][expr]  # type: ignore[no-any-return]

    def keep_sql(sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        columns, rows = sql_rows(sql)
        kept["sql"][sql] = [columns, [list(r) for r in rows]]
        return columns, rows

    return keep_range, keep_instant, keep_sql, kept


def save_recording(
    path: Path,
    kept: Mapping[str, Any],
    ctx: expand.Context,
    panels: Sequence[tuple[str, int]],
    title: str,
) -> None:
    """Write a recording: the queries' results, the time range, the variables and the panels."""
    variables = {
        name: {
            "selected": v.selected if isinstance(v.selected, str) else list(v.selected),
            "options": list(v.options),
            "all_value": v.all_value,
        }
        for name, v in ctx.variables.items()
    }
    document = {
        "start": ctx.start.timestamp(),
        "end": ctx.end.timestamp(),
        "interval_s": ctx.interval_s,
        "scrape_interval_s": ctx.scrape_interval_s,
        "variables": variables,
        "panels": [list(p) for p in panels],
        "title": title,
        **kept,
    }
    path.write_text(json.dumps(document, default=str, sort_keys=True))


def replay(
    recording: Path, out: Path, boards: Mapping[str, Mapping[str, Any]], theme: str = "dark"
) -> list[Drawn]:
    """Draw a recording's panels again, from the dashboards in ``boards`` (by uid)."""
    doc = json.loads(recording.read_text())
    ctx = expand.Context(
        start=datetime.fromtimestamp(doc["start"], timezone.utc),
        end=datetime.fromtimestamp(doc["end"], timezone.utc),
        interval_s=doc["interval_s"],
        scrape_interval_s=doc["scrape_interval_s"],
        variables={
            name: expand.Variable(v["selected"], options=v["options"], all_value=v["all_value"])
            for name, v in doc["variables"].items()
        },
    )

    def lookup(kind: str) -> Callable[[str], Any]:
        def get(query: str) -> Any:
            if query not in doc[kind]:
                raise KeyError(f"the recording has no result for this query (re-run the fleet test): {query}")
            return doc[kind][query]

        return get

    def sql(query: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        columns, rows = lookup("sql")(query)
        return columns, [tuple(r) for r in rows]

    panels = [(boards[uid], int(panel)) for uid, panel in doc["panels"]]
    return render(
        out,
        panels,
        ctx,
        prom_range=lookup("range"),
        prom_instant=lookup("instant"),
        sql_rows=sql,
        title=doc.get("title", ""),
        theme=theme,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tools.dashboard_picture RECORDING OUT.png [--theme light]``."""
    parser = argparse.ArgumentParser(prog="python -m tools.dashboard_picture", description=main.__doc__)
    parser.add_argument("recording", type=Path, help="a recording written by the fleet dashboards test")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--theme", choices=sorted(gs.THEMES), default="dark")
    parser.add_argument(
        "--dashboards", type=Path, default=Path("dashboards"), help="the dashboard JSON directory"
    )
    args = parser.parse_args(argv)
    try:
        boards = {}
        for path in sorted(args.dashboards.glob("*.json")):
            board = json.loads(path.read_text(encoding="utf-8"))
            boards[board["uid"]] = board
        drawn = replay(args.recording, args.out, boards, args.theme)
    except (OSError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for d in drawn:
        print(f"{d.points:6d} points  {d.title}")
    return 0 if all(d.points > 0 for d in drawn) else 1


if __name__ == "__main__":
    sys.exit(main())
