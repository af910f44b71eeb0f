"""``otelkv sidecar --upstream URL``: run the sidecar in front of an existing router.

Every argument is checked before anything is created or started (no store directory, no
process, no listener for a command that is refused): bad values exit 2; a store that is
locked, a port that is taken or a proxy process that fails exits 4 (docs/cli.md).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import logging
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from otelkv.cli.errors import EXIT_OK, EXIT_UNAVAILABLE, UnavailableError
from otelkv.cli.source import QueryError, check_url
from otelkv.sidecar.identity import MAX_ID_CHARS

PROXY_CHECK_S = 0.2
"""How often the command checks that its proxy process is still there."""


def add_sidecar_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "sidecar",
        help="transparent proxy in front of the router: turn spans, OTLP receiver, store, query API",
        description="Proxies OpenAI-compatible requests to --upstream byte for byte, opens one turn "
        "span per agent turn, receives engine and agent spans over OTLP/HTTP, keeps them in the "
        "embedded store (chDB, the OpenTelemetry Collector ClickHouse schema) or a ClickHouse "
        "server, and serves /metrics and the query API used by `otelkv slow|conversation|why`.",
    )
    p.add_argument(
        "--upstream", required=True, help="the router (or engine) to forward to, e.g. http://router:8000"
    )
    p.add_argument("--listen", default="127.0.0.1:8800", help="proxy address (default 127.0.0.1:8800)")
    p.add_argument(
        "--admin-listen",
        default="127.0.0.1:8801",
        help="OTLP receiver (/v1/traces), /metrics and query API address (default 127.0.0.1:8801)",
    )
    store = p.add_mutually_exclusive_group()
    store.add_argument(
        "--store", help="embedded store directory (default $OTELKV_STORE or ~/.local/share/otelkv/store)"
    )
    store.add_argument(
        "--clickhouse", help="ClickHouse HTTP URL instead of the embedded store, e.g. http://ch:8123"
    )
    store.add_argument("--no-store", action="store_true", help="keep no spans (metrics and proxying only)")
    p.add_argument(
        "--retention-days", type=int, default=7, help="drop stored spans after this many days (default 7)"
    )
    p.add_argument(
        "--body-conversation-id",
        action="store_true",
        help="also add conversation_id to request bodies (for routers that key on the body)",
    )
    p.add_argument(
        "--no-session-header", action="store_true", help="do not add X-Session-ID to upstream requests"
    )
    p.add_argument(
        "--no-body-context",
        action="store_true",
        help="do not write the turn's traceparent and conversation id into completion bodies' "
        "vllm_xargs (they reach the engines through routers that drop headers)",
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="an engine's HTTP address (repeatable): `otelkv doctor` reads its /metrics",
    )
    p.add_argument(
        "--router-handle-ttl",
        type=float,
        metavar="SECONDS",
        help="how long the router keeps a decode handle, for `otelkv doctor` "
        "(routers without spans do not say)",
    )
    p.add_argument(
        "--conversation-id-max-chars",
        type=int,
        default=MAX_ID_CHARS,
        metavar="N",
        help=f"client conversation ids longer than this are kept as a hash of them (default {MAX_ID_CHARS})",
    )
    p.add_argument(
        "--hash-conversation-ids",
        action="store_true",
        help="keep every client conversation id as a hash of it, never in clear (docs/security.md)",
    )
    p.set_defaults(handler=run_sidecar)


def _host_port(value: str, flag: str) -> tuple[str, int]:
    """(host, port) of ``HOST:PORT`` (an empty host is 127.0.0.1; port 0 picks a free one)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise QueryError(f"{flag} wants HOST:PORT (port 0-65535), got {value!r}")
    return host or "127.0.0.1", int(port)


