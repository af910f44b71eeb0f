"""Fail-open is otelkv's core promise: an exception in an observer must never reach vLLM,
yet must be counted (for ``/metrics``) and logged once (for humans) per site.

Fault injection exists to prove that promise on a live fleet, so it must fire exactly at
the configured sites and nowhere else.
"""

from __future__ import annotations

import logging
import threading

import pytest

from otelkv.engine.guard import ErrorLedger, InjectedFaultError, guarded


class Observer:
    """A minimal host for guarded methods: ``guarded`` only needs ``self.errors``."""

    def __init__(self, fault_sites: frozenset[str] = frozenset()) -> None:
        self.errors = ErrorLedger(fault_sites)
        self.calls: list[str] = []

    @guarded("obs.ok")
    def ok(self, x: int, *, y: int = 0) -> int:
        self.calls.append("ok")
        return x + y

    @guarded("obs.boom")
    def boom(self) -> int:
        self.calls.append("boom")
        raise KeyError("missing")

    @guarded("obs.other")
    def other(self) -> None:
        self.calls.append("other")
        raise ValueError("bad")

    @guarded("obs.exit")
    def exit(self) -> None:
        raise SystemExit(3)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "vllm.otelkv" and r.levelno == logging.WARNING]


def test_success_passes_through() -> None:
    obs = Observer()
    assert obs.ok(2, y=3) == 5
    assert obs.errors.drain() == {}
    assert Observer.ok.__name__ == "ok"


def test_exception_is_swallowed_counted_and_returns_none() -> None:
    obs = Observer()
    assert obs.boom() is None
    assert obs.boom() is None
    assert obs.other() is None
    assert obs.errors.drain() == {"obs.boom": 2, "obs.other": 1}
    assert dict(obs.errors.total) == {"obs.boom": 2, "obs.other": 1}


def test_drain_resets_pending_but_not_total() -> None:
    obs = Observer()
    obs.boom()
    assert obs.errors.drain() == {"obs.boom": 1}
    assert obs.errors.drain() == {}
    obs.boom()
    assert obs.errors.drain() == {"obs.boom": 1}
    assert obs.errors.total["obs.boom"] == 2


def test_logs_once_per_site(caplog: pytest.LogCaptureFixture) -> None:
    obs = Observer()
    with caplog.at_level(logging.WARNING, logger="vllm.otelkv"):
        for _ in range(3):
            obs.boom()
        obs.other()
        obs.errors.drain()
        obs.boom()  # draining does not re-arm the log line
    records = warnings_of(caplog)
    assert [r.args for r in records] == [("obs.boom",), ("obs.other",)]
    assert records[0].getMessage().startswith("otelkv: instrumentation error at obs.boom;")
    assert records[0].exc_info is not None and isinstance(records[0].exc_info[1], KeyError)
    assert isinstance(records[1].exc_info[1], ValueError)  # type: ignore[index]


def test_base_exceptions_are_not_swallowed() -> None:
    obs = Observer()
    with pytest.raises(SystemExit):
        obs.exit()
    assert obs.errors.drain() == {}


def test_broken_ledger_still_fails_open() -> None:
    obs = Observer()
    obs.errors = None  # type: ignore[assignment]
    assert obs.ok(1) is None  # `self.errors.fault_sites` raised inside the guard
    assert obs.calls == []


def test_fault_injection_only_at_listed_sites(caplog: pytest.LogCaptureFixture) -> None:
    obs = Observer(frozenset({"obs.ok"}))
    with caplog.at_level(logging.WARNING, logger="vllm.otelkv"):
        assert obs.ok(1) is None
    assert obs.calls == []  # the real method never ran
    assert obs.errors.drain() == {"obs.ok": 1}
    (record,) = warnings_of(caplog)
    assert isinstance(record.exc_info[1], InjectedFaultError)  # type: ignore[index]
    assert str(record.exc_info[1]) == "otelkv fault injected at obs.ok"  # type: ignore[index]
    assert obs.other() is None
    assert obs.calls == ["other"]  # not listed: runs (and fails on its own)


def test_fault_injection_all() -> None:
    obs = Observer(frozenset({"all"}))
    assert (obs.ok(1), obs.boom(), obs.other()) == (None, None, None)
    assert obs.calls == []
    assert obs.errors.drain() == {"obs.ok": 1, "obs.boom": 1, "obs.other": 1}


@pytest.mark.parametrize(
    ("sites", "site", "inject"),
    [
        (frozenset(), "a", False),
        (frozenset({"a"}), "a", True),
        (frozenset({"a"}), "b", False),
        (frozenset({"all"}), "b", True),
        (frozenset({"ALL"}), "b", False),
    ],
)
def test_should_inject(sites: frozenset[str], site: str, inject: bool) -> None:
    assert ErrorLedger(sites).should_inject(site) is inject


def test_injected_fault_is_a_runtime_error() -> None:
    assert issubclass(InjectedFaultError, RuntimeError)


def test_ledger_counts_exactly_under_threads() -> None:
    ledger = ErrorLedger()
    drained: list[dict[str, int]] = []
    exc = RuntimeError("x")

    def work() -> None:
        for _ in range(2000):
            ledger.record("site", exc)

    def drain() -> None:
        for _ in range(200):
            drained.append(ledger.drain())

    threads = [threading.Thread(target=work) for _ in range(4)] + [threading.Thread(target=drain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    drained.append(ledger.drain())
    assert sum(d.get("site", 0) for d in drained) == 8000
    assert ledger.total["site"] == 8000
