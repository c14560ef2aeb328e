"""A graceful stop of a job (`fleet stop`): the ranks save and leave, then teardown.

``Stopper.stop`` carries out a stop request (``LiveJob.request_stop``) on the running
attempt, for ``attempts.AttemptRunner``:

1. the watchdog pauses (ranks leaving on purpose are no hang, their exits no crash) and
   a ``stop`` action row is stored with who asked and why;
2. every running rank gets a ``stop`` command through its node's agent. The built-in
   trainer's ranks agree on it inside the next step's all-reduce, save a checkpoint of
   that step and return (``workers/train.py``). A program's ranks get it in their
   session, which sends the program SIGTERM, as torchrun does: a program that saves a
   checkpoint on SIGTERM keeps its own (fleet does not see it);
3. it waits for the ranks, up to ``job.stop_timeout_s``, and kills any still running;
   a trainer rank that fails meanwhile leaves its peers in the step's all-reduce, so
   they are wound down at once;
4. the agents are flushed, so that the checkpoint's event is in the store, and the
   attempt ends STOPPED with a reason naming who stopped it and what was saved:
   ``stopped by operator alice@host: maintenance; checkpoint at step 40``.

Ranks still starting (restoring, joining the process group) take the command with their
first report and stop after their first step, with its checkpoint. A stop while no
attempt runs (``Stopper.between``: placing, waiting for nodes, backing off before a
restart) ends the job at once. ``LiveJob.stop_phase`` says how far it got
("checkpointing" / "signalled" / "tearing down"), for `fleet status` and `fleet stop`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from fleet.controlplane.agent_server import AgentRegistry
from fleet.controlplane.config import JobConfig
from fleet.controlplane.errors import UnavailableError
from fleet.controlplane.job_control import LiveJob
from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.runtime import Agents, RankFailure, Workers
from fleet.controlplane.store import Store
from fleet.controlplane.watchdog import Watchdog
from fleet.proto import events_pb2
from fleet.workers.failures import signal_name

log = logging.getLogger(__name__)

#: How often the ranks are polled while they stop, seconds.
POLL_INTERVAL_S = 0.05
#: How long the peers of a trainer rank that failed while stopping get to leave.
WIND_DOWN_S = 3.0
#: How long the agents get to deliver what the ranks sent as they left (the checkpoint).
FLUSH_TIMEOUT_S = 5.0


class Stopper:
    """Carries out a job's stop (see the module docstring); ``progress(message)`` shows
    how far it got."""

    def __init__(self, job_config: JobConfig, store: Store, job: LiveJob, *, registry: AgentRegistry,
                 agents: Agents, watchdog: Watchdog, progress: Callable[[str], None]) -> None:
        self._cfg = job_config
        self._builtin = job_config.user_program is None
        self._store = store
        self._job = job
        self._registry = registry
        self._agents = agents
        self._watchdog = watchdog
        self._progress = progress

    def stop(self, group: Workers, attempt: int) -> tuple[JobState, str]:
        """Stop the running ``attempt``; returns the job's end state and reason."""
        job, timeout_s = self._job, self._cfg.stop_timeout_s
        self._watchdog.pause()
        self._store.record_action(job.job_id, attempt, "stop", job.stop_reason)
        t0 = time.monotonic()
        told = self._send_stop(group, attempt)
        failures: list[RankFailure] = []
        if told:
            phase = "checkpointing" if self._builtin else "signalled"
            job.set_stop_phase(phase)
            self._progress(f"stopping: {phase} (up to {timeout_s:g} s, job.stop_timeout_s)")
            deadline = t0 + timeout_s
            while not group.finished and time.monotonic() < deadline:
                failures += group.poll(min(POLL_INTERVAL_S, max(0.0, deadline - time.monotonic())))
                # a program's ranks end by SIGTERM; a trainer rank that fails leaves its peers
                # waiting in the step's all-reduce
                if failures and self._builtin:
                    failures += group.wind_down(WIND_DOWN_S)
                    break
        left = group.running()
        if left:
            group.kill()
        job.set_stop_phase("tearing down")
        self._progress("stopping: tearing down")
        self._agents.flush(timeout_s=FLUSH_TIMEOUT_S)
        final = self._store.last_step(job.job_id, attempt)
        self._store.set_attempt_final_step(job.job_id, attempt, final)
        took_s = time.monotonic() - t0
        if not told:
            how = "no agent could carry the stop command to the ranks: they were killed"
        elif self._builtin:
            how = self._checkpoint_outcome(final, left, failures)
        else:
            how = program_outcome(failures, len(group.returned()), left, timeout_s, took_s)
        if self._builtin and (not told or left or failures):
            how += "; " + self._newest_checkpoint()
        reason = f"{job.stop_reason}; {how}"
        log.warning("attempt %d stopped in %.2f s: %s", attempt, took_s, reason)
        self._store.set_attempt_state(job.job_id, attempt, AttemptState.STOPPED, reason)
        return JobState.STOPPED, reason

    def between(self) -> tuple[JobState, str]:
        """A stop while no attempt runs (placing, waiting for nodes, backing off): at once."""
        job = self._job
        self._store.record_action(job.job_id, job.attempt, "stop", job.stop_reason)
        job.set_stop_phase("tearing down")
        return JobState.STOPPED, f"{job.stop_reason}; no attempt was running; {self._newest_checkpoint()}"

    def _send_stop(self, group: Workers, attempt: int) -> list[int]:
        """Hand the stop command to every running rank's agent; returns the ranks it reached
        (for the trainer one is enough: the ranks agree on it)."""
        told = []
        for rank in group.running():
            node = group.placement[rank].name
            try:
                self._registry.send(node, events_pb2.Command(
                    command_id=uuid.uuid4().hex[:12], job_id=self._job.job_id, attempt=attempt, rank=rank,
                    stop=True))
                told.append(rank)
            except UnavailableError as exc:
                log.warning("stop: rank %d not told: %s", rank, exc)
        return told

    def _checkpoint_outcome(self, final: int, left: list[int], failures: list[RankFailure]) -> str:
        """What became of the built-in trainer's stop checkpoint."""
        if failures:
            first = failures[0]
            return f"rank {first.rank} failed while stopping ({first.error}); the rest were ended"
        if left:
            return (f"rank(s) {left} did not stop within {self._cfg.stop_timeout_s:g} s (job.stop_timeout_s) "
                    f"and were killed after step {final}")
        if self._cfg.checkpoint_interval <= 0:
            return f"no checkpoint (job.checkpoint_interval is 0); stopped after step {final}"
        ckpt = self._store.latest_valid_checkpoint(self._job.job_id)
        if ckpt is not None and ckpt.step == final:
            return f"checkpoint at step {final}"
        return f"stopped after step {final}, whose checkpoint did not reach the store"

    def _newest_checkpoint(self) -> str:
        newest = self._store.latest_valid_checkpoint(self._job.job_id)
        return f"newest valid checkpoint at step {newest.step}" if newest else "no valid checkpoint"


def program_outcome(failures: list[RankFailure], exited_ok: int, left: list[int], timeout_s: float,
                    took_s: float) -> str:
    """How a program's ranks took their SIGTERM: ``exited_ok`` ranks returned (exit code
    0), ``failures`` ended otherwise, ``left`` were still running at the timeout."""
    codes: dict[str, int] = {"exit code 0": exited_ok} if exited_ok else {}
    for f in failures:
        code = "failed" if f.exit_code is None else f"exit code {f.exit_code}" if f.exit_code >= 0 else \
            signal_name(f.exit_code) or f"signal {-f.exit_code}"
        codes[code] = codes.get(code, 0) + 1
    out = "every rank's program was sent SIGTERM (it keeps its own checkpoint, if it saves one then)"
    if left:
        return out + f"; rank(s) {left} still ran after {timeout_s:g} s (job.stop_timeout_s) and were killed"
    ended = ", ".join(f"{n} {code}" for code, n in sorted(codes.items()))
    return out + f" and ended within {took_s:.1f} s" + (f" ({ended})" if ended else "")
