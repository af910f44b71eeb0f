"""How often does a normal conversation pull KV computed for tokens its prompt does not have?

    .venv/bin/python bench/continuity_share.py [--scenarios all] [--ttl 20]   # ~5 minutes

Method. Start the reference fleet in observe mode (vLLM loads whatever a decode handle
offers; otelkv only records), run the named scenarios (the workloads of ``otelkv fleet
record`` and the demo: the agent sends its history back as it sent it, and each answer as
the text it received), then read every prefill request the engines recorded. For each one
that pulled from the decode node, from the engine's own span:

* ``offered``: prompt tokens the handle offered (what vLLM loads with the local hit);
* ``wrong``: loaded positions from the first differing 32-token chunk on (``local hit +
  pulled - max(first mismatch, local hit)``), and whether the difference starts in the
  earlier history or in the previous answer;
* ``unverified``: offered tokens in a partial chunk.

It prints, per scenario and in all: prefills, pulls, pulls with a mismatch (by where), and
the share of pulled tokens whose KV belonged to other tokens. The truth for "the answer came
back as other tokens" is the digest the decode node computed from the token ids it
generated, compared with vLLM's tokenization of the next prompt: nothing here is inferred
from text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from otelkv import names
from otelkv.fleet.fleet import Fleet, FleetConfig
from otelkv.fleet.scenarios import SCENARIOS, ScenarioParams, build, parse_names

EXPORT_SETTLE_S = 3.0
"""The engines export their spans every ~0.5 s from a separate process."""


def tally(spans: list[Any], scenario_of: dict[str, str]) -> dict[str, Counter[str]]:
    """Per scenario: prefills, pulls, pulled tokens, wrong tokens, pulls with a mismatch by where."""
    out: dict[str, Counter[str]] = defaultdict(Counter)
    prefill = names.engine_request_span_name(names.ROLE_PREFILL)
    for span in spans:
        if span.name != prefill:
            continue
        a = span.attributes
        conversation = str(a.get(names.GEN_AI_CONVERSATION_ID, ""))
        scenario = scenario_of.get(conversation, "(no scenario: the fleet's warm-up)")
        row = out[scenario]
        row["prefills"] += 1
        pulled = int(a.get(names.TOKENS_PULLED) or 0)
        if not pulled:
            continue
        row["pulls"] += 1
        row["pulled_tokens"] += pulled
        row["with_digest"] += bool(a.get(names.CONTINUITY_DIGEST))
        first = a.get(names.CONTINUITY_FIRST_MISMATCH)
        if first is None:
            offered, matching = (
                int(a.get(k, 0)) for k in (names.CONTINUITY_OFFERED, names.CONTINUITY_MATCHING)
            )
            row["unverified_tokens"] += offered - matching
            continue
        local = int(a.get(names.TOKENS_LOCAL_CACHE_HIT) or 0)
        wrong = max(local + pulled - max(int(first), local), 0)
        if wrong:
            row["pulls_mismatch"] += 1
            row[f"pulls_mismatch_{a.get(names.CONTINUITY_MISMATCH_IN)}"] += 1
            row["wrong_tokens"] += wrong
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="all", help=f"comma-separated, or all: {', '.join(SCENARIOS)}")
    parser.add_argument("--ttl", type=float, default=20.0, help="decoder_kv_blocks_ttl (s)")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="also write the tallies here")
    args = parser.parse_args(argv)
    wanted = list(SCENARIOS) if args.scenarios == "all" else parse_names(args.scenarios)
    plan = build(wanted, ScenarioParams(ttl_s=args.ttl, scale=args.scale))
    scenario_of = {c.conversation_id: name for name, convs in plan for c in convs}
    config = FleetConfig(decoder_ttl_s=args.ttl, continuity=names.CONTINUITY_MODE_OBSERVE)
    with Fleet(config) as fleet:
        driver = fleet.driver()
        for name, conversations in plan:
            runs = driver.run_sync(conversations)
            ok = sum(t.ok for run in runs for t in run)
            print(f"{name}: {ok}/{sum(len(r) for r in runs)} turns answered", flush=True)
        assert fleet.sink is not None
        time.sleep(EXPORT_SETTLE_S)
        spans = fleet.sink.spans()
    rows = tally(spans, scenario_of)
    total: Counter[str] = Counter()
    for row in rows.values():
        total.update(row)
    print(
        "\nprefill requests that pulled KV from the decode node, and the share of pulled tokens whose KV "
        "belonged to other tokens"
    )
    print(
        f"{'scenario':24} {'prefills':>8} {'pulls':>6} {'digest':>6} {'mismatch':>8} "
        f"{'in answer':>9} {'in history':>10} {'pulled tok':>10} {'wrong tok':>9} {'share':>7}"
    )
    for name, row in [*sorted(rows.items()), ("all", total)]:
        share = row["wrong_tokens"] / row["pulled_tokens"] if row["pulled_tokens"] else 0.0
        print(
            f"{name:24} {row['prefills']:8} {row['pulls']:6} {row['with_digest']:6} "
            f"{row['pulls_mismatch']:8} "
            f"{row['pulls_mismatch_answer']:9} {row['pulls_mismatch_history']:10} {row['pulled_tokens']:10} "
            f"{row['wrong_tokens']:9} {share:7.2%}"
        )
    if args.json:
        args.json.write_text(json.dumps({k: dict(v) for k, v in [*rows.items(), ("all", total)]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
