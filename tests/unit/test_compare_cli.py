"""``otelkv compare`` end to end: two runs written into real chDB store directories, the CLI on them."""

from __future__ import annotations

import io
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from otelkv import names
from otelkv.analysis.compare.aggregate import compare_runs
from otelkv.cli.compare_report import svg
from otelkv.cli.compare_report.html import page
from otelkv.cli.main import main
from tests.unit.test_compare_aggregate import MANIFEST_A, MANIFEST_B, check_comparison, run_spans, runs
from tests.unit.test_diagnose import T0, S
from tests.unit.test_tune_cli import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("compare", *args)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from otelkv.store.chdb_store import ChdbStore

    root = tmp_path_factory.mktemp("compare")
    # Two hours ago: the store's TTL drops parts older than its retention as soon as they land.
    base_s = (time.time_ns() - 2 * 3600 * S - T0) / S
    out = []
    for name, on, manifest in (("on", True, MANIFEST_A), ("off", False, MANIFEST_B)):
        spans = run_spans(on, base_s)
        store = ChdbStore(root / name)  # one directory open at a time in this process
        try:
            assert store.insert_spans(spans) == len(spans)
        finally:
            store.close()
        (root / name / names.RUN_MANIFEST_FILE).write_text(json.dumps(manifest))
        out.append(root / name)
    return out[0], out[1]


def test_json_and_html_on_two_store_directories(stores: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = stores
    report = tmp_path / "report.html"
    done = _cli(str(a), str(b), "--json", "--html", str(report))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    check_comparison(data)
    assert (data["a"]["where"], data["b"]["where"]) == (str(a), str(b))
    assert data["a"]["scenarios"] == ["agent-short-tools"]
    assert f"HTML report: {report}" in done.stderr

    html = report.read_text()
    assert html.startswith("<!DOCTYPE html>") and "<script" not in html
    assert not re.search(r"(src|href)=", html)  # self-contained: nothing fetched from anywhere
    # Seven charts: TTFT by turn index and by prompt length, prefill split, pulls by reason,
    # block-seconds, peak memory, and the scatter of matched turns.
    assert html.count("<svg ") == 7
    titles = re.findall(r'aria-label="([^"]+)"', html)
    assert titles == [
        "TTFT by turn index",
        "TTFT by prompt length (tokens)",
        "Prefill seconds summed over turns",
        "Pull decisions by reason",
        "Block-seconds held",
        "Peak retained memory",
        "Matched turns: TTFT in A and B (dashed: 1.2x A)",
    ]
    # The scatter: five matched turns, the two regressions in red, c1#2's tooltip.
    assert html.count('class="point"') == 5 and html.count(f'fill="{svg.PALETTE[5]}" class="point"') == 2
    assert "<title>c1#2: A 0.6s, B 0.9s</title>" in html
    assert '<tr class="differs"><td>bidirectional_kv_xfer</td><td>on</td><td>off</td>' in html
    assert "bidirectional_off: bidirectional_kv_xfer is off on the prefill and decode node" in html


def test_terminal_summary(stores: tuple[Path, Path]) -> None:
    a, b = stores
    done = _cli(str(a), str(b), "--regression", "1.4")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert f"A: {a} [agent-short-tools]: 5 turns (5 ok)" in text
    assert "5 turns in both runs (matched by conversation id and turn index)" in text
    assert re.search(r"^\* bidirectional_kv_xfer\s+on\s+off$", text, re.M)
    assert re.search(r"^all\s+5\s+0\.40s\s+0\.60s\s+6\s+0\.45s\s+1\.00s\s+1\.12x$", text, re.M)
    assert re.search(r"^2\s+1\s+0\.60s\s+0\.60s\s+1\s+0\.90s\s+0\.90s\s+1\.50x$", text, re.M)
    assert re.search(r"^A\s+5\s+1\.15s\s+0\.15s\s+2\s+700$", text, re.M)
    assert re.search(r"^B\s+6\s+1\.90s\s+0\.00s\s+0\s+0$", text, re.M)
    assert re.search(r"^decode_ttl\s+A\s+5\s+378\s+2\.7 MiB\s+28\s+consumed 3, expired 2$", text, re.M)
    assert "or failed only in B: 2 of 5 compared; 0 faster in B" in text
    assert re.search(r"^c1#2\s+0\.60s\s+0\.90s\s+1\.50x\s+pulled -> bidirectional_off", text, re.M)


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(tmp_path / "none"), str(tmp_path / "none2")]) == 2
    assert "no store at" in capsys.readouterr().err
    assert main(["compare", "a", "b", "--regression", "0.5"]) == 2
    assert "--regression must be at least 1" in capsys.readouterr().err


def test_html_escapes_hostile_ids() -> None:
    a, b = runs()
    data = compare_runs(a, b)
    data["regressions"]["turns"][0]["ref"] = "<img src=x onerror=alert(1)>#2"
    data["a"]["where"] = "</title><script>x</script>"
    html = page(data)
    assert "<img src=x" not in html and "<script>" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;#2" in html


def test_svg_axis_tops() -> None:
    assert [svg.nice_max(v) for v in (0, 0.03, 0.9, 1.0, 1.2, 2.4, 7, 120)] == [
        1,
        0.05,
        1,
        1,
        2,
        2.5,
        10,
        200,
    ]
    empty = svg.bars("nothing", [], [("A", [])])
    assert empty.startswith("<svg") and empty.endswith("</svg>")
    buf = io.StringIO(svg.scatter("none", [], factor=1.2))
    assert "<circle" not in buf.getvalue()
