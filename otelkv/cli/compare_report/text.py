"""The terminal summary of a comparison (the dict of :func:`.aggregate.compare_runs`)."""

from __future__ import annotations

from typing import Any, TextIO

from otelkv.cli import render

REGRESSIONS_SHOWN = 15


def _s(value: float | None) -> str:
    return render.seconds(value) if value is not None else "-"


def ratio(a: float | None, b: float | None) -> str:
    """B over A as ``1.50x`` (``-`` when either is missing or A is 0)."""
    return f"{b / a:.2f}x" if a and b is not None else "-"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return "-" if value is None else str(value)


def _ttft_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            row["bucket"],
            row["a"]["count"],
            _s(row["a"]["p50_s"]),
            _s(row["a"]["p95_s"]),
            row["b"]["count"],
            _s(row["b"]["p50_s"]),
            _s(row["b"]["p95_s"]),
            ratio(row["a"]["p50_s"], row["b"]["p50_s"]),
        ]
        for row in rows
    ]


_TTFT_HEAD = ["", "A n", "A p50", "A p95", "B n", "B p50", "B p95", "B/A p50"]


def _header(data: dict[str, Any], out: TextIO) -> None:
    a, b, m = data["a"], data["b"], data["matching"]
    for side in (a, b):
        what = f" [{', '.join(side['scenarios'])}]" if side.get("scenarios") else ""
        out.write(f"{side['label']}: {side['where']}{what}: {side['turns']} turns ({_outcomes(side)})\n")
    out.write(f"{m['matched']} turns in both runs (matched by conversation id and turn index)\n")
    for note in data.get("notes") or []:
        out.write(f"note: {note}\n")


def _outcomes(side: dict[str, Any]) -> str:
    return ", ".join(f"{n} {k}" for k, n in side["outcomes"].items()) or "none"


def show_compare(data: dict[str, Any], out: TextIO) -> None:
    _header(data, out)
    rows = [
        [("* " if s["differs"] else "  ") + s["key"], _value(s["a"]), _value(s["b"])]
        for s in data["settings"]
    ]
    out.write("\nsettings (* differs):\n" + render.table(["", "A", "B"], rows) + "\n")

    ttft = data["ttft"]
    overall = [{"bucket": "all", **ttft["overall"]}]
    out.write("\ntime to first token:\n")
    out.write(render.table(_TTFT_HEAD, _ttft_rows(overall), right=tuple(range(1, 8))) + "\n")
    out.write("\nby turn index:\n")
    out.write(
        render.table(["TURN", *_TTFT_HEAD[1:]], _ttft_rows(ttft["by_turn_index"]), right=tuple(range(1, 8)))
    )
    out.write("\n\nby prompt length (tokens):\n")
    out.write(
        render.table(
            ["PROMPT", *_TTFT_HEAD[1:]], _ttft_rows(ttft["by_prompt_tokens"]), right=tuple(range(1, 8))
        )
    )
    out.write("\n")

    pa, pb = data["prefill"]["a"], data["prefill"]["b"]
    prefill = [
        [
            label,
            p["turns"],
            _s(p["compute_per_turn_s"]),
            _s(p["transfer_per_turn_s"]),
            _s(p.get("prefill_p50_s")),
            p["turns_with_pull"],
            "-" if p.get("pulled_tokens_per_turn") is None else f"{p['pulled_tokens_per_turn']:.1f}",
        ]
        for label, p in (("A", pa), ("B", pb))
    ]
    out.write(
        "\nprefill per turn, mean over the turns with a prefill request (compute: engine time; "
        "KV transfer: waiting for KV pulled from decode):\n"
    )
    head = ["RUN", "TURNS", "COMPUTE", "KV TRANSFER", "P50 PREFILL", "TURNS THAT PULLED", "PULLED TOKENS"]
    out.write(render.table(head, prefill, right=(1, 2, 3, 4, 5, 6)) + "\n")

    reasons = sorted(set(data["pulls_by_reason"]["a"]) | set(data["pulls_by_reason"]["b"]))
    pulls = [
        [r, data["pulls_by_reason"]["a"].get(r, 0), data["pulls_by_reason"]["b"].get(r, 0)] for r in reasons
    ]
    out.write(
        "\npull decisions by reason (prefill node):\n"
        + render.table(["REASON", "A", "B"], pulls, right=(1, 2))
    )
    out.write("\n")

    _retained(data["retained"], out)
    _regressions(data["regressions"], out)


def _retained(retained: dict[str, Any], out: TextIO) -> None:
    kinds = sorted(set(retained["a"]) | set(retained["b"]))
    out.write("\nretained KV (blocks kept for the other node):\n")
    if not kinds:
        out.write("  none in either run\n")
        return
    rows = []
    for kind in kinds:
        for label in ("a", "b"):
            r = retained[label].get(kind)
            rows.append(
                [
                    kind,
                    label.upper(),
                    r["count"],
                    f"{r['block_seconds']:.0f}",
                    f"{r.get('block_seconds_per_turn') or 0:.1f}",
                    render.human_bytes(r["peak_bytes"]),
                    r["peak_blocks"],
                    ", ".join(f"{k} {n}" for k, n in r["outcomes"].items()),
                ]
                if r
                else [kind, label.upper(), 0, "0", "0.0", "0 B", 0, "-"]
            )
    head = ["KIND", "RUN", "COUNT", "BLOCK-S", "PER TURN", "PEAK MEM", "PEAK BLOCKS", "ENDED"]
    out.write(render.table(head, rows, right=(2, 3, 4, 5, 6)))
    out.write("\n")


def pull_reason(turn: dict[str, Any]) -> str | None:
    """The prefill node's pull reason of one side of a pair (None: no prefill span)."""
    return (turn.get("prefill") or {}).get("reason")


def _regressions(reg: dict[str, Any], out: TextIO) -> None:
    out.write(
        f"\nturns slower in B (TTFT > {reg['factor']:g}x A and +{reg['min_delta_s']:g}s) or failed "
        "only in B: "
        f"{reg['count']} of {reg['compared']} compared; {reg['faster_count']} faster in B by the same test\n"
    )
    rows = []
    for t in reg["turns"][:REGRESSIONS_SHOWN]:
        a, b = t["a"], t["b"]
        diagnoses = ",".join(d["id"] for d in b["diagnoses"]) or "-"
        rows.append(
            [
                t["ref"],
                _s(a["ttft_s"]),
                _s(b["ttft_s"]),
                f"{t['ratio']:.2f}x" if t["ratio"] is not None else t["kind"],
                f"{pull_reason(a) or '-'} -> {pull_reason(b) or '-'}",
                diagnoses,
            ]
        )
    if rows:
        head = ["TURN", "A TTFT", "B TTFT", "B/A", "PULL REASON A -> B", "B DIAGNOSES"]
        out.write(render.table(head, rows, right=(1, 2, 3)) + "\n")
        more = reg["count"] - len(rows)
        if more > 0:
            out.write(f"... and {more} more (--json or --html lists all)\n")
        out.write("`otelkv why TURN --store B` explains one of B's turns.\n")
