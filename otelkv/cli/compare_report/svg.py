"""Small SVG charts written by hand: grouped bars, stacked bars and a log-log scatter.

Why not matplotlib (which ``tools/dashboard_picture.py`` uses for the README picture):
``compare`` needs only the sidecar extra, and matplotlib is a developer dependency; a
report with a few bar charts does not justify it. Hand-written SVG is also deterministic
(the same comparison writes the same bytes, so tests can read the charts), stays text
(conversation ids remain selectable and searchable in the page), and weighs a few kB.
Every string that reaches the markup goes through :func:`html.escape`.

Each chart has a ``viewBox`` and no fixed size: the page's stylesheet gives it the width of
its grid cell (``width: 100%``) and the height follows the aspect ratio. Axis ticks are
round numbers in the unit a reader thinks in (1, 2 or 5 x 10^k of ms or s, KiB or MiB,
tokens, per cent), and every legend swatch is drawn with the colour of the marks it names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH = 640
HEIGHT = 300
LEFT, RIGHT, TOP, BOTTOM = 64, 14, 48, 30
SCATTER_WIDTH, SCATTER_HEIGHT = 640, 520
SCATTER_LEFT, SCATTER_BOTTOM = 80, 44
PALETTE = ("#3274d9", "#ff9830", "#8ab8ff", "#ffcb7d", "#73bf69", "#f2495c")
"""A, B, then their lighter variants (p95 next to p50), then extra series."""
POINT = PALETTE[0]
"""A matched turn in the scatter that did not regress."""
REGRESSED = PALETTE[5]
"""A matched turn that regressed (the scatter's points and its legend)."""

UNITS = ("s", "B", "tokens", "%", "")
"""What :func:`axis` knows: seconds, bytes, tokens, per cent, a plain count."""
_BYTE_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def nice_step(raw: float) -> float:
    """The smallest 1, 2 or 5 x 10^k at or above ``raw`` (> 0)."""
    power = 10.0 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if raw <= mult * power * (1 + 1e-9):
            return mult * power
    return 10 * power  # pragma: no cover - the loop ends at 10


@dataclass(frozen=True)
class Axis:
    """A linear value axis from 0 to ``top`` with a tick every ``step`` (both in base units)."""

    top: float
    step: float
    unit: str
    scale: float = 1.0
    """Base units per displayed unit (1e-3 for ms, 1024**2 for MiB)."""
    suffix: str = ""

    @property
    def ticks(self) -> list[float]:
        return [i * self.step for i in range(round(self.top / self.step) + 1)]

    def label(self, value: float) -> str:
        """A tick's text: ``0``, ``200 ms``, ``1.5 s``, ``2 MiB``, ``2500``, ``40%``."""
        return _label(value, self.step, self.scale, self.suffix)


def _label(value: float, step: float, scale: float, suffix: str) -> str:
    shown, shown_step = value / scale, step / scale
    if value == 0:
        return "0"
    decimals = max(0, -math.floor(math.log10(shown_step) + 1e-9))
    if not suffix and shown >= 10_000:  # counts: 10k, 25k, 1.5M
        for letter, size in (("M", 1e6), ("k", 1e3)):
            if shown >= size:
                return _trim(f"{shown / size:.{max(0, decimals - 3)}f}") + letter
    text = _trim(f"{shown:.{decimals}f}")
    if suffix == "%":
        return text + "%"
    return f"{text} {suffix}" if suffix else text


def _trim(text: str) -> str:
    return text.rstrip("0").rstrip(".") if "." in text else text


def axis(max_value: float, unit: str) -> Axis:
    """Round ticks from 0 to at or above ``max_value`` (at least one interval, at most about six)."""
    if unit == "B":
        name, size = next(((n, s) for n, s in _BYTE_UNITS if max_value >= s), ("B", 1))
        step = nice_step(max(max_value / size, 1.0) / 5) * size
        if size == 1:
            step = max(step, 1.0)  # no fractions of a byte
        return Axis(_top(max_value, step), step, unit, float(size), name)
    if unit == "s":
        if max_value <= 0:
            return Axis(1.0, 0.2, unit, 1.0, "s")
        step = nice_step(max_value / 5)
        top = _top(max_value, step)
        return Axis(top, step, unit, 1e-3, "ms") if top < 1 else Axis(top, step, unit, 1.0, "s")
    if unit == "%":
        step = nice_step(max(max_value, 1.0) / 5)
        return Axis(min(_top(max_value, step), 100.0), step, unit, 1.0, "%")
    step = max(nice_step(max(max_value, 1.0) / 5), 1.0)  # counts and tokens: whole numbers
    return Axis(_top(max_value, step), step, unit)


def _top(max_value: float, step: float) -> float:
    return max(math.ceil(max_value / step - 1e-9), 1) * step


def value_label(value: float, unit: str) -> str:
    """One value for a tooltip, in the unit the axis uses for it (3 significant digits)."""
    if unit == "s":
        return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"
    if unit == "B":
        name, size = next(((n, s) for n, s in _BYTE_UNITS if value >= s), ("B", 1))
        return f"{value / size:.3g} {name}" if size > 1 else f"{value:.0f} B"
    if unit == "%":
        return f"{value:.3g}%"
    text = f"{value:,.0f}" if value >= 1000 or value == int(value) else f"{value:.3g}"
    return f"{text} {unit}" if unit else text


def _open(title: str, width: int, height: int, *, css: str = "chart") -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{css}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{escape(title)}">',
        f'<text x="{LEFT}" y="18" class="title">{escape(title)}</text>',
    ]


