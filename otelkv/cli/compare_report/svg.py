"""Small SVG charts written by hand: grouped bars, stacked bars and a scatter.

Why not matplotlib (which ``tools/dashboard_picture.py`` uses for the README picture):
``compare`` needs only the sidecar extra, and matplotlib is a developer dependency; a
report with a few bar charts does not justify it. Hand-written SVG is also deterministic
(the same comparison writes the same bytes, so tests can read the charts), stays text
(conversation ids remain selectable and searchable in the page), and weighs a few kB.
Every string that reaches the markup goes through :func:`html.escape`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

WIDTH = 640
HEIGHT = 260
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 40, 36
PALETTE = ("#3274d9", "#ff9830", "#8ab8ff", "#ffcb7d", "#73bf69", "#f2495c")
"""A, B, then their lighter variants (p95 next to p50), then extra series."""


def nice_max(value: float) -> float:
    """The axis top: 1, 2, 2.5 or 5 times a power of ten, at or above ``value``."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * power:
            return step * power
    return 10 * power  # pragma: no cover - the loop ends at 10


def _num(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.3g}s"
    if unit == "B":
        for prefix, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
            if value >= size:
                return f"{value / size:.3g} {prefix}iB"
        return f"{value:.0f} B"
    return f"{value:.3g}"


def _frame(title: str, top: float, unit: str) -> list[str]:
    plot_h = HEIGHT - TOP - BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">',
        f'<text x="{LEFT}" y="16" class="title">{escape(title)}</text>',
    ]
    for i in range(5):
        y = TOP + plot_h * (1 - i / 4)
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(
            f'<text x="{LEFT - 4}" y="{y + 4:.1f}" class="axis" text-anchor="end">'
            f"{_num(top * i / 4, unit)}</text>"
        )
    return parts


def _legend(labels: Sequence[str]) -> list[str]:
    parts, x = [], LEFT
    for i, label in enumerate(labels):
        parts.append(f'<rect x="{x}" y="24" width="10" height="10" fill="{PALETTE[i % len(PALETTE)]}"/>')
        parts.append(f'<text x="{x + 14}" y="33" class="legend">{escape(label)}</text>')
        x += 24 + 7 * len(label)
    return parts


def bars(
    title: str,
    categories: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None]]],
    *,
    unit: str = "s",
    stacked: bool = False,
) -> str:
    """Bars per category, one per series side by side (or stacked); None draws nothing."""
    values = [v or 0.0 for _, vs in series for v in vs]
    if stacked:
        totals = [sum(vs[i] or 0.0 for _, vs in series) for i in range(len(categories))]
        top = nice_max(max(totals, default=0.0))
    else:
        top = nice_max(max(values, default=0.0))
    parts = _frame(title, top, unit) + _legend([label for label, _ in series])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(len(categories), 1)
    width = slot * 0.8 / (1 if stacked else max(len(series), 1))
    for c, category in enumerate(categories):
        x0 = LEFT + slot * c + slot * 0.1
        base = 0.0
        for s, (label, vs) in enumerate(series):
            value = vs[c]
            if value is None:
                continue
            h = plot_h * value / top
            y = TOP + plot_h - h - (plot_h * base / top if stacked else 0.0)
            x = x0 if stacked else x0 + width * s
            tip = f"{category} {label}: {_num(value, unit)}"
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{h:.1f}" '
                f'fill="{PALETTE[s % len(PALETTE)]}" class="bar"><title>{escape(tip)}</title></rect>'
            )
            if stacked:
                base += value
        parts.append(
            f'<text x="{LEFT + slot * (c + 0.5):.1f}" y="{HEIGHT - BOTTOM + 14}" class="axis" '
            f'text-anchor="middle">{escape(category)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def scatter(title: str, points: Sequence[tuple[str, float, float, bool]], *, factor: float) -> str:
    """Each matched turn at (A's TTFT, B's TTFT); the diagonal and ``factor`` x A as guides.

    Points above the dashed line are the regressions (drawn in red).
    """
    top = nice_max(max((max(a, b) for _, a, b, _ in points), default=0.0))
    parts = _frame(title, top, "s") + _legend(["turn (A TTFT across, B TTFT up)", "regressed"])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def xy(a: float, b: float) -> tuple[float, float]:
        return LEFT + plot_w * a / top, TOP + plot_h * (1 - b / top)

    (x0, y0), (x1, y1) = xy(0, 0), xy(top, top)
    parts.append(f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y1:.1f}" class="guide"/>')
    fx, fy = xy(top / factor, top)
    parts.append(f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{fx:.1f}" y2="{fy:.1f}" class="guide dashed"/>')
    for ref, a, b, regressed in points:
        x, y = xy(a, b)
        color = PALETTE[5] if regressed else PALETTE[0]
        tip = f"{ref}: A {_num(a, 's')}, B {_num(b, 's')}"
        parts.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{color}" class="point">'
            f"<title>{escape(tip)}</title></circle>"
        )
    for i in range(5):
        x = LEFT + plot_w * i / 4
        parts.append(
            f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 14}" class="axis" text-anchor="middle">'
            f"{_num(top * i / 4, 's')}</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts)
