"""External checkers for dashboard queries: promtool (PromQL) and Grafana's TraceQL grammar;
and the system tools other unit tests need (headless Chromium for the compare report).

Shared by the unit tests and the real-fleet test. A missing tool skips the test with the
command that installs it - unless ``OTELKV_REQUIRE_FLEET_TESTS=1`` (CI), where a missing
tool is a failure: a check that did not run must not look green.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

TRACEQL_DIR = Path(__file__).resolve().parents[1] / "traceql"

INSTALL_HINTS = {
    "promtool": "apt-get install -y prometheus",
    "prometheus": "apt-get install -y prometheus",
    "node": "apt-get install -y nodejs npm",
    "chromium": "apt-get install -y chromium",
    "@grafana/lezer-traceql": f"npm ci --prefix {TRACEQL_DIR}",
}


def _missing(what: str) -> None:
    message = f"{what} is not available (install: {INSTALL_HINTS[what]})"
    if os.environ.get("OTELKV_REQUIRE_FLEET_TESTS") == "1":
        pytest.fail(message + "; OTELKV_REQUIRE_FLEET_TESTS=1 requires it")
    pytest.skip(message)


def require_tool(name: str) -> str:
    """The tool's path; skips (or fails under CI) when it is not installed."""
    path = shutil.which(name)
    if path is None:
        _missing(name)
    assert path is not None
    return path


def require_traceql_parser() -> Path:
    require_tool("node")
    if not (TRACEQL_DIR / "node_modules" / "@grafana" / "lezer-traceql").is_dir():
        _missing("@grafana/lezer-traceql")
    return TRACEQL_DIR


def promtool_check(expressions: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` over one recording rule per expression (rc 0 = all parse)."""
    promtool = require_tool("promtool")
    rules = [{"record": f"otelkv:dashboard_check:{i}", "expr": expr} for i, expr in enumerate(expressions)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rules.yml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
        return subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
        )


def traceql_parse(queries: Sequence[str]) -> tuple[int, list[dict[str, Any]]]:
    """(exit code, per-query errors) from ``tests/traceql/check.mjs``."""
    directory = require_traceql_parser()
    done = subprocess.run(
        ["node", "check.mjs"],
        cwd=directory,
        input=json.dumps(list(queries)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode == 2:
        raise AssertionError(f"TraceQL checker refused its input: {done.stderr}")
    return done.returncode, json.loads(done.stdout)
