"""How each panel type is drawn, in pixels inside its panel, the way Grafana lays it out.

The drawing half of :mod:`tools.dashboard_picture`: a time series (lines, bars or points,
stacked or not, thresholds, a list or table legend with its calcs), a bar gauge (horizontal
gauges with name and value, gradient or solid, unfilled track) and a bar chart (stacked or
grouped bars per category). Colours, units and gaps come from :mod:`tools.grafana_style`;
every size is in pixels of a dashboard :data:`WIDTH_PX` wide at :data:`DPI`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timezone
from typing import Any

from tools import grafana_expand as expand
from tools import grafana_style as gs

WIDTH_PX = 1600
"""The picture's width: a dashboard on a common laptop screen."""
DPI = 100
ROW_PX, MARGIN_PX, HEADER_PX, PAD_PX = 30, 8, 32, 8
"""Grafana's grid row height and gap, a panel's header height and its padding (pixels)."""
FONT_PT = 8.5
"""12 px text (axis ticks, legends) at :data:`DPI`."""

_CALC_TITLES = {
    "mean": "Mean",
    "max": "Max",
    "min": "Min",
    "last": "Last",
    "lastNotNull": "Last *",
    "first": "First",
    "firstNotNull": "First *",
    "sum": "Total",
    "count": "Count",
    "range": "Range",
    "delta": "Delta",
}
"""Legend calcs (``options.legend.calcs``) and the column titles Grafana gives them."""


@dataclass(frozen=True)
class Series:
    """A time series field: its Grafana field, and its samples with gaps as NaN."""

    field: gs.Field
    times: list[float]


def span_nulls(times: Sequence[float], values: Sequence[float], span: Any) -> tuple[list[float], list[float]]:
    """The points a line joins: ``spanNulls`` true joins across every null, a number (ms) across
    shorter gaps; false (Grafana's default) joins none, so each null stays a break."""
    if span is True:
        kept = [(t, v) for t, v in zip(times, values, strict=True) if not math.isnan(v)]
        return [t for t, _ in kept], [v for _, v in kept]
    if isinstance(span, (int, float)) and not isinstance(span, bool) and span > 0:
        out_t, out_v = [], []
        i = 0
        while i < len(values):
            if math.isnan(values[i]):
                j = i
                while j < len(values) and math.isnan(values[j]):
                    j += 1
                before = times[i - 1] if i > 0 else times[i]
                after = times[j] if j < len(times) else times[-1]
                if not (0 < i and j < len(values) and (after - before) * 1000 <= span):
                    out_t.append(times[i])
                    out_v.append(math.nan)
                i = j
                continue
            out_t.append(times[i])
            out_v.append(values[i])
            i += 1
        return out_t, out_v
    return list(times), list(values)


def calc(name: str, values: Sequence[float]) -> float | None:
    """A legend calculation (``reducers``) over a field's values; nulls are skipped except by ``last``."""
    present = [v for v in values if not math.isnan(v)]
    if name == "last":
        return values[-1] if values and not math.isnan(values[-1]) else None
    if name == "count":
        return float(len(values))
    if not present:
        return None
    return {
        "mean": lambda: sum(present) / len(present),
        "max": lambda: max(present),
        "min": lambda: min(present),
        "lastNotNull": lambda: present[-1],
        "first": lambda: present[0],
        "firstNotNull": lambda: present[0],
        "sum": lambda: sum(present),
        "range": lambda: max(present) - min(present),
        "delta": lambda: present[-1] - present[0],
    }.get(name, lambda: None)()


# --- drawing ---------------------------------------------------------------------------------