def _check_store_dir(path: Path) -> None:
    """A directory the sidecar can create or open, checked without creating anything."""
    if path.exists():
        if not path.is_dir():
            raise QueryError(f"--store {path} is a file: give a directory (it is created if missing)")
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            raise UnavailableError(f"--store {path}: no permission to read and write it")
        return
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise QueryError(f"--store {path}: {parent} is a file, so the directory cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UnavailableError(f"--store {path}: no permission to create it in {parent}")


def _check_args(args: argparse.Namespace) -> None:
    """Every argument, before anything is created or started (:class:`QueryError`, exit 2)."""
    from otelkv.sidecar.relay import check_upstream

    try:
        check_upstream(args.upstream)
    except ValueError as exc:
        raise QueryError(f"--{exc}") from None  # "--upstream must be an http(s)://... URL, got ..."
    if args.clickhouse is not None:
        check_url(args.clickhouse, "--clickhouse")
    for url in args.engine:
        check_url(url, "--engine")
    if args.retention_days < 1:
        raise QueryError(f"--retention-days must be at least 1, got {args.retention_days}")
    if args.conversation_id_max_chars < 1:
        raise QueryError(
            f"--conversation-id-max-chars must be at least 1, got {args.conversation_id_max_chars}"
        )
    ttl = args.router_handle_ttl
    if ttl is not None and (not math.isfinite(ttl) or ttl < 0):
        raise QueryError("--router-handle-ttl must be a number of seconds >= 0")


def run_sidecar(args: argparse.Namespace) -> int:
    """Check every argument, start the sidecar, serve until SIGINT/SIGTERM (exit 0) or until
    the proxy process dies (exit 4, so that a supervisor restarts it). After serving, the
    process exits from here (:func:`_exit_without_finalization`); errors before it serves
    return through the CLI's error handler."""
    from otelkv.sidecar.app import Sidecar, SidecarConfig, default_store_path
    from otelkv.sidecar.proxy_process import ProxyStartError
    from otelkv.store.base import StoreError

    _check_args(args)
    # A crash in native code (chDB, uvloop, httptools) prints every thread's Python stack;
    # a stderr without a file descriptor (captured, embedded) gets no such report.
    with contextlib.suppress(OSError, ValueError, RuntimeError, AttributeError):
        faulthandler.enable()
    host, port = _host_port(args.listen, "--listen")
    admin_host, admin_port = _host_port(args.admin_listen, "--admin-listen")
    store_path = Path(args.store).expanduser() if args.store else default_store_path()
    if not args.no_store and not args.clickhouse:
        _check_store_dir(store_path)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = SidecarConfig(
        upstream=args.upstream,
        host=host,
        port=port,
        admin_host=admin_host,
        admin_port=admin_port,
        store_path=store_path,
        clickhouse_url=args.clickhouse,
        store=not args.no_store,
        retention_days=args.retention_days,
        inject_session_header=not args.no_session_header,
        inject_body_conversation_id=args.body_conversation_id,
        inject_body_context=not args.no_body_context,
        conversation_id_max_chars=args.conversation_id_max_chars,
        hash_conversation_ids=args.hash_conversation_ids,
        engine_urls=tuple(args.engine),
        router_handle_ttl_s=args.router_handle_ttl,
    )
    # From here a SIGTERM/SIGINT asks for a clean stop: one that arrives while the sidecar
    # starts or before its banner is read stops it once it is up, still with exit code 0.
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        sidecar = Sidecar(config).start()
    except StoreError as exc:  # locked by another process, unreadable, chDB missing
        raise UnavailableError(" ".join(str(exc).split())) from None
    except ProxyStartError as exc:  # the message names the port that is taken
        raise UnavailableError(str(exc).removeprefix("otelkv sidecar: ")) from None
    except OSError as exc:
        if exc.filename:  # the store directory (its permissions were checked, but may change)
            raise UnavailableError(f"cannot open {exc.filename}: {exc.strerror or exc}") from None
        raise UnavailableError(
            f"cannot listen on the admin address {args.admin_listen}: {exc.strerror or exc}"
        ) from None
    print(f"otelkv sidecar: send agent traffic to {sidecar.url} (forwarded to {config.upstream})")
    print(f"  engines and agents export spans to {sidecar.otlp_endpoint}")
    print(f"  metrics: {sidecar.admin_url}/metrics   query API: {sidecar.admin_url}/api/v1/")
    print(f"  store: {sidecar.describe_store()}", flush=True)
    # What is alive now (imports, chDB, the servers) lives as long as the sidecar: keep the
    # collector's full passes off it, as vLLM's EngineCore and the proxy process do.
    gc.collect()
    gc.freeze()
    code = EXIT_OK
    try:
        # Without the proxy process no request gets through: a sidecar that went on serving
        # health checks would hide that from its supervisor. Stop (the store is flushed and
        # closed cleanly) and exit non-zero, so the supervisor restarts the whole sidecar.
        while not stop.wait(PROXY_CHECK_S):
            if sidecar.proxy.exited.is_set():
                print(
                    "otelkv sidecar: the proxy process exited unexpectedly "
                    f"(exit code {sidecar.proxy.returncode}); stopping so that it can be restarted",
                    file=sys.stderr,
                    flush=True,
                )
                code = EXIT_UNAVAILABLE
                break
    finally:
        sidecar.stop()
    _exit_without_finalization(code)


def _exit_without_finalization(code: int) -> NoReturn:
    """Exit now, skipping the interpreter's finalization and C++ static destructors.

    ``Sidecar.stop`` has flushed and closed the store and stopped both processes' servers:
    nothing is left to save. chDB's embedded engine keeps thread pools that its session's
    close does not join; tearing the engine's globals down under them at exit can kill a
    process that stopped cleanly with SIGSEGV, and a supervisor would then see a crash.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
