"""ON/OFF on the real fleet: ``otelkv fleet record`` twice, then ``otelkv compare`` on the stores.

Two fleet starts (one per arm, about a minute each on 2 cores), so the workload is the
smallest that still pulls: one ``agent-short-tools`` conversation of four turns with
0.75-1.5 s tool waits, inside the router's 24 s handle TTL (decode TTL 30 s: reads of an idle engine stall
for seconds on a loaded 2-core machine, and vLLM declines reads from 5 s before the deadline).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from otelkv import names
from otelkv.fleet.record import RecordOptions, record
from tests.schema import assert_valid

pytestmark = pytest.mark.fleet

ROOT = Path(__file__).resolve().parents[2]
TTL_S = 30.0
SCENARIO = "agent-short-tools"
SCALE = 0.5  # one conversation, four turns


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("compare")
    manifests = {}
    for arm, bidirectional in (("on", True), ("off", False)):
        options = RecordOptions(
            scenarios=(SCENARIO,),
            store=root / arm,
            bidirectional=bidirectional,
            ttl_s=TTL_S,
            scale=SCALE,
            workdir=root / f"{arm}-logs",
        )
        manifests[arm] = record(options, out=io.StringIO())
    done = subprocess.run(
        [sys.executable, "-m", "otelkv.cli.main", "compare", str(root / "on"), str(root / "off"), "--json"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return {"manifests": manifests, "compare": assert_valid(json.loads(done.stdout)), "root": root}


def test_both_arms_sent_the_same_turns(runs: dict[str, Any]) -> None:
    on, off = runs["manifests"]["on"], runs["manifests"]["off"]
    for manifest in (on, off):
        assert manifest["turns"] == {"sent": 4, "ok": 4, "failed": 0, "interrupted": 0}, manifest["failures"]
        assert manifest["conversations"] == {SCENARIO: ["agent-short-tools-0"]}
    assert (on["settings"]["bidirectional_kv_xfer"], off["settings"]["bidirectional_kv_xfer"]) == (
        True,
        False,
    )
    assert (Path(runs["root"]) / "on" / names.RUN_MANIFEST_FILE).exists()


def test_compare_finds_pulls_and_transfer_only_in_on(runs: dict[str, Any]) -> None:
    data = runs["compare"]
    assert data["matching"]["matched"] == 4 and data["a"]["turns"] == data["b"]["turns"] == 4
    settings = {row["key"]: row for row in data["settings"]}
    assert settings["bidirectional_kv_xfer"]["differs"]
    assert (settings["bidirectional_kv_xfer"]["a"], settings["bidirectional_kv_xfer"]["b"]) == (True, False)
    assert settings["decoder_kv_blocks_ttl_s"]["a"] == settings["decoder_kv_blocks_ttl_s"]["b"] == TTL_S

    pulls_a, pulls_b = data["pulls_by_reason"]["a"], data["pulls_by_reason"]["b"]
    assert pulls_a.get(names.REASON_PULLED, 0) >= 1, pulls_a
    # Off on both nodes the decode node returns no handle, so every turn is recorded as such.
    assert set(pulls_b) <= {names.REASON_NO_DECODE_HANDLE, names.REASON_BIDIRECTIONAL_OFF}, pulls_b
    assert sum(pulls_b.values()) == 4

    prefill_a, prefill_b = data["prefill"]["a"], data["prefill"]["b"]
    assert prefill_a["turns_with_pull"] >= 1 and prefill_a["pulled_tokens"] > 0
    assert prefill_a["transfer_s"] > 0
    assert prefill_b["turns_with_pull"] == 0 and prefill_b["transfer_s"] == 0
    assert prefill_a["compute_s"] > 0 and prefill_b["compute_s"] > 0

    # The memory side: only the ON arm's decode node kept blocks for a next turn.
    assert data["retained"]["a"][names.RETENTION_DECODE_TTL]["count"] >= 3
    assert names.RETENTION_DECODE_TTL not in data["retained"]["b"]
