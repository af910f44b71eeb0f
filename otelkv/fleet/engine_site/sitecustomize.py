"""Start-up hook of the reference fleet's engine processes (see ``otelkv.fleet.engine_hooks``).

The fleet puts this directory first on each engine's ``PYTHONPATH``, so Python runs this
module when any process of the engine starts (API server, engine core, workers). It
applies the settings the environment asks for, then runs the ``sitecustomize`` this one
shadows, if the interpreter has one (found on ``sys.path`` past every spelling of this
directory, and run once).
"""

import importlib.machinery
import importlib.util
import os
import sys

_RAN = "_otelkv_fleet_sitecustomize_ran"


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin is None:
        return
    if os.path.realpath(spec.origin) == os.path.realpath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if not getattr(sys, _RAN, False):
    setattr(sys, _RAN, True)
    try:
        from otelkv.fleet import engine_hooks

        engine_hooks.install()
    except Exception as exc:  # noqa: BLE001 - an engine must start whatever happens here
        sys.stderr.write(f"otelkv fleet: engine start-up settings not applied: {exc!r}\n")
    try:
        _run_shadowed_sitecustomize()
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"otelkv fleet: the interpreter's own sitecustomize failed: {exc!r}\n")
