"""How a command ends: exit codes (docs/cli.md), the errors reported without a traceback, the one-line
``error:`` message."""

from __future__ import annotations

import sys

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CLIError(Exception):
    """Reported as ``error: <message>`` (exit 1), without a traceback."""
    exit_code = EXIT_FAIL


class UsageError(CLIError):
    """A bad combination of options (exit 2)."""
    exit_code = EXIT_USAGE


def one_line(message) -> str:
    return " ".join(str(message).split())


def err(message) -> None:
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
