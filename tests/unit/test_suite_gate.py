"""The gate in ``tests/conftest.py``: under ``OTELKV_REQUIRE_FLEET_TESTS=1`` only a green
run of the whole suite passes.

Each case runs a two-module suite (one unit test, one "fleet" test) in a fresh pytest
process with a copy of the real conftest, and narrows or breaks it the way a run could.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
PASSING = "def test_ok() -> None:\n    assert True\n"


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    (pytester.path / "tests" / "unit").mkdir(parents=True)
    (pytester.path / "tests" / "fleet").mkdir()
    (pytester.path / "tests" / "conftest.py").write_text(CONFTEST.read_text())
    (pytester.path / "tests" / "unit" / "test_unit.py").write_text(PASSING)
    (pytester.path / "tests" / "fleet" / "test_engines.py").write_text(
        PASSING + "\n\ndef test_other() -> None:\n    pass\n"
    )
    monkeypatch.setenv("OTELKV_REQUIRE_FLEET_TESTS", "1")
    return pytester


def run(suite: pytest.Pytester, *args: str) -> pytest.RunResult:
    return suite.runpytest_subprocess("-p", "no:cacheprovider", "tests", *args)


def test_the_whole_suite_green_passes(suite: pytest.Pytester) -> None:
    result = run(suite)
    assert result.ret == 0, result.stdout.str()


@pytest.mark.parametrize(
    ("module", "says"),
    [
        (  # a module-level importorskip: skipped at collection, no test report at all
            "import pytest\npytest.importorskip('no_such_module_here')\n" + PASSING,
            "*1 module(s) skipped at collection: tests/unit/test_extra.py*",
        ),
        ("import pytest\n\n@pytest.mark.skip(reason='not here')\n" + PASSING, "*1 test(s) skipped*"),
    ],
)
def test_a_skip_fails_the_run(suite: pytest.Pytester, module: str, says: str) -> None:
    (suite.path / "tests" / "unit" / "test_extra.py").write_text(module)
    result = run(suite)
    assert result.ret == 1
    result.stdout.fnmatch_lines([says])


def test_deselecting_fleet_tests_fails_the_run(suite: pytest.Pytester) -> None:
    result = run(suite, "-k", "not other")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*1 test(s) deselected*"])


def test_running_part_of_the_suite_fails_the_run(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "tests/fleet")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*no unit test passed*1 test module(s) not run: tests/unit/test_unit.py*"])


def test_last_failed_only_fails_the_run(suite: pytest.Pytester) -> None:
    (suite.path / "tests" / "unit" / "test_unit.py").write_text(
        PASSING + "\n\ndef test_bad() -> None:\n    assert False\n"
    )
    assert suite.runpytest_subprocess("tests").ret == 1  # leaves test_bad in the cache
    (suite.path / "tests" / "unit" / "test_unit.py").write_text(
        PASSING + "\n\ndef test_bad() -> None:\n    pass\n"
    )
    result = suite.runpytest_subprocess("tests", "--lf")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*run with --lf*"])


def test_without_the_variable_a_part_may_run(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTELKV_REQUIRE_FLEET_TESTS")
    result = run(suite, "-k", "not other")
    assert result.ret == 0, result.stdout.str()
