"""``otelkv compare`` numbers on two hand-built runs, every one worked out by hand.

Run A has bidirectional transfer on, run B off; same conversations:

=====  =====  ======  ======  ======  =============  =============  ===========================
turn   start  prompt  A TTFT  B TTFT  A prefill c/t  B prefill c/t  A decode retention
=====  =====  ======  ======  ======  =============  =============  ===========================
c1#0   100    100     0.50    0.50    0.30 / 0       0.30 / 0       4 blocks 400 kB, 2 s, read
c1#1   103    300     0.30    0.45    0.15 / 0.05    0.35 / 0       10 blocks 1 MB, 3 s, read
c1#2   107    600     0.60    0.90    0.30 / 0.10    0.60 / 0       20 blocks 2 MB, 12 s, expired
c2#0   100.5  100     0.40    0.40    0.25 / 0       0.25 / 0       4 blocks 400 kB, 1 s, read
c2#1   103.5  200     0.20    0.21    0.15 / 0       0.15 / 0       8 blocks 800 kB, 12 s, expired
c3#0   101    150     -       1.00    -              0.25 / 0       (only in B)
=====  =====  ======  ======  ======  =============  =============  ===========================

(c/t: compute / KV-transfer seconds.) A pulls 200 and 500 tokens on c1#1 and c1#2; c2#1's
reusable KV is below the threshold. A also holds the fleet's warm-up turn (left out).
A retention starts when its decode request ends (start + 0.98 s).
"""

from __future__ import annotations

from typing import Any

import pytest

from otelkv import names
from otelkv.analysis.compare.aggregate import CompareOptions, compare_runs, prompt_bucket, stats
from otelkv.analysis.compare.rows import OUTCOME_ERROR, OUTCOME_INTERRUPTED, Run, load_run, turn_row
from otelkv.analysis.model import build_turn
from otelkv.analysis.sources import InMemorySource
from otelkv.spans import SpanRecord
from tests.unit.test_diagnose import stored, trace_id, turn_trace

# conv, index, start, prompt, (A ttft, B ttft), (A prefill end, B prefill end), A pulled, A wait, A reason, A retention
PLAN: list[tuple[Any, ...]] = [
    (
        "c1",
        0,
        100.0,
        100,
        (0.50, 0.50),
        (0.35, 0.35),
        0,
        None,
        names.REASON_NO_DECODE_HANDLE,
        (4, 400_000, 2.0, "consumed"),
    ),
    (
        "c1",
        1,
        103.0,
        300,
        (0.30, 0.45),
        (0.25, 0.40),
        200,
        0.05,
        names.REASON_PULLED,
        (10, 1_000_000, 3.0, "consumed"),
    ),
    (
        "c1",
        2,
        107.0,
        600,
        (0.60, 0.90),
        (0.45, 0.65),
        500,
        0.10,
        names.REASON_PULLED,
        (20, 2_000_000, 12.0, "expired"),
    ),
    (
        "c2",
        0,
        100.5,
        100,
        (0.40, 0.40),
        (0.30, 0.30),
        0,
        None,
        names.REASON_NO_DECODE_HANDLE,
        (4, 400_000, 1.0, "consumed"),
    ),
    (
        "c2",
        1,
        103.5,
        200,
        (0.20, 0.21),
        (0.20, 0.20),
        0,
        None,
        names.REASON_BELOW_THRESHOLD,
        (8, 800_000, 12.0, "expired"),
    ),
]


