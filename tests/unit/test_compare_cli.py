"""``otelkv compare`` end to end: two runs written into real chDB store directories, the CLI on them."""

from __future__ import annotations

import json
import re
import subprocess
import time
from html import unescape
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
    return build_stores(tmp_path_factory.mktemp("compare"))


def build_stores(root: Path) -> tuple[Path, Path]:
    """Runs A (bidirectional on) and B (off) of the hand-worked plan as chDB stores under ``root``."""
    from otelkv.store.chdb_store import ChdbStore

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
    # Self-contained: nothing fetched from anywhere, and without --trace-url the only links are
    # in-page: each regressed point of the scatter to its row in the table.
    assert "src=" not in html
    assert re.findall(r'href="([^"]*)"', html) == ["#regressed-2", "#regressed-1"]
    assert re.search(r'<tr id="regressed-1"><td>c1#2</td>', html)
    assert re.search(r'<tr id="regressed-2"><td>c1#1</td>', html)
    # Seven charts: TTFT by turn index and by prompt length, prefill split, pulls by reason,
    # block-seconds, peak memory, and the scatter of matched turns.
    assert html.count("<svg ") == 7
    titles = [unescape(t) for t in re.findall(r'aria-label="([^"]+)"', html)]
    assert titles == [
        "TTFT by turn index",
        "TTFT by prompt length (tokens)",
        "Prefill seconds per turn (mean)",
        "Pull decisions by reason (% of each run's prefill requests)",
        "Block-seconds held per turn",
        "Peak retained memory (most held at once)",
        "Matched turns: TTFT in A and B (1.2x A dashed)",
    ]
    # The scatter: five matched turns, the two regressions in red, c1#2's tooltip.
    assert html.count('class="point"') == 5 and html.count(f'fill="{svg.REGRESSED}" class="point"') == 2
    assert "<title>c1#2: A 600 ms, B 900 ms</title>" in html
    # Per turn, not summed: A's 5 turns with prefill computed 1.15 s (0.23 s a turn), B's 6 turns 1.90 s.
    assert "<title>A (5 turns) compute: 230 ms</title>" in html
    assert "<title>B (6 turns) compute: 317 ms</title>" in html
    # A's 2 pulls of its 5 prefill decisions; B's 6 of 6 were bidirectional_off.
    assert "<title>pulled A: 40%</title>" in html and "<title>bidirectional_off B: 100%</title>" in html
    assert "<title>decode_ttl A: 75.6</title>" in html  # 378 block-seconds over 5 turns
    for chart in re.findall(r"<svg .*?</svg>", html, re.S):
        check_legend(chart)
    assert '<tr class="differs"><td>bidirectional_kv_xfer</td><td>on</td><td>off</td>' in html
    # B's diagnoses of c1#2, one a line, by cost as `otelkv why` gives them.
    assert re.search(
        r'<tr id="regressed-1">.*?<div><code>tool_wait_dominates</code>: The agent waited 2\.0s.*?</div>'
        r"<div><code>bidirectional_off</code>: bidirectional_kv_xfer is off on the prefill and decode node",
        html,
    )


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
    # Prefill per turn: A 1.15 s compute and 0.15 s transfer over 5 turns, median turn 0.25 s, 700
    # tokens pulled by 2 turns; B 1.90 s over 6 turns.
    assert re.search(r"^A\s+5\s+0\.23s\s+0\.03s\s+0\.25s\s+2\s+140\.0$", text, re.M)
    assert re.search(r"^B\s+6\s+0\.32s\s+0\.00s\s+0\.25s\s+0\s+0\.0$", text, re.M)
    assert re.search(
        r"^decode_ttl\s+A\s+5\s+378\s+75\.6\s+2\.7 MiB\s+28\s+consumed 3, expired 2$", text, re.M
    )
    assert "or failed only in B: 2 of 5 compared; 0 faster in B" in text
    assert re.search(r"^c1#2\s+0\.60s\s+0\.90s\s+1\.50x\s+pulled -> bidirectional_off", text, re.M)


def test_bad_input_exits_2_or_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(tmp_path / "none"), str(tmp_path / "none2")]) == 3  # not found
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


