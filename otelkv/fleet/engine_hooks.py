"""Two start-up settings of the reference fleet's engines that vLLM does not expose.

The reference fleet runs a prefill and a decode engine on one small CPU-only host (2 cores
in CI). Two things vLLM 0.32 and NIXL 1.5 do there, and that no ``vllm serve`` option
changes, starve the host and the engines themselves:

* **Both engines' NIXL worker threads share one core.** On CPU, vLLM's NIXL worker pins the
  thread that runs the model and posts KV reads to the last core of each NUMA node
  (``base_worker.py``: "reserve different cores for start_load_kv()"), the same core for
  every engine on the host. While the decode node retains a turn's blocks, its engine core
  steps every 1 ms and its worker spins on ``sched_yield`` on that core; the prefill worker,
  woken to post the next turn's read, then waited 30-40 s for that core (three runs of
  three, a turn whose read the decode node's TTL then declined). :data:`KV_CORE_ENV` pins
  each engine's thread to its own core instead (the core its OpenMP threads are bound to).
* **NIXL's UCX progress thread busy-polls.** The Python API creates agents with the
  progress thread on and a poll timeout of 0, so every idle worker burns a whole core.
  With :data:`PROGRESS_THREAD_ENV` = ``0`` the agent has no progress thread and UCX is
  progressed by the calls vLLM makes on every engine step (transfer state, notifications);
  cma reads are one-sided, and an engine that holds blocks for another keeps stepping
  while it does.

What it changes on the reference fleet (2 cores) is measured side by side by
``bench/fleet_idle.py`` (figures in ``docs/performance.md``): an idle pair uses 0.05 cores
instead of 2, pulling turns take about a second instead of 4-12 s at the median, and the
same workload pulls the same tokens, fails the same turn and ends its retentions the same
way.

:func:`install` runs in every process of an engine: ``engine_site/sitecustomize.py``, on
the engines' ``PYTHONPATH``, calls it at interpreter start-up, before vLLM is imported.
Without the two variables it changes nothing. It never raises: a failure leaves vLLM as
it is and says so on stderr (the engine log).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

PROGRESS_THREAD_ENV = "OTELKV_FLEET_NIXL_PROGRESS_THREAD"
"""``0``: create NIXL agents without the UCX progress thread. Unset: NIXL's default."""
KV_CORE_ENV = "OTELKV_FLEET_KV_CORE"
"""Comma-separated cores for the thread vLLM's NIXL worker pins. Unset: vLLM's choice."""
SITE_DIR = Path(__file__).with_name("engine_site")
"""The directory to put first on an engine's ``PYTHONPATH`` (holds the sitecustomize)."""

_NIXL_API_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl_rocm._api")
_PINNING_MODULE_SUFFIX = ".nixl.base_worker"


def _note(message: str) -> None:
    sys.stderr.write(f"otelkv fleet: {message}\n")


def without_progress_thread(api: ModuleType) -> bool:
    """Make ``api.nixl_agent_config`` turn the progress thread off; False if it has none."""
    config_cls = getattr(api, "nixl_agent_config", None)
    if config_cls is None or getattr(config_cls, "_otelkv_no_progress_thread", False):
        return False
    original = config_cls.__init__

    def init_without_progress_thread(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.enable_pthread = False

    config_cls.__init__ = init_without_progress_thread
    config_cls._otelkv_no_progress_thread = True
    return True


SetAffinity = Callable[[int, Iterable[int]], None]


def pinning_to(cores: set[int], setaffinity: SetAffinity) -> SetAffinity:
    """``os.sched_setaffinity`` that pins to ``cores`` when vLLM's NIXL worker pins itself.

    Every other caller gets the call it made: only the one line of vLLM that reserves a
    core for KV transfers is redirected. If ``cores`` cannot be used (not allowed in this
    process), the call vLLM made goes through instead.
    """

    def sched_setaffinity(pid: int, mask: Iterable[int]) -> None:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if pid == 0 and caller.endswith(_PINNING_MODULE_SUFFIX):
            try:
                setaffinity(pid, cores)
            except OSError as exc:
                _note(f"NIXL worker thread left on vLLM's core(s): core(s) {sorted(cores)}: {exc}")
            else:
                _note(f"NIXL worker thread pinned to core(s) {sorted(cores)} instead of {sorted(mask)}")
                return
        setaffinity(pid, mask)

    sched_setaffinity._otelkv_pinning = True  # type: ignore[attr-defined]
    return sched_setaffinity


def parse_cores(text: str) -> set[int]:
    """``"0"`` or ``"0,2"`` as a set of core numbers; ValueError for anything else."""
    cores = {int(part) for part in text.split(",") if part.strip()}
    if not cores or min(cores) < 0:
        raise ValueError(f"{KV_CORE_ENV}={text!r} is not a list of cores")
    return cores


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds NIXL's ``_api`` module as usual and patches it once it has been executed."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in _NIXL_API_MODULES:
            return None
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
        except Exception as exc:  # noqa: BLE001 - then the normal finders import it unpatched
            _note(f"could not look for {name}: {exc!r}")
            return None
        return spec


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, plus the patch after it has executed the module."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        try:
            if without_progress_thread(module):
                _note(f"{module.__name__}: NIXL agents start without the UCX progress thread")
        except Exception as exc:  # noqa: BLE001 - the engine must start whatever happens here
            _note(f"could not turn the NIXL progress thread off: {exc!r}")


def install(environ: Mapping[str, str] | None = None) -> None:
    """Apply what the environment asks for (see the module docstring); never raises.

    Each setting is applied on its own, once per process however often this is called.
    """
    env = os.environ if environ is None else environ
    if env.get(PROGRESS_THREAD_ENV) == "0":
        try:
            for name in _NIXL_API_MODULES:
                if name in sys.modules:
                    without_progress_thread(sys.modules[name])
            if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
                sys.meta_path.insert(0, _PatchAfterImport())
        except Exception as exc:  # noqa: BLE001 - the engine must start whatever happens here
            _note(f"NIXL progress thread left on: {exc!r}")
    if env.get(KV_CORE_ENV):
        try:
            if not getattr(os.sched_setaffinity, "_otelkv_pinning", False):
                os.sched_setaffinity = pinning_to(parse_cores(env[KV_CORE_ENV]), os.sched_setaffinity)
        except Exception as exc:  # noqa: BLE001 - the engine must start whatever happens here
            _note(f"NIXL worker thread left on vLLM's core: {exc!r}")