def _value_grid(ax: Axis, width: int, height: int, bottom: int) -> list[str]:
    plot_h = height - TOP - bottom
    parts = []
    for tick in ax.ticks:
        y = TOP + plot_h * (1 - tick / ax.top)
        parts.append(f'<line x1="{LEFT}" x2="{width - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        label = escape(ax.label(tick))
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" class="axis" text-anchor="end">{label}</text>')
    return parts


def _legend(items: Sequence[tuple[str, str, str]], *, y: float = 28) -> list[str]:
    """One swatch per (label, colour, shape) in a row; shape is ``rect`` or ``circle``."""
    parts, x = [], float(LEFT)
    for label, color, shape in items:
        if shape == "circle":
            parts.append(f'<circle cx="{x + 5}" cy="{y + 5}" r="4" fill="{color}" class="swatch"/>')
        elif shape == "dashed":
            parts.append(f'<line x1="{x}" x2="{x + 16}" y1="{y + 5}" y2="{y + 5}" class="guide dashed"/>')
            x += 6
        elif shape == "line":
            parts.append(f'<line x1="{x}" x2="{x + 16}" y1="{y + 5}" y2="{y + 5}" class="guide"/>')
            x += 6
        else:
            parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{color}" class="swatch"/>')
        parts.append(f'<text x="{x + 14}" y="{y + 9}" class="legend">{escape(label)}</text>')
        x += 30 + 6.2 * len(label)
    return parts


def bars(
    title: str,
    categories: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None]]],
    *,
    unit: str = "s",
    stacked: bool = False,
    colors: Sequence[str] = PALETTE,
) -> str:
    """Bars per category, one per series side by side (or stacked); None draws nothing.

    Series ``i`` is drawn, and named in the legend, in ``colors[i]``; a series with no value
    at all is left out of the legend (a legend names only marks that are drawn).
    """
    if stacked:
        top = max((sum(vs[i] or 0.0 for _, vs in series) for i in range(len(categories))), default=0.0)
    else:
        top = max((v or 0.0 for _, vs in series for v in vs), default=0.0)
    ax = axis(top, unit)
    color = [colors[i % len(colors)] for i in range(len(series))]
    parts = _open(title, WIDTH, HEIGHT) + _value_grid(ax, WIDTH, HEIGHT, BOTTOM)
    drawn = [i for i, (_, vs) in enumerate(series) if any(v is not None for v in vs)]
    parts += _legend([(series[i][0], color[i], "rect") for i in drawn])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(len(categories), 1)
    width = min(slot * 0.8 / (1 if stacked else max(len(series), 1)), 90.0)
    for c, category in enumerate(categories):
        used = width * (1 if stacked else len(series))
        x0 = LEFT + slot * c + (slot - used) / 2
        base = 0.0
        for s, (label, vs) in enumerate(series):
            value = vs[c]
            if value is None:
                continue
            h = plot_h * value / ax.top
            y = TOP + plot_h - h - (plot_h * base / ax.top if stacked else 0.0)
            x = x0 if stacked else x0 + width * s
            tip = f"{category} {label}: {value_label(value, unit)}"
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{h:.1f}" '
                f'fill="{color[s]}" class="bar"><title>{escape(tip)}</title></rect>'
            )
            if stacked:
                base += value
        parts.append(
            f'<text x="{LEFT + slot * (c + 0.5):.1f}" y="{HEIGHT - BOTTOM + 16}" class="axis" '
            f'text-anchor="middle">{escape(category)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


@dataclass(frozen=True)
class LogAxis:
    """A log axis from ``low`` to ``high`` seconds, ticks at 1, 2 and 5 x 10^k between them."""

    low: float
    high: float

    @property
    def ticks(self) -> list[float]:
        out, k = [], math.floor(math.log10(self.low))
        while True:
            for mult in (1, 2, 5):
                tick = mult * 10.0**k
                if tick > self.high * (1 + 1e-9):
                    return out
                if tick >= self.low * (1 - 1e-9):
                    out.append(float(f"{tick:.12g}"))
            k += 1

    @property
    def minor(self) -> list[float]:
        """Unlabelled grid lines at 3, 4, 6, 7, 8 and 9 x 10^k (log paper): values between ticks."""
        out, k = [], math.floor(math.log10(self.low))
        while 10.0**k < self.high:
            out += [m * 10.0**k for m in (3, 4, 6, 7, 8, 9) if self.low < m * 10.0**k < self.high]
            k += 1
        return out

    def frac(self, value: float) -> float:
        """Where ``value`` (clamped to the axis) sits, 0 at ``low`` and 1 at ``high``."""
        value = min(max(value, self.low), self.high)
        return math.log(value / self.low) / math.log(self.high / self.low)

    def label(self, value: float) -> str:
        return f"{_trim(f'{value * 1000:.3f}')} ms" if value < 1 else f"{_trim(f'{value:.3f}')} s"


def log_axis(values: Sequence[float]) -> LogAxis:
    """The 1-2-5 ticks just around ``values`` (seconds; those at or below 0 are ignored)."""
    positive = [v for v in values if v > 0]
    if not positive:
        return LogAxis(0.01, 1.0)
    low, high = _round_125(min(positive), down=True), _round_125(max(positive), down=False)
    if high <= low:
        high = _round_125(low * 1.5, down=False)
    return LogAxis(low, high)


def _round_125(value: float, *, down: bool) -> float:
    k = math.floor(math.log10(value))
    marks = [m * 10.0**e for e in (k - 1, k, k + 1) for m in (1, 2, 5)]
    if down:
        return float(f"{max(m for m in marks if m <= value * (1 + 1e-9)):.12g}")
    return float(f"{min(m for m in marks if m >= value * (1 - 1e-9)):.12g}")


def scatter(
    title: str,
    points: Sequence[tuple[str, float, float, bool]],
    *,
    factor: float,
    links: Sequence[str | None] = (),
) -> str:
    """Each matched turn at (A's TTFT, B's TTFT) on log-log axes; the diagonal and ``factor`` x A.

    Log axes because TTFTs of one run span two decades (a 40 ms turn that reused KV next to a
    2 s recompute) and a linear axis piles the fast ones into a corner. On log axes the
    ``factor`` line runs parallel to the diagonal. Regressions are drawn in red; ``links[i]``,
    when given, makes point ``i`` a link (to its row in the report's table).
    """
    ax = log_axis([v for _, a, b, _ in points for v in (a, b)])
    w, h = SCATTER_WIDTH, SCATTER_HEIGHT
    plot_w, plot_h = w - SCATTER_LEFT - RIGHT, h - TOP - SCATTER_BOTTOM
    parts = _open(title, w, h, css="chart scatter")
    kinds = {regressed for *_, regressed in points}  # a legend names only marks that are drawn
    parts += _legend(
        [
            *([("turn", POINT, "circle")] if False in kinds else []),
            *([(f"regressed (> {factor:g}x A)", REGRESSED, "circle")] if True in kinds else []),
            ("B = A", "", "line"),
            (f"B = {factor:g}x A", "", "dashed"),
        ]
    )

    def xy(a: float, b: float) -> tuple[float, float]:
        return SCATTER_LEFT + plot_w * ax.frac(a), TOP + plot_h * (1 - ax.frac(b))

    for value in ax.minor:
        x, y = xy(value, value)
        parts.append(f'<line x1="{SCATTER_LEFT}" x2="{w - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="minor"/>')
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{h - SCATTER_BOTTOM}" class="minor"/>')
    for tick in ax.ticks:
        x, y = xy(tick, tick)
        label = escape(ax.label(tick))
        parts.append(f'<line x1="{SCATTER_LEFT}" x2="{w - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{h - SCATTER_BOTTOM}" class="grid"/>')
        parts.append(
            f'<text x="{SCATTER_LEFT - 6}" y="{y + 4:.1f}" class="axis" text-anchor="end">{label}</text>'
        )
        below = h - SCATTER_BOTTOM + 16
        parts.append(f'<text x="{x:.1f}" y="{below}" class="axis" text-anchor="middle">{label}</text>')
    parts.append(
        f'<text x="{SCATTER_LEFT + plot_w / 2:.1f}" y="{h - 6}" class="axis" text-anchor="middle">'
        "TTFT in A (log scale)</text>"
    )
    parts.append(
        f'<text x="16" y="{TOP + plot_h / 2:.1f}" class="axis" text-anchor="middle" '
        f'transform="rotate(-90 16 {TOP + plot_h / 2:.1f})">TTFT in B (log scale)</text>'
    )
    (x0, y0), (x1, y1) = xy(ax.low, ax.low), xy(ax.high, ax.high)
    parts.append(f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y1:.1f}" class="guide"/>')
    if ax.low * factor < ax.high:
        (fx0, fy0), (fx1, fy1) = xy(ax.low, ax.low * factor), xy(ax.high / factor, ax.high)
        parts.append(
            f'<line x1="{fx0:.1f}" y1="{fy0:.1f}" x2="{fx1:.1f}" y2="{fy1:.1f}" class="guide dashed"/>'
        )
    # Regressions last, so that they are drawn over the others.
    order = sorted(range(len(points)), key=lambda i: points[i][3])
    for i in order:
        ref, a, b, regressed = points[i]
        x, y = xy(a, b)
        tip = f"{ref}: A {value_label(a, 's')}, B {value_label(b, 's')}"
        circle = (
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{REGRESSED if regressed else POINT}" '
            f'class="point"><title>{escape(tip)}</title></circle>'
        )
        link = links[i] if i < len(links) else None
        parts.append(f'<a href="{escape(link)}">{circle}</a>' if link else circle)
    parts.append("</svg>")
    return "\n".join(parts)
