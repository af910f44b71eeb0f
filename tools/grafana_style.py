"""What Grafana does to a panel's numbers before it draws them: field config, colours, units, gaps.

The README picture (:mod:`tools.dashboard_picture`) draws panels with matplotlib, and must
draw them as Grafana would from the committed dashboard JSON alone. This module holds the
pure part of that, each piece following the Grafana source it names
(``packages/grafana-data``):

* Field config (``field/fieldOverrides.ts``): a field's config is the panel's
  ``fieldConfig.defaults`` with every matching override applied in order (matchers
  ``byName``, ``byRegexp``, ``byFrameRefID``, ``byType``); a property id such as
  ``custom.fillOpacity`` sets that path. Every non-time field gets the next *series index*
  (the bar chart counts only its value fields, ``panel/barchart/utils.ts``).
* Colours (``themes/createVisualizationColors.ts``, ``field/fieldColor.ts``): named colours
  resolve through the theme's hues (dark and light differ); ``palette-classic`` is the
  theme's classic palette by series index; ``fixed`` is ``fixedColor``; ``thresholds``
  is the colour of the highest step at or below the value. Without a colour mode a panel
  gets its plugin's default: palette-classic for time series and bar charts, thresholds
  elsewhere.
* Units (``valueFormats/*.ts``): ``s``, ``ms``, ``bytes`` (IEC), ``decbytes``, ``Bps``,
  ``bps``, ``short``, ``percent``, ``percentunit``, ``none``, ``reqps``, ``ops``,
  ``suffix:``/``prefix:``/``si:``/``count:`` custom units, else the unit id as a suffix;
  decimals as ``toFixed`` picks them unless the field sets ``decimals``.
* Gaps (``transformations/transformers/nulls/nullInsertThreshold.ts``): a missing step of a
  range query is a null, and with the default ``spanNulls: false`` a null breaks the line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GRID_COLUMNS = 24
"""Grafana's dashboard grid is 24 columns wide."""

_DARK_HUES = {
    "red": ("#FFA6B0", "#FF7383", "#F2495C", "#E02F44", "#C4162A"),
    "orange": ("#FFCB7D", "#FFB357", "#FF9830", "#FF780A", "#FA6400"),
    "yellow": ("#FFF899", "#FFEE52", "#FADE2A", "#F2CC0C", "#E0B400"),
    "green": ("#C8F2C2", "#96D98D", "#73BF69", "#56A64B", "#37872D"),
    "blue": ("#C0D8FF", "#8AB8FF", "#5794F2", "#3274D9", "#1F60C4"),
    "purple": ("#DEB6F2", "#CA95E5", "#B877D9", "#A352CC", "#8F3BB8"),
}
_LIGHT_HUES = {
    "red": ("#FF7383", "#F2495C", "#E02F44", "#C4162A", "#AD0317"),
    "orange": ("#FFB357", "#FF9830", "#FF780A", "#FA6400", "#E55400"),
    "yellow": ("#FFEE52", "#FADE2A", "#F2CC0C", "#E0B400", "#CC9D00"),
    "green": ("#96D98D", "#73BF69", "#56A64B", "#37872D", "#19730E"),
    "blue": ("#8AB8FF", "#5794F2", "#3274D9", "#1F60C4", "#1250B0"),
    "purple": ("#CA95E5", "#B877D9", "#A352CC", "#8F3BB8", "#7C2EA3"),
}
_SHADES = ("super-light-{}", "light-{}", "{}", "semi-dark-{}", "dark-{}")
CLASSIC_PALETTE = (
    *("green", "yellow", "blue", "orange", "red", "purple"),
    *("dark-green", "dark-yellow", "dark-blue", "dark-orange", "dark-red", "dark-purple"),
    *("super-light-green", "super-light-yellow", "super-light-blue"),
    *("super-light-orange", "super-light-red", "super-light-purple"),
    *("#447EBC", "#C15C17", "#890F02", "#0A437C", "#6D1F62", "#584477", "#B7DBAB", "#F4D598"),
    *("#70DBED", "#F9BA8F", "#F29191", "#82B5D8", "#E5A8E2", "#AEA2E0", "#629E51", "#E5AC0E"),
    *("#64B0C8", "#E0752D", "#BF1B00", "#0A50A1", "#962D82", "#614D93", "#9AC48A", "#F2C96D"),
    *("#65C5DB", "#F9934E", "#EA6460", "#5195CE", "#D683CE", "#806EB7", "#3F6833", "#967302"),
    *("#2F575E", "#99440A", "#58140C", "#052B51", "#511749", "#3F2B5B", "#E0F9D7", "#FCEACA"),
    *("#CFFAFF", "#F9E2D2", "#FCE2DE", "#BADFF4", "#F9D9F9", "#DEDAF7"),
)
"""``getClassicPalette()``: the colours ``palette-classic`` hands out by series index."""


