"""What ``otelkv slow|conversation|why`` print: 100 columns, short trace ids, UTC start
times, one TTFT column, the first turn of a conversation, ``why`` wrapped to the width."""

from __future__ import annotations

import io
from typing import Any

import pytest

from otelkv import names
from otelkv.analysis.report import conversation, slow, why
from otelkv.analysis.sources import InMemorySource
from otelkv.cli import render, views
from tests.unit.test_diagnose import T0, S, turn_trace
from tests.unit.test_report import ID1, short_id_spans

LONG_CONV = "3f2a9c1e-5b7d-4e21-9a0c-7d2c1b9e8f00-customer-support-escalations"
"""A long conversation id, as agent frameworks make them (a UUID and a purpose)."""
TRACE = "0123456789abcdef0123456789abcdef"


def turn_row(**over: Any) -> dict[str, Any]:
    """One turn object as the report serializes it (the fields the views read)."""
    row: dict[str, Any] = {
        "trace_id": TRACE,
        "conversation_id": LONG_CONV,
        "turn_index": 1234,
        "start_ns": 1_796_162_400 * S + 123_456_789,  # 2026-12-01 22:00:00.123456789 UTC
        "status": "ok",
        "total_s": 7385.0,
        "phases": {
            "tool_wait_s": 7000.0,
            "app_work_s": 300.0,
            "input_processing_s": 80.5,
            "generation_s": 4.5,
        },
        "ttft_s": 80.5,
        "previous_trace_id": "f" * 32,
        "prefill": {
            "decision": "pull",
            "reason": "pulled",
            "tokens": {"computed": 123456, "local_cache": 654321, "pulled": 1048576},
            "transfer": {"bytes": 987_654_321_000, "wait_s": 12.5},
        },
        "decode": {"retention": {"outcome": "consumed", "held_s": 7385.0, "ttl_s": 14400.0}},
        "diagnoses": [
            {"id": names.DIAG_ID_CHANGED_ON_RESUME},
            {"id": names.DIAG_TOOL_WAIT_DOMINATES},
            {"id": names.DIAG_TTL_LAPSED},
        ],
    }
    row.update(over)
    return row


def lines(text: str) -> list[str]:
    return text.rstrip("\n").split("\n")


def test_slow_fits_100_columns_with_long_ids_and_large_numbers() -> None:
    rows = [
        turn_row(),
        turn_row(turn_index=7, status="error", total_s=0.42, conversation_id="short"),
        turn_row(conversation_id="fp-f195b680e2f065bd", turn_index=3),
    ]
    out = io.StringIO()
    views.show_slow({"turns": rows}, out, width=100)
    text = out.getvalue()
    assert max(len(line) for line in lines(text)) <= 100, text
    header, _, first, failed, fp = lines(text)[:5]
    assert header.split() == [
        "START",
        "TURN",
        "TOTAL",
        "TOOL",
        "APP",
        "TTFT",
        "GEN",
        "TRACE",
        "TOP",
        "DIAGNOSIS",
    ]
    assert first.startswith("2026-12-01 22:00:00Z  3f2a")  # the date, UTC, to the second
    assert "..ons#1234 " in first  # clipped in the middle: the turn index survives
    assert " 2h03m 1h56m 5m00s 1m20s 4.50s  01234567  conversation_id_" in first  # TTFT once
    assert TRACE not in text and "INPUT" not in header
    assert failed.split()[2:4] == ["short#7", "0.42s!"]  # a failed turn is marked
    assert "fp-f1..065bd#3" in fp  # one width for the column: clipped too
    # Without the long ids, the same numbers and a named conversation fit whole.
    out = io.StringIO()
    named = {
        **rows[2],
        "conversation_id": "support-agent",
        "diagnoses": [{"id": names.DIAG_TOOL_WAIT_DOMINATES}],
    }
    views.show_slow({"turns": [named]}, out, width=100)
    assert "support-agent#3 " in out.getvalue() and ".." not in out.getvalue()
    assert max(len(line) for line in lines(out.getvalue())) <= 100


