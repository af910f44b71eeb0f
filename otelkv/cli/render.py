"""Plain-text tables and text for the terminal (no dependency beyond the standard library)."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

DEFAULT_WIDTH = 100
"""Columns assumed when the output is not a terminal (a pipe, a file, a test)."""
ELLIPSIS = ".."
"""Marks where a clipped cell lost characters (ASCII: any terminal encoding shows it)."""

Clip = Callable[[str, int], str]


def terminal_width() -> int:
    """The terminal's columns (``$COLUMNS`` first); :data:`DEFAULT_WIDTH` when there is none."""
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns or DEFAULT_WIDTH


def clip_end(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, the end replaced by :data:`ELLIPSIS`."""
    if len(text) <= width:
        return text
    return text[: max(width - len(ELLIPSIS), 0)] + ELLIPSIS if width > len(ELLIPSIS) else text[:width]


def clip_middle(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters from its middle: both ends stay recognisable."""
    if len(text) <= width:
        return text
    if width <= len(ELLIPSIS) + 1:
        return text[:width]
    keep = width - len(ELLIPSIS)
    head = (keep + 1) // 2
    return text[:head] + ELLIPSIS + text[len(text) - (keep - head) :]


def clip_ref(text: str, width: int) -> str:
    """A ``CONVERSATION#INDEX`` cut in the conversation id's middle; ``#INDEX`` stays whole."""
    conv, sep, index = text.rpartition("#")
    if not sep or len(index) + 1 >= width:
        return clip_middle(text, width)
    return clip_middle(conv, width - len(index) - 1) + sep + index


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    right: Sequence[int] = (),
    tight: Sequence[int] = (),
    width: int | None = None,
    shrink: Mapping[int, tuple[int, Clip]] | None = None,
) -> str:
    """Render rows under headers, columns padded and separated by two spaces.

    ``right``: right-aligned columns. ``tight``: columns set one space after the column
    before (a group of numbers). A header with ``\\n`` takes several lines. With ``width``,
    the columns of ``shrink`` (column -> (narrowest width, how to clip a cell)) give up
    characters in the order given, each down to its narrowest before the next, until the
    table fits; a table that still does not fit (every shrinkable column at its narrowest) is
    printed as is, wider than ``width``.
    """
    cells = [[_fmt(c) for c in row] for row in rows]
    head = [h.split("\n") for h in headers]
    depth = max((len(h) for h in head), default=1)
    head = [[""] * (depth - len(h)) + h for h in head]  # bottom-aligned over the values
    widths = [max(len(x) for x in h) for h in head]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    gaps = [0] + [1 if i in tight else 2 for i in range(1, len(widths))]
    shrink = dict(shrink or {})
    if width is not None:
        while sum(widths) + sum(gaps) > width:
            open_ = [i for i, (least, _) in shrink.items() if widths[i] > least]
            if not open_:
                break
            widths[open_[0]] -= 1
        for row in cells:
            for i, (_, clip) in shrink.items():
                row[i] = clip(row[i], widths[i])

    def line(values: Sequence[str]) -> str:
        parts = [
            " " * gaps[i] + (v.rjust(widths[i]) if i in right else v.ljust(widths[i]))
            for i, v in enumerate(values)
        ]
        return "".join(parts).rstrip()

    out = [line([h[k] for h in head]) for k in range(depth)]
    out.append(line(["-" * w for w in widths]))
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def wrap(text: str, width: int, *, indent: str = "", hang: str | None = None) -> str:
    """``text`` wrapped to ``width`` columns: the first line after ``indent``, the others after
    ``hang`` (default: as many spaces as ``indent``). Words (ids, ``key=value``) are never split."""
    return textwrap.fill(
        text,
        width=max(width, len(indent) + 20),
        initial_indent=indent,
        subsequent_indent=" " * len(indent) if hang is None else hang,
        break_long_words=False,
        break_on_hyphens=False,
    )


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
