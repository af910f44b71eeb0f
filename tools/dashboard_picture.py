"""Draw chosen dashboard panels to a PNG from the same queries Grafana would send.

Why: the README shows what the dashboards show, and that picture must come from a real
run, not a mock-up. Without a Grafana server to screenshot, this draws the panels with
matplotlib from the panels' own queries - PromQL expanded as Grafana expands it and sent
to a real Prometheus, ClickHouse SQL expanded as the plugin does and run on the store -
so a panel whose query is wrong draws nothing, and :func:`render` says so.

Drawn approximately like Grafana: ``timeseries`` as lines (stacked when the panel stacks),
``bargauge`` as horizontal bars of the instant values, ``barchart`` (SQL) as bars per row
with the numeric columns stacked. Other panel types are not drawn.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tools import grafana_expand as expand

PromRange = Callable[[str], list[dict[str, Any]]]
"""An expanded PromQL expression -> Prometheus ``query_range`` result (``matrix`` series)."""
PromInstant = Callable[[str], list[dict[str, Any]]]
"""An expanded PromQL expression -> Prometheus ``query`` result (``vector`` samples)."""
SqlRows = Callable[[str], tuple[list[str], list[tuple[Any, ...]]]]
"""An expanded SQL query -> (column names, rows)."""

_LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_UNITS = {"s": "seconds", "bytes": "bytes", "Bps": "bytes/s", "short": "", "percentunit": "fraction"}


@dataclass(frozen=True)
class Drawn:
    """What one panel drew: how many points (0 means its queries returned nothing)."""

    title: str
    points: int


def _panel(board: Mapping[str, Any], panel_id: int) -> Mapping[str, Any]:
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


def legend(template: str | None, labels: Mapping[str, str]) -> str:
    """A series name the way Grafana's ``legendFormat`` makes it."""
    if not template or template == "__auto":
        inner = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__")
        return inner or "value"
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), template)


def _unit(panel: Mapping[str, Any]) -> str:
    unit = ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("unit") or ""
    if unit.startswith("suffix:"):  # Grafana's custom unit: the text after the colon
        return unit.partition(":")[2].strip()
    return _UNITS.get(unit, unit)


def _stacked(panel: Mapping[str, Any]) -> bool:
    custom = ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("custom") or {}
    return (custom.get("stacking") or {}).get("mode") in ("normal", "percent")


def _draw_timeseries(ax: Any, panel: Mapping[str, Any], ctx: expand.Context, prom_range: PromRange) -> int:
    points = 0
    lines: list[tuple[str, list[datetime], list[float]]] = []
    for target in panel.get("targets") or []:
        for series in prom_range(expand.promql(target["expr"], ctx)):
            xs, ys = [], []
            for ts, value in series.get("values") or []:
                v = float(value)
                if v == v:  # NaN (e.g. 0/0 in a mean) is a gap, as in Grafana
                    xs.append(datetime.fromtimestamp(float(ts), timezone.utc))
                    ys.append(v)
            if xs:
                lines.append((legend(target.get("legendFormat"), series.get("metric") or {}), xs, ys))
                points += len(xs)
    if _stacked(panel) and lines:
        # Stack on the union of timestamps (a series missing at a step counts 0 there).
        stamps = sorted({x for _, xs, _ in lines for x in xs})
        layers = [[dict(zip(xs, ys, strict=True)).get(t, 0.0) for t in stamps] for _, xs, ys in lines]
        ax.stackplot(stamps, layers, labels=[name for name, _, _ in lines], alpha=0.85)
    else:
        for name, xs, ys in lines:
            ax.plot(xs, ys, label=name, linewidth=1.6)
    ax.set_ylabel(_unit(panel))
    ax.tick_params(axis="x", labelrotation=0, labelsize=7)
    import matplotlib.dates as mdates

    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    return points


def _draw_bargauge(ax: Any, panel: Mapping[str, Any], ctx: expand.Context, prom_instant: PromInstant) -> int:
    names, values = [], []
    for target in panel.get("targets") or []:
        for sample in prom_instant(expand.promql(target["expr"], ctx)):
            value = float(sample["value"][1])
            if value == value:
                names.append(legend(target.get("legendFormat"), sample.get("metric") or {}))
                values.append(value)
    ax.barh(names, values, color="#5794f2")
    ax.invert_yaxis()
    ax.set_xlabel(_unit(panel))
    return len(values)


def _draw_sql_bars(ax: Any, panel: Mapping[str, Any], ctx: expand.Context, sql_rows: SqlRows) -> int:
    points = 0
    for target in panel.get("targets") or []:
        columns, rows = sql_rows(expand.clickhouse(target["rawSql"], ctx))
        if not rows:
            continue
        labels = [str(row[0]) for row in rows]
        numeric = [
            i
            for i in range(1, len(columns))
            if all(isinstance(r[i], (int, float)) or r[i] is None for r in rows)
        ]
        bottom = [0.0] * len(rows)
        for i in numeric:
            heights = [float(r[i] or 0) for r in rows]
            ax.bar(labels, heights, bottom=bottom, label=columns[i])
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
            points += len(rows)
        ax.set_ylabel(_unit(panel))
        ax.tick_params(axis="x", labelsize=7)
    return points


def render(
    out: Path,
    panels: Sequence[tuple[Mapping[str, Any], int]],
    ctx: expand.Context,
    *,
    prom_range: PromRange,
    prom_instant: PromInstant,
    sql_rows: SqlRows,
    title: str = "",
    columns: int = 2,
) -> list[Drawn]:
    """Draw ``panels`` (dashboard JSON, panel id) into ``out``; returns what each drew."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(7 * columns, 3.6 * rows), squeeze=False)
    drawn = []
    for ax, (board, panel_id) in zip(axes.flat, panels, strict=False):
        panel = _panel(board, panel_id)
        kind = panel.get("type")
        if kind == "timeseries":
            points = _draw_timeseries(ax, panel, ctx, prom_range)
        elif kind == "bargauge":
            points = _draw_bargauge(ax, panel, ctx, prom_instant)
        elif kind == "barchart":
            points = _draw_sql_bars(ax, panel, ctx, sql_rows)
        else:
            raise ValueError(f"panel {panel_id} is a {kind}: not drawn by otelkv's renderer")
        ax.set_title(f"{board.get('title')}: {panel.get('title')}", fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", framealpha=0.7)
        drawn.append(Drawn(str(panel.get("title")), points))
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn
