"""Panel constructors shared by the dashboards: units, thresholds, legends and layout.

Each dashboard module calls these once per panel with an explicit panel id (the SDK leaves
ids unset; Grafana would invent them on load, and committed JSON must be stable).
Layout is the SDK's: panels flow left to right in a 24-column grid, ``width`` columns each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grafana_foundation_sdk.builders import barchart, bargauge, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DynamicConfigValue,
    MatcherConfig,
    Panel,
    Threshold,
    ThresholdsMode,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from otelkv.dashboards.sources import CLICKHOUSE, PROMETHEUS, Datasource

HEIGHT = 8
STAT_HEIGHT = 4

Target = cogbuilder.Builder[cogvariants.Dataquery]
PanelBuilder = cogbuilder.Builder[Panel]

# Units (Grafana unit ids).
SECONDS = "s"
BYTES = "bytes"
BYTES_PER_SECOND = "Bps"
PERCENT = "percentunit"
PER_SECOND = "ops"
REQUESTS_PER_SECOND = "reqps"
TOKENS_PER_SECOND = "suffix: tok/s"
COUNT = "short"


def thresholds(*steps: tuple[float | None, str]) -> dashboard_b.ThresholdsConfig:
    """Absolute thresholds; the first step's value is ``None`` (minus infinity)."""
    return (
        dashboard_b.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=value, color=color) for value, color in steps])
    )


NEUTRAL = thresholds((None, "green"))
"""No judgement: a rate or a size is not good or bad on its own."""


def prom(
    expr: str,
    legend: str = "__auto",
    ref: str = "A",
    *,
    instant: bool = False,
    heatmap: bool = False,
) -> prometheus.Dataquery:
    """A Prometheus target (range unless ``instant``; ``heatmap`` de-accumulates buckets)."""
    query = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(PROMETHEUS.ref())
    query = query.instant() if instant else query.range()
    if heatmap:
        query = query.format(PromQueryFormat.HEATMAP)
    return query


def _legend(calcs: Sequence[str]) -> common_b.VizLegendOptions:
    return (
        common_b.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(list(calcs))
    )


def _tooltip() -> common_b.VizTooltipOptions:
    return (
        common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)
    )


def timeseries_panel(
    panel_id: int,
    title: str,
    description: str,
    unit: str,
    targets: Sequence[Target],
    *,
    width: int = 12,
    height: int = HEIGHT,
    stack: bool = False,
    bars: bool = False,
    limits: dashboard_b.ThresholdsConfig | None = None,
    legend_calcs: Sequence[str] = ("mean", "max"),
    decimals: float | None = None,
) -> timeseries.Panel:
    """A time series; with ``limits`` their lines are drawn dashed on the graph."""
    panel = (
        timeseries.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(PROMETHEUS.ref())
        .unit(unit)
        .min(0)
        .span(width)
        .height(height)
        .legend(_legend(legend_calcs))
        .tooltip(_tooltip())
        .fill_opacity(25 if stack else 10)
        .thresholds(limits or NEUTRAL)
    )
    if decimals is not None:
        panel = panel.decimals(decimals)
    if stack:
        panel = panel.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    if bars:
        panel = panel.draw_style(common.GraphDrawStyle.BARS)
    if limits is not None:
        panel = panel.thresholds_style(
            common_b.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED)
        )
    for target in targets:
        panel = panel.with_target(target)
    return panel


def stat_panel(
    panel_id: int,
    title: str,
    description: str,
    unit: str,
    target: Target,
    limits: dashboard_b.ThresholdsConfig,
    *,
    width: int = 4,
    reducer: str = "lastNotNull",
    decimals: float | None = None,
    source: Datasource = PROMETHEUS,
) -> stat.Panel:
    """One number, coloured by ``limits``, with a sparkline (``source``: where it is read)."""
    panel = (
        stat.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(source.ref())
        .unit(unit)
        .span(width)
        .height(STAT_HEIGHT)
        .thresholds(limits)
        .color_mode(common.BigValueColorMode.VALUE)
        .graph_mode(common.BigValueGraphMode.AREA)
        .reduce_options(common_b.ReduceDataOptions().calcs([reducer]).values(False))
        .with_target(target)
    )
    if decimals is not None:
        panel = panel.decimals(decimals)
    return panel


