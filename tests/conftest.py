"""Shared pytest set-up.

With ``OTELKV_REQUIRE_FLEET_TESTS=1`` (set by ``scripts/test.sh``, hence by CI) a run only
passes if real-engine tests actually ran and passed and nothing was skipped: an empty
selection, a missing dependency or a skipped fleet must not look green.
"""

from __future__ import annotations

import os

import pytest

from otelkv.engine import telemetry

_outcomes: dict[str, int] = {"fleet_passed": 0, "unit_passed": 0, "skipped": 0}


@pytest.fixture(autouse=True)
def _fresh_tracers() -> None:
    telemetry.reset_for_tests()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _outcomes["skipped"] += 1
    elif report.when == "call" and report.passed:
        key = "fleet_passed" if "/fleet/" in report.nodeid.replace("\\", "/") else "unit_passed"
        _outcomes[key] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("OTELKV_REQUIRE_FLEET_TESTS") != "1" or exitstatus not in (0, 5):
        return
    problems = []
    if _outcomes["fleet_passed"] == 0:
        problems.append("no real-engine (tests/fleet) test passed")
    if _outcomes["unit_passed"] == 0:
        problems.append("no unit test passed")
    if _outcomes["skipped"]:
        problems.append(f"{_outcomes['skipped']} test(s) skipped")
    if problems:
        print("\notelkv: the suite is not green: " + "; ".join(problems))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
