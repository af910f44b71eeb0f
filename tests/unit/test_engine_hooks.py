"""The reference fleet's engine start-up settings (``otelkv.fleet.engine_hooks``).

The pure parts are tested here in-process; the start-up path (the ``sitecustomize`` on
``PYTHONPATH``, NIXL's real ``_api`` module) in a fresh interpreter, the way an engine
process starts. That the fleet's transfers, expiries and retentions still happen with
these settings is what every test under ``tests/fleet`` checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from otelkv.fleet import engine_hooks
from otelkv.fleet.engines import Engine, EngineSpec


def test_progress_thread_is_turned_off_on_every_new_config() -> None:
    class Config:
        def __init__(self, enable_prog_thread: bool = True, num_threads: int = 0) -> None:
            self.enable_pthread = enable_prog_thread
            self.num_threads = num_threads

    api = types.ModuleType("fake_api")
    api.nixl_agent_config = Config  # type: ignore[attr-defined]
    assert engine_hooks.without_progress_thread(api)
    assert not engine_hooks.without_progress_thread(api), "patched twice"
    config = Config(enable_prog_thread=True, num_threads=4)
    assert config.enable_pthread is False
    assert config.num_threads == 4
    assert not engine_hooks.without_progress_thread(types.ModuleType("no_config"))


def _call_from(module_name: str, fn: object, *args: object) -> None:
    """Call ``fn(*args)`` from code whose module ``__name__`` is ``module_name``."""
    exec("fn(*args)", {"__name__": module_name, "fn": fn, "args": args})


def test_only_vllms_nixl_worker_pinning_is_redirected() -> None:
    calls: list[tuple[int, set[int]]] = []
    pin = engine_hooks.pinning_to({0}, lambda pid, mask: calls.append((pid, set(mask))))
    _call_from("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", pin, 0, [1])
    _call_from("vllm.utils.numa_utils", pin, 0, [1])
    _call_from("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", pin, 1234, [1])
    assert calls == [(0, {0}), (0, {1}), (1234, {1})]


@pytest.mark.parametrize(("text", "cores"), [("0", {0}), ("0,2", {0, 2}), (" 1 ,", {1})])
def test_cores_parse(text: str, cores: set[int]) -> None:
    assert engine_hooks.parse_cores(text) == cores


@pytest.mark.parametrize("text", ["", ",", "-1", "one"])
def test_bad_cores_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        engine_hooks.parse_cores(text)


def test_a_core_the_process_may_not_use_leaves_vllms_choice(capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[set[int]] = []

    def setaffinity(pid: int, mask: object) -> None:
        if set(mask) == {99}:  # type: ignore[call-overload]
            raise OSError(22, "Invalid argument")
        calls.append(set(mask))  # type: ignore[call-overload]

    pin = engine_hooks.pinning_to({99}, setaffinity)
    _call_from("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", pin, 0, [1])
    assert calls == [{1}]
    assert "left on vLLM's core(s)" in capsys.readouterr().err


def test_install_never_raises_and_wraps_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = os.sched_setaffinity
    engine_hooks.install({engine_hooks.KV_CORE_ENV: "not-a-core"})
    assert os.sched_setaffinity is before
    assert "left on vLLM's core" in capsys.readouterr().err
    monkeypatch.setattr(os, "sched_setaffinity", before)  # restored after the test
    engine_hooks.install({engine_hooks.KV_CORE_ENV: "0"})
    wrapped = os.sched_setaffinity
    assert wrapped is not before
    engine_hooks.install({engine_hooks.KV_CORE_ENV: "0"})
    assert os.sched_setaffinity is wrapped


def test_the_vllm_line_that_pins_is_still_where_the_hook_looks() -> None:
    """If vLLM moves or changes its pinning call, the redirect would silently do nothing."""
    import importlib.util

    pytest.importorskip("vllm")
    spec = importlib.util.find_spec("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    assert spec is not None and spec.origin is not None
    assert spec.name.endswith(engine_hooks._PINNING_MODULE_SUFFIX)
    assert "os.sched_setaffinity(0, " in Path(spec.origin).read_text()


def _spec(**kw: object) -> EngineSpec:
    return EngineSpec(role="prefill", engine_id="p", model_dir=Path("/m"), cpu_core=0, **kw)  # type: ignore[arg-type]


def test_engine_environment_carries_the_settings(tmp_path: Path) -> None:
    env = Engine(_spec(), tmp_path / "log").environment()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(engine_hooks.SITE_DIR)
    assert env[engine_hooks.PROGRESS_THREAD_ENV] == "0"
    assert env[engine_hooks.KV_CORE_ENV] == "0"
    assert (engine_hooks.SITE_DIR / "sitecustomize.py").is_file()


def test_engine_started_as_vllm_does_gets_none_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(engine_hooks.PROGRESS_THREAD_ENV, "0")  # inherited from a parent fleet
    monkeypatch.setenv(engine_hooks.KV_CORE_ENV, "0")
    env = Engine(_spec(nixl_progress_thread=True, own_kv_core=False), tmp_path / "log").environment()
    assert engine_hooks.PROGRESS_THREAD_ENV not in env
    assert engine_hooks.KV_CORE_ENV not in env
    assert str(engine_hooks.SITE_DIR) not in env.get("PYTHONPATH", "")


def test_a_pythonpath_of_the_spec_keeps_the_hooks_first(tmp_path: Path) -> None:
    env = Engine(_spec(env={"PYTHONPATH": "/opt/extra"}), tmp_path / "log").environment()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(engine_hooks.SITE_DIR), "/opt/extra"]


PROBE = """
import json, os, sys
from nixl._api import nixl_agent_config
config = nixl_agent_config(num_threads=4, capture_telemetry=True)
print(json.dumps({"progress_thread": config.enable_pthread, "num_threads": config.num_threads,
                  "setaffinity_wrapped": os.sched_setaffinity.__module__ != "posix",
                  "other_site": getattr(sys.modules.get("sitecustomize"), "OTHER", None)
                  or os.environ.get("OTHER_SITE_RAN")}))
"""


def _probe(env: dict[str, str]) -> dict[str, object]:
    pytest.importorskip("nixl")
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_fresh_engine_interpreter_creates_nixl_agents_without_the_progress_thread(tmp_path: Path) -> None:
    """The real start-up path: ``sitecustomize`` from ``PYTHONPATH``, NIXL's real ``_api``."""
    other = tmp_path / "other_site"
    other.mkdir()
    (other / "sitecustomize.py").write_text(
        "import os\nos.environ['OTHER_SITE_RAN'] = os.environ.get('OTHER_SITE_RAN', '') + 'yes'\n"
    )
    alias = tmp_path / "same_site"  # this directory again under another name: must not recurse
    alias.symlink_to(engine_hooks.SITE_DIR)
    env = Engine(_spec(), tmp_path / "log").environment()
    env["PYTHONPATH"] += os.pathsep + str(alias) + os.pathsep + str(other)
    found = _probe(env)
    assert found == {
        "progress_thread": False,
        "num_threads": 4,
        "setaffinity_wrapped": True,
        "other_site": "yes",  # the sitecustomize it shadows still runs, once
    }


def test_without_the_settings_nixl_keeps_its_default(tmp_path: Path) -> None:
    env = Engine(_spec(nixl_progress_thread=True, own_kv_core=False), tmp_path / "log").environment()
    found = _probe(env)
    assert found["progress_thread"] is True
    assert found["setaffinity_wrapped"] is False
