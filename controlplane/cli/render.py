"""The one table renderer: every listing prints as a Rich table, or as JSON with --json.
Also the CLI's other output conventions: an error as two lines on stderr (``print_error``)
and a spinner on stderr while a long step runs (``progress``); stdout carries only results."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fleet.workers.failures import signal_name


def _console(stderr: bool = False) -> Console:
    probe = Console(stderr=stderr)
    # piped output (logs, CI, `| less`) would otherwise be squeezed into 80 columns
    return probe if probe.is_terminal else Console(stderr=stderr, width=160)


console = _console()
err_console = _console(stderr=True)


def print_error(message: str, hint: str = "") -> None:
    """``error: <message>`` and, when there is one, ``hint: <hint>`` (dim) on stderr: one
    line each, whatever the terminal's width; brackets in either are text, not markup."""
    err_console.print(Text.assemble(("error:", "red"), " ", " ".join(message.splitlines())),
                      highlight=False, soft_wrap=True)
    if hint:
        err_console.print(Text.assemble("hint: ", " ".join(hint.splitlines()), style="dim"),
                          highlight=False, soft_wrap=True)


@contextlib.contextmanager
def progress(message: str) -> Iterator[Callable[[str], None]]:
    """A spinner with ``message`` on stderr while the block runs; yields a function that
    replaces the message. Only on a terminal: a pipe, a log or CI gets nothing, and
    stdout (a --json document) never does."""
    if not err_console.is_terminal:
        yield lambda _message: None
        return
    with err_console.status(Text(message), spinner="dots") as status:
        yield lambda text: status.update(Text(text))


def print_json(data: Any) -> None:
    """Machine-readable output: one JSON document on stdout, nothing else."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for i, c in enumerate(columns):
        # the first column is the key users copy (a job id, a rank): never cut it
        t.add_column(c, justify="right" if c.startswith("#") else "left", no_wrap=i == 0, overflow="fold")
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    return t


def print_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    console.print(table(title, columns, rows))


def fmt_time(ts: float | None) -> str:
    if not ts:
        return "-"
    import datetime as dt

    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def exit_text(code: int | None) -> str:
    """A process's exit status as people read it: ``exit code 1``, ``killed by signal 9
    (SIGKILL)`` for a negative code (how Python reports a signal death); "" when unknown."""
    if code is None:
        return ""
    if code >= 0:
        return f"exit code {code}"
    name = signal_name(code)
    return f"killed by signal {-code} ({name})" if name else f"killed by signal {-code}"


#: How many lines of a traceback the text views show (the end, where the error is).
TRACEBACK_LINES = 10


def print_traceback(text: str, lines: int = TRACEBACK_LINES, indent: str = "    ") -> None:
    """The last ``lines`` lines of a traceback, indented under what it belongs to."""
    all_lines = text.rstrip("\n").splitlines()
    if len(all_lines) > lines:
        console.print(f"{indent}...", highlight=False, markup=False)
    for line in all_lines[-lines:]:
        console.print(f"{indent}{line}", highlight=False, markup=False, soft_wrap=True)


def step_text(done: int, total: int) -> str:
    """``step 120/300``; for a program of yours (no total): ``step 120``, or "" before any step."""
    if total:
        return f"step {done}/{total}, "
    return f"step {done}, " if done else ""