def bargauge_panel(
    panel_id: int,
    title: str,
    description: str,
    unit: str,
    targets: Sequence[Target],
    *,
    width: int = 12,
    height: int = HEIGHT,
    limits: dashboard_b.ThresholdsConfig | None = None,
    decimals: float | None = None,
) -> bargauge.Panel:
    """Horizontal bars, one per series, each showing the series' last value (counts of
    events: ``decimals=0``)."""
    panel = (
        bargauge.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(PROMETHEUS.ref())
        .unit(unit)
        .min(0)
        .span(width)
        .height(height)
        .orientation(common.VizOrientation.HORIZONTAL)
        .display_mode(common.BarGaugeDisplayMode.GRADIENT)
        .thresholds(limits or NEUTRAL)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if decimals is not None:
        panel = panel.decimals(decimals)
    for target in targets:
        panel = panel.with_target(target)
    return panel


def table_panel(
    panel_id: int,
    title: str,
    description: str,
    target: Target,
    *,
    columns: dict[str, list[DynamicConfigValue]] | None = None,
    sort_by: str | None = None,
    width: int = 24,
    height: int = 10,
) -> table.Panel:
    """A ClickHouse table; ``columns`` maps a column name to its field overrides."""
    panel = (
        table.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(CLICKHOUSE.ref())
        .span(width)
        .height(height)
        .filterable(True)
        .thresholds(NEUTRAL)
        .with_target(target)
    )
    if sort_by is not None:
        panel = panel.sort_by([common_b.TableSortByFieldState().display_name(sort_by).desc(True)])
    for column, properties in (columns or {}).items():
        panel = panel.override_by_name(column, properties)
    return panel


def barchart_panel(
    panel_id: int,
    title: str,
    description: str,
    unit: str,
    target: Target,
    x_field: str,
    *,
    stack: bool = True,
    width: int = 12,
    height: int = HEIGHT,
) -> barchart.Panel:
    """Bars per category (``x_field``), stacked over the numeric columns (ClickHouse table)."""
    panel = (
        barchart.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(CLICKHOUSE.ref())
        .unit(unit)
        .min(0)
        .span(width)
        .height(height)
        .x_field(x_field)
        .orientation(common.VizOrientation.VERTICAL)
        .show_value(common.VisibilityMode.NEVER)
        .legend(_legend(()).display_mode(common.LegendDisplayMode.LIST))
        .tooltip(_tooltip())
        .fill_opacity(80)
        .thresholds(NEUTRAL)
        .with_target(target)
    )
    if stack:
        panel = panel.stacking(common.StackingMode.NORMAL)
    return panel


def unit_of(unit: str, decimals: int | None = None) -> list[DynamicConfigValue]:
    """Field overrides: a column's unit (and decimals)."""
    out = [DynamicConfigValue(id_val="unit", value=unit)]
    if decimals is not None:
        out.append(DynamicConfigValue(id_val="decimals", value=decimals))
    return out


def coloured(limits: dashboard_b.ThresholdsConfig) -> list[DynamicConfigValue]:
    """Field overrides: colour a table column's text by ``limits``."""
    return [
        DynamicConfigValue(id_val="custom.cellOptions", value={"type": "color-text"}),
        DynamicConfigValue(id_val="thresholds", value=limits.build()),
    ]


def links(*pairs: tuple[str, str]) -> DynamicConfigValue:
    """A column's data links: ``(title, url)`` pairs (urls may use Grafana link variables)."""
    value: list[dict[str, Any]] = [{"title": title, "url": url} for title, url in pairs]
    return DynamicConfigValue(id_val="links", value=value)


def by_name(name: str) -> MatcherConfig:
    return MatcherConfig(id_val="byName", options=name)
