"""Real-fleet fixtures: each test module starts one real 1P1D vLLM pair and stops it.

Nothing here is mocked: two vLLM engines (CPU build) with NIXL over UCX, the reference
router, and an OTLP receiver collecting the spans the engines export. Engine logs stay
in the fleet's workdir (printed on failure) for post-mortems, and a failed test's report
carries the last lines of each engine's log: CI keeps the report, not the workdir.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import pytest

from otelkv.fleet.fleet import Fleet, FleetConfig

pytestmark = pytest.mark.fleet

LOG_TAIL_LINES = 40
"""Lines of each engine's log a failed test's report carries."""


FLEET = pytest.StashKey[Fleet]()
"""The module's fleet, on its module node: a test that fails before its ``fleet`` argument
is set up (in a fixture that uses the fleet) still reports the fleet's logs."""
FAILED = pytest.StashKey[bool]()


def fleet_fixture(config: FleetConfig, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """Start a fleet for the requesting (module-scoped) fixture, stop it after the module."""
    fleet = Fleet(config).start()
    request.node.stash[FLEET] = fleet
    try:
        yield fleet
    finally:
        if request.node.stash.get(FAILED, False):
            print(f"\nfleet logs kept in {fleet.workdir}")
        fleet.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    module = item.getparent(pytest.Module)
    if report.failed and module is not None:
        module.stash[FAILED] = True
        fleet = module.stash.get(FLEET, None)
        if fleet is not None:
            report.sections.append(("fleet engine logs, last lines", engine_log_tails(fleet)))


def engine_log_tails(fleet: Fleet, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` of each engine's log, each line prefixed with the engine's role:
    what the engines did when a request hung or failed (a timeout says nothing else)."""
    tails: list[str] = []
    for engine in (fleet.prefill, fleet.decode):
        if engine is None or not engine.log_path.exists():
            continue
        with engine.log_path.open(errors="replace") as log:
            tails += [f"[{engine.spec.role}] {line.rstrip()}" for line in deque(log, maxlen=lines)]
    return "\n".join(tails) or "(no engine log)"