@dataclass(frozen=True)
class Theme:
    """The colours of Grafana's dark or light theme that a panel uses (``themes/createColors.ts``)."""

    name: str
    canvas: str
    panel: str
    border: str
    text: str
    text_secondary: str
    grid: str
    unfilled: str
    hues: Mapping[str, Sequence[str]]


DARK = Theme(
    name="dark",
    canvas="#111217",
    panel="#181b1f",
    border="#2c2f35",
    text="#ccccdc",
    text_secondary="#9fa0ac",
    grid="#25282e",
    unfilled="#22252b",
    hues=_DARK_HUES,
)
LIGHT = Theme(
    name="light",
    canvas="#f4f5f5",
    panel="#ffffff",
    border="#dcdee1",
    text="#24292e",
    text_secondary="#5b5f63",
    grid="#ebebec",
    unfilled="#f4f5f5",
    hues=_LIGHT_HUES,
)
THEMES = {DARK.name: DARK, LIGHT.name: LIGHT}


def color(name: str | None, theme: Theme) -> str:
    """A colour name as Grafana's ``getColorByName`` resolves it: theme hue, then CSS/hex as is."""
    if not name:
        return "#808080"  # FALLBACK_COLOR
    for hue, shades in theme.hues.items():
        for template, value in zip(_SHADES, shades, strict=True):
            if name == template.format(hue):
                return value
    if name == "text":
        return theme.text
    if name == "transparent":
        return "#00000000"
    return name  # "#hex", "rgb(...)" and CSS names (matplotlib knows the same CSS names)


# --- field config -------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One drawn field (a series or a column) and the config Grafana gives it."""

    name: str
    config: Mapping[str, Any]
    series_index: int
    values: Sequence[float]


def _matches(matcher: Mapping[str, Any], name: str, ref_id: str, numeric: bool) -> bool:
    kind, option = matcher.get("id"), matcher.get("options")
    if kind == "byName":
        return bool(option == name)
    if kind == "byRegexp":
        return option is not None and re.fullmatch(str(option), name) is not None
    if kind == "byFrameRefID":
        return bool(option == ref_id)
    if kind == "byType":
        return option == ("number" if numeric else "string")
    return False


