"""`fleet up`: bring up Ray, the controller and the agents; run the job to its end.

``run_job`` is the one path every job takes from a validated ``ClusterConfig`` to its end
(`fleet run` builds its config in memory and calls it too)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fleet.controlplane.cli.common import CLUSTER_ENV, SetOpt, load_cluster
from fleet.controlplane.cli.render import console, err_console, print_json
from fleet.controlplane.errors import Interrupted, JobFailedError, JobStoppedError
from fleet.controlplane.lifecycle import JobState

if TYPE_CHECKING:  # the config imports pydantic and gRPC: only `fleet up` itself pays for them
    from fleet.controlplane.config import ClusterConfig
    from fleet.controlplane.controller import Progress as JobProgress
    from fleet.controlplane.store import Store


def _setup_logging(state_dir: Path, verbose: bool) -> Path:
    """Full logs go to <state_dir>/logs/controller.log; warnings also to the terminal."""
    log_dir = state_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "controller.log"
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"))
    term = RichHandler(console=err_console, show_path=False, level=logging.INFO if verbose else logging.WARNING)
    root.handlers[:] = [file_handler, term]
    return path


def up(
    cluster: Annotated[
        Path | None, typer.Option("--cluster", "-c", envvar=CLUSTER_ENV, show_envvar=True,
                                  help="cluster.yaml to run.",
                                  show_default="examples/local.yaml")
    ] = None,
    sets: SetOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the final summary as JSON.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show controller logs.")] = False,
    resume: Annotated[
        str, typer.Option("--resume", metavar="JOB",
                          help="Take JOB up again: one stopped with `fleet stop`, or one whose controller "
                               "died (what it left running is ended). It goes on from its newest valid "
                               "checkpoint under the settings of the file given (--cluster, --set).")
    ] = "",
) -> None:
    """Run the job described in a cluster.yaml until it succeeds, fails for good, or is
    stopped (exit 0, 7, 8). --set overrides a key of the file; FLEET_STORE and
    FLEET_STATE_DIR override store.url and state_dir."""
    from fleet.controlplane.entrypoint import check_entrypoint

    config, cluster = load_cluster(cluster, sets)  # before anything starts: a bad --set is exit 2 at once
    check_entrypoint(config, str(cluster))
    run_job(config, json_out=json_out, verbose=verbose, resume=resume)


def run_job(config: ClusterConfig, *, json_out: bool = False, verbose: bool = False, resume: str = "",
            announce: bool = False) -> None:
    """Run ``config``'s job to its end, as `fleet up` and `fleet run` do: progress bar on
    stderr, Ray's chatter in ``<state_dir>/logs/controller.log``, then the summary (JSON
    with ``json_out``). ``announce``: print the job id alone on stdout's first line as
    soon as it exists. ``resume``: take over that job instead of creating one.

    Returns when the job SUCCEEDED; raises ``JobFailedError`` (FAILED), ``JobStoppedError``
    (STOPPED) or ``Interrupted`` (Ctrl-C). The entrypoint must have passed
    ``check_entrypoint`` already: nothing here may run before that check."""
    # imported here: the other commands need no controller, and start faster without it
    from fleet.controlplane.controller import Controller
    from fleet.controlplane.store import Store

    state_dir = Path(config.state_dir)
    log_path = _setup_logging(state_dir, verbose)
    t0 = time.monotonic()
    with Store(config.store.url) as store:
        bar = Progress(
            TextColumn("[bold]{task.fields[job]}[/]"),
            TextColumn("{task.fields[state]:<10}"),
            TextColumn("attempt {task.fields[attempt]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[msg]}"),
            console=err_console,
            transient=json_out,
            disable=json_out,
            # leave fd-level stdout alone: _stdout_to sends Ray's chatter to the log
            redirect_stdout=False,
            redirect_stderr=False,
        )
        total = config.job.steps if config.job.user_program is None else None  # a program's steps are its own
        task = bar.add_task("job", total=total, job="(new job)", state="PENDING", attempt=0, msg="")
        say: Callable[[str], None] | None = None  # the real stdout, once fd 1 goes to the log
        announced = not announce

        def show(p: JobProgress) -> None:
            nonlocal announced
            if not announced and p.job_id and say is not None:
                announced = True
                say(p.job_id)
            bar.update(task, completed=p.step, job=p.job_id, state=p.state, attempt=p.attempt, msg=p.message)

        def tee(line: str) -> None:  # a rank's output line (job.entrypoint.tee)
            if json_out:  # stdout holds nothing but the summary
                err_console.print(line, markup=False, highlight=False, soft_wrap=True)
            elif say is not None:
                say(line)

        controller = Controller(config, store, config_json=config.model_dump_json(), on_progress=show,
                                resume_job=resume, on_output=tee)
        try:
            with _stdout_to(log_path) as terminal, bar:
                say = _terminal_writer(terminal, bar)
                result = controller.run()
        except KeyboardInterrupt:
            raise Interrupted(
                f"interrupted; job {controller.job_id} stopped and everything it started torn down"
            ) from None
        summary = {
            "job_id": result.job_id,
            "state": result.state.value,
            "attempts": result.attempts,
            "final_step": result.final_step,
            "total_steps": total or 0,
            "reason": result.reason,
            "wall_s": round(time.monotonic() - t0, 3),
            "timings_s": {k: round(v, 3) for k, v in result.timings_s.items()},
            "phases_s": _worker_phases(store, result.job_id),
            "log": str(log_path),
        }
    if json_out:
        print_json(summary)
    else:
        colour = "green" if result.state is JobState.SUCCEEDED else "red"
        steps = f"step {result.final_step}/{total}, " if total else \
            f"last step reported {result.final_step}, " if result.final_step else ""
        console.print(
            f"job [bold]{result.job_id}[/] [{colour}]{result.state.value}[/]: {result.reason}; "
            f"{result.attempts} attempt(s), {steps}{summary['wall_s']:.1f} s"
        )
        console.print(f"inspect: fleet replay {result.job_id}    logs: {log_path}")
    if result.state is JobState.FAILED:
        raise JobFailedError(f"job {result.job_id} failed: {result.reason}",
                             hint=f"`fleet report {result.job_id}` and `fleet replay {result.job_id}` show why")
    if result.state is JobState.STOPPED:
        raise JobStoppedError(f"job {result.job_id} stopped: {result.reason}",
                              hint=f"stopped on purpose (exit code 8, not a failure); "
                                   f"`fleet report {result.job_id}` shows its attempts")


def _terminal_writer(terminal: int, bar: Progress) -> Callable[[str], None]:
    """Print one line on the real stdout (``terminal``, a file descriptor) while fd 1 goes
    to the log: through the live progress bar's console when both are the same terminal
    (so the bar is redrawn below it), else straight to the descriptor (a pipe)."""
    if os.isatty(terminal) and err_console.is_terminal and not bar.disable:
        return lambda line: bar.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def write(line: str) -> None:
        os.write(terminal, f"{line}\n".encode())

    return write


def _worker_phases(store: Store, job_id: str) -> dict[str, float]:
    """Slowest rank's process-group init and restore time, and training time, of attempt 1."""
    phases: dict[str, float] = {}
    statuses = store.worker_status(job_id, attempt=1)
    for state, key in (("PG_READY", "pg_init_s"), ("RESTORED", "restore_s")):
        vals = [s.phase_s for s in statuses if s.state == state and s.phase_s is not None]
        if vals:
            phases[key] = round(max(vals), 3)
    steps = store.steps(job_id, attempt=1, rank=0)
    if steps:
        phases["train_steps_s"] = round(sum(s.step_time_s for s in steps), 3)
        first = [s for s in statuses if s.state == "TRAINING"]
        done = [s for s in statuses if s.state == "FINISHED"]
        if first and done:
            phases["training_wall_s"] = round((max(d.time_ns for d in done) - min(f.time_ns for f in first)) / 1e9, 3)
    return phases


@contextlib.contextmanager
def _stdout_to(path: Path) -> Iterator[int]:
    """Append everything written to fd 1 to ``path`` for a while; yields a descriptor of
    the real stdout, for what must still reach it (the job id of `fleet run`).

    Ray's driver prints cluster messages (e.g. "A worker died ...") straight to stdout;
    while the job runs they belong in the log, not in the terminal between progress
    updates, and `fleet up --json` must print nothing but its JSON.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.close(fd)
    try:
        yield saved
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
