"""One self-contained HTML page for a comparison: tables, inline SVG charts, no scripts.

Self-contained because the report gets attached to tickets and mailed around: no CDN, no
JavaScript, no external stylesheet or font. Built from the same dict as ``--json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from otelkv.cli import render
from otelkv.cli.compare_report import svg
from otelkv.cli.compare_report.text import pull_reason, ratio

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1320px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; } td, th { padding: 3px 10px; text-align: left; }
th { background: #f3f3f3; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.differs td { background: #fff4d6; } .note { color: #8a5a00; } code { font-size: 13px; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
svg.chart { border: 1px solid #eee; background: #fff; }
svg .title { font-size: 13px; font-weight: 600; } svg .axis, svg .legend { font-size: 11px; fill: #555; }
svg .grid { stroke: #eee; } svg .guide { stroke: #999; } svg .dashed { stroke-dasharray: 4 3; }
"""


def _cell(value: Any) -> str:
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
) -> str:
    out = ["<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"]
    for i, row in enumerate(rows):
        cls = ' class="differs"' if i < len(marks) and marks[i] else ""
        cells = "".join(
            f'<td class="n">{_cell(v)}</td>' if j in numeric else f"<td>{_cell(v)}</td>"
            for j, v in enumerate(row)
        )
        out.append(f"<tr{cls}>{cells}</tr>")
    return "\n".join(out) + "</table>"


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
    return f"<h2>Time to first token {escape(title)}</h2><div class='charts'>{chart}<div>{table}</div></div>"


def _prefill_section(data: dict[str, Any]) -> str:
    pa, pb = data["prefill"]["a"], data["prefill"]["b"]
    chart = svg.bars(
        "Prefill seconds summed over turns",
        ["A", "B"],
        [
            ("compute", [pa["compute_s"], pb["compute_s"]]),
            ("KV transfer (pull)", [pa["transfer_s"], pb["transfer_s"]]),
        ],
        stacked=True,
    )
    table = _table(
        [
            "run",
            "turns",
            "compute",
            "KV transfer",
            "per turn compute",
            "per turn transfer",
            "pulls",
            "pulled tokens",
        ],
        [
            [
                label,
                p["turns"],
                render.seconds(p["compute_s"]),
                render.seconds(p["transfer_s"]),
                render.seconds(p["compute_per_turn_s"]),
                render.seconds(p["transfer_per_turn_s"]),
                p["turns_with_pull"],
                p["pulled_tokens"],
            ]
            for label, p in (("A", pa), ("B", pb))
        ],
        numeric=range(1, 8),
    )
    reasons = sorted(set(data["pulls_by_reason"]["a"]) | set(data["pulls_by_reason"]["b"]))
    pulls = svg.bars(
        "Pull decisions by reason",
        reasons,
        [
            (label.upper(), [data["pulls_by_reason"][label].get(r, 0) for r in reasons])
            for label in ("a", "b")
        ],
        unit="",
    )
    return (
        "<h2>Prefill: compute and KV transfer</h2><p>Compute is the prefill engine's time not spent waiting "
        "for remote KV; KV transfer is the time its request waited for KV pulled from the decode node.</p>"
        f"<div class='charts'>{chart}{pulls}</div>{table}"
    )


def _retained_section(retained: dict[str, Any]) -> str:
    kinds = sorted(set(retained["a"]) | set(retained["b"]))
    if not kinds:
        return "<h2>Retained KV</h2><p>No retention in either run.</p>"

    def get(label: str, kind: str, key: str) -> float:
        return float((retained[label].get(kind) or {}).get(key) or 0)

    charts = svg.bars(
        "Block-seconds held",
        kinds,
        [(x.upper(), [get(x, k, "block_seconds") for k in kinds]) for x in "ab"],
        unit="",
    ) + svg.bars(
        "Peak retained memory",
        kinds,
        [(x.upper(), [get(x, k, "peak_bytes") for k in kinds]) for x in "ab"],
        unit="B",
    )
    rows = [
        [
            k,
            x.upper(),
            get(x, k, "count"),
            get(x, k, "block_seconds"),
            render.human_bytes(get(x, k, "peak_bytes")),
            get(x, k, "peak_blocks"),
            ", ".join(f"{o} {n}" for o, n in ((retained[x].get(k) or {}).get("outcomes") or {}).items()),
        ]
        for k in kinds
        for x in "ab"
    ]
    table = _table(
        ["kind", "run", "count", "block-s", "peak memory", "peak blocks", "ended"], rows, numeric=(2, 3, 4, 5)
    )
    return f"<h2>Retained KV (memory cost)</h2><div class='charts'>{charts}</div>{table}"


def _regression_section(reg: dict[str, Any]) -> str:
    points = [(p["ref"], p["a_ttft_s"], p["b_ttft_s"], p["regressed"]) for p in reg["points"]]
    chart = svg.scatter(
        f"Matched turns: TTFT in A and B (dashed: {reg['factor']:g}x A)", points, factor=reg["factor"]
    )
    rows = [
        [
            t["ref"],
            render.seconds(t["a"]["ttft_s"]),
            render.seconds(t["b"]["ttft_s"]),
            f"{t['ratio']:.2f}x" if t["ratio"] is not None else t["kind"],
            pull_reason(t["a"]),
            pull_reason(t["b"]),
            "; ".join(f"{d['id']}: {d['summary']}" for d in t["b"]["diagnoses"]) or "-",
            t["b"]["trace_id"],
        ]
        for t in reg["turns"]
    ]
    table = _table(
        ["turn", "A TTFT", "B TTFT", "B/A", "pull A", "pull B", "B diagnoses", "B trace"],
        rows,
        numeric=(1, 2, 3),
    )
    return (
        f"<h2>Turns that regressed</h2><p>{reg['count']} of {reg['compared']} matched turns are slower "
        f"in B by more than {reg['factor']:g}x and {reg['min_delta_s']:g}s, or failed only in B; "
        f"{reg['faster_count']} are faster in B by the same test.</p><div class='charts'>{chart}</div>{table}"
    )


def page(data: dict[str, Any]) -> str:
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
        _retained_section(data["retained"]),
        _regression_section(data["regressions"]),
    ]
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>otelkv compare</title>"
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