def _set_path(config: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value


def field_config(
    panel: Mapping[str, Any], name: str, *, ref_id: str = "", numeric: bool = True
) -> dict[str, Any]:
    """The panel's defaults with every override that matches this field applied, in order."""
    source = panel.get("fieldConfig") or {}
    config = _deep_copy(source.get("defaults") or {})
    for override in source.get("overrides") or []:
        if _matches(override.get("matcher") or {}, name, ref_id, numeric):
            for prop in override.get("properties") or []:
                _set_path(config, str(prop.get("id")), _deep_copy(prop.get("value")))
    if not (config.get("color") or {}).get("mode"):
        config["color"] = {"mode": default_color_mode(panel, config)}
    return config


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def default_color_mode(panel: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    """The colour mode a panel's plugin fills in when the JSON sets none."""
    if panel.get("type") in ("timeseries", "barchart"):
        return "palette-classic"
    return "thresholds" if config.get("thresholds") else "palette-classic"


def display_name(config: Mapping[str, Any], name: str) -> str:
    """The field's ``displayName`` when the config sets one, else its name."""
    return str(config.get("displayName") or name)


def threshold_color(config: Mapping[str, Any], value: float | None, theme: Theme) -> str:
    """The colour of the highest threshold step at or below ``value`` (the base step's value is null)."""
    steps = (config.get("thresholds") or {}).get("steps") or [{"color": "green", "value": None}]
    chosen = steps[0].get("color")
    for step in steps[1:]:
        limit = step.get("value")
        if value is not None and limit is not None and value >= float(limit):
            chosen = step.get("color")
    return color(chosen, theme)


def threshold_stops(
    config: Mapping[str, Any], value: float, low: float, high: float, theme: Theme
) -> list[tuple[float, str]]:
    """A gradient bar gauge's colour stops along its full length (``BarGauge.tsx`` ``getBarGradient``):
    the base colour at 0, then each threshold at or below ``value`` from halfway between the
    previous threshold and its own position, the last colour to the end."""
    steps = (config.get("thresholds") or {}).get("steps") or [{"color": "green", "value": None}]
    stops = [(0.0, color(steps[0].get("color"), theme))]
    last = 0.0
    for step in steps[1:]:
        limit = step.get("value")
        if limit is None or value < float(limit):
            break
        at = min(1.0, max(0.0, (float(limit) - low) / (high - low))) if high > low else 0.0
        stops.append((max(stops[-1][0], at - (at - last) / 2), color(step.get("color"), theme)))
        last = at
    stops.append((1.0, stops[-1][1]))
    return stops


def field_color(
    config: Mapping[str, Any], series_index: int, theme: Theme, value: float | None = None
) -> str:
    """A field's colour: fixed, classic palette by series index, or by threshold of ``value``."""
    mode = (config.get("color") or {}).get("mode") or "palette-classic"
    if mode in ("fixed", "shades"):
        return color((config.get("color") or {}).get("fixedColor"), theme)
    if mode == "thresholds":
        return threshold_color(config, value, theme)
    return color(CLASSIC_PALETTE[series_index % len(CLASSIC_PALETTE)], theme)


def series_color(field: Field, theme: Theme) -> str:
    """The colour a line or bar series is drawn in; by value modes use its last non-null value."""
    last = next((v for v in reversed(field.values) if v is not None and not math.isnan(v)), None)
    return field_color(field.config, field.series_index, theme, last)


# --- units --------------------------------------------------------------------------------

_SI = ("f", "p", "n", "µ", "m", "", "k", "M", "G", "T", "P", "E", "Z", "Y")
_BIN = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "Zi", "Yi")


def _decimals_for(value: float) -> int:
    """``getDecimalsForValue``: enough decimals for about two significant digits."""
    log10 = math.floor(math.log10(abs(value)))
    dec = -log10 + 1
    norm = value / 10.0 ** (-dec)
    if abs(norm) > 2.25:
        dec += 1
    if value % 1 == 0:
        dec = 0
    return max(0, dec)


def to_fixed(value: float, decimals: int | None = None) -> str:
    """Grafana's ``toFixed``: ``decimals`` or the automatic choice, trailing zeros kept."""
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if math.isnan(value):
        return "NaN"
    if decimals is None:
        decimals = 0 if value == 0 else _decimals_for(value)
    return f"{value:.{max(0, decimals)}f}"


def _scaled(
    value: float, decimals: int | None, factor: float, suffixes: Sequence[str], offset: int = 0
) -> str:
    """``scaledUnits``: divide by ``factor`` per step, suffix of that step."""
    if value == 0 or math.isnan(value) or math.isinf(value):
        index = 0
    else:
        index = math.floor(math.log(abs(value), factor) + 1e-12)
    index = max(-offset, min(index, len(suffixes) - offset - 1))
    return to_fixed(value / factor**index, decimals) + suffixes[offset + index]


def _seconds(value: float, decimals: int | None) -> str:
    a = abs(value)
    if value == 0:
        return "0 s"
    for limit, scale, suffix in (
        (1e-6, 1e9, " ns"),
        (1e-3, 1e6, " µs"),
        (1.0, 1e3, " ms"),
        (60.0, 1.0, " s"),
        (3600.0, 1 / 60, " min"),
        (86400.0, 1 / 3600, " hour"),
        (604800.0, 1 / 86400, " day"),
        (31536000.0, 1 / 604800, " week"),
    ):
        if a < limit:
            return to_fixed(value * scale, decimals) + suffix
    return to_fixed(value / 3.15569e7, decimals) + " year"


def format_value(value: float, unit: str | None, decimals: int | None = None) -> str:
    """A value with its unit, as Grafana's ``getValueFormat(unit)(value, decimals)`` writes it."""
    unit = unit or ""
    if unit == "ms":
        return _seconds(value / 1000.0, decimals)
    simple = {
        "s": lambda: _seconds(value, decimals),
        "short": lambda: _scaled(
            value, decimals, 1000, ("", " K", " Mil", " Bil", " Tri", " Quadr", " Quint", " Sext", " Sept")
        ),
        "percent": lambda: to_fixed(value, decimals) + "%",
        "percentunit": lambda: to_fixed(100 * value, decimals) + "%",
        "bytes": lambda: _scaled(value, decimals, 1024, [f" {p}B" for p in _BIN]),
        "decbytes": lambda: _scaled(value, decimals, 1000, [f" {p}B" for p in _SI], _SI.index("")),
        "Bps": lambda: _scaled(value, decimals, 1000, [f" {p}B/s" for p in _SI], _SI.index("")),
        "binBps": lambda: _scaled(value, decimals, 1024, [f" {p}B/s" for p in _BIN]),
        "bps": lambda: _scaled(value, decimals, 1000, [f" {p}bps" for p in _SI], _SI.index("")),
        "reqps": lambda: _scaled(value, decimals, 1000, ("", "K", "M", "B", "T")) + " req/s",
        "ops": lambda: _scaled(value, decimals, 1000, ("", "K", "M", "B", "T")) + " ops/s",
        "": lambda: to_fixed(value, decimals),
        "none": lambda: to_fixed(value, decimals),
    }
    if unit in simple:
        return simple[unit]()
    key, sep, sub = unit.partition(":")
    if sep and key == "suffix":
        return to_fixed(value, decimals) + " " + sub.strip()
    if sep and key == "prefix":
        return sub + to_fixed(value, decimals)
    if sep and key == "count":
        return _scaled(value, decimals, 1000, ("", "K", "M", "B", "T")) + " " + sub
    if sep and key == "si":
        offset = _SI.index(sub[0]) - _SI.index("") if sub[:1] in _SI and len(sub) > 1 else 0
        base = sub[1:] if offset else sub
        return _scaled(value, decimals, 1000, [f" {p}{base}" for p in _SI], _SI.index("") + offset)
    return to_fixed(value, decimals) + " " + unit


def axis_decimals(step: float) -> int | None:
    """The decimals of an axis whose ticks are ``step`` apart (``guessDecimals``); None: automatic."""
    if step <= 0 or step >= 1:
        return None
    text = f"{round(step, 6):.6f}".rstrip("0")
    return len(text.partition(".")[2]) or None


def axis_label(value: float, step: float, config: Mapping[str, Any]) -> str:
    """A tick label: the field's unit, its ``decimals`` if set, else the decimals of the tick step."""
    decimals = config.get("decimals")
    return format_value(value, config.get("unit"), decimals if decimals is not None else axis_decimals(step))


def value_label(value: float | None, config: Mapping[str, Any]) -> str:
    """A value in a legend or a bar gauge: the field's unit and decimals; ``-`` for no value."""
    if value is None or math.isnan(value):
        return "-"
    return format_value(value, config.get("unit"), config.get("decimals"))


# --- nulls and stacking -------------------------------------------------------------------


def with_gaps(
    times: Sequence[float], values: Sequence[float], step: float
) -> tuple[list[float], list[float]]:
    """Points at every ``step`` from the first to the last sample; a missing step is NaN (a gap).

    Prometheus leaves a step out when a series has no sample there; Grafana's null-insert
    threshold (the query's interval) puts a null at each such step, and ``spanNulls: false``
    draws no line across it. A NaN value (0/0) is a gap too.
    """
    out_t: list[float] = []
    out_v: list[float] = []
    for t, v in zip(times, values, strict=True):
        if out_t:
            missing = out_t[-1] + step
            while t - missing > step * 0.5:
                out_t.append(missing)
                out_v.append(math.nan)
                missing += step
        out_t.append(t)
        out_v.append(v)
    return out_t, out_v


def on_grid(
    stamps: Sequence[float], series: Iterable[tuple[Sequence[float], Sequence[float]]]
) -> list[list[float]]:
    """Each series' values at ``stamps`` (NaN where it has no value): one row per series."""
    rows = []
    for times, values in series:
        by_time = dict(zip(times, values, strict=True))
        rows.append([by_time.get(t, math.nan) for t in stamps])
    return rows


def stack(rows: Sequence[Sequence[float]], percent: bool = False) -> list[tuple[list[float], list[float]]]:
    """(bottom, top) of each series stacked on those before it; a null stays a gap and adds 0."""
    width = len(rows[0]) if rows else 0
    totals = [sum(r[i] for r in rows if not math.isnan(r[i])) for i in range(width)]
    accum = [0.0] * width
    out = []
    for row in rows:
        bottom, top = [], []
        for i, v in enumerate(row):
            scale = (1.0 / totals[i]) if percent and totals[i] else 1.0
            if math.isnan(v):
                bottom.append(math.nan)
                top.append(math.nan)
                continue
            bottom.append(accum[i] * scale)
            accum[i] += v
            top.append(accum[i] * scale)
        out.append((bottom, top))
    return out


# --- bars and layout ----------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    """One drawn bar: its left edge, width, bottom and top in data coordinates."""

    left: float
    width: float
    bottom: float
    top: float


def category_bars(
    totals_by_series: Sequence[Sequence[float]], group_width: float, bar_width: float, stacked: bool
) -> list[list[Bar]]:
    """Bars of a bar chart with categories at 0, 1, ...: stacked in one bar per category, or side by side.

    A category's slot is 1 wide; its group takes ``groupWidth`` of it and each bar
    ``barWidth`` of its share of the group (``panel/barchart/bars.ts``); one value field
    uses ``barWidth`` as the group width.
    """
    n_series = len(totals_by_series)
    if n_series == 1:
        group_width, bar_width = bar_width, 1.0
    per_group = 1 if stacked else n_series
    share = group_width / per_group
    width = share * bar_width
    out: list[list[Bar]] = []
    accum = [0.0] * (len(totals_by_series[0]) if totals_by_series else 0)
    for s, values in enumerate(totals_by_series):
        bars = []
        for i, v in enumerate(values):
            v = 0.0 if v is None or math.isnan(v) else float(v)
            slot = 0 if stacked else s
            left = i - group_width / 2 + slot * share + (share - width) / 2
            bottom = accum[i] if stacked else 0.0
            bars.append(Bar(left, width, bottom, bottom + v))
            if stacked:
                accum[i] += v
        out.append(bars)
    return out


def time_bars(
    times: Sequence[float],
    tops: Sequence[float],
    interval: float,
    factor: float = 0.6,
    bottoms: Sequence[float] | None = None,
) -> list[Bar]:
    """Bars of a time series drawn as bars: centred on each sample, ``barWidthFactor`` of the
    interval wide (``drawStyle: bars``); no bar at a null."""
    width = interval * factor
    lows = bottoms if bottoms is not None else [0.0] * len(tops)
    return [
        Bar(t - width / 2, width, lo, hi)
        for t, lo, hi in zip(times, lows, tops, strict=True)
        if not math.isnan(hi)
    ]


def nice_limit(top: float) -> float:
    """An axis end at or above ``top`` on a 1-2-2.5-5 x 10^n tick (so nothing is cut off)."""
    if top <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(top))
    for m in (1, 2, 2.5, 5, 10):
        if m * magnitude >= top * (1 - 1e-12):
            return m * magnitude
    return 10 * magnitude


