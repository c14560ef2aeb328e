"""Where each rank stands in each group, and whom it waits on there.

A rank *waits* in a group at sequence number ``s`` when its collective ``s`` there is
entered and not completed (the oldest of the trailing run of open entries), or when its
trace *ends* there: gloo retires an op that failed or timed out (a peer died) just as
one that completed, so a retired last op may be where the rank was stopped. An ended
rank counts as waiting only where nothing else explains the stop, i.e. for members that
left no trace (``checks``). It *timed out* there when the dump was written at least the
group's timeout after the op was entered (``RankTrace.dumped_ns``): then the evidence says
so.

A waiter at ``s`` waits on the members that never entered ``s`` (*behind*), else on
members *stuck* in an earlier or the same collective that another member completed
(entered, never completed: a hung kernel, a GPU error), else on members that left no
trace. Those "waiter -> awaited" edges, from every group and from point-to-point ops,
make the wait-for graph the verdict is read from (``controlplane.diagnosis.verdict``).

Counters from the dump's ``pg_status`` stand in for entries that are not there (an
``onlyActive`` dump keeps only open entries; a dump taken while the rank held the GIL
keeps none). gloo's counters also count point-to-point ops, so they are not used as
collective sequence numbers there.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.controlplane.diagnosis.traces import GroupOps, RankTrace

#: A retired op counts as timed out when the dump came this share of its timeout after it.
TIMEOUT_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class Front:
    """One rank's position in one group."""

    entered: int            # newest sequence number entered (0: none)
    open: int | None        # oldest open one of the trailing run (None: all completed)
    ended: bool             # all completed, and the rank's newest entry overall is here
    timed_out: bool         # ended on a retired op the dump says took its whole timeout
    from_status: bool       # counters, not entries, placed it

    @property
    def wait_seq(self) -> int | None:
        """Where the rank waits or was stopped in this group (None: neither)."""
        if self.open is not None:
            return self.open
        return self.entered if self.ended else None

    @property
    def completed(self) -> int:
        """Newest sequence number it completed (a timed-out op does not count)."""
        if self.open is not None:
            return self.open - 1
        return self.entered - 1 if self.timed_out else self.entered


def front(trace: RankTrace, group: str, last_group: str | None) -> Front | None:
    """``trace``'s position in ``group`` (None when it has neither entries nor counters
    there). ``last_group``: the group of the rank's newest entry overall, where a
    timed-out op may have ended it."""
    ops = trace.groups.get(group)
    status = trace.status.get(group)
    if (ops is None or not ops.seqs) and (status is None or status.counts_p2p or status.enqueued <= 0):
        return None
    entered, open_seq = 0, None
    if ops is not None and ops.seqs:
        entered, open_seq = ops.seqs[-1], _trailing_open(ops)
    from_status = False
    if status is not None and not status.counts_p2p:
        if status.enqueued > entered:
            from_status = True
            entered = status.enqueued
            if open_seq is None and status.completed < status.enqueued:
                open_seq = max(status.completed + 1, 1)
        if open_seq is not None and status.completed >= open_seq:
            open_seq = status.completed + 1 if status.completed < entered else None
    ended = open_seq is None and ops is not None and bool(ops.seqs) and last_group == group
    return Front(entered, open_seq, ended, ended and _took_timeout(trace, group, ops), from_status)


def _trailing_open(ops: GroupOps) -> int | None:
    done = ops.done
    i = len(done)
    while i > 0 and not done[i - 1]:
        i -= 1
    return ops.seqs[i] if i < len(done) else None


def _took_timeout(trace: RankTrace, group: str, ops: GroupOps) -> bool:
    timeout_ms = trace.group_timeout_ms.get(group, 0)
    if not trace.dumped_ns or timeout_ms <= 0 or not ops.enter_ns[-1]:
        return False
    return trace.dumped_ns - ops.enter_ns[-1] >= TIMEOUT_SHARE * timeout_ms * 1e6


def last_group(trace: RankTrace) -> str | None:
    """The group of the rank's newest collective entry (by enter time)."""
    best, when = None, -1
    for name, ops in trace.groups.items():
        if ops.seqs and ops.enter_ns[-1] > when:
            best, when = name, ops.enter_ns[-1]
    return best