def test_slow_wide_prints_whole_ids() -> None:
    out = io.StringIO()
    views.show_slow({"turns": [turn_row()]}, out, wide=True, width=100)
    row = lines(out.getvalue())[2]
    assert f"{LONG_CONV}#1234" in row and TRACE in row and names.DIAG_ID_CHANGED_ON_RESUME in row


def test_slow_of_a_real_report_shows_prefixes_why_accepts() -> None:
    source = InMemorySource(short_id_spans())
    out = io.StringIO()
    views.show_slow(slow(source, limit=3), out, width=100)
    row = next(line for line in lines(out.getvalue()) if "conv-lapse#1 " in line)
    short = row.split()[8]
    assert short == ID1[:8] and why(source, short)["turn"]["turn_index"] == 1


def test_conversation_fits_100_columns_and_names_its_columns() -> None:
    rows = [
        turn_row(
            turn_index=0,
            previous_trace_id=None,
            prefill={
                "decision": "recompute",
                "reason": "no_decode_handle",
                "tokens": {"computed": 99999, "local_cache": 0, "pulled": 0},
            },
        ),
        turn_row(turn_index=1, prefill={"decision": "recompute", "reason": names.REASON_BELOW_THRESHOLD}),
        turn_row(turn_index=1234),
    ]
    data = {"conversation_id": LONG_CONV, "total_s": 123456.0, "turns": rows}
    out = io.StringIO()
    views.show_conversation(data, out, width=100)
    text = out.getvalue()
    assert max(len(line) for line in lines(text)) <= 100, text
    top = next(i for i, line in enumerate(lines(text)) if line.strip().startswith("TOKENS"))
    table = lines(text)[top : top + 6]
    assert table[0].split() == ["TOKENS", "PULL", "RETENTION"]
    assert table[1].split()[-6:] == ["c/l/p", "this", "turn", "read", "left", "for", "next"][-6:]
    assert "this turn read" in table[1] and "left for next" in table[1]
    assert "first turn" in table[3] and "no_decode_handle" not in text
    assert names.REASON_BELOW_THRESHOLD in table[4]
    assert "pulled 919.8 GiB 12.5s" in table[5] and "123k/654k/1.0M" in table[5]
    assert "consumed 2h03m/4h00m" in table[5] and table[5].split()[3] == "01234567"
    assert f"  #1234  {names.DIAG_ID_CHANGED_ON_RESUME}, {names.DIAG_TOOL_WAIT_DOMINATES}," in text


def test_first_turn_resumed_from_another_conversation_keeps_its_reason() -> None:
    """A resumed first turn could have read the other conversation's KV: its reason stays."""
    resumed = turn_row(
        turn_index=0, resumed_from={"conversation_id": "old"}, prefill={"reason": "no_decode_handle"}
    )
    out = io.StringIO()
    views.show_conversation({"conversation_id": "c", "turns": [resumed]}, out, width=100)
    assert "no_decode_handle" in out.getvalue() and views.FIRST_TURN not in out.getvalue()


def test_turn_zero_is_no_failure_in_views_or_diagnoses() -> None:
    """Turn 0 and turn 1 both reach prefill without a handle after a streamed decode call.
    For turn 1 that is a lost handle (the diagnosis must fire: this test can fail); for
    turn 0 there was nothing to reuse: no diagnosis cites it and PULL says "first turn"."""
    no_handle = {
        "prefill": {names.PULL_REASON: names.REASON_NO_DECODE_HANDLE},
        "router": {names.ROUTER_HANDLE: names.ROUTER_HANDLE_MISS, names.ROUTER_DECODE_STREAMED: True},
        "decode": {names.KV_PARAMS_RETURNED: False},
    }
    t0 = turn_trace("conv-s", 0, start_s=100.0, **no_handle)
    t1 = turn_trace("conv-s", 1, start_s=103.0, gap_s=2.0, prev_trace=t0[0].trace_id, **no_handle)
    data = conversation(InMemorySource(t0 + t1), "conv-s")
    first, second = data["turns"]
    assert first["prefill"]["reason"] == second["prefill"]["reason"] == names.REASON_NO_DECODE_HANDLE
    assert names.DIAG_DECODE_NO_HANDLE in [d["id"] for d in second["diagnoses"]]
    for diag in first["diagnoses"]:
        assert diag["evidence"].get("pull_reason") != names.REASON_NO_DECODE_HANDLE, diag["id"]
        assert "handle" not in diag["id"], diag["id"]
    out = io.StringIO()
    views.show_conversation(data, out, width=100)
    rows = [line for line in lines(out.getvalue()) if line[:2] in ("0 ", "1 ")]
    assert views.FIRST_TURN in rows[0] and names.REASON_NO_DECODE_HANDLE in rows[1]