def bars_limits(bars: Iterable[Bar]) -> tuple[float, float, float, float]:
    """(x0, x1, y0, y1) that hold every bar whole: the y end on a nice tick above the tallest."""
    bars = list(bars)
    if not bars:
        return 0.0, 1.0, 0.0, 1.0
    x0 = min(b.left for b in bars)
    x1 = max(b.left + b.width for b in bars)
    low = min(0.0, *(min(b.bottom, b.top) for b in bars))
    high = max(0.0, *(max(b.bottom, b.top) for b in bars))
    return x0, x1, -nice_limit(-low) if low < 0 else 0.0, nice_limit(high)


@dataclass(frozen=True)
class Cell:
    """A panel's place on the 24-column grid (gridPos units)."""

    x: int
    y: int
    w: int
    h: int


def layout(sizes: Sequence[tuple[int, int]]) -> list[Cell]:
    """Panels of gridPos sizes ``(w, h)`` placed left to right in order, a new row when one does not fit.

    The picture shows panels of several dashboards, so their own ``x``/``y`` would overlap;
    each keeps its width and height, which is what decides how Grafana draws it.
    """
    cells = []
    x = y = row_h = 0
    for w, h in sizes:
        w = max(1, min(GRID_COLUMNS, w))
        if x + w > GRID_COLUMNS:
            x, y, row_h = 0, y + row_h, 0
        cells.append(Cell(x, y, w, h))
        x += w
        row_h = max(row_h, h)
    return cells