class Canvas:
    """The figure in pixels from the top left, the way a dashboard is laid out."""

    def __init__(self, fig: Any, width: float, height: float) -> None:
        self.fig, self.width, self.height = fig, width, height

    def axes(self, left: float, top: float, width: float, height: float, **kwargs: Any) -> Any:
        rect = [left / self.width, 1 - (top + height) / self.height, width / self.width, height / self.height]
        return self.fig.add_axes(rect, **kwargs)

    def text(self, x: float, y: float, text: str, **kwargs: Any) -> Any:
        return self.fig.text(x / self.width, 1 - y / self.height, text, **kwargs)

    def rect(self, left: float, top: float, width: float, height: float, **kwargs: Any) -> None:
        from matplotlib.patches import FancyBboxPatch

        box = FancyBboxPatch(
            (left / self.width, 1 - (top + height) / self.height),
            width / self.width,
            height / self.height,
            boxstyle="round,pad=0,rounding_size=0.002",
            transform=self.fig.transFigure,
            **kwargs,
        )
        self.fig.patches.append(box)


@dataclass(frozen=True)
class Box:
    left: float
    top: float
    width: float
    height: float


def text_px(text: str, size: float = FONT_PT) -> float:
    """How wide ``text`` is drawn at ``size`` points, in pixels (for legends and gauges' columns)."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    width, _, _ = TextToPath().get_text_width_height_descent(text, FontProperties(size=size), ismath=False)
    return float(width) * DPI / 72.0


def _style_axes(ax: Any, theme: gs.Theme) -> None:
    ax.set_facecolor("none")
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(colors=theme.text_secondary, labelsize=FONT_PT, length=0, pad=6)
    ax.grid(True, color=theme.grid, linewidth=1.0)
    ax.set_axisbelow(True)


def y_axis(ax: Any, top: float, bottom: float, config: Mapping[str, Any], height_px: float) -> None:
    """A value axis from ``bottom`` to a nice tick at or above ``top``, labels in the field's unit."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator

    low = float(config["min"]) if config.get("min") is not None else min(0.0, bottom)
    high = float(config["max"]) if config.get("max") is not None else max(top, low)
    if high <= low:
        high = low + 1.0
    ticks = MaxNLocator(nbins=max(2, int(height_px // 36)), steps=[1, 2, 2.5, 5, 10]).tick_values(low, high)
    if config.get("max") is None:
        high = max(high, float(ticks[-1]))
    ticks = [t for t in ticks if low - 1e-9 <= t <= high + 1e-9]
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    ax.set_ylim(low, high)
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: gs.axis_label(v, step, config)))


def _legend(
    canvas: Canvas,
    box: Box,
    options: Mapping[str, Any],
    entries: Sequence[tuple[str, str, Mapping[str, Any], Sequence[float]]],
    theme: gs.Theme,
) -> None:
    """A Grafana legend under the plot: a list of swatches, or a table with the chosen calcs."""
    calcs = [c for c in options.get("calcs") or [] if c in _CALC_TITLES]
    rows = [
        (name, colour, [calc(c, values) for c in calcs], config) for name, colour, config, values in entries
    ]
    sort_by, desc = options.get("sortBy"), bool(options.get("sortDesc"))
    if sort_by in [_CALC_TITLES[c] for c in calcs]:
        k = [_CALC_TITLES[c] for c in calcs].index(sort_by)
        rows.sort(key=lambda r: (r[2][k] is None, -(r[2][k] or 0) if desc else (r[2][k] or 0)))
    if options.get("displayMode") == "table":
        col_w = 80.0
        y = box.top + 10
        for k, c in enumerate(calcs):
            x = box.left + box.width - (len(calcs) - 1 - k) * col_w - 4
            canvas.text(
                x, y, _CALC_TITLES[c], color=theme.text_secondary, fontsize=FONT_PT, ha="right", va="center"
            )
        for name, colour, values, config in rows:
            y += 19
            canvas.rect(box.left + 2, y - 1.5, 14, 3, facecolor=colour, edgecolor="none", zorder=5)
            canvas.text(box.left + 22, y, name, color=theme.text, fontsize=FONT_PT, va="center")
            for k, value in enumerate(values):
                x = box.left + box.width - (len(calcs) - 1 - k) * col_w - 4
                label = gs.value_label(value, config)
                canvas.text(x, y, label, color=theme.text, fontsize=FONT_PT, ha="right", va="center")
        return
    x, y = box.left, box.top + 10
    for name, colour, _, _ in rows:
        width = 22 + text_px(name) + 16
        if x + width > box.left + box.width and x > box.left:
            x, y = box.left, y + 19
        canvas.rect(x + 2, y - 1.5, 14, 3, facecolor=colour, edgecolor="none", zorder=5)
        canvas.text(x + 22, y, name, color=theme.text, fontsize=FONT_PT, va="center")
        x += width


def _legend_height(options: Mapping[str, Any], names: Sequence[str], width: float) -> float:
    if options.get("showLegend") is False or options.get("displayMode") == "hidden" or not names:
        return 0.0
    if options.get("displayMode") == "table":
        return 19.0 * (len(names) + 1) + 4
    lines, x = 1, 0.0
    for name in names:
        w = 22 + text_px(name) + 16
        if x + w > width and x > 0:
            lines, x = lines + 1, 0.0
        x += w
    return 19.0 * lines + 6


def _plot_box(content: Box, legend_h: float) -> Box:
    """The plotting area inside a panel's content: room for y labels on the left, times below."""
    left_pad, bottom_pad = 64.0, 26.0
    return Box(
        content.left + left_pad,
        content.top + 4,
        content.width - left_pad - 8,
        content.height - legend_h - bottom_pad - 4,
    )


def _thresholds(ax: Any, config: Mapping[str, Any], theme: gs.Theme) -> None:
    """The panel's thresholds on a time series, as ``custom.thresholdsStyle`` asks: a line
    (solid or dashed) at each step and/or the area of each step in its colour, faintly."""
    mode = str(((config.get("custom") or {}).get("thresholdsStyle") or {}).get("mode", "off"))
    steps = (config.get("thresholds") or {}).get("steps") or []
    if mode == "off" or not steps or (config.get("thresholds") or {}).get("mode") == "percentage":
        return
    low, high = ax.get_ylim()
    for k, step in enumerate(steps):
        colour = gs.color(step.get("color"), theme)
        start = low if step.get("value") is None else float(step["value"])
        end = float(steps[k + 1]["value"]) if k + 1 < len(steps) else high
        if "area" in mode and start < high:
            ax.axhspan(max(start, low), min(end, high), color=colour, alpha=0.15, linewidth=0, zorder=0)
        if ("line" in mode or "dashed" in mode) and step.get("value") is not None and low < start <= high:
            ax.axhline(start, color=colour, linewidth=1, linestyle=(0, (10, 10)) if "dashed" in mode else "-")
    ax.set_ylim(low, high)


def time_locator(maxticks: int) -> Any:
    """Matplotlib's date locator, able to place at most ``maxticks`` ticks on any span: its
    default intervals stop at 30 s and 30 min, so a 100 s run on a narrow panel (3 ticks) found
    none and warned; 60 closes those gaps, and 2 ticks are enough to switch to minutes."""
    import matplotlib.dates as mdates

    locator = mdates.AutoDateLocator(minticks=2, maxticks=maxticks)
    locator.intervald[mdates.SECONDLY] = [1, 2, 5, 10, 15, 30, 60]
    locator.intervald[mdates.MINUTELY] = [1, 2, 5, 10, 15, 30, 60]
    return locator


def draw_timeseries(
    canvas: Canvas,
    content: Box,
    panel: Mapping[str, Any],
    fields: Sequence[Series],
    ctx: expand.Context,
    step: float,
    theme: gs.Theme,
) -> int:
    import matplotlib.dates as mdates
    import numpy as np

    options = (panel.get("options") or {}).get("legend") or {}
    shown = [s for s in fields if not ((s.field.config.get("custom") or {}).get("hideFrom") or {}).get("viz")]
    in_legend = [
        s for s in shown if not ((s.field.config.get("custom") or {}).get("hideFrom") or {}).get("legend")
    ]
    legend_h = _legend_height(options, [s.field.name for s in in_legend], content.width)
    box = _plot_box(content, legend_h)
    ax = canvas.axes(box.left, box.top, box.width, box.height)
    _style_axes(ax, theme)
    day = 86400.0
    x0, x1 = ctx.start.timestamp(), ctx.end.timestamp()
    stacked_groups: dict[str, list[Series]] = {}
    for s in shown:
        stacking = (s.field.config.get("custom") or {}).get("stacking") or {}
        if stacking.get("mode") in ("normal", "percent"):
            stacked_groups.setdefault(f"{stacking.get('mode')}:{stacking.get('group', 'A')}", []).append(s)
    bounds: dict[int, tuple[list[float], list[float], list[float]]] = {}
    for key, group in stacked_groups.items():
        stamps = sorted({t for s in group for t in s.times})
        rows = gs.on_grid(stamps, [(s.times, s.field.values) for s in group])
        for s, (bottom, top) in zip(group, gs.stack(rows, percent=key.startswith("percent")), strict=True):
            bounds[s.field.series_index] = (stamps, bottom, top)
    high, low, points = 0.0, 0.0, 0
    all_bars: list[gs.Bar] = []
    for s in shown:
        custom = s.field.config.get("custom") or {}
        colour = gs.series_color(s.field, theme)
        times, bottom, top = bounds.get(
            s.field.series_index, (s.times, [0.0] * len(s.times), list(s.field.values))
        )
        line_w = float(custom.get("lineWidth", 1))
        fill = float(custom.get("fillOpacity", 0)) / 100.0
        style = custom.get("drawStyle", "line")
        points += sum(1 for v in s.field.values if not math.isnan(v))
        finite = [v for v in top if not math.isnan(v)]
        if finite:
            high, low = max(high, max(finite)), min(low, min(finite))
        if style == "bars":
            factor = float(custom.get("barWidthFactor", 0.6))
            bars = gs.time_bars(times, top, step, factor, bottoms=bottom)
            all_bars += bars
            ax.bar(
                [b.left / day for b in bars],
                [b.top - b.bottom for b in bars],
                width=[b.width / day for b in bars],
                bottom=[b.bottom for b in bars],
                align="edge",
                color=colour,
                alpha=max(fill, 0.1) if fill else 1.0,
                edgecolor=colour,
                linewidth=line_w if fill else 0,
            )
            continue
        line_t, line_v = span_nulls(times, top, custom.get("spanNulls", False))
        # The fill's lower edge has its nulls where the line has them, so both join alike.
        bottom = [math.nan if math.isnan(t) else b for b, t in zip(bottom, top, strict=True)]
        _, line_b = span_nulls(times, bottom, custom.get("spanNulls", False))
        xs = np.array(line_t) / day
        ys = np.array(line_v, dtype=float)
        drawstyle = {"stepAfter": "steps-post", "stepBefore": "steps-pre"}.get(
            custom.get("lineInterpolation"), "default"
        )
        if style != "points" and line_w > 0:
            ax.plot(xs, ys, color=colour, linewidth=line_w, drawstyle=drawstyle, solid_joinstyle="round")
        if fill > 0 and style != "points":
            step_fill = {"steps-post": "post", "steps-pre": "pre"}.get(drawstyle)
            ax.fill_between(
                xs,
                np.array(line_b, dtype=float),
                ys,
                where=~np.isnan(ys),
                color=colour,
                alpha=fill,
                linewidth=0,
                step=step_fill,
                interpolate=False,
            )
        show_points = custom.get("showPoints", "auto")
        lonely = [
            i
            for i in range(len(ys))
            if not math.isnan(ys[i])
            and (i == 0 or math.isnan(ys[i - 1]))
            and (i == len(ys) - 1 or math.isnan(ys[i + 1]))
        ]
        marks = list(range(len(ys))) if style == "points" or show_points == "always" else lonely
        if (marks and show_points != "never") or style == "points":
            size = float(custom.get("pointSize", 5))
            ax.plot(xs[marks], ys[marks], "o", color=colour, markersize=size * 0.72, linewidth=0)
    if all_bars:
        bx0, bx1, _, _ = gs.bars_limits(all_bars)
        x0, x1 = min(x0, bx0), max(x1, bx1)
    ax.set_xlim(x0 / day, x1 / day)
    ax.xaxis.set_major_locator(time_locator(max(3, int(box.width // 90))))
    span = x1 - x0
    fmt = "%H:%M:%S" if span <= 600 else "%H:%M" if span <= 86400 else "%m/%d %H:%M"
    ax.xaxis.set_major_formatter(mdates.DateFormatter(fmt, tz=timezone.utc))
    ax.xaxis.grid(True, color=theme.grid)
    first = fields[0].field.config if fields else gs.field_config(panel, "")
    if any(key.startswith("percent") for key in stacked_groups):
        first = {**first, "unit": "percentunit", "max": 1}
    y_axis(ax, high, low, first, box.height)
    _thresholds(ax, first, theme)
    if legend_h:
        legend_box = Box(content.left, content.top + content.height - legend_h, content.width, legend_h)
        entries = [
            (s.field.name, gs.series_color(s.field, theme), s.field.config, s.field.values) for s in in_legend
        ]
        _legend(canvas, legend_box, options, entries, theme)
    return points


def _gradient(
    ax: Any, left: float, top: float, full: float, filled: float, height: float, stops: Any
) -> None:
    """A horizontal gradient over a bar ``full`` long, shown for its first ``filled`` pixels."""
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap

    if filled <= 0:
        return
    cmap = LinearSegmentedColormap.from_list("bar", stops)
    n = max(2, int(full))
    image = cmap(np.linspace(0, 1, n))[None, : max(1, round(n * filled / full))]
    ax.imshow(
        image,
        extent=(left, left + filled, top + height, top),
        aspect="auto",
        interpolation="bilinear",
        zorder=2,
    )


def draw_bargauge(
    canvas: Canvas, content: Box, panel: Mapping[str, Any], fields: Sequence[gs.Field], theme: gs.Theme
) -> int:
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Rectangle

    options = panel.get("options") or {}
    ax = canvas.axes(content.left, content.top, content.width, content.height)
    ax.set_axis_off()
    if not fields:
        return 0
    values = [f.values[0] for f in fields]
    spacing = 8.0
    row_h = min(
        float(options.get("maxVizHeight", 300)), (content.height - spacing * (len(fields) - 1)) / len(fields)
    )
    row_h = max(row_h, float(options.get("minVizHeight", 16)))
    title_above = row_h > 40
    labels = [gs.value_label(v, f.config) for f, v in zip(fields, values, strict=True)]
    value_w = max(text_px(label, FONT_PT + 2) for label in labels) + 10
    name_w = (
        0.0
        if title_above
        else min(max(text_px(f.name, FONT_PT + 1) for f in fields) + 10, content.width * 0.4)
    )
    mode = options.get("displayMode", "gradient")
    for i, (field, value, label) in enumerate(zip(fields, values, labels, strict=True)):
        config = field.config
        low = float(config["min"]) if config.get("min") is not None else min(0.0, *values)
        high = float(config["max"]) if config.get("max") is not None else max(values)
        if high <= low:
            high = low + 1.0
        top = i * (row_h + spacing)
        bar_top, bar_h = top, row_h
        if title_above:
            ax.text(0, top + 8, field.name, color=theme.text, fontsize=FONT_PT + 1, va="center")
            bar_top, bar_h = top + 18, row_h - 18
        else:
            ax.text(0, top + row_h / 2, field.name, color=theme.text, fontsize=FONT_PT + 1, va="center")
        left, full = name_w, content.width - name_w - value_w
        filled = full * min(1.0, max(0.0, (value - low) / (high - low)))
        colour = gs.field_color(config, field.series_index, theme, value)
        if options.get("showUnfilled", True):
            ax.add_patch(Rectangle((left, bar_top), full, bar_h, facecolor=theme.unfilled, edgecolor="none"))
        if mode == "gradient":
            if (config.get("color") or {}).get("mode") == "thresholds":
                stops = gs.threshold_stops(config, value, low, high, theme)
            else:
                stops = [(0.0, to_rgba(colour, 0.35)), (1.0, to_rgba(colour))]
                full = filled  # a single colour fades in along the filled part
            _gradient(ax, left, bar_top, full, filled, bar_h, stops)
        else:
            ax.add_patch(Rectangle((left, bar_top), filled, bar_h, facecolor=colour, edgecolor="none"))
        value_mode = options.get("valueMode", "color")
        if value_mode != "hidden":
            text_colour = colour if value_mode == "color" else theme.text
            ax.text(
                content.width,
                bar_top + bar_h / 2,
                label,
                color=text_colour,
                fontsize=FONT_PT + 2,
                ha="right",
                va="center",
                fontweight="normal",
            )
    ax.set_xlim(0, content.width)  # after imshow, which sets the limits to its image
    ax.set_ylim(content.height, 0)
    return len(fields)


def draw_barchart(
    canvas: Canvas,
    content: Box,
    panel: Mapping[str, Any],
    categories: Sequence[str],
    fields: Sequence[gs.Field],
    theme: gs.Theme,
) -> int:
    from matplotlib.patches import Rectangle

    options = panel.get("options") or {}
    legend_opts = options.get("legend") or {}
    legend_h = _legend_height(legend_opts, [f.name for f in fields], content.width)
    box = _plot_box(content, legend_h)
    ax = canvas.axes(box.left, box.top, box.width, box.height)
    _style_axes(ax, theme)
    ax.xaxis.grid(False)
    stacking = options.get("stacking", "none")
    values = [list(f.values) for f in fields]
    if stacking == "percent":
        totals = [sum(v[i] for v in values if not math.isnan(v[i])) or 1.0 for i in range(len(categories))]
        values = [[x / t for x, t in zip(v, totals, strict=True)] for v in values]
    bars = gs.category_bars(
        values,
        float(options.get("groupWidth", 0.7)),
        float(options.get("barWidth", 0.97)),
        stacking != "none",
    )
    for field, series in zip(fields, bars, strict=True):
        custom = field.config.get("custom") or {}
        colour = gs.series_color(field, theme)
        alpha = float(custom.get("fillOpacity", 80)) / 100.0
        for bar in series:
            ax.add_patch(
                Rectangle(
                    (bar.left, bar.bottom),
                    bar.width,
                    bar.top - bar.bottom,
                    facecolor=colour,
                    alpha=alpha,
                    edgecolor="none",
                )
            )
            if float(custom.get("lineWidth", 1)) > 0:
                ax.add_patch(
                    Rectangle(
                        (bar.left, bar.bottom),
                        bar.width,
                        bar.top - bar.bottom,
                        facecolor="none",
                        edgecolor=colour,
                        linewidth=float(custom.get("lineWidth", 1)),
                    )
                )
    all_bars = [b for series in bars for b in series]
    y0 = min([0.0] + [min(b.bottom, b.top) for b in all_bars])
    y1 = max([0.0] + [max(b.bottom, b.top) for b in all_bars])
    ax.set_xlim(-0.5, len(categories) - 0.5)
    ax.set_xticks(range(len(categories)), categories)
    config = fields[0].config if fields else gs.field_config(panel, "")
    if stacking == "percent":
        config = {**config, "unit": "percentunit", "max": 1}
    y_axis(ax, y1 if config.get("max") is None else float(config["max"]), y0, config, box.height)
    if legend_h:
        legend_box = Box(content.left, content.top + content.height - legend_h, content.width, legend_h)
        entries = [(f.name, gs.series_color(f, theme), f.config, f.values) for f in fields]
        _legend(canvas, legend_box, legend_opts, entries, theme)
    return sum(1 for f in fields for v in f.values if not math.isnan(v))
