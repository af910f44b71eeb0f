"""One self-contained HTML page for a comparison: tables, inline SVG charts, no scripts.

Self-contained because the report gets attached to tickets and mailed around: no CDN, no
JavaScript, no external stylesheet or font, nothing fetched. Built from the same dict as
``--json``. The only links are in-page anchors (a regressed point of the scatter to its row
in the regressions table) and, when ``trace_url`` is given, each regressed turn's trace id to
that trace in the user's Grafana or Tempo.

Figures that two runs are compared by are per turn (means, medians, shares), not sums: the
runs rarely have the same number of turns, and a sum grows with the count.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from otelkv.cli import render
from otelkv.cli.compare_report import svg
from otelkv.cli.compare_report.text import pull_reason, ratio

STYLE = """
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; padding: 0 24px; max-width: 1400px;
  color: #222; }
h1 { font-size: 20px; overflow-wrap: anywhere; }
h2 { font-size: 16px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; }
td, th { padding: 3px 10px; text-align: left; vertical-align: top; } th { background: #f3f3f3; }
td.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.differs td { background: #fff4d6; } tr:target td { background: #ffe3e6; } .note { color: #8a5a00; }
code { font-size: 12px; } td:first-child { white-space: nowrap; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(440px, 1fr)); gap: 16px;
  align-items: start; }
.scroll { overflow-x: auto; }
svg.chart, svg.scatter { display: block; width: 100%; height: auto; border: 1px solid #eee;
  background: #fff; }
svg .title { font-size: 14px; font-weight: 600; } svg .axis, svg .legend { font-size: 12px; fill: #555; }
svg .grid { stroke: #e6e6e6; } svg .minor { stroke: #f3f3f3; }
svg .guide { stroke: #888; } svg .dashed { stroke-dasharray: 5 4; }
svg.scatter { max-width: 760px; } svg a .point { stroke: #222; stroke-width: 1; }
"""


class Raw(str):
    """Markup a table cell holds as it is (already escaped where it has to be)."""


def _cell(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return "-" if value is None else escape(str(value))


def _table(
    head: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    numeric: Sequence[int] = (),
    marks: Sequence[bool] = (),
    ids: Sequence[str] = (),
) -> str:
    out = ["<div class='scroll'><table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"]
    for i, row in enumerate(rows):
        cls = ' class="differs"' if i < len(marks) and marks[i] else ""
        ident = f' id="{escape(ids[i])}"' if i < len(ids) else ""
        cells = "".join(
            f'<td class="n">{_cell(v)}</td>' if j in numeric else f"<td>{_cell(v)}</td>"
            for j, v in enumerate(row)
        )
        out.append(f"<tr{ident}{cls}>{cells}</tr>")
    return "\n".join(out) + "</table></div>"


def _ttft_section(title: str, rows: list[dict[str, Any]]) -> str:
    buckets = [r["bucket"] for r in rows]
    chart = svg.bars(
        f"TTFT {title}",
        buckets,
        [
            ("A p50", [r["a"]["p50_s"] for r in rows]),
            ("B p50", [r["b"]["p50_s"] for r in rows]),
            ("A p95", [r["a"]["p95_s"] for r in rows]),
            ("B p95", [r["b"]["p95_s"] for r in rows]),
        ],
    )
    table = _table(
        ["", "A n", "A p50", "A p95", "B n", "B p50", "B p95", "B/A p50"],
        [
            [
                r["bucket"],
                r["a"]["count"],
                render.seconds(r["a"]["p50_s"]),
                render.seconds(r["a"]["p95_s"]),
                r["b"]["count"],
                render.seconds(r["b"]["p50_s"]),
                render.seconds(r["b"]["p95_s"]),
                ratio(r["a"]["p50_s"], r["b"]["p50_s"]),
            ]
            for r in rows
        ],
        numeric=range(1, 8),
    )
    return f"<h2>Time to first token {escape(title)}</h2><div class='charts'>{chart}{table}</div>"


PREFILL_COLORS = ("#73bf69", "#b877d9")
"""Compute and KV transfer: not the runs' blue and orange, which mean A and B everywhere else."""


def share(counts: dict[str, int], reason: str) -> float:
    """``reason``'s per cent of one run's pull decisions (0 when the run has none)."""
    total = sum(counts.values())
    return 100.0 * counts.get(reason, 0) / total if total else 0.0


def _prefill_section(data: dict[str, Any]) -> str:
    pa, pb = data["prefill"]["a"], data["prefill"]["b"]
    chart = svg.bars(
        "Prefill seconds per turn (mean)",
        [f"A ({pa['turns']} turns)", f"B ({pb['turns']} turns)"],
        [
            ("compute", [pa["compute_per_turn_s"], pb["compute_per_turn_s"]]),
            ("KV transfer (pull)", [pa["transfer_per_turn_s"], pb["transfer_per_turn_s"]]),
        ],
        stacked=True,
        colors=PREFILL_COLORS,
    )
    table = _table(
        [
            "run",
            "turns",
            "compute per turn",
            "KV transfer per turn",
            "prefill p50",
            "turns that pulled",
            "pulled tokens per turn",
            "compute, all turns",
            "KV transfer, all turns",
        ],
        [
            [
                label,
                p["turns"],
                render.seconds(p["compute_per_turn_s"]),
                render.seconds(p["transfer_per_turn_s"]),
                render.seconds(p.get("prefill_p50_s")),
                p["turns_with_pull"],
                _per_turn(p.get("pulled_tokens_per_turn")),
                render.seconds(p["compute_s"]),
                render.seconds(p["transfer_s"]),
            ]
            for label, p in (("A", pa), ("B", pb))
        ],
        numeric=range(1, 9),
    )
    by_reason = data["pulls_by_reason"]
    reasons = sorted(set(by_reason["a"]) | set(by_reason["b"]))
    pulls = svg.bars(
        "Pull decisions by reason (% of each run's prefill requests)",
        reasons,
        [(label.upper(), [share(by_reason[label], r) for r in reasons]) for label in ("a", "b")],
        unit="%",
    )
    pulls_table = _table(
        ["reason", "A", "A %", "B", "B %"],
        [
            [
                r,
                by_reason["a"].get(r, 0),
                f"{share(by_reason['a'], r):.0f}%",
                by_reason["b"].get(r, 0),
                f"{share(by_reason['b'], r):.0f}%",
            ]
            for r in reasons
        ],
        numeric=(1, 2, 3, 4),
    )
    return (
        "<h2>Prefill: compute and KV transfer</h2><p>Per turn that had a prefill request. Compute is the "
        "prefill engine's time not spent waiting for remote KV; KV transfer is the time its request waited "
        "for KV pulled from the decode node.</p>"
        f"<div class='charts'>{chart}{pulls}</div>{table}{pulls_table}"
    )


def _per_turn(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _retained_section(retained: dict[str, Any], turns: dict[str, int]) -> str:
    kinds = sorted(set(retained["a"]) | set(retained["b"]))
    if not kinds:
        return "<h2>Retained KV</h2><p>No retention in either run.</p>"

    def get(label: str, kind: str, key: str) -> float:
        return float((retained[label].get(kind) or {}).get(key) or 0)

    charts = svg.bars(
        "Block-seconds held per turn",
        kinds,
        [(x.upper(), [get(x, k, "block_seconds_per_turn") for k in kinds]) for x in "ab"],
        unit="",
    ) + svg.bars(
        "Peak retained memory (most held at once)",
        kinds,
        [(x.upper(), [get(x, k, "peak_bytes") for k in kinds]) for x in "ab"],
        unit="B",
    )
    rows = [
        [
            k,
            x.upper(),
            int(get(x, k, "count")),
            _per_turn(get(x, k, "count") / turns[x] if turns[x] else None),
            f"{get(x, k, 'block_seconds_per_turn'):.1f}",
            f"{get(x, k, 'block_seconds'):.0f}",
            render.human_bytes(get(x, k, "peak_bytes")),
            int(get(x, k, "peak_blocks")),
            ", ".join(f"{o} {n}" for o, n in ((retained[x].get(k) or {}).get("outcomes") or {}).items()),
        ]
        for k in kinds
        for x in "ab"
    ]
    table = _table(
        [
            "kind",
            "run",
            "count",
            "per turn",
            "block-s per turn",
            "block-s, all",
            "peak memory",
            "peak blocks",
            "ended",
        ],
        rows,
        numeric=(2, 3, 4, 5, 6, 7),
    )
    return (
        "<h2>Retained KV (memory cost)</h2><p>Blocks an engine kept for the other node: block-seconds "
        "(blocks x seconds held) per turn of the run, and the most bytes held at once.</p>"
        f"<div class='charts'>{charts}</div>{table}"
    )


def _diagnoses(found: Sequence[dict[str, Any]]) -> Raw:
    """One line per diagnosis, its id first (the order ``otelkv why`` gives: by cost)."""
    lines = [f"<div><code>{escape(d['id'])}</code>: {escape(d['summary'])}</div>" for d in found]
    return Raw("".join(lines) or "-")


def trace_link(trace_id: str, trace_url: str | None) -> Raw:
    """The trace id, as a link when ``trace_url`` (a template with ``{trace_id}``) is given.

    Plain substitution, not :meth:`str.format`: Grafana Explore URLs hold JSON braces.
    """
    code = f"<code>{escape(trace_id)}</code>"
    if not trace_url or not trace_id:
        return Raw(code)
    return Raw(f'<a href="{escape(trace_url.replace("{trace_id}", trace_id))}">{code}</a>')


def _regression_section(reg: dict[str, Any], trace_url: str | None) -> str:
    row_id = {t["ref"]: f"regressed-{i + 1}" for i, t in enumerate(reg["turns"])}
    points = [(p["ref"], p["a_ttft_s"], p["b_ttft_s"], p["regressed"]) for p in reg["points"]]
    chart = svg.scatter(
        f"Matched turns: TTFT in A and B ({reg['factor']:g}x A dashed)",
        points,
        factor=reg["factor"],
        links=[f"#{row_id[p[0]]}" if p[3] and p[0] in row_id else None for p in points],
    )
    rows = [
        [
            t["ref"],
            render.seconds(t["a"]["ttft_s"]),
            render.seconds(t["b"]["ttft_s"]),
            f"{t['ratio']:.2f}x" if t["ratio"] is not None else t["kind"],
            pull_reason(t["a"]),
            pull_reason(t["b"]),
            _diagnoses(t["b"]["diagnoses"]),
            trace_link(t["b"]["trace_id"], trace_url),
        ]
        for t in reg["turns"]
    ]
    table = _table(
        ["turn", "A TTFT", "B TTFT", "B/A", "pull A", "pull B", "B diagnoses", "B trace"],
        rows,
        numeric=(1, 2, 3),
        ids=[row_id[t["ref"]] for t in reg["turns"]],
    )
    lead = " a red point leads to its row below." if rows else ""
    return (
        f"<h2>Turns that regressed</h2><p>{reg['count']} of {reg['compared']} matched turns are slower "
        f"in B by more than {reg['factor']:g}x and {reg['min_delta_s']:g}s, or failed only in B; "
        f"{reg['faster_count']} are faster in B by the same test. Points below the diagonal are faster "
        f"in B;{lead or ' points above the dashed line regressed.'}</p>"
        f"<div class='charts'>{chart}</div>{table if rows else ''}"
    )


def page(data: dict[str, Any], *, trace_url: str | None = None) -> str:
    """The report; ``trace_url`` (``...{trace_id}...``) turns trace ids into links."""
    a, b = data["a"], data["b"]
    settings = data["settings"]
    runs = _table(
        ["", "store", "scenarios", "recorded", "turns"],
        [
            [
                s["label"],
                s["where"],
                ", ".join(s.get("scenarios") or []) or "-",
                s.get("recorded_at"),
                s["turns"],
            ]
            for s in (a, b)
        ],
        numeric=(4,),
    )
    settings_table = _table(
        ["setting", "A", "B", "A from", "B from"],
        [[s["key"], s["a"], s["b"], s["a_source"], s["b_source"]] for s in settings],
        marks=[s["differs"] for s in settings],
    )
    notes = "".join(f"<p class='note'>note: {escape(n)}</p>" for n in data.get("notes") or [])
    body = [
        f"<h1>otelkv compare: {escape(a['where'])} (A) vs {escape(b['where'])} (B)</h1>",
        runs,
        f"<p>{data['matching']['matched']} turns in both runs, matched by conversation id and turn "
        "index.</p>",
        notes,
        "<h2>Settings</h2><p>Highlighted: differs between the runs.</p>",
        settings_table,
        _ttft_section("by turn index", data["ttft"]["by_turn_index"]),
        _ttft_section("by prompt length (tokens)", data["ttft"]["by_prompt_tokens"]),
        _prefill_section(data),
        _retained_section(data["retained"], {"a": a["turns"], "b": b["turns"]}),
        _regression_section(data["regressions"], trace_url),
    ]
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'><title>otelkv compare</title>"
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
