"""A recorded run as one plain row per turn, and the settings it ran with.

Rows, not :class:`~otelkv.analysis.model.Turn` objects, because the two runs of a
comparison cannot be open at the same time (chDB: one directory per process at a time),
and because the HTML and JSON outputs want flat data. Everything a comparison needs is
taken from the turn while it is at hand, including its diagnoses.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otelkv import names
from otelkv.analysis import scope, turn_json
from otelkv.analysis.diagnose import diagnose, pull_seconds
from otelkv.analysis.linker import window_turns
from otelkv.analysis.model import Leg, Turn
from otelkv.analysis.report import diagnosis_context
from otelkv.analysis.sources import SpanSource
from otelkv.analysis.tune.config import in_force

OUTCOME_OK = turn_json.OUTCOME_OK
OUTCOME_INTERRUPTED = turn_json.OUTCOME_INTERRUPTED
OUTCOME_ERROR = turn_json.OUTCOME_ERROR

MAX_TURNS = 200_000
"""Most turns read from one run (the most recent ones)."""

SETTING_KEYS = (
    "bidirectional_kv_xfer",
    "decoder_kv_blocks_ttl_s",
    "kv_recompute_threshold",
    "router_handle_ttl_s",
    "router_decode_streamed",
    "kv_load_failure_policy",
)
"""Settings compared across runs (the manifest's keys; the spans give the same ones)."""


@dataclass(frozen=True)
class Held:
    """One retention: blocks an engine kept for the other node, from ``start_ns`` for ``held_s``."""

    kind: str
    outcome: str | None
    blocks: int
    bytes: int
    held_s: float
    start_ns: int


@dataclass(frozen=True)
class TurnRow:
    conversation_id: str
    index: int | None
    trace_id: str
    start_ns: int
    outcome: str
    ttft_s: float | None
    prompt_tokens: int | None
    total_s: float
    prefill_compute_s: float | None
    """Prefill engine time not spent waiting for remote KV (None: no prefill span)."""
    prefill_transfer_s: float | None
    """Seconds the prefill request waited for KV pulled from the decode node (D->P)."""
    pulled_tokens: int = 0
    computed_tokens: int | None = None
    pull_reason: str | None = None
    status_message: str = ""
    held: tuple[Held, ...] = ()
    diagnoses: tuple[dict[str, Any], ...] = field(default=())
    """As :func:`otelkv.analysis.turn_json.diagnosis_object` writes them."""
    prefill_prompt_tokens: int | None = None
    """The prefill node's prompt tokens (None: no prefill span)."""
    prefill_pulled_tokens: int | None = None
    prefill_pull_s: float | None = None
    """:func:`otelkv.analysis.diagnose.pull_seconds` of the prefill request (any direction)."""

    @property
    def key(self) -> tuple[str, int | None]:
        return (self.conversation_id, self.index)

    @property
    def ref(self) -> str:
        return f"{self.conversation_id}#{self.index}" if self.index is not None else self.trace_id

    @property
    def counts_for_ttft(self) -> bool:
        return self.ttft_s is not None and self.outcome != OUTCOME_ERROR

    def as_turn(self) -> dict[str, Any]:
        """This row as the fields of the turn object it was taken from (same names)."""
        prefill = None
        if self.prefill_prompt_tokens is not None:
            prefill = {
                "tokens": {
                    "prompt": self.prefill_prompt_tokens,
                    "computed": self.computed_tokens,
                    "pulled": self.prefill_pulled_tokens,
                },
                "reason": self.pull_reason,
                "compute_s": turn_json.r6(self.prefill_compute_s),
                "pull_s": turn_json.r6(self.prefill_pull_s),
            }
        return {
            "trace_id": self.trace_id,
            "conversation_id": self.conversation_id,
            "turn_index": self.index,
            "start_ns": self.start_ns,
            "start": turn_json.iso(self.start_ns),
            "outcome": self.outcome,
            "status_message": self.status_message,
            "total_s": turn_json.r6(self.total_s),
            "ttft_s": turn_json.r6(self.ttft_s),
            "prefill": prefill,
            "diagnoses": list(self.diagnoses),
        }


@dataclass
class Run:
    """One side of a comparison."""

    label: str
    where: str
    rows: list[TurnRow]
    settings: dict[str, Any]
    """What the spans say was in force (``None``: they do not say)."""
    manifest: dict[str, Any] | None = None
    warmup_turns: int = 0
    """Turns of the fleet's warm-up conversation, left out."""

    def summary(self) -> dict[str, Any]:
        outcomes = Counter(r.outcome for r in self.rows)
        return {
            "label": self.label,
            "where": self.where,
            "turns": len(self.rows),
            "outcomes": dict(sorted(outcomes.items())),
            "warmup_turns_left_out": self.warmup_turns,
            "scenarios": (self.manifest or {}).get("scenarios"),
            "scenario_params": (self.manifest or {}).get("scenario_params"),
            "recorded_at": (self.manifest or {}).get("recorded_at"),
        }


def manifest_path(store: Path | str) -> Path:
    """Where ``otelkv fleet record`` leaves a run's manifest: inside its store directory."""
    return Path(store) / names.RUN_MANIFEST_FILE


def read_manifest(store: Path | str) -> dict[str, Any] | None:
    """The run's manifest, or None when the store was not recorded by ``otelkv fleet record``."""
    try:
        data = json.loads(manifest_path(store).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _transfer_s(leg: Leg) -> float:
    """Seconds the prefill request spent on a reverse pull (0 when it pulled nothing)."""
    if leg.transfer is not None and leg.transfer.direction == names.DIRECTION_D_TO_P:
        return pull_seconds(leg) or 0.0
    return leg.remote_kv_wait_s or 0.0


def _held(turn: Turn) -> tuple[Held, ...]:
    # A retention starts when its request ends (the TTL counts from there), as tune models it.
    out = []
    for leg in (turn.prefill, turn.decode):
        ret = leg.retention if leg is not None else None
        if leg is not None and ret is not None and ret.held_s is not None:
            out.append(Held(ret.kind, ret.outcome, ret.blocks, ret.bytes, ret.held_s, leg.end_ns))
    return tuple(out)


def turn_row(turn: Turn, diagnoses: Sequence[Any] = ()) -> TurnRow:
    leg = turn.prefill
    prompt = turn.input_tokens if turn.input_tokens is not None else (leg.prompt_tokens if leg else None)
    return TurnRow(
        conversation_id=turn.conversation_id,
        index=turn.index,
        trace_id=turn.trace_id,
        start_ns=turn.start_ns,
        outcome=turn_json.turn_outcome(turn),
        ttft_s=turn.ttft_s,
        prompt_tokens=prompt,
        total_s=turn.total_s,
        prefill_compute_s=leg.compute_s if leg else None,
        prefill_transfer_s=_transfer_s(leg) if leg else None,
        pulled_tokens=(leg.pulled or 0) if leg else 0,
        computed_tokens=leg.computed if leg else None,
        pull_reason=leg.reason if leg else None,
        status_message=turn.status_message,
        held=_held(turn),
        diagnoses=tuple(turn_json.diagnosis_object(d) for d in diagnoses),
        prefill_prompt_tokens=leg.prompt_tokens if leg else None,
        prefill_pulled_tokens=leg.pulled if leg else None,
        prefill_pull_s=pull_seconds(leg) if leg else None,
    )


def _agreed(values: Sequence[Any]) -> Any:
    """The one value every engine reported; None when none did; ``"mixed"`` when they differ."""
    seen = sorted({v for v in values if v is not None}, key=str)
    if not seen:
        return None
    return seen[0] if len(seen) == 1 else "mixed: " + ", ".join(map(str, seen))


def spans_settings(turns: Sequence[Turn]) -> dict[str, Any]:
    """The settings in force, as the engines' resources and the router's spans recorded them."""
    cfg = in_force(turns)
    configs = [c for t in turns for c in t.configs()]
    routers = [t.router for t in turns if t.router is not None]
    return {
        "bidirectional_kv_xfer": _agreed([c.bidirectional for c in configs]),
        "decoder_kv_blocks_ttl_s": cfg.ttl_s,
        "kv_recompute_threshold": cfg.threshold,
        "router_handle_ttl_s": cfg.router_ttl_s,
        "router_decode_streamed": _agreed([r.decode_streamed for r in routers]),
        "kv_load_failure_policy": _agreed([c.load_failure_policy for c in configs]),
    }


def rows_from_turns(turns: Sequence[Turn]) -> tuple[list[TurnRow], int]:
    """(rows, turns left out by :func:`otelkv.analysis.scope.counted`): every counted turn
    diagnosed, in (conversation, index) order."""
    kept = scope.counted_turns(turns)
    ctx = diagnosis_context(kept)
    rows = [turn_row(t, diagnose(t, ctx)) for t in kept]
    rows.sort(key=lambda r: (r.conversation_id, r.index if r.index is not None else -1, r.start_ns))
    return rows, len(turns) - len(kept)


def load_run(source: SpanSource, *, label: str, where: str, manifest: dict[str, Any] | None = None) -> Run:
    """Every counted turn of a span source (the whole store: a recorded run is one store), the
    way ``slow`` and ``tune`` count them; the warm-up turns left out are counted apart."""
    turns, _ = window_turns(source, since_ns=None, until_ns=None, max_turns=MAX_TURNS)
    rows, _ = rows_from_turns(turns)
    warmup = sum(
        len(
            source.turn_spans(
                since_ns=None, until_ns=None, limit=None, slowest_first=False, conversation_id=c
            )
        )
        for c in sorted(scope.LEFT_OUT_CONVERSATIONS)
    )
    return Run(label, where, rows, spans_settings(turns), manifest, warmup)