def test_legends_name_only_what_is_drawn() -> None:
    """A run against itself: no regression, so no red in the scatter's legend and no table."""
    a, _ = runs()
    html = page(compare_runs(a, a))
    charts = re.findall(r"<svg .*?</svg>", html, re.S)
    assert len(charts) == 7
    for chart in charts:
        check_legend(chart)
    assert svg.REGRESSED not in charts[-1] and "regressed-" not in html
    assert "0 of 5 matched turns are slower in B" in html
    # B with no TTFT in a bucket: its bars and its legend entry are left out together.
    lone = svg.bars("t", ["0", "1"], [("A p50", [0.1, 0.2]), ("B p50", [None, None])])
    check_legend(lone)
    assert "B p50" not in lone


def check_legend(chart: str) -> None:
    """Every legend swatch names marks drawn in its colour, and every mark's colour is in the legend."""
    swatches = set(re.findall(r'fill="(#[0-9a-f]{6})" class="swatch"', chart))
    marks = set(re.findall(r'fill="(#[0-9a-f]{6})" class="(?:bar|point)"', chart))
    assert swatches == marks, chart[:200]


@pytest.mark.parametrize(
    ("top", "unit", "labels"),
    [
        (2.07, "s", ["0", "0.5 s", "1 s", "1.5 s", "2 s", "2.5 s"]),
        (0.6, "s", ["0", "200 ms", "400 ms", "600 ms"]),
        (0.9, "s", ["0", "0.2 s", "0.4 s", "0.6 s", "0.8 s", "1 s"]),
        (0.03, "s", ["0", "10 ms", "20 ms", "30 ms"]),
        (0, "s", ["0", "0.2 s", "0.4 s", "0.6 s", "0.8 s", "1 s"]),
        (3.6 * 2**20, "B", ["0", "1 MiB", "2 MiB", "3 MiB", "4 MiB"]),
        (1.4 * 2**20, "B", ["0", "0.5 MiB", "1 MiB", "1.5 MiB"]),
        (500, "B", ["0", "100 B", "200 B", "300 B", "400 B", "500 B"]),
        (2144, "", ["0", "500", "1000", "1500", "2000", "2500"]),
        (45_000, "", ["0", "10k", "20k", "30k", "40k", "50k"]),
        (3, "", ["0", "1", "2", "3"]),
        (140, "tokens", ["0", "50", "100", "150"]),
        (100, "%", ["0", "20%", "40%", "60%", "80%", "100%"]),
    ],
)
def test_axis_ticks_are_round_in_the_readers_unit(top: float, unit: str, labels: list[str]) -> None:
    axis = svg.axis(top, unit)
    assert [axis.label(t) for t in axis.ticks] == labels
    assert axis.ticks[-1] >= top


def test_scatter_log_axis_and_empty_charts() -> None:
    log = svg.log_axis([0.045, 2.07, 0.0])  # a 0 s TTFT cannot sit on a log axis: ignored
    assert [log.label(t) for t in log.ticks] == [
        "20 ms",
        "50 ms",
        "100 ms",
        "200 ms",
        "500 ms",
        "1 s",
        "2 s",
        "5 s",
    ]
    assert [svg.log_axis([0.5]).label(t) for t in svg.log_axis([0.5]).ticks] == ["500 ms", "1 s"]
    empty = svg.bars("nothing", [], [("A", [])])
    assert empty.startswith("<svg") and empty.endswith("</svg>")
    assert 'class="point"' not in svg.scatter("none", [], factor=1.2)


def test_trace_ids_link_to_the_given_url(stores: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = stores
    report = tmp_path / "report.html"
    # Grafana Explore URLs hold JSON braces: only {trace_id} is replaced.
    template = 'https://grafana.example/explore?left={"queries":[{"query":"{trace_id}"}]}'
    done = _cli(str(a), str(b), "--html", str(report), "--trace-url", template)
    assert done.returncode == 0, done.stderr
    html = report.read_text()
    c12 = json.loads(_cli(str(a), str(b), "--json").stdout)["regressions"]["turns"][0]["b"]["trace_id"]
    url = template.replace("{trace_id}", c12).replace('"', "&quot;")
    assert f'<a href="{url}"><code>{c12}</code></a>' in html
    assert _cli(str(a), str(b), "--html", str(report), "--trace-url", "https://x/").returncode == 2