def run_spans(on: bool, base_s: float = 0.0) -> list[SpanRecord]:
    """Run A (``on``) or B, ``base_s`` seconds after the test module's T0."""
    side = 0 if on else 1
    off = {names.BIDIRECTIONAL_KV_XFER: False}
    spans: list[SpanRecord] = []
    for conv, index, start, prompt, ttfts, p_ends, pulled, wait, reason, ret in PLAN:
        prefill = {
            names.GEN_AI_USAGE_INPUT_TOKENS: prompt,
            names.TOKENS_COMPUTED: prompt - pulled if on else prompt,
            names.TOKENS_PULLED: pulled if on else 0,
            names.PULL_DECISION: names.DECISION_PULL if on and pulled else names.DECISION_RECOMPUTE,
            names.PULL_REASON: reason if on else names.REASON_BIDIRECTIONAL_OFF,
        }
        blocks, size, held, outcome = ret
        spans += turn_trace(
            conv,
            index,
            start_s=base_s + start,
            ttft_s=ttfts[side],
            prev_trace=trace_id(conv, index - 1) if index else "",
            turn={names.GEN_AI_USAGE_INPUT_TOKENS: prompt},
            prefill=prefill,
            prefill_span=(0.05, p_ends[side]),
            prefill_transfer={names.TRANSFER_WAIT_SECONDS: wait, names.TRANSFER_TOKENS: pulled}
            if on and wait
            else None,
            prefill_resource=None if on else off,
            decode_resource=None if on else off,
            retention={
                names.RETENTION_BLOCKS: blocks,
                names.RETENTION_BYTES: size,
                names.RETENTION_HELD_SECONDS: held,
                names.RETENTION_OUTCOME: outcome,
            }
            if on
            else None,
        )
    if on:
        spans += turn_trace(names.FLEET_WARMUP_CONVERSATION, 0, start_s=base_s + 90.0, ttft_s=0.9)
    else:
        spans += turn_trace(
            "c3",
            0,
            start_s=base_s + 101.0,
            ttft_s=1.0,
            turn={names.GEN_AI_USAGE_INPUT_TOKENS: 150},
            prefill={names.PULL_REASON: names.REASON_BIDIRECTIONAL_OFF},
            prefill_resource=off,
            decode_resource=off,
        )
    return spans


