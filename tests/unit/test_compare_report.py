"""The ``otelkv compare --html`` report as a reader sees it: rendered by headless Chromium.

Two real chDB stores (the hand-worked runs of ``test_compare_aggregate``), the CLI writes the
report, Chromium takes a screenshot, and the pixels are read back: the page is not blank,
every colour the legends name is drawn as marks (not only as a legend swatch), and the charts
use the page width (A's bars appear in both grid columns of a 1280 px window).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from PIL import Image, ImageChops

from otelkv.cli.compare_report import html, svg
from tests.unit.dashboards_tools import require_tool
from tests.unit.test_compare_cli import build_stores
from tests.unit.test_tune_cli import run_cli

WINDOW = (1280, 4000)
"""Tall enough for the whole report of the hand-worked runs (headless screenshots the viewport)."""
WHITE = (255, 255, 255)


def _rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def screenshot(page: Path, out: Path, profile: Path) -> Path:
    chromium = require_tool("chromium")
    done = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",  # root in containers; the page is our own file
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--screenshot={out}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0 and out.exists(), done.stderr[-2000:]
    return out


def where(image: Image.Image, color: str) -> tuple[int, tuple[int, int, int, int] | None]:
    """How many pixels have exactly ``color``, and their bounding box."""
    solid = Image.new("RGB", image.size, _rgb(color))
    r, g, b = ImageChops.difference(image, solid).split()
    mask = ImageChops.lighter(r, ImageChops.lighter(g, b)).point(lambda v: 255 if v == 0 else 0)
    return mask.histogram()[255], mask.getbbox()


def test_report_in_headless_chromium(tmp_path: Path) -> None:
    a, b = build_stores(tmp_path / "runs")
    report = tmp_path / "report.html"
    done = run_cli("compare", str(a), str(b), "--html", str(report))
    assert done.returncode == 0, done.stderr
    image = Image.open(screenshot(report, tmp_path / "report.png", tmp_path / "profile")).convert("RGB")
    assert image.size == WINDOW

    counts = {color: n for n, color in image.getcolors(WINDOW[0] * WINDOW[1])}
    inked = 1 - counts.get(WHITE, 0) / (WINDOW[0] * WINDOW[1])
    assert inked > 0.03, f"only {inked:.1%} of the page is not white"

    # Each legend colour is drawn as marks too: its pixels reach well below its 10 px swatch.
    # A and B (p50 bars, pulls, retention), their p95 variants, the prefill split, the regressed
    # points of the scatter (the hand-worked runs have two).
    legend_colors = {
        "A": svg.PALETTE[0],
        "B": svg.PALETTE[1],
        "A p95": svg.PALETTE[2],
        "B p95": svg.PALETTE[3],
        "compute": html.PREFILL_COLORS[0],
        "KV transfer": html.PREFILL_COLORS[1],
        "regressed": svg.REGRESSED,
    }
    boxes = {}
    for name, color in legend_colors.items():
        n, box = where(image, color)
        assert box is not None and n > 60, f"{name} ({color}): {n} pixels"
        assert box[3] - box[1] > 30, f"{name} ({color}) drawn only in a legend: {box}"
        boxes[name] = box
    # The page width is used: A's bars sit in both columns of the chart grid, across the window.
    left, _, right, _ = boxes["A"]
    assert left < WINDOW[0] * 0.2 and right > WINDOW[0] * 0.75, boxes["A"]
