"""Is ``otelkv tune``'s what-if right? Predict a setting from one run, then run it and measure.

    .venv/bin/python bench/tune_validation.py            # ~10 minutes (two fleet starts)

1. Record the scenarios on the reference fleet at ``--ttl-a`` (run A).
2. Ask ``otelkv tune`` on run A what ``--ttl-b`` would do (its router TTL = TTL - 6 s, as
   the fleet sets it; the same threshold).
3. Record the same scenarios, with pauses still written for ``--ttl-a``, at ``--ttl-b``
   (run B), so both runs send the same workload and only the setting differs.
4. Measure run B with ``otelkv compare A B`` and print predicted vs measured: hand-offs
   pulled, tokens pulled, tokens computed in prefill, prefill compute seconds,
   decode-retention block-seconds.

Prefill *seconds* on this 2-core machine swing with CPU starvation (a sleeping process has
woken seconds late while the fleet runs), so tokens computed is the stable measure of
prefill work; the seconds row is printed with that caveat.

Predicted prefill compute for B is run A's measured compute minus the extra prefill the
model says B saves over A (``prefill_saved_s`` at B minus at A, both replayed from A), so
the comparison is on the quantity a user sees, not on the model's own baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from otelkv.fleet.record import RecordOptions, record  # noqa: E402
from otelkv.fleet.scenarios import ROUTER_TTL_MARGIN_S  # noqa: E402


def _cli(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "otelkv.cli.main", *args, "--json"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(f"otelkv {' '.join(args)} failed:\n{done.stderr}")
    return json.loads(done.stdout)


def _grid_row(tune: dict[str, Any], ttl: float, threshold: int) -> dict[str, Any]:
    for row in tune["grid"]:
        if row["decoder_kv_blocks_ttl_s"] == ttl and row["kv_recompute_threshold"] == threshold:
            return row
    raise SystemExit(f"tune's grid has no row for TTL {ttl} / threshold {threshold}")


def _error(predicted: float | None, measured: float | None) -> str:
    if predicted is None or measured is None:
        return "-"
    if measured == 0:
        return "exact" if predicted == 0 else "n/a (measured 0)"
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="agent-short-tools,pause-beyond-ttl")
    parser.add_argument("--ttl-a", type=float, default=20.0)
    parser.add_argument("--ttl-b", type=float, default=40.0)
    parser.add_argument("--threshold", type=int, default=64)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--out", type=Path, help="a new directory for both runs (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--analyse-only", action="store_true", help="reuse the two runs already recorded in --out"
    )
    args = parser.parse_args()

    out = args.out or Path(tempfile.mkdtemp(prefix="otelkv-tune-validation-"))
    scenarios = tuple(s for s in args.scenarios.split(",") if s)
    tune_args = (
        "--since",
        "1d",
        "--ttl",
        f"{args.ttl_a:g}s,{args.ttl_b:g}s",
        "--threshold",
        str(args.threshold),
    )
    for arm, ttl in (("a", args.ttl_a), ("b", args.ttl_b)):
        if args.analyse_only:
            break
        record(
            RecordOptions(
                scenarios=scenarios,
                store=out / arm,
                ttl_s=ttl,
                threshold=args.threshold,
                scale=args.scale,
                scenario_ttl_s=args.ttl_a,
                workdir=out / f"{arm}-logs",
            )
        )
    tune = _cli("tune", "--store", str(out / "a"), *tune_args)
    compared = _cli("compare", str(out / "a"), str(out / "b"))

    at_a = _grid_row(tune, args.ttl_a, args.threshold)
    at_b = _grid_row(tune, args.ttl_b, args.threshold)
    pa, pb = compared["prefill"]["a"], compared["prefill"]["b"]
    saved_delta = None
    if at_a["prefill_saved_s"] is not None and at_b["prefill_saved_s"] is not None:
        saved_delta = at_b["prefill_saved_s"] - at_a["prefill_saved_s"]
    predicted_compute = pa["compute_s"] - saved_delta if saved_delta is not None else None
    retained_b = compared["retained"]["b"].get("decode_ttl", {})
    # Tokens the prefill node computes: the CPU-noise-free measure of prefill work.
    predicted_computed = pa["computed_tokens"] - (at_b["pulled_tokens"] - at_a["pulled_tokens"])
    rows = [
        ("hand-offs pulled", at_b["pulls"], pb["turns_with_pull"]),
        ("tokens pulled", at_b["pulled_tokens"], pb["pulled_tokens"]),
        ("tokens computed in prefill", predicted_computed, pb["computed_tokens"]),
        ("prefill compute (s)", predicted_compute, pb["compute_s"]),
        ("decode block-seconds", at_b["block_seconds"], retained_b.get("block_seconds")),
    ]
    print(
        f"\nrun A: TTL {args.ttl_a:g}s, run B: TTL {args.ttl_b:g}s (router TTL - {ROUTER_TTL_MARGIN_S:g}s), "
        f"threshold {args.threshold}, scenarios {','.join(scenarios)}; stores in {out}"
    )
    print(f"model check on A: {tune['model_check']}")
    print(
        f"run A measured: pulls {pa['turns_with_pull']}, prefill compute {pa['compute_s']}s; "
        f"tune at A: pulls {at_a['pulls']}, block-s {at_a['block_seconds']}"
    )
    width = max(len(r[0]) for r in rows)
    print(f"\n{'':{width}}  {'predicted from A':>16}  {'measured in B':>14}  {'error':>16}")
    for name, predicted, measured in rows:
        p = (
            "-"
            if predicted is None
            else f"{predicted:.3f}"
            if isinstance(predicted, float)
            else str(predicted)
        )
        m = "-" if measured is None else f"{measured:.3f}" if isinstance(measured, float) else str(measured)
        print(f"{name:{width}}  {p:>16}  {m:>14}  {_error(predicted, measured):>16}")
    if args.json:
        args.json.write_text(
            json.dumps({"rows": rows, "tune_a": at_a, "tune_b": at_b, "compare": compared}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
