"""Exit codes and the errors every ``otelkv`` command reports as one line on stderr.

A command raises one of these errors (or returns an exit code); the top-level handler in
:mod:`otelkv.cli.main` prints ``otelkv COMMAND: MESSAGE`` and exits with the error's
:attr:`CliError.exit_code`. The codes are the same for every command (docs/cli.md), so a
script can tell "you asked wrongly" (2) from "it is not there" (3) from "try again when
the service is back" (4) without reading the message.
"""

from __future__ import annotations

EXIT_OK = 0
"""The command did what was asked."""
EXIT_FAILED = 1
"""The command worked and its answer is a failure (``doctor`` found a failing check,
``dashboards build --check`` found stale files, a demo or recorded run had no good turn)."""
EXIT_USAGE = 2
"""Bad arguments or bad input values (argparse uses 2 as well)."""
EXIT_NOT_FOUND = 3
"""The store, trace, turn or conversation asked for is not there."""
EXIT_UNAVAILABLE = 4
"""Something needed is unreachable or failed at run time: sidecar, ClickHouse, Grafana or
upstream unreachable, the store locked or unreadable, a started process failed, a bug."""
EXIT_INTERRUPTED = 130
"""Interrupted (Ctrl-C), the shell's 128 + SIGINT."""


class CliError(Exception):
    """A failure the user can act on; ``str()`` is the one-line message (no command prefix).

    ``exit_code`` is the class's code unless the constructor is given another one.
    """

    exit_code: int = EXIT_USAGE

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class QueryError(CliError):
    """Bad input to a query command (exit 2); the subclasses below carry the other codes.

    Kept as the name every command module catches and raises.
    """


class NotFoundError(QueryError):
    """The store, trace, turn or conversation asked for is not there (exit 3)."""

    exit_code: int = EXIT_NOT_FOUND


class UnavailableError(QueryError):
    """A sidecar, ClickHouse, Grafana or upstream is unreachable, the store is locked or
    unreadable, or a started process failed (exit 4)."""

    exit_code: int = EXIT_UNAVAILABLE
