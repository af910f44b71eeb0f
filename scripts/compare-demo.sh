#!/usr/bin/env bash
# Record the same agent scenarios on the reference fleet twice, bidirectional KV transfer
# on (run A) and off (run B), then compare the two runs: a terminal summary and a
# self-contained HTML report. Each run starts its own fleet (a minute or two on 2 cores)
# and takes about four minutes in all. Usage: scripts/compare-demo.sh [OUTPUT_DIR]
# (a new directory; default: a fresh temp dir). SCENARIOS= and TTL= override the workload.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
OTELKV="${OTELKV_VENV:-.venv}/bin/otelkv"
SCENARIOS="${SCENARIOS:-agent-short-tools,pause-beyond-ttl,no-reuse}"
TTL="${TTL:-20}"
OUT="${1:-$(mktemp -d "${TMPDIR:-/tmp}/otelkv-compare-XXXXXX")}"
"$OTELKV" fleet record --scenario "$SCENARIOS" --ttl "$TTL" --store "$OUT/on"
"$OTELKV" fleet record --scenario "$SCENARIOS" --ttl "$TTL" --store "$OUT/off" --no-bidirectional
exec "$OTELKV" compare "$OUT/on" "$OUT/off" --html "$OUT/compare.html"
