"""The arms of ``bench/proxy_comparison.py``: the proxies it starts in front of one upstream.

Every proxy runs in the foreground from a config written to a temporary directory, so the
machine's own services and configs play no part:

* ``nginx``: one worker, upstream keep-alive, ``proxy_http_version 1.1``,
  ``proxy_buffering off`` (and no request limit on kept-alive connections on either side,
  as the sidecar has none).
* ``haproxy``: ``nbthread 1``, ``mode http``, ``http-reuse always``.
* ``sidecar`` / ``sidecar-nostore``: ``otelkv sidecar`` with its chDB store, or ``--no-store``.

nginx and HAProxy come from Debian (``apt-get install`` when missing, said on stderr).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from proxy_load import cpu_seconds, start_sidecar, start_upstream, wait_http

from otelkv.fleet.engines import free_port

ARMS = ("direct", "nginx", "haproxy", "sidecar", "sidecar-nostore")

NGINX_CONF = """\
{user}worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 1000000;
    upstream backend {{
        server 127.0.0.1:{upstream};
        keepalive {keepalive};
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""

HAPROXY_CONF = """\
global
    nbthread 1
    maxconn 4096
defaults
    mode http
    http-reuse always
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend bench
    bind 127.0.0.1:{port}
    default_backend upstream
backend upstream
    server up 127.0.0.1:{upstream}
"""


@dataclass
class Arm:
    name: str
    url: str
    roles: dict[str, list[psutil.Process]] = field(default_factory=dict)
    """The proxy's processes by role (empty for direct): their CPU is the arm's."""
    admin: str | None = None
    """The sidecar's admin address (metrics)."""
    store: str | None = None
    sent: int = 0
    """Requests the client sent through this arm, warm-up included."""

    def cpu(self) -> dict[str, float]:
        return {role: cpu_seconds(procs) for role, procs in self.roles.items()}


def binary(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/sbin") / name) if p.exists()), None
    )


def ensure_installed(packages: list[str]) -> None:
    """apt-get install the Debian packages whose binary (same name) is missing."""
    missing = [p for p in packages if binary(p) is None]
    if not missing:
        return
    print(f"installing {' '.join(missing)} with apt-get (Debian packages)", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", *missing]
    if subprocess.run(install, env=env, stdout=sys.stderr).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, stdout=sys.stderr, check=True)
        subprocess.run(install, env=env, stdout=sys.stderr, check=True)


def version(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    return (out.stdout + out.stderr).strip().splitlines()[0]


class Fleet:
    """The upstream and every arm's processes; stops them all on exit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.arms: list[Arm] = []
        self.upstream = ""
        self.upstream_process: psutil.Process | None = None

    def start(self, arms: list[str], concurrency: int) -> None:
        up_port = free_port()
        self.upstream = f"http://127.0.0.1:{up_port}"
        self.procs.append(start_upstream(up_port))
        self.upstream_process = psutil.Process(self.procs[-1].pid)
        wait_http(self.upstream + "/v1/chat/completions")
        start: dict[str, Callable[[], Arm]] = {
            "direct": lambda: Arm("direct", self.upstream),
            "nginx": lambda: self._nginx(up_port, concurrency),
            "haproxy": lambda: self._haproxy(up_port),
            "sidecar": lambda: self._sidecar("sidecar", store=True),
            "sidecar-nostore": lambda: self._sidecar("sidecar-nostore", store=False),
        }
        for name in arms:
            self.arms.append(start[name]())

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        self.procs.append(proc)
        return proc

    def _ready(self, name: str, url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
        """Wait until ``url`` answers; else raise with the end of the arm's log."""
        try:
            wait_http(url, timeout)
        except TimeoutError:
            log = (self.tmp / f"{name}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name} did not start (exit code {proc.poll()}):\n{log}") from None

    def _nginx(self, upstream: int, concurrency: int) -> Arm:
        port = free_port()
        conf = self.tmp / "nginx.conf"
        user = "user root;\n" if os.geteuid() == 0 else ""  # workers must reach the temp dir
        keepalive = max(64, concurrency)
        conf.write_text(
            NGINX_CONF.format(user=user, tmp=self.tmp, upstream=upstream, port=port, keepalive=keepalive)
        )
        nginx = binary("nginx") or "nginx"
        proc = self._spawn("nginx", [nginx, "-e", "stderr", "-p", str(self.tmp), "-c", str(conf)])
        url = f"http://127.0.0.1:{port}"
        self._ready("nginx", url + "/v1/chat/completions", proc)
        master = psutil.Process(proc.pid)
        return Arm("nginx", url, {"master": [master], "worker": master.children(recursive=True)})

    def _haproxy(self, upstream: int) -> Arm:
        port = free_port()
        conf = self.tmp / "haproxy.cfg"
        conf.write_text(HAPROXY_CONF.format(upstream=upstream, port=port))
        proc = self._spawn("haproxy", [binary("haproxy") or "haproxy", "-db", "-f", str(conf)])
        url = f"http://127.0.0.1:{port}"
        self._ready("haproxy", url + "/v1/chat/completions", proc)
        main = psutil.Process(proc.pid)
        return Arm("haproxy", url, {"haproxy": [main, *main.children(recursive=True)]})

    def _sidecar(self, name: str, store: bool) -> Arm:
        port, admin_port = free_port(), free_port()
        store_dir = tempfile.mkdtemp(prefix="store-", dir=self.tmp) if store else None
        with open(self.tmp / f"{name}.log", "wb") as log:
            proc = start_sidecar(self.upstream, port, admin_port, store_dir, log=log)
        self.procs.append(proc)
        admin, url = f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{port}"
        self._ready(name, admin + "/api/v1/health", proc, timeout=60)
        self._ready(name, url + "/v1/chat/completions", proc)
        main = psutil.Process(proc.pid)
        roles = {"main": [main], "proxy": main.children(recursive=True)}
        return Arm(name, url, roles, admin=admin, store=store_dir)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
