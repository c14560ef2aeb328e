"""The one table renderer: every listing prints as a Rich table, or as JSON with --json."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

def _console(stderr: bool = False) -> Console:
    probe = Console(stderr=stderr)
    # piped output (logs, CI, `| less`) would otherwise be squeezed into 80 columns
    return probe if probe.is_terminal else Console(stderr=stderr, width=160)


console = _console()
err_console = _console(stderr=True)


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
