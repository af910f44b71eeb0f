"""PromQL text for the dashboards, built from :mod:`otelkv.names`.

Metric names come from ``names.METRIC_*`` (plus the suffix the Prometheus client adds:
``_total`` for counters, ``_bucket``/``_sum``/``_count`` for histograms); label values come
from the closed vocabularies in :mod:`otelkv.names`. Label names are the ones the exporters
attach (:mod:`otelkv.engine.prom`, :mod:`otelkv.sidecar.metrics`, vLLM's ``model_name``,
Prometheus' ``instance``); ``tests/unit/test_dashboards_promql.py`` checks them against the
real expositions, so a renamed label fails a unit test instead of emptying a panel.

Every selector carries braces (at least the dashboard's filters), which is what lets the
tests find every metric a dashboard reads with one regular expression.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from otelkv import names

RATE_WINDOW = "$__rate_interval"
"""Grafana's rate window: at least four scrape intervals, so a rate always has two samples."""
RANGE_WINDOW = "$__range"
"""The dashboard's whole time range (for "over the range" totals in stats and bar gauges)."""

# Label names: vLLM's and Prometheus' own, then otelkv's (from the metric table in names).
MODEL_NAME = names.LABEL_MODEL
"""vLLM's label for the served model on every engine series (otelkv's included), and the
sidecar's for the requested model: one name, so one selector filters both."""
INSTANCE = "instance"
"""The scrape target Prometheus attaches: one per engine (``host:port``)."""
LE = "le"
MODEL = MODEL_NAME
PART = names.LABEL_PART
PHASE = names.LABEL_PHASE
TURN_INDEX = names.LABEL_TURN_INDEX
SOURCE = names.LABEL_SOURCE
DECISION = names.LABEL_DECISION
REASON = names.LABEL_REASON
DIRECTION = names.LABEL_DIRECTION
BACKEND = names.LABEL_BACKEND
OUTCOME = names.LABEL_OUTCOME
KIND = names.LABEL_KIND
ROLE = names.LABEL_ROLE
STATUS = names.LABEL_STATUS

TURN_STATUS_OK = names.TURN_STATUS_OK
"""``status`` value of ``otelkv_turns_total`` for a turn answered without an error."""
TURN_STATUS_ERROR = names.TURN_STATUS_ERROR

MODEL_VAR = "model"
ENGINE_VAR = "engine"

ENGINE_FILTERS = (f'{MODEL_NAME}=~"${MODEL_VAR}"', f'{INSTANCE}=~"${ENGINE_VAR}"')
"""What the ``model`` and ``engine`` variables select on engine series."""
SIDECAR_FILTERS = (f'{MODEL}=~"${MODEL_VAR}"',)
"""What the ``model`` variable selects on the sidecar's turn series (they have no engine)."""


def counter(metric: str) -> str:
    """The exposed name of a counter (prometheus_client appends ``_total``)."""
    return f"{metric}_total"


def bucket(metric: str) -> str:
    return f"{metric}_bucket"


def hist_sum(metric: str) -> str:
    return f"{metric}_sum"


def hist_count(metric: str) -> str:
    return f"{metric}_count"


def eq(label: str, value: str) -> str:
    """``label="value"`` with the value quoted as a PromQL string."""
    return f"{label}={json.dumps(value)}"


def one_of(label: str, values: Iterable[str]) -> str:
    """``label=~"a|b"`` for a set of literal values (none of ours needs regex escaping)."""
    return f"{label}=~{json.dumps('|'.join(values))}"


def sel(metric: str, filters: Sequence[str], *matchers: str) -> str:
    """``metric{matchers..., filters...}``: always with braces (see the module docstring)."""
    return f"{metric}{{{', '.join([*matchers, *filters])}}}"


def rate(series: str, window: str = RATE_WINDOW) -> str:
    return f"rate({series}[{window}])"


def increase(series: str, window: str = RANGE_WINDOW) -> str:
    return f"increase({series}[{window}])"


def count_over(expr: str) -> str:
    """A count of events over a window as a whole number: ``increase()`` extrapolates to the
    window's edges (3 events can read 3.2), and a count of events has no fractions."""
    return f"round({expr})"


def sum_by(labels: Sequence[str], expr: str) -> str:
    """``sum by (labels) (expr)``, or ``sum(expr)`` with no labels."""
    if not labels:
        return f"sum({expr})"
    return f"sum by ({', '.join(labels)}) ({expr})"


def quantile(q: float, bucket_series: str, by: Sequence[str] = (), window: str = RATE_WINDOW) -> str:
    """The ``q`` quantile of a histogram, per ``by`` group, over ``window``."""
    fn = rate if window == RATE_WINDOW else increase
    return f"histogram_quantile({q}, {sum_by([*by, LE], fn(bucket_series, window))})"


def ratio(numerator: str, denominator: str) -> str:
    return f"{numerator} / {denominator}"


def label_values(metric_selector: str, label: str) -> str:
    """A Grafana variable query: the values ``label`` takes on ``metric_selector``."""
    return f"label_values({metric_selector}, {label})"
