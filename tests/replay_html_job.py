"""A job in a real store for the HTML incident report's tests: two attempts of four ranks
(nodes node-0 and node-1), written only through the Store's own methods, as the controller
writes them.

Attempt 1 runs steps 1..12 and ends with a crash of rank 1 (exit code 1); the job restarts
from the checkpoint of step 10. Attempt 2 runs steps 11..20, its ranks declare their groups
(the world "0" and the pairs "1" = {0, 1}, "2" = {2, 3}) and record their collectives:
``WORLD_SEQS`` world all_reduces and pair all_reduces between them; rank ``CULPRIT`` never
enters world collective ``WORLD_SEQS``, in which the three others wait; then the hang
incident. Losses fall from 4.0.

Timestamps are the store's own for attempts (their creation and end) and the builder's
for the records and incidents (an incident is detected ``TICK_S``s after the records it
follows), so everything lands in order on one time axis: the builder waits for the clock
to pass the newest record before it writes what comes after it (a few tens of ms).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.store import Store
from fleet.proto import events_pb2 as pb

RANKS = 4
CULPRIT = 2
WORLD_SEQS = 30
#: Seconds between two records of the simulated job.
TICK_S = 0.001


@dataclass(frozen=True)
class HtmlJob:
    job: str
    culprit: int
    world_seq: int  # the collective the culprit never entered
    incidents: int
    attempts: int


def _past(t_s: float, timeout_s: float = 5.0) -> None:
    """Return once the clock is past ``t_s`` (the records' newest time)."""
    deadline = time.monotonic() + timeout_s
    while time.time() <= t_s:
        assert time.monotonic() < deadline, "the clock did not reach the records' time"
        time.sleep(min(0.005, max(t_s - time.time(), 0.0) + 0.001))


def _steps(job: str, attempt: int, first: int, last: int, t0: float) -> tuple[list[pb.Event], float]:
    events, end = [], t0
    for k, step in enumerate(range(first, last + 1)):
        end = t0 + (k + 1) * 3 * TICK_S
        for r in range(RANKS):
            ev = pb.Event()
            s = ev.step
            s.job_id, s.attempt, s.rank, s.step = job, attempt, r, step
            s.loss, s.step_time_s, s.tokens_per_s = 4.0 / (1 + 0.15 * step), 3 * TICK_S, 4096.0
            s.end_ns = int(end * 1e9)
            events.append(ev)
    return events, end


def _collective(job: str, attempt: int, rank: int, group: str, size: int, seq: int, enter_s: float,
                done: bool) -> pb.Event:
    ev = pb.Event()
    c = ev.collective
    c.job_id, c.attempt, c.rank, c.group, c.group_size = job, attempt, rank, group, size
    c.seq, c.op, c.state = seq, "all_reduce", "completed" if done else "started"
    c.input_sizes.add().dims.extend([1024])
    c.output_sizes.add().dims.extend([1024])
    c.input_dtypes.append("float32")
    c.output_dtypes.append("float32")
    c.enter_ns = int(enter_s * 1e9)
    if done:
        c.exit_ns = c.enter_ns + int(0.4 * TICK_S * 1e9)
    return ev


def build(store: Store) -> HtmlJob:
    """Write the job (module docstring) into ``store``."""
    job = store.create_job("html-report", total_steps=40, config_json="{}")
    store.set_job_state(job, JobState.PLACING, "placing")
    store.create_attempt(job)
    store.set_attempt_state(job, 1, AttemptState.RUNNING)
    store.set_job_state(job, JobState.RUNNING, "running")
    for r in range(RANKS):
        store.record_rank(job, 1, r, f"node-{r // 2}", 1000 + r)
    start = store.get_attempts(job)[0].started_at
    events, end = _steps(job, 1, 1, 12, start + 5 * TICK_S)
    store.record_batch("agent-a", 1, 1, events)
    _past(end + 4 * TICK_S)
    store.record_incident(job, 1, "crash", "exit", "rank 1 exited with code 1", rank=1, node="node-0",
                          exit_code=1, detected_at=end + 4 * TICK_S)
    store.set_attempt_state(job, 1, AttemptState.FAILED, "crash: rank 1 on node-0")
    store.record_action(job, 1, "restart", "crash of rank 1")

    store.create_attempt(job)
    store.set_attempt_restored(job, 2, 10)
    store.set_attempt_state(job, 2, AttemptState.RUNNING)
    for r in range(RANKS):
        store.record_rank(job, 2, r, f"node-{r // 2}", 2000 + r)
    start = store.get_attempts(job)[1].started_at + 5 * TICK_S
    events, _ = _steps(job, 2, 11, 20, start)
    for r in range(RANKS):
        pair = ("1", [0, 1]) if r < 2 else ("2", [2, 3])
        for g, desc, members in (("0", "default_pg", list(range(RANKS))), (pair[0], f"pair{pair[0]}", pair[1])):
            events.append(pb.Event(group=pb.ProcessGroupInfo(job_id=job, attempt=2, rank=r, group=g, desc=desc,
                                                             ranks=members)))
        for seq in range(1, WORLD_SEQS + 1):
            at = start + seq * 2 * TICK_S + r * 0.05 * TICK_S
            if not (r == CULPRIT and seq == WORLD_SEQS):
                events.append(_collective(job, 2, r, "0", RANKS, seq, at, done=seq < WORLD_SEQS))
            if seq < WORLD_SEQS:
                events.append(_collective(job, 2, r, pair[0], 2, seq, at + TICK_S, done=True))
    newest = start + WORLD_SEQS * 2 * TICK_S + TICK_S
    store.record_batch("agent-a", 1, 2, events)
    _past(newest + 10 * TICK_S)
    store.record_incident(job, 2, "hang", "hang", f"no rank finished a step; flight recorder: rank {CULPRIT} never "
                          f"entered all_reduce {WORLD_SEQS} of group 0, in which 3 members wait", rank=CULPRIT,
                          node=f"node-{CULPRIT // 2}", detected_at=newest + 10 * TICK_S)
    store.set_attempt_state(job, 2, AttemptState.FAILED, f"hang: rank {CULPRIT} on node-{CULPRIT // 2}")
    store.set_job_state(job, JobState.FAILED, f"hang: rank {CULPRIT}")
    return HtmlJob(job, CULPRIT, WORLD_SEQS, incidents=2, attempts=2)
