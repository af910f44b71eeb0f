"""``otelkv fleet record`` orchestration with a stand-in fleet (the engines are the fleet tests' job)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from otelkv import names
from otelkv.analysis.compare.rows import read_manifest
from otelkv.cli.main import main
from otelkv.fleet.agent import Conversation, TurnResult
from otelkv.fleet.record import RecordOptions, record


class FakeFleet:
    """Records what ``record`` asks of a fleet; every turn succeeds except ``no-reuse-1``."""

    def __init__(self, config: Any, log: list[Any]) -> None:
        self.config, self.log, self.workdir = config, log, Path("/tmp/fleet-logs")

    def __enter__(self) -> FakeFleet:
        self.log.append("start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.append("stop")

    def driver(self) -> FakeFleet:
        return self

    def run_sync(self, conversations: list[Conversation]) -> list[list[TurnResult]]:
        self.log.append(("run", [c.conversation_id for c in conversations]))
        out = []
        for conv in conversations:
            results = []
            for i, turn in enumerate(conv.turns):
                r = TurnResult(conv.conversation_id, i, "0" * 32, 200, 0.1, 0.05)
                r.interrupted = turn.interrupt_after is not None
                if conv.conversation_id == "no-reuse-1":
                    r.status, r.error = 500, "Internal Server Error"
                results.append(r)
            out.append(results)
        return out

    def flush_spans(self) -> None:
        self.log.append("flush_spans")

    def flush_store(self) -> None:
        self.log.append("flush_store")


def _record(tmp_path: Path, **kw: Any) -> tuple[dict[str, Any], list[Any], list[Any]]:
    log: list[Any] = []
    sleeps: list[float] = []
    configs: list[Any] = []

    def factory(config: Any) -> FakeFleet:
        configs.append(config)
        return FakeFleet(config, log)

    options = RecordOptions(scenarios=("interrupted", "no-reuse"), store=tmp_path / "run", **kw)
    manifest = record(options, fleet_factory=factory, out=io.StringIO(), sleep=sleeps.append)
    return manifest, [*log, ("sleeps", sleeps)], configs


def test_record_runs_scenarios_in_order_then_waits_flushes_and_writes_the_manifest(tmp_path: Path) -> None:
    manifest, log, (config,) = _record(tmp_path, ttl_s=12.0, threshold=32)
    assert (config.sidecar, config.sidecar_store, config.bidirectional) == (True, tmp_path / "run", True)
    assert (config.decoder_ttl_s, config.recompute_threshold, config.effective_router_ttl()) == (
        12.0,
        32,
        6.0,
    )
    assert log == [
        "start",
        ("run", ["interrupted-0"]),
        ("run", ["no-reuse-0", "no-reuse-1", "no-reuse-2", "no-reuse-3"]),
        "flush_spans",
        "flush_store",
        "stop",
        ("sleeps", [14.0, 1.5]),  # TTL + 2 s for the last retentions, then the engines' last export
    ]
    assert read_manifest(tmp_path / "run") == manifest
    assert (tmp_path / "run" / names.RUN_MANIFEST_FILE).exists()
    assert manifest["settings"] == {
        "bidirectional_kv_xfer": True,
        "decoder_kv_blocks_ttl_s": 12.0,
        "kv_recompute_threshold": 32,
        "router_handle_ttl_s": 6.0,
        "router_decode_streamed": False,
        "kv_load_failure_policy": "fail",
        "prefix_caching_prefill": True,
    }
    assert manifest["scenarios"] == ["interrupted", "no-reuse"]
    assert manifest["scenario_params"] == {"ttl_s": 12.0, "scale": 1.0, "seed": 0, "router_ttl_s": None}
    assert manifest["conversations"]["interrupted"] == ["interrupted-0"]
    assert manifest["turns"] == {"sent": 8, "ok": 7, "failed": 1, "interrupted": 1}
    assert manifest["failures"] == ["no-reuse-1#0: Internal Server Error"]
    assert manifest["workdir"] == "/tmp/fleet-logs"


def test_bidirectional_off_waits_briefly_and_scenario_ttl_is_kept(tmp_path: Path) -> None:
    manifest, log, (config,) = _record(tmp_path, bidirectional=False, ttl_s=40.0, scenario_ttl_s=20.0)
    assert config.bidirectional is False and log[-1] == ("sleeps", [2.0, 1.5])
    assert manifest["settings"]["bidirectional_kv_xfer"] is False
    assert manifest["scenario_params"]["ttl_s"] == 20.0  # pauses as in a run at TTL 20 s


def test_refuses_a_store_that_holds_something(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(ValueError, match="not an empty directory"):
        record(RecordOptions(scenarios=("resumed",), store=tmp_path / "used"), fleet_factory=lambda c: None)
    assert main(["fleet", "record", "--scenario", "resumed", "--store", str(tmp_path / "used")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["fleet", "record", "--scenario", "nope", "--store", str(tmp_path / "new")]) == 2
    assert "unknown scenario nope; known: agent-short-tools" in capsys.readouterr().err
    assert main(["fleet", "record", "--scenario", "resumed", "--store", "x", "--ttl", "soon"]) == 2
    assert "bad duration" in capsys.readouterr().err


def test_read_manifest_of_a_store_without_one(tmp_path: Path) -> None:
    assert read_manifest(tmp_path) is None
    (tmp_path / names.RUN_MANIFEST_FILE).write_text("[1, 2]")
    assert read_manifest(tmp_path) is None
    (tmp_path / names.RUN_MANIFEST_FILE).write_text(json.dumps({"format": 1}))
    assert read_manifest(tmp_path) == {"format": 1}


def test_failed_turns_do_not_fail_the_recording_unless_none_succeeded() -> None:
    from otelkv.cli.fleet_cmd import record_exit_code

    def manifest(sent: int, ok: int) -> dict[str, Any]:
        return {"turns": {"sent": sent, "ok": ok, "failed": sent - ok, "interrupted": 0}}

    assert record_exit_code(manifest(24, 23)) == 0
    assert record_exit_code(manifest(24, 0)) == 1
    assert record_exit_code(manifest(0, 0)) == 1
