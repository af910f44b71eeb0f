#!/usr/bin/env bash
# Set up the environment, then run the demo: a real prefill/decode vLLM pair with the
# instrumented NixlConnector, otelkv's sidecar in front of the router, agent conversations,
# then `otelkv slow` and a conversation waterfall from the sidecar's store.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec "${OTELKV_VENV:-.venv}/bin/otelkv" demo "$@"
