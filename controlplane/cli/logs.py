"""`fleet logs`: print the ranks' output of a job's attempt, or follow it as it grows.

The launcher keeps every rank's stdout and stderr in
``<state_dir>/logs/<job>/attempt-<n>/rank-<r>.log``. By default the last attempt that
has logs is shown, every rank one after another in rank order, each line prefixed
``[rank r]`` when more than one rank is shown. ``--follow`` prints lines as they arrive
(interleaved by arrival, through ``logtee.LogTee``) until the attempt or the job ends in
the store, or Ctrl-C. A job, attempt or rank without a log is one line, exit 3.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fleet.controlplane.cli.common import ClusterOpt, StateDirOpt, StoreOpt, open_store, state_dir_of
from fleet.controlplane.errors import Interrupted, NotFoundError
from fleet.controlplane.interrupts import DeferredInterrupt
from fleet.controlplane.logtee import LogTee, rank_logs

if TYPE_CHECKING:
    from fleet.controlplane.store import Store

#: How often `--follow` reads new lines and asks the store whether the attempt ended.
FOLLOW_POLL_S = 0.2
_ATTEMPT_DIR = re.compile(r"^attempt-(\d+)$")


def logs(
    job_id: Annotated[str, typer.Argument(help="The job, as `fleet jobs` lists it.")],
    attempt: Annotated[
        int | None, typer.Option("--attempt", min=1, help="Attempt number \\[default: the last with logs].")
    ] = None,
    rank: Annotated[int | None, typer.Option("--rank", min=0, help="Only this rank \\[default: every rank].")] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines until the attempt ends (or Ctrl-C).")
    ] = False,
    state_dir: StateDirOpt = None,
    store: StoreOpt = None, cluster: ClusterOpt = None,
) -> None:
    """Print the stdout and stderr of a job's ranks (the last attempt by default)."""
    state_dir = state_dir_of(state_dir, cluster)
    number, folder = attempt_log_dir(state_dir, job_id, attempt)
    ranks = rank_logs(folder)
    if rank is not None and rank not in ranks:
        raise NotFoundError(f"job {job_id} attempt {number} has no log for rank {rank} "
                            f"(ranks with logs: {_listing(ranks)})")
    if not follow:
        if not ranks:
            raise NotFoundError(f"job {job_id} attempt {number} has no rank logs in {folder}")
        shown = [rank] if rank is not None else list(ranks)
        for r in shown:
            print_log(ranks[r], _out, prefix=f"[rank {r}] " if len(shown) > 1 else "")
        return
    if store is None and cluster is None:  # `fleet run`'s layout: the store is in the state folder
        store = f"sqlite:///{state_dir / 'fleet.db'}"
    with open_store(store, cluster) as st:
        follow_logs(st, job_id, number, folder, rank, _out_now)


def attempt_log_dir(state_dir: Path, job_id: str, attempt: int | None) -> tuple[int, Path]:
    """(attempt number, its log folder): ``attempt``'s, or the highest-numbered one;
    ``NotFoundError`` when the job or that attempt has no logs."""
    job_dir = state_dir / "logs" / job_id
    found: dict[int, Path] = {}
    if "/" not in job_id and job_id not in ("", ".", "..") and job_dir.is_dir():
        found = {int(m.group(1)): p for p in job_dir.iterdir()
                 if (m := _ATTEMPT_DIR.match(p.name)) and p.is_dir()}
    if not found:
        raise NotFoundError(f"job {job_id}: no logs under {state_dir / 'logs'}",
                            hint="--state-dir (or FLEET_STATE_DIR) names the folder the job ran in: "
                                 "its cluster file's state_dir, or `fleet run --state-dir`")
    if attempt is None:
        attempt = max(found)
    if attempt not in found:
        raise NotFoundError(f"job {job_id} has no logs for attempt {attempt} "
                            f"(attempts with logs: {_listing(found)})")
    return attempt, found[attempt]


def print_log(path: Path, write: Callable[[str], None], prefix: str = "") -> None:
    """``write`` every line of ``path`` (without its newline) after ``prefix``, streamed."""
    with open(path, "rb") as f:
        for raw in f:
            write(prefix + raw.rstrip(b"\n").removesuffix(b"\r").decode("utf-8", errors="replace"))


def follow_logs(store: Store, job_id: str, attempt: int, folder: Path, rank: int | None,
                write: Callable[[str], None], poll_s: float = FOLLOW_POLL_S) -> None:
    """``write`` the attempt's lines as they arrive until the store says the attempt (or
    the job) ended, then what is left; Ctrl-C raises ``Interrupted`` after the same."""
    job = store.get_job(job_id)
    world = _world_size(job.config_json)
    prefix = rank is None and world != 1
    try:
        # Ctrl-C between two polls of the store, never inside one (``interrupts``)
        with DeferredInterrupt() as ctrl_c, \
                LogTee(folder, write, poll_s, ranks=None if rank is None else {rank}, prefix=prefix):
            while not _attempt_ended(store, job_id, attempt):
                ctrl_c.pause(poll_s)
    except KeyboardInterrupt:
        raise Interrupted(f"stopped following the logs of job {job_id} attempt {attempt}") from None


def _attempt_ended(store: Store, job_id: str, attempt: int) -> bool:
    if store.get_job(job_id).state.terminal:
        return True
    return any(a.number == attempt and a.state.terminal for a in store.get_attempts(job_id))


def _world_size(config_json: str) -> int | None:
    """The job's ranks, from the config it was started with (None: unknown)."""
    try:
        job = json.loads(config_json)["job"]
        return int(job["nodes"]) * int(job["ranks_per_node"])
    except (ValueError, KeyError, TypeError):
        return None


def _listing(numbers: dict[int, Path]) -> str:
    return ", ".join(map(str, sorted(numbers))) or "none"


def _out(line: str) -> None:
    sys.stdout.write(line + "\n")


def _out_now(line: str) -> None:
    """``_out`` for lines that arrive while following: each is shown at once."""
    _out(line)
    sys.stdout.flush()
