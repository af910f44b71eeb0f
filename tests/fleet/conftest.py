"""Real-fleet fixtures: each test module starts one real 1P1D vLLM pair and stops it.

Nothing here is mocked: two vLLM engines (CPU build) with NIXL over UCX, the reference
router, and an OTLP receiver collecting the spans the engines export. Engine logs stay
in the fleet's workdir (printed on failure) for post-mortems.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from otelkv.fleet.fleet import Fleet, FleetConfig

pytestmark = pytest.mark.fleet


def fleet_fixture(config: FleetConfig, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    fleet = Fleet(config).start()
    try:
        yield fleet
    finally:
        failed = getattr(request.node, "_otelkv_failed", False)
        if failed:
            print(f"\nfleet logs kept in {fleet.workdir}")
        fleet.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        # Remember on the module so the module-scoped fleet can say where its logs are.
        item.module._otelkv_failed = True  # type: ignore[attr-defined]
