"""Shared pytest set-up, and the gate that keeps a partial run from looking green.

With ``OTELKV_REQUIRE_FLEET_TESTS=1`` (set by ``scripts/test.sh``, hence by CI) a run
passes only if it was the whole suite and all of it passed: every test module under
``tests/`` collected, nothing skipped (at collection, as a module-level ``importorskip``
does, or at run time), nothing deselected (``-k``, ``-m``) or left out (``--lf``,
``--sw``), and at least one real-engine (``tests/fleet``) and one unit test passed. A missing dependency, an empty
selection or a narrowed one is a failure there, with the reason printed. Run pytest
directly, without the variable, to run a part of the suite.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from otelkv.engine import telemetry

pytest_plugins = ("pytester",)  # tests/unit/test_suite_gate.py runs small suites through this gate

TESTS = Path(__file__).resolve().parent
REQUIRE_ENV = "OTELKV_REQUIRE_FLEET_TESTS"

_outcomes: dict[str, int] = {"fleet_passed": 0, "unit_passed": 0, "skipped": 0, "deselected": 0}
_collect_skipped: list[str] = []
_collected_modules: set[Path] = set()


@pytest.fixture(autouse=True)
def _fresh_tracers() -> None:
    telemetry.reset_for_tests()


def suite_modules() -> set[Path]:
    """Every test module of the suite (the npm tree of the TraceQL checker is not ours)."""
    found = set()
    for folder, subfolders, files in os.walk(TESTS):
        subfolders[:] = [d for d in subfolders if d != "node_modules" and not d.startswith(".")]
        found.update(Path(folder, f) for f in files if f.startswith("test_") and f.endswith(".py"))
    return found


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _collect_skipped.append(report.nodeid or "?")


def pytest_deselected(items: list[pytest.Item]) -> None:
    _outcomes["deselected"] += len(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    _collected_modules.update(Path(str(item.path)).resolve() for item in session.items)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _outcomes["skipped"] += 1
    elif report.when == "call" and report.passed:
        key = "fleet_passed" if "/fleet/" in report.nodeid.replace("\\", "/") else "unit_passed"
        _outcomes[key] += 1


def gate_problems(
    outcomes: dict[str, int], collect_skipped: list[str], missing_modules: list[str]
) -> list[str]:
    """Why a run is not a green run of the whole suite (empty: it is)."""
    problems = []
    if outcomes["fleet_passed"] == 0:
        problems.append("no real-engine (tests/fleet) test passed")
    if outcomes["unit_passed"] == 0:
        problems.append("no unit test passed")
    if outcomes["skipped"]:
        problems.append(f"{outcomes['skipped']} test(s) skipped")
    if collect_skipped:
        problems.append(
            f"{len(collect_skipped)} module(s) skipped at collection: {', '.join(collect_skipped)}"
        )
    if outcomes["deselected"]:
        problems.append(f"{outcomes['deselected']} test(s) deselected (-k, -m ...)")
    if missing_modules:
        shown = ", ".join(missing_modules[:5]) + (" ..." if len(missing_modules) > 5 else "")
        problems.append(f"{len(missing_modules)} test module(s) not run: {shown}")
    return problems


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get(REQUIRE_ENV) != "1" or exitstatus not in (0, 5):
        return
    missing = sorted(str(p.relative_to(TESTS.parent)) for p in suite_modules() - _collected_modules)
    # --lf and --sw drop passed tests without reporting them as deselected.
    narrowing = [o for o in ("lf", "stepwise") if session.config.getoption(o, default=False)]
    problems = gate_problems(_outcomes, _collect_skipped, missing)
    if narrowing:
        problems.append("run with " + ", ".join(f"--{o}" for o in narrowing))
    if problems:
        print(
            f"\notelkv: not a green run of the whole suite ({REQUIRE_ENV}=1): "
            + "; ".join(problems)
            + ". Run pytest without the variable to run a part of it."
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
