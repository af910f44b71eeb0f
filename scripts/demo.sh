#!/usr/bin/env bash
# Set up the environment, then run the demo: a real prefill/decode vLLM pair with the
# instrumented NixlConnector, agent conversations, and what the spans recorded per turn.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec "${OTELKV_VENV:-.venv}/bin/otelkv" demo "$@"