WHY = {
    "turn": turn_row(
        conversation_id="support-agent",
        diagnoses=[
            {
                "id": names.DIAG_TTL_LAPSED,
                "title": "Decode KV expired during the gap",
                "cost_s": 0.02,
                "summary": "The 18.1s gap before this turn exceeded decoder_kv_blocks_ttl=15s; blocks were "
                "held 15.0s then freed unread, so prefill recomputed 116 tokens instead of pulling them.",
                "evidence": {f"evidence_key_{i}": 1000 + i for i in range(14)},
                "fix": "Raise decoder_kv_blocks_ttl (kv_connector_extra_config of the decode node's "
                "--kv-transfer-config) to about 30s to bridge gaps like this one (vLLM declines reads "
                "from 5s before the deadline), if the memory is there.",
            }
        ],
    )
}


@pytest.mark.parametrize("width", [60, 100, 160])
def test_why_wraps_to_the_width_and_keeps_indentation(width: int) -> None:
    out = io.StringIO()
    views.show_why(WHY, out, width=width)
    text = lines(out.getvalue())
    assert max(len(line) for line in text) <= width, "\n".join(text)
    start = next(i for i, line in enumerate(text) if line.startswith("   evidence: "))
    end = next(i for i, line in enumerate(text) if line.startswith("   fix: "))
    evidence = text[start:end]
    assert all(line.startswith(" " * 13) and line[13] != " " for line in evidence[1:])
    assert " ".join(line.strip() for line in evidence).removeprefix("evidence: ") == ", ".join(
        f"evidence_key_{i}=100{i}" if i < 10 else f"evidence_key_{i}=10{i}" for i in range(14)
    )
    fix = text[end:]
    assert all(line.startswith(" " * 8) and line[8] != " " for line in fix[1:])
    assert len(evidence[0]) > width - 25  # the lines use the width they have
    summary = [line for line in text if line.startswith("   ") and not line.startswith("   evidence")]
    assert summary and all(line[3] != " " for line in summary[:2])


def test_why_uses_the_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "72")
    assert render.terminal_width() == 72
    out = io.StringIO()
    views.show_why(WHY, out)
    assert max(len(line) for line in lines(out.getvalue())) <= 72


def test_start_times_are_utc_with_the_date() -> None:
    assert views.when(T0) == "2023-11-14 22:13:20Z" and views.when(None) == "-"


def test_the_readme_shows_the_tables_as_they_are_printed() -> None:
    """The README's demo output is real output: its header and legend lines are the ones the
    views print today, up to column widths (a change of columns must update the README too)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    slow_out, conv_out = io.StringIO(), io.StringIO()
    views.show_slow({"turns": [turn_row(conversation_id="support-agent")]}, slow_out, width=100)
    views.show_conversation(
        {"conversation_id": "c", "turns": [turn_row(turn_index=0), turn_row(turn_index=1)]},
        conv_out,
        width=100,
    )
    printed = lines(slow_out.getvalue()) + lines(conv_out.getvalue())
    header_lines = [
        line for line in printed if line.startswith(("START ", "#  TOTAL", "TOOL, APP:", "PHASES:"))
    ]
    assert len(header_lines) == 4
    readme_lines = {" ".join(line.split()) for line in readme.splitlines()}
    for line in header_lines:
        assert " ".join(line.split()) in readme_lines, line
