#!/usr/bin/env bash
# Set up the environment, then run the whole suite: lint, import layers, unit tests and the tests that
# start real vLLM engines (NixlConnector over UCX). Fails if no real-engine test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/system-tools.sh
# The TraceQL parser the dashboard tests check queries with (@grafana/lezer-traceql).
npm ci --prefix tests/traceql --no-audit --no-fund --loglevel=error >/dev/null
VENV=${OTELKV_VENV:-.venv}
"$VENV/bin/ruff" check otelkv tests bench tools
# The layers of otelkv (pyproject.toml, [tool.importlinter]): no import against them, no cycle.
"$VENV/bin/lint-imports" --no-cache --no-logo
export OTELKV_REQUIRE_FLEET_TESTS=1
exec "$VENV/bin/python" -m pytest "$@"
