"""What Grafana does to a query before the datasource sees it: variables and macros.

The tests run every dashboard query against real Prometheus, chDB and the TraceQL parser;
for that the query must first look exactly like what Grafana would send. This module
reproduces that, from the sources it names:

* Prometheus (Grafana's Prometheus datasource): ``$__rate_interval`` is
  ``max($__interval + scrape interval, 4 x scrape interval)``; ``$__interval`` and
  ``$__range`` are durations in seconds; a multi-value or "All" variable used in a regex
  becomes ``(a|b)`` of regex-escaped values (escaped once more for the PromQL string,
  as Grafana's ``prometheusSpecialRegexEscape`` does), or the custom all value (``.*``).
* ClickHouse (grafana-clickhouse-datasource): the frontend first replaces
  ``$__conditionalAll(cond, $var)`` by ``cond``, or by ``1=1`` when the variable is "All"
  or empty; then Grafana interpolates variables (``${var:singlequote}`` gives
  ``'a','b'`` with ``'`` escaped as ``\\'``); then the backend expands its macros
  (``pkg/macros/macros.go``): ``$__timeFilter(c)`` is
  ``c >= toDateTime(from_s) AND c <= toDateTime(to_s)``, ``$__fromTime`` is
  ``toDateTime(from_s)``, ``$__timeInterval(c)`` is
  ``toStartOfInterval(toDateTime(c), INTERVAL n second)``, and so on.
* Tempo: variables are interpolated as plain text.

An unknown macro raises: a misspelt macro would otherwise reach ClickHouse as text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

ALL = "$__all"
"""The value Grafana stores for a variable set to "All"."""


@dataclass(frozen=True)
class Variable:
    """A variable's selection: its values (or :data:`ALL`) and what "All" means."""

    selected: Sequence[str] | str
    options: Sequence[str] = ()
    """Every value the variable offers (what "All" expands to without a custom all value)."""
    all_value: str | None = None
    """The variable's custom all value (``allValue``), e.g. ``.*``."""

    @property
    def is_all(self) -> bool:
        return self.selected == ALL or list(self.selected) == [ALL]

    def values(self) -> list[str]:
        if self.is_all:
            return [self.all_value] if self.all_value is not None else list(self.options)
        if isinstance(self.selected, str):
            return [self.selected]
        return list(self.selected)


@dataclass(frozen=True)
class Context:
    """The dashboard state a query runs in: time range, interval and variable values."""

    start: datetime
    end: datetime
    interval_s: float = 15.0
    scrape_interval_s: float = 15.0
    variables: Mapping[str, Variable] = field(default_factory=dict)

    @property
    def rate_interval_s(self) -> int:
        return int(max(self.interval_s + self.scrape_interval_s, 4 * self.scrape_interval_s))

    @property
    def range_s(self) -> int:
        return max(1, math.ceil((self.end - self.start).total_seconds()))


_VARIABLE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)|\[\[(\w+)(?::(\w+))?\]\]")
_REGEX_SPECIAL = re.compile(r"[\\^$*+?.()|{}\[\]/]")
_PROMETHEUS_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")


def _regex_escape(value: str) -> str:
    return _REGEX_SPECIAL.sub(lambda m: "\\" + m.group(0), value)


def _prometheus_escape(value: str) -> str:
    """Grafana's ``prometheusSpecialRegexEscape``: the regex escape, itself escaped for the
    PromQL string the value lands in (``127.0.0.1`` becomes ``127\\\\.0\\\\.0\\\\.1``)."""
    value = value.replace("\\", "\\\\\\\\")
    return _PROMETHEUS_SPECIAL.sub(lambda m: "\\\\" + m.group(0), value)


def _format(name: str, fmt: str | None, variable: Variable, default: str) -> str:
    values = variable.values()
    if variable.is_all and variable.all_value is not None and fmt in (None, "regex", "prometheus"):
        return variable.all_value  # a custom all value is inserted as written
    fmt = fmt or default
    if fmt == "singlequote":
        return ",".join("'" + v.replace("'", "\\'") + "'" for v in values)
    if fmt == "doublequote":
        return ",".join('"' + v.replace('"', '\\"') + '"' for v in values)
    if fmt == "sqlstring":
        return ",".join("'" + v.replace("'", "''") + "'" for v in values)
    if fmt in ("regex", "prometheus"):
        escape = _regex_escape if fmt == "regex" else _prometheus_escape
        escaped = [escape(v) for v in values]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"
    if fmt in ("raw", "csv"):
        return ",".join(values)
    if fmt == "pipe":
        return "|".join(values)
    raise ValueError(f"variable ${name}: format {fmt!r} is not reproduced here")


def interpolate(text: str, ctx: Context, *, default_format: str = "raw") -> str:
    """Replace ``$var``, ``${var}``, ``${var:fmt}`` (not ``$__`` globals) by their values."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3) or match.group(4)
        fmt = match.group(2) or match.group(5)
        if name.startswith("__"):
            return match.group(0)
        variable = ctx.variables.get(name)
        if variable is None:
            raise KeyError(f"no value for dashboard variable ${name}")
        return _format(name, fmt, variable, default_format)

    return _VARIABLE.sub(replace, text)


# ------------------------------------------------------------------ Prometheus


def promql(expr: str, ctx: Context) -> str:
    """A PromQL expression as Grafana's Prometheus datasource sends it."""
    expr = (
        expr.replace("$__rate_interval", f"{ctx.rate_interval_s}s")
        .replace("$__interval_ms", f"{int(ctx.interval_s * 1000)}")
        .replace("$__interval", f"{max(1, int(ctx.interval_s))}s")
        .replace("$__range_s", str(ctx.range_s))
        .replace("$__range", f"{ctx.range_s}s")
    )
    if "$__" in expr:
        raise ValueError(f"unexpanded Grafana global in {expr!r}")
    return interpolate(expr, ctx, default_format="prometheus")


