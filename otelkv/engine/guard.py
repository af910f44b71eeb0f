"""Fail-open guard: an exception inside otelkv never reaches vLLM.

Every observer entry point is wrapped with :func:`guarded`. The wrapped call's exception
is swallowed, counted per site (the count reaches vLLM's ``/metrics`` as
``otelkv_instrumentation_errors_total``) and logged once per site with its traceback, so
a bug shows up in the logs without flooding them at engine-step rate.

The connector keeps the *real* calls into the inner connector outside the guard: their
return values and exceptions pass through unchanged.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("vllm.otelkv")

F = TypeVar("F", bound=Callable[..., Any])


class InjectedFaultError(RuntimeError):
    """Raised on purpose at a site named in ``OTELKV_FAULT_INJECT``."""


class ErrorLedger:
    """Counts caught exceptions per site; thread-safe, drained by the stats path."""

    def __init__(self, fault_sites: frozenset[str] = frozenset()) -> None:
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()
        self._logged: set[str] = set()
        self.total: Counter[str] = Counter()
        self.fault_sites = fault_sites

    def record(self, site: str, exc: BaseException) -> None:
        with self._lock:
            self._pending[site] += 1
            self.total[site] += 1
            first = site not in self._logged
            self._logged.add(site)
        if first:
            logger.warning(
                "otelkv: instrumentation error at %s; the request continues unaffected "
                "(further errors at this site are counted in "
                "otelkv_instrumentation_errors_total, not logged)",
                site,
                exc_info=exc,
            )

    def drain(self) -> dict[str, int]:
        """Errors since the last drain (for the per-step stats payload)."""
        if not self._pending:
            return {}
        with self._lock:
            out = dict(self._pending)
            self._pending.clear()
        return out

    def should_inject(self, site: str) -> bool:
        return bool(self.fault_sites) and ("all" in self.fault_sites or site in self.fault_sites)


def guarded(site: str) -> Callable[[F], F]:
    """Decorate an observer method so it can never raise into the host.

    The instance must have an ``errors`` attribute holding an :class:`ErrorLedger`.
    A guarded method returns ``None`` when it fails.
    """

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                if self.errors.fault_sites and self.errors.should_inject(site):
                    raise InjectedFaultError(f"otelkv fault injected at {site}")
                return func(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - fail open by design
                try:
                    self.errors.record(site, exc)
                except Exception:  # noqa: BLE001 - even the ledger must not raise
                    pass
                return None

        return wrapper  # type: ignore[return-value]

    return decorate
