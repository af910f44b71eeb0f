"""Plain-text tables for the terminal (no dependency beyond the standard library)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()) -> str:
    """Render rows under headers, columns padded; ``right`` lists right-aligned columns."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(widths[i]) if i in right else v.ljust(widths[i]) for i, v in enumerate(values)]
        return "  ".join(parts).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def seconds(value: float | None) -> str:
    """A duration the way people read it: ``0.42s``, ``12.3s``, ``4m05s``, ``2h03m``."""
    if value is None:
        return "-"
    if value < 10:
        return f"{value:.2f}s"
    if value < 60:
        return f"{value:.1f}s"
    if value < 3600:
        m, s = divmod(round(value), 60)
        return f"{m}m{s:02d}s"
    h, rest = divmod(round(value), 3600)
    return f"{h}h{rest // 60:02d}m"


BAR_WIDTH = 40
BAR_SEGMENTS: tuple[tuple[str, str, str], ...] = (
    ("tool_wait", "~", "tool wait"),
    ("app_work", ".", "app work"),
    ("input_processing", "#", "input processing"),
    ("generation", "=", "generation"),
)
"""(phase, character, label) in the order a turn lives them: the gap, then the request."""


def phase_bar(phases: dict[str, float] | None, scale_s: float, width: int = BAR_WIDTH) -> str:
    """A fixed-width bar, one segment per phase, scaled so ``scale_s`` fills the width.

    Any phase that took time gets at least one character, so a short prefill next to a
    long tool wait stays visible; rounding is taken from the longest segment.
    """
    if not phases or scale_s <= 0:
        return " " * width
    total = sum(max(phases.get(p, 0.0) or 0.0, 0.0) for p, _, _ in BAR_SEGMENTS)
    used = max(1, min(width, round(width * total / scale_s))) if total > 0 else 0
    cells: list[int] = []
    for phase, _, _ in BAR_SEGMENTS:
        value = max(phases.get(phase, 0.0) or 0.0, 0.0)
        cells.append(0 if value <= 0 or total <= 0 else max(1, round(used * value / total)))
    while sum(cells) > max(used, sum(1 for c in cells if c)):
        cells[cells.index(max(cells))] -= 1
    bar = "".join(char * n for (_, char, _), n in zip(BAR_SEGMENTS, cells, strict=True))
    return bar.ljust(width)[:width]


def bar_legend() -> str:
    return "  ".join(f"{char} {label}" for _, char, label in BAR_SEGMENTS)