_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),\s*)?(\w+)\)\s*$", re.S)


def label_values(query: str, ctx: Context) -> tuple[str | None, str]:
    """A ``label_values(selector, label)`` variable query: (interpolated selector, label)."""
    match = _LABEL_VALUES.match(query)
    if match is None:
        raise ValueError(f"not a label_values() query: {query!r}")
    selector = match.group(1)
    return (promql(selector, ctx) if selector else None), match.group(2)


# ------------------------------------------------------------------ ClickHouse


def _macro_args(sql: str, open_paren: int) -> tuple[list[str], int]:
    """Arguments of a macro call starting at ``open_paren``, split at top-level commas.

    Commas and parentheses inside quoted strings do not count (``'a,b'`` is one value).
    """
    depth, args, start, i = 0, [], open_paren + 1, open_paren
    quote: str | None = None
    while i < len(sql):
        ch = sql[i]
        if quote is not None:
            if ch == "\\":
                i += 1  # skip the escaped character
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                args.append(sql[start:i])
                return [a.strip() for a in args], i + 1
        elif ch == "," and depth == 1:
            args.append(sql[start:i])
            start = i + 1
        i += 1
    raise ValueError(f"unbalanced parentheses in macro call: {sql[open_paren : open_paren + 60]!r}")


def conditional_all(sql: str, ctx: Context) -> str:
    """The plugin frontend's ``$__conditionalAll(cond, $var)``, innermost-last like the plugin."""
    macro = "$__conditionalAll("
    while (index := sql.rfind(macro)) != -1:
        args, end = _macro_args(sql, index + len(macro) - 1)
        if len(args) != 2 or not args[1].startswith("$"):
            raise ValueError(f"$__conditionalAll needs (condition, $variable): {args}")
        variable = ctx.variables.get(args[1][1:])
        if variable is None:
            raise KeyError(f"no value for dashboard variable {args[1]}")
        empty = not variable.is_all and not variable.values()
        sql = sql[:index] + ("1=1" if variable.is_all or empty else args[0]) + sql[end:]
    return sql


def _seconds(moment: datetime) -> int:
    return int(moment.timestamp())


def _millis(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def clickhouse_macros(sql: str, ctx: Context) -> str:
    """The plugin backend's macros (``pkg/macros/macros.go``)."""
    start, end = ctx.start, ctx.end
    interval_s = max(int(ctx.interval_s), 1)
    interval_ms = max(int(ctx.interval_s * 1000), 1)

    def time_filter(column: str) -> str:
        return f"{column} >= toDateTime({_seconds(start)}) AND {column} <= toDateTime({_seconds(end)})"

    with_args = {
        "timeFilter": time_filter,
        "timeFilter_ms": lambda c: (
            f"{c} >= fromUnixTimestamp64Milli({_millis(start)}) "
            f"AND {c} <= fromUnixTimestamp64Milli({_millis(end)})"
        ),
        "dateFilter": lambda c: f"{c} >= toDate('{start:%Y-%m-%d}') AND {c} <= toDate('{end:%Y-%m-%d}')",
        "timeInterval": lambda c: f"toStartOfInterval(toDateTime({c}), INTERVAL {interval_s} second)",
        "timeInterval_ms": lambda c: (
            f"toStartOfInterval(toDateTime64({c}, 3), INTERVAL {interval_ms} millisecond)"
        ),
    }
    plain = {
        "fromTime": f"toDateTime({_seconds(start)})",
        "toTime": f"toDateTime({_seconds(end)})",
        "fromTime_ms": f"fromUnixTimestamp64Milli({_millis(start)})",
        "toTime_ms": f"fromUnixTimestamp64Milli({_millis(end)})",
        "interval_s": str(interval_s),
    }
    out: list[str] = []
    pos = 0
    for match in re.finditer(r"\$__(\w+)", sql):
        if match.start() < pos:
            continue  # inside arguments already consumed
        name = match.group(1)
        out.append(sql[pos : match.start()])
        if name in with_args:
            args, pos = _macro_args(sql, match.end())
            if len(args) != 1:
                raise ValueError(f"$__{name} takes one argument, got {args}")
            out.append(with_args[name](args[0]))
        elif name in plain:
            out.append(plain[name])
            pos = match.end()
        else:
            raise ValueError(f"unknown ClickHouse macro $__{name}")
    out.append(sql[pos:])
    return "".join(out)


def clickhouse(sql: str, ctx: Context) -> str:
    """A ClickHouse panel's SQL as the plugin sends it to ClickHouse."""
    return clickhouse_macros(interpolate(conditional_all(sql, ctx), ctx), ctx)


# ------------------------------------------------------------------ Tempo


def traceql(query: str, ctx: Context) -> str:
    return interpolate(query, ctx)