MANIFEST_A = {
    "scenarios": ["agent-short-tools"],
    "scenario_params": {"ttl_s": 12.0, "scale": 1.0, "seed": 0, "router_ttl_s": None},
    "settings": {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl_s": 12.0, "router_handle_ttl_s": 6.0},
}
MANIFEST_B = {**MANIFEST_A, "settings": {**MANIFEST_A["settings"], "bidirectional_kv_xfer": False}}


def runs(form: Any = lambda s: s, manifests: bool = True) -> tuple[Run, Run]:
    a = load_run(
        InMemorySource(form(run_spans(True))),
        label="A",
        where="on",
        manifest=MANIFEST_A if manifests else None,
    )
    b = load_run(
        InMemorySource(form(run_spans(False))),
        label="B",
        where="off",
        manifest=MANIFEST_B if manifests else None,
    )
    return a, b


def check_comparison(data: dict[str, Any]) -> None:
    """The hand-worked numbers (shared with the CLI test on real chDB stores)."""
    assert data["a"]["turns"] == 5 and data["b"]["turns"] == 6
    assert data["a"]["warmup_turns_left_out"] == 1 and data["a"]["outcomes"] == {"ok": 5}
    assert data["matching"]["matched"] == 5
    assert (data["matching"]["only_a"], data["matching"]["only_b"]) == (0, 1)

    overall = data["ttft"]["overall"]
    # A: 0.2 0.3 0.4 0.5 0.6 -> nearest rank p50 = 3rd, p95 = 5th.  B adds c3's 1.0 s: 6 values.
    assert overall["a"] == {"count": 5, "p50_s": 0.4, "p95_s": 0.6, "mean_s": 0.4}
    assert overall["b"] == {
        "count": 6,
        "p50_s": 0.45,
        "p95_s": 1.0,
        "mean_s": pytest.approx(3.46 / 6, abs=1e-6),
    }
    by_index = {row["bucket"]: row for row in data["ttft"]["by_turn_index"]}
    assert list(by_index) == ["0", "1", "2"]
    assert (by_index["0"]["a"]["p50_s"], by_index["0"]["a"]["p95_s"]) == (0.4, 0.5)
    assert (by_index["0"]["b"]["count"], by_index["0"]["b"]["p50_s"], by_index["0"]["b"]["p95_s"]) == (
        3,
        0.5,
        1.0,
    )
    assert (by_index["1"]["a"]["p50_s"], by_index["1"]["b"]["p50_s"], by_index["1"]["b"]["p95_s"]) == (
        0.2,
        0.21,
        0.45,
    )
    assert (by_index["2"]["a"]["p50_s"], by_index["2"]["b"]["p50_s"]) == (0.6, 0.9)
    by_prompt = {row["bucket"]: row for row in data["ttft"]["by_prompt_tokens"]}
    assert list(by_prompt) == ["<128", "128-255", "256-511", "512-1023"]
    assert by_prompt["128-255"]["a"]["count"] == 1 and by_prompt["128-255"]["b"]["count"] == 2
    assert (by_prompt["128-255"]["b"]["p50_s"], by_prompt["128-255"]["b"]["p95_s"]) == (0.21, 1.0)
    assert (by_prompt["512-1023"]["a"]["p50_s"], by_prompt["512-1023"]["b"]["p50_s"]) == (0.6, 0.9)

    pa, pb = data["prefill"]["a"], data["prefill"]["b"]
    assert pa["compute_s"] == pytest.approx(1.15, abs=1e-6) and pa["transfer_s"] == pytest.approx(
        0.15, abs=1e-6
    )
    assert (pa["turns"], pa["turns_with_pull"], pa["pulled_tokens"], pa["computed_tokens"]) == (
        5,
        2,
        700,
        600,
    )
    assert pb["compute_s"] == pytest.approx(1.90, abs=1e-6) and pb["transfer_s"] == 0
    assert (pb["turns"], pb["turns_with_pull"], pb["pulled_tokens"]) == (6, 0, 0)
    # Per turn, what runs of different lengths compare by. A's prefill (compute + transfer) per
    # turn: 0.30 0.20 0.40 0.25 0.15; B's: 0.30 0.35 0.60 0.25 0.15 and c3's 0.25.
    assert (pa["compute_per_turn_s"], pa["transfer_per_turn_s"]) == (pytest.approx(0.23), pytest.approx(0.03))
    assert (pa["prefill_p50_s"], pa["pulled_tokens_per_turn"]) == (pytest.approx(0.25), 140)
    assert (pb["compute_per_turn_s"], pb["transfer_per_turn_s"]) == (pytest.approx(1.90 / 6, abs=1e-6), 0)
    assert (pb["prefill_p50_s"], pb["pulled_tokens_per_turn"]) == (pytest.approx(0.25), 0)

    assert data["pulls_by_reason"]["a"] == {"below_threshold": 1, "no_decode_handle": 2, "pulled": 2}
    assert data["pulls_by_reason"]["b"] == {"bidirectional_off": 6}

    kept = data["retained"]["a"]["decode_ttl"]
    assert kept["count"] == 5 and kept["block_seconds"] == pytest.approx(8 + 30 + 240 + 4 + 96)
    assert kept["block_seconds_per_turn"] == pytest.approx(378 / 5)
    # c1#2 (107.98 s for 12 s) and c2#1 (104.48 s for 12 s) overlap: 20 + 8 blocks, 2.8 MB.
    assert (kept["peak_bytes"], kept["peak_blocks"]) == (2_800_000, 28)
    assert kept["outcomes"] == {"consumed": 3, "expired": 2}
    assert data["retained"]["b"] == {}

    reg = data["regressions"]
    assert (reg["factor"], reg["compared"], reg["count"], reg["faster_count"]) == (1.2, 5, 2, 0)
    assert [t["ref"] for t in reg["turns"]] == ["c1#2", "c1#1"]  # worst first
    worst = reg["turns"][0]
    a, b = worst["a"], worst["b"]
    assert (a["ttft_s"], b["ttft_s"], worst["ratio"], worst["delta_s"]) == (0.6, 0.9, 1.5, 0.3)
    assert (a["prefill"]["reason"], b["prefill"]["reason"]) == ("pulled", "bidirectional_off")
    found = {d["id"]: d for d in b["diagnoses"]}
    assert list(found) == [
        names.DIAG_TOOL_WAIT_DOMINATES,
        names.DIAG_BIDIRECTIONAL_OFF,
    ]  # by cost: the 2 s gap first
    # what c1#1's decode request held (its 300 prompt + 40 output tokens) was recomputed
    assert "prefill recomputed 340 tokens" in found[names.DIAG_BIDIRECTIONAL_OFF]["summary"]
    assert names.DIAG_BIDIRECTIONAL_OFF not in [d["id"] for d in a["diagnoses"]]
    assert sum(p["regressed"] for p in reg["points"]) == 2 and len(reg["points"]) == 5

    settings = {row["key"]: row for row in data["settings"]}
    assert settings["bidirectional_kv_xfer"]["a"] is True and settings["bidirectional_kv_xfer"]["b"] is False
    assert (
        settings["bidirectional_kv_xfer"]["differs"]
        and settings["bidirectional_kv_xfer"]["a_source"] == "spans"
    )
    assert (settings["decoder_kv_blocks_ttl_s"]["a"], settings["decoder_kv_blocks_ttl_s"]["differs"]) == (
        12.0,
        False,
    )
    assert settings["kv_recompute_threshold"]["b"] == 64
    # No router span records its handle TTL: the manifest's value, said so.
    assert (settings["router_handle_ttl_s"]["a"], settings["router_handle_ttl_s"]["a_source"]) == (
        6.0,
        "manifest",
    )
    assert [k for k, row in settings.items() if row["differs"]] == ["bidirectional_kv_xfer"]
    assert data["notes"] == [
        "0 turns only in A and 1 only in B (failed or cut-short conversations, or different workloads)"
    ]


@pytest.mark.parametrize("form", [lambda s: s, stored], ids=["native", "stored"])
def test_compare_by_hand(form: Any) -> None:
    a, b = runs(form)
    check_comparison(compare_runs(a, b))


def test_factor_and_min_delta() -> None:
    a, b = runs()
    assert compare_runs(a, b, CompareOptions(factor=1.6))["regressions"]["count"] == 0
    # 1.2x but at least 0.2 s slower: only c1#2 (+0.3 s); c1#1 is +0.15 s.
    only = compare_runs(a, b, CompareOptions(min_delta_s=0.2))["regressions"]
    assert [t["ref"] for t in only["turns"]] == ["c1#2"]
    # Swapped, B's slow turns are A's improvements.
    back = compare_runs(b, a)["regressions"]
    assert (back["count"], back["faster_count"]) == (0, 2)


def test_failed_and_interrupted_turns() -> None:
    """A turn that fails only in B regresses; an interrupted one keeps its TTFT."""
    ok = build_turn(turn_trace("c9", 0, ttft_s=0.3))
    failed = build_turn(turn_trace("c9", 0, ttft_s=0.3, status="Error"))
    cut_spans = turn_trace("c9", 0, ttft_s=0.3, status="Error")
    cut_spans[0] = type(cut_spans[0])(
        **{**cut_spans[0].__dict__, "status_message": names.CLIENT_DISCONNECTED}
    )
    cut = build_turn(cut_spans)
    assert ok and failed and cut
    assert turn_row(failed).outcome == OUTCOME_ERROR and turn_row(cut).outcome == OUTCOME_INTERRUPTED
    a = Run("A", "a", [turn_row(ok)], {})
    data = compare_runs(a, Run("B", "b", [turn_row(failed)], {}))
    assert data["regressions"]["turns"][0]["kind"] == "failed" and data["ttft"]["overall"]["b"]["count"] == 0
    data = compare_runs(a, Run("B", "b", [turn_row(cut)], {}))
    assert data["regressions"]["count"] == 0 and data["ttft"]["overall"]["b"]["p50_s"] == 0.3


def test_workload_notes_without_manifests_and_with_different_scenarios() -> None:
    a, b = runs(manifests=False)
    notes = compare_runs(a, b)["notes"]
    assert notes[0] == "no run manifest for A and B: settings are read from the spans only"
    a.manifest, b.manifest = MANIFEST_A, {**MANIFEST_B, "scenarios": ["no-reuse"]}
    assert "the runs differ in scenarios" in compare_runs(a, b)["notes"][0]


def test_buckets_and_stats() -> None:
    assert [prompt_bucket(n) for n in (None, 0, 127, 128, 511, 512, 2047, 2048)] == [
        "?",
        "<128",
        "<128",
        "128-255",
        "256-511",
        "512-1023",
        "1024-2047",
        "2048+",
    ]
    assert stats([]) == {"count": 0, "p50_s": None, "p95_s": None, "mean_s": None}
    assert stats([3.0, 1.0, 2.0]) == {"count": 3, "p50_s": 2.0, "p95_s": 3.0, "mean_s": 2.0}


def test_turns_that_failed_while_recording_are_named_in_the_notes() -> None:
    a, b = runs()
    b.manifest = {
        **MANIFEST_B,
        "turns": {"sent": 24, "ok": 23, "failed": 1, "interrupted": 0},
        "failures": ["pause-beyond-ttl-1#2: Internal Server Error"],
    }
    notes = compare_runs(a, b)["notes"]
    assert (
        "B: 1 of 24 turns failed while recording (pause-beyond-ttl-1#2: Internal Server Error); "
        "they count as errors, not in TTFT"
    ) in notes
    assert not any(n.startswith("A:") for n in notes)
    b.manifest = {**b.manifest, "turns": {"sent": 24, "ok": 21, "failed": 3, "interrupted": 0}}
    assert "B: 3 of 24 turns failed while recording (the first 1: pause-beyond-ttl-1#2" in " ".join(
        compare_runs(a, b)["notes"]
    )
    b.manifest = {**b.manifest, "failures": []}  # a manifest that lists none
    assert "B: 3 of 24 turns failed while recording; they count" in " ".join(compare_runs(a, b)["notes"])
