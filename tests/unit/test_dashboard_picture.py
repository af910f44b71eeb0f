"""The README picture's pure parts: Grafana's field config, colours, units, gaps, bars and layout.

The expected values come from Grafana's own definitions (theme hues, classic palette order,
value formatters, ``spanNulls: false``) worked by hand for each input, and from the inputs
themselves (which steps are missing, how tall the bars are); none is computed by the code
under test.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from tools import grafana_expand as expand
from tools import grafana_style as gs
from tools.dashboard_picture import (
    main,
    recorder,
    render,
    replay,
    save_recording,
    table_fields,
    timeseries_fields,
)
from tools.panel_draw import calc, span_nulls, y_axis

NAN = math.nan


def _panel(kind: str = "timeseries", **field_config: Any) -> dict[str, Any]:
    return {
        "type": kind,
        "id": 1,
        "title": "t",
        "fieldConfig": {"defaults": {}, "overrides": [], **field_config},
    }


# --- units ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "unit", "decimals", "expected"),
    [
        (27.93, "s", None, "27.9 s"),  # two significant digits: toFixed's automatic decimals
        (7.0, "s", None, "7 s"),  # a whole number has none
        (0.25, "s", None, "250 ms"),  # under a second: milliseconds
        (90.0, "s", None, "1.50 min"),
        (0.0, "s", None, "0 s"),
        (7.37, "s", 0, "7 s"),  # the field's decimals win
        (1536.0, "bytes", None, "1.50 KiB"),  # IEC: 1024 per step
        (120_000.0, "Bps", None, "120 kB/s"),  # SI: 1000 per step
        (2_500_000.0, "Bps", 1, "2.5 MB/s"),
        (512.0, "Bps", None, "512 B/s"),
        (0.5, "percentunit", None, "50%"),
        (0.257, "percentunit", 1, "25.7%"),
        (1234.0, "short", None, "1.23 K"),
        (15.0, "short", None, "15"),
        (12.5, "suffix: tok/s", None, "12.5 tok/s"),
        (3.0, "reqps", None, "3 req/s"),
        (4.0, "widgets", None, "4 widgets"),  # an unknown unit is a suffix
    ],
)
def test_values_are_written_in_the_fields_unit(
    value: float, unit: str, decimals: int | None, expected: str
) -> None:
    assert gs.format_value(value, unit, decimals) == expected


def test_axis_ticks_take_the_decimals_of_their_step() -> None:
    assert gs.axis_label(20_000.0, 20_000.0, {"unit": "Bps"}) == "20 kB/s"
    assert gs.axis_label(2.5, 0.5, {"unit": "short"}) == "2.5"
    assert gs.axis_label(2.0, 0.5, {"unit": "short"}) == "2.0"
    assert gs.axis_label(2.0, 0.5, {"unit": "short", "decimals": 0}) == "2"
    assert gs.value_label(None, {"unit": "s"}) == "-"


# --- field config and colours -----------------------------------------------------------------


def test_overrides_apply_to_the_matching_field_only() -> None:
    panel = _panel(
        defaults={"unit": "s", "custom": {"fillOpacity": 10}},
        overrides=[
            {
                "matcher": {"id": "byName", "options": "pulled"},
                "properties": [
                    {"id": "color", "value": {"mode": "fixed", "fixedColor": "purple"}},
                    {"id": "custom.fillOpacity", "value": 60},
                    {"id": "unit", "value": "bytes"},
                ],
            },
            {
                "matcher": {"id": "byRegexp", "options": "local.*"},
                "properties": [{"id": "decimals", "value": 2}],
            },
            {
                "matcher": {"id": "byFrameRefID", "options": "B"},
                "properties": [{"id": "displayName", "value": "b"}],
            },
        ],
    )
    pulled = gs.field_config(panel, "pulled", ref_id="A")
    assert pulled["unit"] == "bytes" and pulled["custom"]["fillOpacity"] == 60
    assert gs.field_color(pulled, 0, gs.DARK) == "#B877D9"  # Grafana's dark "purple"
    assert gs.field_color(pulled, 0, gs.LIGHT) == "#A352CC"  # and its light one
    local = gs.field_config(panel, "local_cache", ref_id="A")
    assert local["unit"] == "s" and local["custom"]["fillOpacity"] == 10 and local["decimals"] == 2
    assert gs.display_name(gs.field_config(panel, "x", ref_id="B"), "x") == "b"
    assert "decimals" not in gs.field_config(panel, "computed", ref_id="A")  # the defaults stay untouched


def test_series_take_the_classic_palette_in_order() -> None:
    config = gs.field_config(_panel("timeseries"), "any")
    assert config["color"] == {"mode": "palette-classic"}  # the time series plugin's default
    dark = [gs.field_color(config, i, gs.DARK) for i in range(4)]
    assert dark == ["#73BF69", "#FADE2A", "#5794F2", "#FF9830"]  # green, yellow, blue, orange
    assert gs.field_color(config, 0, gs.LIGHT) == "#56A64B"  # light theme "green"
    assert gs.field_color(config, 6, gs.DARK) == "#37872D"  # "dark-green" after the six hues


def test_bar_gauges_colour_by_threshold() -> None:
    steps = [
        {"color": "green", "value": None},
        {"color": "yellow", "value": 1.0},
        {"color": "red", "value": 3.0},
    ]
    config = gs.field_config(
        _panel("bargauge", defaults={"thresholds": {"mode": "absolute", "steps": steps}}), "p50"
    )
    assert config["color"] == {"mode": "thresholds"}
    assert gs.field_color(config, 5, gs.DARK, 0.4) == "#73BF69"
    assert gs.field_color(config, 5, gs.DARK, 1.0) == "#FADE2A"  # at the step: that step's colour
    assert gs.field_color(config, 5, gs.DARK, 28.0) == "#F2495C"
    # The gradient: green at the start, yellow from halfway to its step (1 of 0..10), no red below 3.
    assert gs.threshold_stops(config, 2.0, 0.0, 10.0, gs.DARK) == [
        (0.0, "#73BF69"),
        (0.05, "#FADE2A"),
        (1.0, "#FADE2A"),
    ]


def test_a_css_or_hex_colour_passes_through() -> None:
    assert gs.color("#123456", gs.DARK) == "#123456"
    assert gs.color("rgb(1, 2, 3)", gs.LIGHT) == "rgb(1, 2, 3)"
    assert gs.color("semi-dark-blue", gs.DARK) == "#3274D9"


# --- nulls ------------------------------------------------------------------------------------


def test_missing_steps_become_gaps() -> None:
    times, values = gs.with_gaps([10.0, 11.0, 12.0, 15.0, 16.0], [1.0, 2.0, 3.0, 4.0, 5.0], 1.0)
    assert times == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0]
    assert [v if not math.isnan(v) else None for v in values] == [1.0, 2.0, 3.0, None, None, 4.0, 5.0]


def test_a_series_without_missing_steps_is_unchanged() -> None:
    assert gs.with_gaps([0.0, 2.0, 4.0], [1.0, NAN, 3.0], 2.0)[0] == [0.0, 2.0, 4.0]


def test_prometheus_series_with_missing_steps_draw_gaps() -> None:
    panel = _panel()
    panel["targets"] = [{"expr": "up", "legendFormat": "{{job}}", "refId": "A"}]
    ctx = expand.Context(
        start=datetime.fromtimestamp(100, timezone.utc), end=datetime.fromtimestamp(110, timezone.utc)
    )

    def prom_range(expr: str) -> list[dict[str, Any]]:
        assert expr == "up"
        return [{"metric": {"job": "vllm"}, "values": [[100, "1"], [101, "NaN"], [102, "2"], [105, "3"]]}]

    (series,) = timeseries_fields(panel, ctx, prom_range, step=1.0)
    assert series.field.name == "vllm"
    assert series.times == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
    present = [not math.isnan(v) for v in series.field.values]
    assert present == [True, False, True, False, False, True]
    # Grafana's default spanNulls: false keeps every break; true joins them; a threshold joins shorter ones.
    assert span_nulls(series.times, series.field.values, False)[0] == series.times
    assert span_nulls(series.times, series.field.values, True)[0] == [100.0, 102.0, 105.0]
    joined_t, joined_v = span_nulls(series.times, series.field.values, 2000)  # joins gaps up to 2 s
    assert joined_t == [100.0, 102.0, 103.0, 105.0] and math.isnan(joined_v[2])


def test_stacking_keeps_gaps_and_stacks_on_what_is_there() -> None:
    (first, second) = gs.stack([[1.0, NAN, 1.0], [2.0, 2.0, 2.0]])
    assert first[1][0] == 1.0 and math.isnan(first[1][1]) and math.isnan(first[0][1])
    assert second == ([1.0, 0.0, 1.0], [3.0, 2.0, 3.0])
    (_, top), (_, total) = gs.stack([[1.0], [3.0]], percent=True)
    assert top == [0.25] and total == [1.0]


def test_legend_calcs_skip_nulls() -> None:
    assert calc("mean", [1.0, NAN, 3.0]) == 2.0
    assert calc("max", [1.0, NAN, 3.0]) == 3.0
    assert calc("lastNotNull", [1.0, 2.0, NAN]) == 2.0
    assert calc("last", [1.0, 2.0, NAN]) is None
    assert calc("mean", [NAN]) is None


# --- bars and layout --------------------------------------------------------------------------


def test_stacked_category_bars_fit_inside_the_axes() -> None:
    tool_wait, work = [0.5, 1.2, 0.0], [1.0, 26.1, 3.0]  # turn 1 is 27.3 s high
    bars = gs.category_bars([tool_wait, work], 0.7, 0.97, stacked=True)
    x0, x1, y0, y1 = gs.bars_limits(b for series in bars for b in series)
    assert bars[1][1].bottom == 1.2 and bars[1][1].top == pytest.approx(27.3)
    assert all(b.width == pytest.approx(0.7 * 0.97) for series in bars for b in series)
    assert y0 == 0.0 and y1 >= 27.3
    assert -0.5 <= x0 and x1 <= 2.5  # inside the three category slots


def test_grouped_bars_share_the_group_and_one_field_uses_the_bar_width() -> None:
    (a, b) = gs.category_bars([[1.0], [2.0]], 0.8, 0.5, stacked=False)
    assert a[0].left + a[0].width <= b[0].left  # side by side, not overlapping
    assert a[0].width == pytest.approx(0.4 * 0.5)
    (only,) = gs.category_bars([[1.0]], 0.7, 0.97, stacked=False)
    assert only[0].width == pytest.approx(0.97)


def test_time_bars_are_as_wide_as_the_interval_allows_and_stay_inside() -> None:
    bars = gs.time_bars([100.0, 101.0, 102.0], [1.0, NAN, 4.0], 1.0, 0.6)
    assert [(b.left, b.width) for b in bars] == [(pytest.approx(99.7), 0.6), (pytest.approx(101.7), 0.6)]
    x0, x1, _, y1 = gs.bars_limits(bars)
    assert x0 <= 99.7 and x1 >= 102.3 and y1 >= 4.0


def test_the_value_axis_ends_above_the_tallest_bar() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    try:
        y_axis(ax, 27.3, 0.0, {"unit": "s", "min": 0}, 200.0)
        low, high = ax.get_ylim()
        assert low == 0.0 and high >= 27.3
        labels = [ax.yaxis.get_major_formatter()(t, 0) for t in ax.yaxis.get_major_locator()()]
        assert labels[0] == "0 s" and all(label.endswith(" s") for label in labels)
    finally:
        plt.close(fig)


def test_panels_keep_their_grid_sizes_and_wrap_rows() -> None:
    cells = gs.layout([(12, 8), (8, 8), (12, 8), (12, 6), (24, 4)])
    assert [(c.x, c.y, c.w, c.h) for c in cells] == [
        (0, 0, 12, 8),
        (12, 0, 8, 8),
        (0, 8, 12, 8),
        (12, 8, 12, 6),
        (0, 16, 24, 4),
    ]


# --- rendering --------------------------------------------------------------------------------


def _board() -> dict[str, Any]:
    steps = {"mode": "absolute", "steps": [{"color": "green", "value": None}]}
    return {
        "uid": "b",
        "title": "Board",
        "panels": [
            {
                "id": 1,
                "type": "timeseries",
                "title": "rate",
                "gridPos": {"x": 0, "y": 0, "w": 12, "h": 8},
                "fieldConfig": {"defaults": {"unit": "Bps", "custom": {"stacking": {"mode": "normal"}}}},
                "options": {"legend": {"displayMode": "table", "calcs": ["mean", "max"], "showLegend": True}},
                "targets": [{"expr": "rate", "legendFormat": "{{dir}}", "refId": "A"}],
            },
            {
                "id": 2,
                "type": "bargauge",
                "title": "counts",
                "gridPos": {"x": 12, "y": 0, "w": 8, "h": 8},
                "fieldConfig": {"defaults": {"unit": "short", "min": 0, "thresholds": steps}},
                "options": {"displayMode": "gradient"},
                "targets": [{"expr": "count", "legendFormat": "{{reason}}", "instant": True, "refId": "A"}],
            },
            {
                "id": 3,
                "type": "barchart",
                "title": "turns",
                "gridPos": {"x": 0, "y": 8, "w": 12, "h": 8},
                "fieldConfig": {"defaults": {"unit": "s"}},
                "options": {"stacking": "normal", "xField": "turn", "legend": {"showLegend": True}},
                "targets": [{"rawSql": "SELECT 1", "refId": "A"}],
            },
            {"id": 4, "type": "table", "title": "rows", "targets": []},
        ],
    }


def _queries() -> tuple[Any, Any, Any]:
    def prom_range(expr: str) -> list[dict[str, Any]]:
        return [
            {"metric": {"dir": "D->P"}, "values": [[100, "10"], [101, "20"], [104, "5"]]},
            {"metric": {"dir": "P->D"}, "values": [[100, "1"], [102, "2"]]},
        ]

    def prom_instant(expr: str) -> list[dict[str, Any]]:
        return [
            {"metric": {"reason": "pulled"}, "value": [110, "4"]},
            {"metric": {"reason": "x"}, "value": [110, "NaN"]},
        ]

    def sql_rows(sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        return ["turn", "tool_wait", "generation"], [("turn 0", 0.0, 1.5), ("turn 1", 2.0, None)]

    return prom_range, prom_instant, sql_rows


def _ctx() -> expand.Context:
    return expand.Context(
        start=datetime.fromtimestamp(99, timezone.utc),
        end=datetime.fromtimestamp(106, timezone.utc),
        interval_s=1.0,
    )


def test_render_draws_each_panel_from_its_queries(tmp_path: Path) -> None:
    prom_range, prom_instant, sql_rows = _queries()
    board = _board()
    out = tmp_path / "p.png"
    for theme in ("dark", "light"):
        drawn = render(
            out,
            [(board, 1), (board, 2), (board, 3)],
            _ctx(),
            prom_range=prom_range,
            prom_instant=prom_instant,
            sql_rows=sql_rows,
            title="x",
            theme=theme,
        )
        # 5 samples; one gauge (the NaN sample is no bar); 3 non-null cells of the table.
        assert [(d.title, d.points) for d in drawn] == [("rate", 5), ("counts", 1), ("turns", 3)]
        assert out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="table"):
        render(out, [(board, 4)], _ctx(), prom_range=prom_range, prom_instant=prom_instant, sql_rows=sql_rows)


def test_table_fields_take_the_x_field_and_number_the_value_fields() -> None:
    _, _, sql_rows = _queries()
    board = _board()
    categories, fields = table_fields(board["panels"][2], _ctx(), sql_rows)
    assert categories == ["turn 0", "turn 1"]
    assert [(f.name, f.series_index) for f in fields] == [("tool_wait", 0), ("generation", 1)]
    assert math.isnan(fields[1].values[1])


def test_replay_redraws_from_a_saved_recording(tmp_path: Path) -> None:
    board = _board()
    prom_range, prom_instant, sql_rows, kept = recorder(*_queries())
    panels = [("b", 1), ("b", 2), ("b", 3)]
    first = render(
        tmp_path / "a.png",
        [(board, p) for _, p in panels],
        _ctx(),
        prom_range=prom_range,
        prom_instant=prom_instant,
        sql_rows=sql_rows,
    )
    save_recording(tmp_path / "run.json", kept, _ctx(), panels, "title")
    assert json.loads((tmp_path / "run.json").read_text())["range"] == {"rate": _queries()[0]("rate")}
    assert replay(tmp_path / "run.json", tmp_path / "b.png", {"b": board}) == first
    # A panel whose query changed since the run is refused, not drawn empty.
    board["panels"][0]["targets"][0]["expr"] = "other"
    with pytest.raises(KeyError, match="re-run the fleet test"):
        replay(tmp_path / "run.json", tmp_path / "c.png", {"b": board})


def test_the_command_says_what_is_wrong_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main([str(tmp_path / "missing.json"), str(tmp_path / "out.png"), "--dashboards", str(tmp_path)]) == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    "custom",
    [
        {"spanNulls": True, "fillOpacity": 20},
        {"spanNulls": 1500, "lineInterpolation": "stepAfter", "fillOpacity": 10},
        {"drawStyle": "bars", "fillOpacity": 50, "stacking": {"mode": "normal"}},
        {"drawStyle": "points", "stacking": {"mode": "percent"}},
        {"thresholdsStyle": {"mode": "dashed+area"}},
    ],
)
def test_every_time_series_style_draws_every_sample(tmp_path: Path, custom: dict[str, Any]) -> None:
    prom_range, prom_instant, sql_rows = _queries()
    board = _board()
    panel = board["panels"][0]
    panel["fieldConfig"]["defaults"]["custom"] = custom
    panel["fieldConfig"]["defaults"]["thresholds"] = {
        "mode": "absolute",
        "steps": [{"color": "green", "value": None}, {"color": "red", "value": 15}],
    }
    (drawn,) = render(
        tmp_path / "s.png",
        [(board, 1)],
        _ctx(),
        prom_range=prom_range,
        prom_instant=prom_instant,
        sql_rows=sql_rows,
    )
    assert drawn.points == 5


@pytest.mark.parametrize("maxticks", [3, 4, 6, 10])
def test_time_axis_ticks_fit_any_run_length(maxticks: int) -> None:
    """A narrow panel (3 ticks) over a run of any length gets ticks without matplotlib warning
    that it found no interval (the suite turns that warning into a failure)."""
    import warnings

    import matplotlib.dates as mdates

    from tools.panel_draw import time_locator

    start = 20_000.0  # days since the epoch, as matplotlib's date axis counts
    for span_s in (5, 20, 45, 70, 100, 150, 250, 400, 900, 1800, 3600, 7200, 4 * 3600, 86400):
        locator = time_locator(maxticks)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ticks = locator.tick_values(mdates.num2date(start), mdates.num2date(start + span_s / 86400))
        inside = [t for t in ticks if start <= t <= start + span_s / 86400]
        assert 1 <= len(inside) <= maxticks + 1, (span_s, len(inside))
