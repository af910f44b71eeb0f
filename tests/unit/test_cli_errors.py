"""Every ``otelkv`` command fails with one line on stderr and the exit code of docs/cli.md.

0 ok · 1 the answer is a failure · 2 bad arguments or input · 3 not found · 4 unreachable or
failed at run time · 130 interrupted. Commands run in-process through
:func:`otelkv.cli.main.main` (the same top-level handler the console script runs); a few run
as subprocesses, the only way to see that the interpreter printed no traceback.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

import pytest

from otelkv.analysis.sources import InMemorySource
from otelkv.cli import main as cli_main
from otelkv.cli import query_cmds, source
from otelkv.cli.main import main
from tests.unit.test_report import lapse_conversation, quick_conversation

OK, FAILED, USAGE, NOT_FOUND, UNAVAILABLE, INTERRUPTED = 0, 1, 2, 3, 4, 130
"""The table of docs/cli.md, written out here rather than imported from the code under test."""

SPANS = lapse_conversation() + quick_conversation()
"""Two conversations: conv-lapse (turns 0 and 1) and conv-quick (turns 0 and 1)."""


def free_url() -> str:
    """An address nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def call(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``otelkv ARGV`` run in this process."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: --help, --version, bad arguments
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    """The single stderr line of a failed command (no traceback, no exception class dump)."""
    lines = [line for line in err.splitlines() if not line.startswith("reading run ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "Error:" not in err, err
    return lines[0]


def in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Query commands read SPANS through the local querier (the same path as a store)."""
    monkeypatch.setattr(query_cmds, "resolve", lambda **kw: source.LocalQuerier(InMemorySource(SPANS)))


# ------------------------------------------------------------------ the cases of issue 15


def test_sidecar_url_that_is_not_a_url_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = call(["slow", "--sidecar", "not-a-url"], capsys)
    assert code == USAGE
    assert one_line(err) == "otelkv slow: --sidecar wants an http(s)://HOST:PORT URL, got 'not-a-url'"


@pytest.mark.parametrize(
    "argv",
    [["slow"], ["conversation", "conv-1"], ["why", "conv-1#0"], ["tune"]],
    ids=["slow", "conversation", "why", "tune"],
)
def test_unreachable_clickhouse_exits_4(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    url = free_url()
    code, out, err = call([*argv, "--clickhouse", url], capsys)
    assert code == UNAVAILABLE and out == ""
    line = one_line(err)
    assert line.startswith(f"otelkv {argv[0]}: cannot reach ClickHouse {url}")
    assert "StoreError" not in line


def test_compare_with_an_unreachable_clickhouse_exits_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = free_url()
    code, _, err = call(["compare", url, str(tmp_path)], capsys)
    assert code == UNAVAILABLE
    line = one_line(err)
    assert line.startswith(f"otelkv compare: cannot read run A: cannot reach ClickHouse {url}")


def test_missing_store_given_with_store_is_not_found(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nonexistent"
    code, _, err = call(["slow", "--store", str(missing)], capsys)
    assert code == NOT_FOUND
    line = one_line(err)
    assert line.startswith(f"otelkv slow: no store at {missing}:")
    # --store was passed: the message must not tell the user to pass it, nor talk of a sidecar it never asked.
    assert "no sidecar answered" not in line and "or pass --store" not in line


def test_compare_on_a_file_says_it_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "passwd"
    a_file.write_text("root:x:0:0::/root:/bin/sh\n")
    code, _, err = call(["compare", str(a_file), str(tmp_path)], capsys)
    assert code == USAGE
    line = one_line(err)
    assert (
        line
        == f"otelkv compare: {a_file} is a file, not a store directory: pass the directory the sidecar writes to"
    )
    assert "Errno" not in line


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--upstream", "not-a-url"], "--upstream must be an http(s)://host[:port] URL, got 'not-a-url'"),
        (["--upstream", "http://127.0.0.1:9", "--listen", "garbage"], "--listen wants HOST:PORT"),
        (["--upstream", "http://127.0.0.1:9", "--admin-listen", "127.0.0.1:70000"], "--admin-listen wants"),
        (["--upstream", "http://127.0.0.1:9", "--retention-days", "0"], "--retention-days must be"),
        (["--upstream", "http://127.0.0.1:9", "--engine", "prefill:8000"], "--engine wants an http(s)"),
        (["--upstream", "http://router:8000/v1"], "--upstream URL must not have a path"),
    ],
    ids=["upstream", "listen", "admin-port", "retention", "engine", "upstream-path"],
)
def test_sidecar_validates_every_argument_before_creating_anything(
    extra: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "new" / "store"
    code, out, err = call(["sidecar", *extra, "--store", str(store)], capsys)
    assert code == USAGE and out == ""
    assert one_line(err).startswith(f"otelkv sidecar: {expected}"), err
    assert not (tmp_path / "new").exists()  # no store directory for a refused command


def test_sidecar_store_that_is_a_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "store"
    a_file.write_text("")
    code, _, err = call(["sidecar", "--upstream", "http://127.0.0.1:9", "--store", str(a_file)], capsys)
    assert code == USAGE and "is a file" in one_line(err)


def test_version_comes_from_the_installed_package(capsys: pytest.CaptureFixture[str]) -> None:
    installed = distribution("otelkv").metadata["Version"]
    code, out, _ = call(["--version"], capsys)
    assert code == OK and out.strip() == f"otelkv {installed}"


# ------------------------------------------------------------------ not found, usage, interrupts, bugs


def test_unknown_trace_turn_or_conversation_exits_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    in_memory(monkeypatch)
    unknown_trace = "f" * 32
    assert unknown_trace not in {s.trace_id for s in SPANS}
    for argv, says in (
        (["why", unknown_trace], f"no spans for trace {unknown_trace}"),
        (["why", "conv-quick#5"], "no turn 5 in conversation 'conv-quick'"),
        (["conversation", "conv-missing"], "no turns for conversation 'conv-missing'"),
    ):
        code, out, err = call(argv, capsys)
        assert code == NOT_FOUND and out == "", argv
        assert one_line(err).startswith(f"otelkv {argv[0]}: {says}"), err
    code, out, _ = call(["why", "conv-quick#1", "--json"], capsys)  # the same path finds what is there
    assert code == OK and '"conv-quick"' in out


def test_bad_references_and_times_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    in_memory(monkeypatch)
    for argv, says in (
        (["why", "garbage"], "'garbage' is neither a trace id"),
        (["slow", "--since", "garbage"], "bad time 'garbage'"),
        (["tune", "--since", "garbage"], "bad time 'garbage'"),
        (["doctor", "--since", "garbage"], "bad time 'garbage'"),
        (["slow", "--limit", "0"], "--limit must be at least 1"),
    ):
        code, _, err = call(argv, capsys)
        assert code == USAGE, argv
        assert one_line(err).startswith(f"otelkv {argv[0]}: {says}"), err


@pytest.mark.parametrize(
    "argv",
    [["why"], ["conversation"], ["compare", "only-a"], ["sidecar"], ["slow", "--limit", "x"], []],
    ids=["why", "conversation", "compare", "sidecar", "limit", "no-command"],
)
def test_missing_or_malformed_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = call(argv, capsys)
    assert code == USAGE and out == "" and "error:" in err and "Traceback" not in err


def test_store_directory_states(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = call(["slow", "--store", str(a_file)], capsys)
    assert code == USAGE and "is a file, not a store directory" in one_line(err)
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = call(["conversation", "c", "--store", str(empty)], capsys)
    assert code == NOT_FOUND and "is not an otelkv store" in one_line(err)
    assert list(empty.iterdir()) == []  # asking did not create a store there


def test_unreadable_store_exits_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import types

    def open_store(**kw: Any) -> Any:  # what chDB raises on a directory it may not read
        raise PermissionError(13, "Permission denied", str(kw.get("path")))

    (tmp_path / "metadata").mkdir()
    monkeypatch.setitem(sys.modules, "otelkv.store", types.SimpleNamespace(open_store=open_store))
    code, _, err = call(["slow", "--store", str(tmp_path)], capsys)
    assert code == UNAVAILABLE
    assert one_line(err).startswith(f"otelkv slow: cannot open the store {tmp_path}: ")


def test_sidecar_that_is_not_a_sidecar_exits_4(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as server:  # accepts, then closes without a word: not HTTP
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        import threading

        def serve() -> None:
            conn, _ = server.accept()
            conn.recv(65536)
            conn.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        code, _, err = call(["slow", "--sidecar", url], capsys)
        thread.join(10)
    assert code == UNAVAILABLE and f"sidecar at {url} is unreachable" in one_line(err)


def test_dashboards_push_to_an_unreachable_grafana_exits_4(capsys: pytest.CaptureFixture[str]) -> None:
    url = free_url()
    code, _, err = call(["dashboards", "push", "--url", url, "--timeout", "5"], capsys)
    assert code == UNAVAILABLE
    assert one_line(err).startswith(f"otelkv dashboards: cannot reach Grafana at {url}")
    code, _, err = call(["dashboards", "push", "--url", "grafana:3000"], capsys)
    assert code == USAGE and "must start with http://" in one_line(err)


def test_dashboards_build_into_a_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "out"
    a_file.write_text("")
    code, _, err = call(["dashboards", "build", "--out", str(a_file)], capsys)
    assert code == USAGE and one_line(err) == f"otelkv dashboards: --out {a_file} is a file: give a directory"


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--ttl", "0"],
        ["demo", "--workdir", "FILE"],
        ["fleet", "--port", "70000"],
        ["fleet", "--workdir", "FILE"],
    ],
    ids=["demo-ttl", "demo-workdir", "fleet-port", "fleet-workdir"],
)
def test_demo_and_fleet_refuse_bad_values_before_starting_engines(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    code, out, err = call([str(a_file) if a == "FILE" else a for a in argv], capsys)
    assert code == USAGE and "starting" not in out
    assert one_line(err).startswith(f"otelkv {argv[0]}: ")


def handled(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    """``otelkv slow``'s handler raises ``exc``."""

    def handler(args: argparse.Namespace, out: Any = None) -> int:
        raise exc

    monkeypatch.setattr(query_cmds, "run_slow", handler)


@pytest.mark.parametrize(
    ("exc", "expected_code", "says"),
    [
        (KeyboardInterrupt(), INTERRUPTED, "otelkv slow: interrupted"),
        (
            RuntimeError("boom\nsecond line"),
            UNAVAILABLE,
            "otelkv slow: unexpected error (RuntimeError: boom second",
        ),
        (
            ModuleNotFoundError("No module named 'chdb'"),
            UNAVAILABLE,
            "otelkv slow: a package this command needs",
        ),
        (PermissionError(13, "Permission denied", "/x"), UNAVAILABLE, "otelkv slow: Permission denied (/x)"),
        (source.NotFoundError("no such thing"), NOT_FOUND, "otelkv slow: no such thing"),
        (source.UnavailableError("down"), UNAVAILABLE, "otelkv slow: down"),
        (source.QueryError("bad"), USAGE, "otelkv slow: bad"),
    ],
    ids=["interrupt", "bug", "missing-extra", "oserror", "not-found", "unavailable", "usage"],
)
def test_top_level_handler(
    exc: BaseException,
    expected_code: int,
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    handled(monkeypatch, exc)
    code, _, err = call(["slow"], capsys)
    assert code == expected_code
    assert err.startswith(says) and err.count("\n") == 1 and "Traceback" not in err


def test_a_closed_pipe_is_not_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    handled(monkeypatch, BrokenPipeError(32, "Broken pipe"))
    code, _, err = call(["slow"], capsys)
    assert code == OK and err == ""


def test_every_command_goes_through_the_handler() -> None:
    """Each subcommand, and each action of one, sets ``handler``: none bypasses :func:`run`."""

    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(actions[0].choices) if actions else {}

    commands = subcommands(cli_main.build_parser())
    expected = {"slow", "conversation", "why", "tune", "doctor", "compare", "dashboards", "sidecar"}
    assert expected | {"fleet", "demo"} <= set(commands)
    missing = []
    for name, sub in commands.items():
        if sub.get_default("handler") is not None:
            continue  # its actions, if any (fleet record), go through the same handler
        actions = subcommands(sub)
        missing += [f"{name} {a}" for a, p in actions.items() if p.get_default("handler") is None]
        missing += [] if actions else [name]
    assert not missing


# ------------------------------------------------------------------ as a user runs them


@pytest.mark.parametrize(
    ("argv", "expected_code"),
    [
        (["slow", "--sidecar", "not-a-url"], USAGE),
        (["sidecar", "--upstream", "not-a-url", "--no-store"], USAGE),
        (["compare", "FILE", "FILE"], USAGE),
        (["why", "f" * 32, "--store", "MISSING"], NOT_FOUND),
        (["slow", "--clickhouse", "UNREACHABLE"], UNAVAILABLE),
    ],
    ids=["sidecar-url", "upstream", "compare-file", "missing-store", "clickhouse"],
)
def test_no_traceback_from_the_console_script(argv: list[str], expected_code: int, tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    subs = {"FILE": str(a_file), "MISSING": str(tmp_path / "missing"), "UNREACHABLE": free_url()}
    done = subprocess.run(
        [sys.executable, "-m", "otelkv.cli.main", *(subs.get(a, a) for a in argv)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == expected_code, done.stderr
    assert one_line(done.stderr).startswith(f"otelkv {argv[0]}: ")
