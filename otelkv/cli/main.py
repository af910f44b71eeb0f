"""``otelkv`` command line. Each subcommand lives in its own module and is imported lazily,
so ``otelkv --help`` works without the heavy extras installed.

Every subcommand runs through :func:`run`, the one place that turns an exception into one
line on stderr (``otelkv COMMAND: what happened and what to do``) and an exit code of
:mod:`otelkv.cli.errors`; no command prints a traceback. The codes are listed in docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from otelkv.cli.errors import (
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
)

MAX_MESSAGE_CHARS = 500
"""A message longer than this is cut: one line on a terminal, not a dump of a server's reply."""


def package_version() -> str:
    """The installed distribution's version (what pip installed), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("otelkv")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from otelkv import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otelkv",
        description="Observability for multi-turn agent traffic on disaggregated vLLM fleets.",
        epilog="Exit codes: 0 ok, 1 the answer is a failure (doctor), 2 bad arguments, 3 not found, "
        "4 unreachable or failed at run time, 130 interrupted (docs/cli.md).",
    )
    parser.add_argument("--version", action="version", version=f"otelkv {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="start the reference fleet, run an agent workload, show what the spans recorded",
        description="Starts a real prefill/decode vLLM pair (CPU build) with the instrumented "
        "NixlConnector, drives agent conversations with short and long tool waits, and prints "
        "per-turn prefill decisions, KV transfers and retention from the engines' spans.",
    )
    demo.add_argument("--ttl", type=float, default=15.0, help="decoder_kv_blocks_ttl in seconds (default 15)")
    demo.add_argument(
        "--long-pause", type=float, default=18.0, help="tool wait longer than the TTL (default 18)"
    )
    demo.add_argument("--workdir", help="where logs and spans.jsonl go (default: a new temp dir)")
    demo.add_argument("--json", action="store_true", help="print the turn summaries as JSON")
    demo.set_defaults(handler=_run_demo)

    from otelkv.cli.fleet_cmd import add_fleet_command

    add_fleet_command(sub)

    from otelkv.cli.sidecar_cmd import add_sidecar_command

    add_sidecar_command(sub)
    from otelkv.cli.query_cmds import add_query_commands

    add_query_commands(sub)
    from otelkv.cli.tune_cmd import add_tune_command

    add_tune_command(sub)
    from otelkv.cli.doctor_cmd import add_doctor_command

    add_doctor_command(sub)
    from otelkv.cli.funnel_cmd import add_funnel_command

    add_funnel_command(sub)
    from otelkv.cli.compare_cmd import add_compare_command

    add_compare_command(sub)
    from otelkv.cli.dashboards_cmd import add_dashboards_command

    add_dashboards_command(sub)
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Unwind normally on SIGTERM, so context managers stop every process they started.
    raise SystemExit(128 + signum)


def _run_demo(args: argparse.Namespace) -> int:
    from otelkv.cli.demo import run_demo

    return run_demo(args)


def _prog(args: argparse.Namespace) -> str:
    """``otelkv COMMAND [ACTION]``, the prefix of the command's error lines."""
    words = ["otelkv", str(getattr(args, "command", "") or "")]
    for attr in ("dashboards_command", "fleet_command"):
        if getattr(args, attr, None):
            words.append(str(getattr(args, attr)))
    return " ".join(w for w in words if w)


def _instance_of(exc: BaseException, module: str, name: str) -> bool:
    """``isinstance(exc, module.name)`` without importing ``module`` (if it was never imported,
    nothing raised its exception): the handler must not pull in vLLM or chDB to classify."""
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and isinstance(exc, cls)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:MAX_MESSAGE_CHARS]


def explain(exc: Exception) -> tuple[int, str]:
    """The exit code and the one-line message for an exception no command turned into a
    :class:`CliError`: known failures of the layers below get their code and their own
    message; anything else is a bug, reported with its class so that it can be found."""
    if _instance_of(exc, "otelkv.analysis.report", "NotFound"):
        return EXIT_NOT_FOUND, _one_line(str(exc))
    for module, name in (
        ("otelkv.store.base", "StoreError"),
        ("otelkv.sidecar.proxy_process", "ProxyStartError"),
        ("otelkv.fleet.engines", "EngineStartError"),
    ):
        if _instance_of(exc, module, name):
            return EXIT_UNAVAILABLE, _one_line(str(exc).removeprefix("otelkv sidecar: "))
    if isinstance(exc, ImportError):
        return EXIT_UNAVAILABLE, _one_line(
            f"a package this command needs is missing ({exc}): install otelkv with the extra it needs, "
            "e.g. pip install 'otelkv[sidecar]' (docs/cli.md lists them)"
        )
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return EXIT_UNAVAILABLE, _one_line(f"{exc.strerror or exc}{where}")
    if isinstance(exc, MemoryError):
        return EXIT_UNAVAILABLE, "out of memory: try a shorter window (--since) or a smaller --limit"
    return EXIT_UNAVAILABLE, _one_line(
        f"unexpected error ({type(exc).__name__}: {exc}); this is a bug in otelkv, please report it "
        "with the command line"
    )


def run(args: argparse.Namespace) -> int:
    """Run the parsed command through its ``handler``: its exit code, or the code and one line
    on stderr for whatever it raised (docs/cli.md). ``SystemExit`` passes through (SIGTERM)."""
    prog = _prog(args)
    handler = getattr(args, "handler", None)
    if handler is None:  # a command without an action, e.g. `otelkv dashboards`
        print(f"{prog}: missing action: see `{prog} --help`", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(handler(args))
    except CliError as exc:
        print(f"{prog}: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`otelkv slow | head -1`): what it read was right. Point stdout
        # at /dev/null so that the interpreter's final flush does not fail once more.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file descriptor (captured)
            pass
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, never a traceback
        code, message = explain(exc)
        print(f"{prog}: {message}", file=sys.stderr)
        return code


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (argparse exits 2 on bad arguments, 0 for --help and --version) and run."""
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
