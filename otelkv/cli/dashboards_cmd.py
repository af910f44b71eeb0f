"""``otelkv dashboards build`` and ``otelkv dashboards push``: argparse wiring and output.

The work is in :mod:`otelkv.dashboards`; this module parses arguments, reads the
environment (``GRAFANA_URL``, ``GRAFANA_TOKEN``, ``GRAFANA_USER``, ``GRAFANA_PASSWORD``,
``CLICKHOUSE_PASSWORD``) and turns failures into one line on stderr and the exit codes of
:mod:`otelkv.cli.errors`: 2 for bad arguments or rejected credentials, 4 for a Grafana that
cannot be reached or fails, a missing extra or a file that cannot be written, 1 for stale files
under ``build --check``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from otelkv.cli.errors import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE

EXIT_STALE = EXIT_FAILED
EXIT_ERROR = EXIT_USAGE

MISSING_EXTRA = "otelkv dashboards needs the dashboards extra: pip install 'otelkv[dashboards]' ({error})"


def add_dashboards_command(subparsers: Any) -> None:
    """Register ``dashboards build`` and ``dashboards push``; each sets ``handler``."""
    parser = subparsers.add_parser(
        "dashboards",
        help="generate the Grafana dashboards, or push them (and their datasources) to a Grafana",
        description="Grafana dashboards for agent turns, KV reuse and single conversations, "
        "generated from code (grafana-foundation-sdk).",
    )
    sub = parser.add_subparsers(dest="dashboards_command", required=True, metavar="ACTION")

    build = sub.add_parser(
        "build",
        help="regenerate the dashboard JSON and Grafana provisioning files",
        description="Writes the dashboards as sorted JSON plus Grafana provisioning files "
        "(datasources, dashboard provider). With --check, writes nothing and exits 1 when "
        "the files in DIR differ from what the code generates.",
    )
    build.add_argument(
        "--out", metavar="DIR", help="output directory (default: the repository's dashboards/)"
    )
    build.add_argument("--check", action="store_true", help="only compare; exit 1 when files are stale")
    build.set_defaults(handler=run_build)

    push = sub.add_parser(
        "push",
        help="create or update datasources, the folder and the dashboards on a Grafana (idempotent)",
        description="Checks Grafana is reachable, accepts the credentials and is 11.0 or newer, then "
        "creates or updates the datasources given with --datasource, the folder and the "
        "dashboards. A second push with nothing changed changes nothing.",
    )
    push.add_argument(
        "--url", default=os.environ.get("GRAFANA_URL"), help="Grafana's root URL ($GRAFANA_URL)"
    )
    push.add_argument(
        "--token", default=os.environ.get("GRAFANA_TOKEN"), help="service account token ($GRAFANA_TOKEN)"
    )
    push.add_argument(
        "--user", default=os.environ.get("GRAFANA_USER"), help="basic-auth user ($GRAFANA_USER)"
    )
    push.add_argument(
        "--password",
        default=os.environ.get("GRAFANA_PASSWORD"),
        help="basic-auth password ($GRAFANA_PASSWORD)",
    )
    push.add_argument(
        "--folder", default="otelkv", help="folder title (default otelkv; its uid derives from it)"
    )
    push.add_argument(
        "--datasource",
        action="append",
        default=[],
        metavar="KEY=URL",
        help="also create or update a datasource: prometheus=http://prometheus:9090, "
        "clickhouse=clickhouse://user@clickhouse:9000, tempo=http://tempo:3200 (repeatable)",
    )
    push.add_argument(
        "--clickhouse-password",
        default=os.environ.get("CLICKHOUSE_PASSWORD"),
        help="password for the ClickHouse datasource ($CLICKHOUSE_PASSWORD; or in its URL)",
    )
    push.add_argument("--from", dest="source_dir", metavar="DIR", help="push the JSON files in DIR instead")
    push.add_argument(
        "--overwrite", action="store_true", help="replace dashboards even if someone saved them meanwhile"
    )
    push.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request (default 10)")
    push.add_argument("--json", action="store_true", help="print what was done as JSON")
    push.set_defaults(handler=run_push)


def _error(message: str, err: TextIO, code: int = EXIT_ERROR) -> int:
    print(f"otelkv dashboards: {message}", file=err)
    return code


def run_build(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        from otelkv.dashboards import build
    except ImportError as exc:
        return _error(MISSING_EXTRA.format(error=exc), err, EXIT_UNAVAILABLE)
    out_dir = Path(args.out) if args.out else build.DEFAULT_OUT
    if out_dir.exists() and not out_dir.is_dir():
        return _error(f"--out {out_dir} is a file: give a directory", err)
    try:
        return _build(build, out_dir, args.check, out, err)
    except OSError as exc:
        where = exc.filename or out_dir
        verb = "read" if args.check else "write"
        return _error(f"cannot {verb} {where}: {exc.strerror or exc}", err, EXIT_UNAVAILABLE)


def _build(build: Any, out_dir: Path, check: bool, out: TextIO, err: TextIO) -> int:
    """Write the files into ``out_dir`` (0), or with ``check`` compare them (1 when stale)."""
    if check:
        stale = build.stale(out_dir)
        if stale:
            print(
                f"stale in {out_dir}: {', '.join(stale)} (run `otelkv dashboards build` and commit)", file=err
            )
            return EXIT_STALE
        print(f"{out_dir}: up to date", file=out)
        return EXIT_OK
    for path in build.write(out_dir):
        print(path, file=out)
    return EXIT_OK


def _datasource_urls(specs: list[str]) -> dict[str, str]:
    urls: dict[str, str] = {}
    for spec in specs:
        key, sep, url = spec.partition("=")
        if not sep or not url:
            raise ValueError(
                f"--datasource {spec!r}: expected KEY=URL, e.g. prometheus=http://prometheus:9090"
            )
        urls[key.strip()] = url.strip()
    return urls


def _boards(source_dir: str | None) -> list[dict[str, Any]]:
    from otelkv.dashboards import build

    if source_dir is None:
        return [build.to_json(spec.build()) for spec in build.DASHBOARDS]
    files = sorted(Path(source_dir).glob("*.json"))
    if not files:
        raise ValueError(f"no *.json dashboards in {source_dir}")
    boards = []
    for path in files:
        try:
            board = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not a dashboard JSON file ({exc})") from None
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
        if not isinstance(board, dict):
            raise ValueError(f"{path} is not a dashboard JSON file (not an object)")
        boards.append(board)
    return boards


def run_push(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        from otelkv.dashboards.push import Pusher, PushError
    except ImportError as exc:
        return _error(MISSING_EXTRA.format(error=exc), err, EXIT_UNAVAILABLE)
    if not args.url:
        return _error("no Grafana URL: pass --url or set GRAFANA_URL", err)
    try:
        urls = _datasource_urls(args.datasource)
        boards = _boards(args.source_dir)
        pusher = Pusher(
            args.url, token=args.token, user=args.user, password=args.password, timeout_s=args.timeout
        )
        report = pusher.push(
            boards,
            folder_title=args.folder,
            datasource_urls=urls,
            clickhouse_password=args.clickhouse_password,
            overwrite=args.overwrite,
        )
    except PushError as exc:
        return _error(str(exc), err, EXIT_UNAVAILABLE if exc.unreachable else EXIT_ERROR)
    except ValueError as exc:
        return _error(str(exc), err)
    except OSError as exc:
        return _error(
            f"{exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''}", err, EXIT_UNAVAILABLE
        )
    if args.json:
        print(json.dumps(report.__dict__, indent=2, sort_keys=True), file=out)
    else:
        for line in report.lines():
            print(line, file=out)
    return EXIT_OK
