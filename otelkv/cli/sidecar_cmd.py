"""``otelkv sidecar --upstream URL``: run the sidecar in front of an existing router."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

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


def _host_port(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"otelkv sidecar: {flag} wants HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def run_sidecar(args: argparse.Namespace) -> int:
    from otelkv.sidecar.app import Sidecar, SidecarConfig, default_store_path
    from otelkv.sidecar.proxy_process import ProxyStartError
    from otelkv.store.base import StoreError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = _host_port(args.listen, "--listen")
    admin_host, admin_port = _host_port(args.admin_listen, "--admin-listen")
    config = SidecarConfig(
        upstream=args.upstream,
        host=host,
        port=port,
        admin_host=admin_host,
        admin_port=admin_port,
        store_path=Path(args.store) if args.store else default_store_path(),
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
    try:
        sidecar = Sidecar(config).start()
    except StoreError as exc:
        print(f"otelkv sidecar: {exc}", file=sys.stderr)
        return 2
    except ProxyStartError as exc:  # the message names the port or the bad upstream URL
        print(exc, file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"otelkv sidecar: cannot listen: {exc}", file=sys.stderr)
        return 2
    print(f"otelkv sidecar: send agent traffic to {sidecar.url} (forwarded to {config.upstream})")
    print(f"  engines and agents export spans to {sidecar.otlp_endpoint}")
    print(f"  metrics: {sidecar.admin_url}/metrics   query API: {sidecar.admin_url}/api/v1/")
    print(f"  store: {sidecar.describe_store()}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    code = 0
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
                code = 1
                break
    finally:
        sidecar.stop()
    return code
