"""`fleet jobs`: the jobs in the store; `fleet stop`: stop the running job gracefully.

`fleet stop JOB` asks the running controller (its controller.json in the state folder,
ControlService ``StopJob``) to stop the job: the ranks save a checkpoint and leave, then
the controller tears down (``controlplane.stopping``). By default it waits, a spinner on
stderr saying how far the stop got, until the job is STOPPED and its controller has gone,
bounded by ``--timeout``. Exit codes: 0 stopped; 3 no such job; 4 the job had already
ended (how is said), or ended otherwise while stopping; 6 no controller running or
reachable, or the stop did not finish within ``--timeout``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fleet.controlplane.cli.common import ClusterOpt, JsonOpt, StateDirOpt, StoreOpt, open_store, state_dir_of
from fleet.controlplane.cli.render import console, err_console, fmt_time, print_json, print_table, progress
from fleet.controlplane.errors import ConfigError, FleetError, NotFoundError, StateError, UnavailableError

if TYPE_CHECKING:
    from fleet.controlplane.cli.status import StatusSource
    from fleet.controlplane.status import Status

#: How often `fleet stop` asks how far the stop got, seconds.
STOP_POLL_S = 0.25
#: What `fleet stop` allows, on top of job.stop_timeout_s, for the checkpoint's commit and
#: the teardown (agents, Ray), seconds.
TEARDOWN_ALLOWANCE_S = 60.0
_ENDED = ("SUCCEEDED", "FAILED", "STOPPED")


def jobs(store: StoreOpt = None, cluster: ClusterOpt = None, json_out: JsonOpt = False) -> None:
    """List jobs, newest first."""
    with open_store(store, cluster) as st:
        records = st.list_jobs()
    rows = [
        {
            "id": j.id,
            "name": j.name,
            "state": j.state.value,
            "steps_completed": j.steps_completed,
            "total_steps": j.total_steps,
            "attempts": j.attempts,
            "created_at": j.created_at,
            "ended_at": j.ended_at,
            "reason": j.reason,
        }
        for j in records
    ]
    if json_out:
        print_json(rows)
        return
    print_table(
        None,
        ["job", "name", "state", "steps", "attempts", "created", "reason"],
        [
            [r["id"], r["name"], r["state"], f"{r['steps_completed']}/{r['total_steps']}",
             r["attempts"], fmt_time(r["created_at"]), r["reason"]]
            for r in rows
        ],
    )


def stop(
    job: Annotated[str, typer.Argument(help="The job to stop (`fleet status` shows the running one).")],
    reason: Annotated[str, typer.Option("--reason", help="Why (stored in the job's reason).")] = "",
    timeout: Annotated[float | None, typer.Option(
        "--timeout", help="Seconds to wait for the job to stop \\[default: job.stop_timeout_s + 60].")] = None,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Ask the controller and return at once.")] = False,
    json_out: JsonOpt = False,
    state_dir: StateDirOpt = None,
    store: StoreOpt = None, cluster: ClusterOpt = None,
) -> None:
    """Stop a running job gracefully: its ranks save a checkpoint and leave, then the
    controller tears down; `fleet up` then exits with code 8 (STOPPED)."""
    from fleet.controlplane.auth import operator  # imports gRPC (TLS): only the stop pays for it
    from fleet.controlplane.cli.status import StatusSource

    if timeout is not None and not 0 < timeout <= 86400:
        raise ConfigError(f"--timeout: must be in (0, 86400] seconds (got {timeout:g})")
    t0 = time.monotonic()
    with StatusSource(state_dir_of(state_dir, cluster), store, cluster) as source:
        client = source.client()
        if client is None:
            path = source.state_dir / "controller.json"
            raise _no_controller(source, job, f"the controller {path} names does not accept connections"
                                 if path.exists() else f"no controller is running ({path} does not exist)")
        try:
            reply = client.stop_job(job, reason.strip(), requested_by=operator())
        except UnavailableError as exc:
            raise _no_controller(source, job, str(exc)) from None
        if no_wait:
            _asked(job, reply.attempt, reply.stop_timeout_s, json_out)
            return
        limit_s = timeout if timeout is not None else reply.stop_timeout_s + TEARDOWN_ALLOWANCE_S
        final, gone = _wait_stopped(source, job, t0 + limit_s, limit_s)
    _stopped(final, gone, time.monotonic() - t0, json_out)


def _no_controller(source: StatusSource, job: str, why: str) -> FleetError:
    """The error when no controller answers: the store says whether the job exists (3) or
    has ended (4); else it is 6, with what to do."""
    try:
        record = source.store().get_job(job)
    except NotFoundError as exc:
        if "no store at" in str(exc):  # no store either: nothing to tell but the controller's absence
            record = None
        else:
            return NotFoundError(f"job {job} not found (and {why})")
    if record is not None and record.state.terminal:
        return StateError(f"job {job} has already ended: {record.state.value}"
                          + (f" ({record.reason})" if record.reason else ""),
                          hint=f"nothing to stop; `fleet report {job}` shows how it went")
    state = f" (the store says it is {record.state.value})" if record is not None else ""
    return UnavailableError(
        f"cannot stop job {job}{state}: {why}",
        hint="is `fleet up` running? --state-dir / FLEET_STATE_DIR name its folder; if its controller died, "
             f"`fleet up --resume {job}` takes the job over")


def _wait_stopped(source: StatusSource, job: str, deadline: float, limit_s: float) -> tuple[Status, bool]:
    """Poll until the job has ended and its controller has gone (spinner on stderr);
    returns (its last status, whether the controller went within the time)."""
    last: Status | None = None
    with progress(f"stopping {job}: asked the controller") as say:
        while True:
            try:
                last = source.get(job)
            except NotFoundError as exc:
                if last is None or "no store at" not in str(exc):
                    raise
                raise UnavailableError(f"the controller of job {job} went away before it said how the job "
                                       f"ended, and {exc}", hint="name the job's store (--store URL, FLEET_STORE "
                                       "or --cluster FILE): `fleet status JOB` then shows how it ended") from None
            if last.job.state in _ENDED:
                break
            if time.monotonic() >= deadline:
                raise UnavailableError(
                    f"job {job} did not stop within {limit_s:g} s (--timeout); it is {last.job.state}"
                    + (f", {last.job.stopping}" if last.job.stopping else ""),
                    hint=f"it goes on stopping: `fleet status {job} --watch` follows it; the controller kills "
                         "ranks still running after job.stop_timeout_s")
            say(f"stopping {job}: {last.job.stopping or 'asked the controller'} "
                f"(attempt {last.job.attempt}, step {last.job.step})")
            time.sleep(STOP_POLL_S)
        say(f"stopping {job}: tearing down")
        path = source.state_dir / "controller.json"
        while _controller_of(path, job) and time.monotonic() < deadline:
            time.sleep(STOP_POLL_S)
    if source.client() is None and last.live:  # the store has the final word once the controller is gone
        try:
            last = source.get(job)
        except FleetError:
            pass
    return last, not _controller_of(path, job)


def _controller_of(path: Path, job: str) -> bool:
    """Whether controller.json still names a controller of ``job``."""
    try:
        return json.loads(path.read_text()).get("job_id") == job
    except (OSError, ValueError):
        return False


def _asked(job: str, attempt: int, stop_timeout_s: float, json_out: bool) -> None:
    if json_out:
        print_json({"job_id": job, "state": "STOPPING", "attempt": attempt, "stop_timeout_s": stop_timeout_s})
        return
    within = f" (up to {stop_timeout_s:g} s)" if stop_timeout_s else ""
    console.print(f"stopping job [bold]{job}[/] (attempt {attempt}): its ranks save a checkpoint and leave"
                  f"{within}, then teardown; `fleet status {job}` follows it", highlight=False)


def _stopped(s: Status, controller_exited: bool, waited_s: float, json_out: bool) -> None:
    j = s.job
    if j.state != "STOPPED":
        raise StateError(f"job {j.job_id} ended {j.state} before the stop took effect: {j.reason}",
                         hint=f"`fleet report {j.job_id}` shows how it went")
    out = {"job_id": j.job_id, "state": j.state, "reason": j.reason, "checkpoint_step": j.checkpoint_step,
           "checkpoint_at_stop": j.checkpoint_step is not None and j.checkpoint_step == j.step,
           "final_step": j.step, "attempt": j.attempt, "waited_s": round(waited_s, 3),
           "controller_exited": controller_exited}
    if json_out:
        print_json(out)
        return
    console.print(f"job [bold]{j.job_id}[/] [yellow]STOPPED[/]: {j.reason} ({waited_s:.1f} s)", highlight=False)
    if not controller_exited:
        err_console.print("[yellow]warning:[/] its controller was still tearing down when --timeout ran out",
                          highlight=False)
