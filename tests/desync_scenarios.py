"""Real gloo runs that plant one kind of desync each and leave native dumps.

``generate(case, outdir)`` starts the case's ranks (``tests.unit.test_workers_support.Ranks``;
four, or eight for ``dead_rank_tp_dp``) that form a gloo process group on 127.0.0.1 and
the case's ``Layout`` of sub-groups (two pair groups; plus a trio; or tensor- and
data-parallel groups), run a few dozen normal collectives on the world group and on each
rank's groups, then misbehave as ``case`` says; every rank that lives writes its native
flight-recorder dump (``torch._C._distributed_c10d._dump_fr_trace``, pickle; JSON for
``healthy-json``) to ``outdir/fr_dump_<rank>``, the naming torchfrtrace reads.
``CASES`` says what a correct diagnosis of each run is. From a shell:
``python -m tests.desync_scenarios CASE OUTDIR``.

Every rank dumps while its planted collective is still outstanding, as a reporter thread
would: a ``desync-dumper`` thread polls the rank's ring until its own entry for the
planted collective is there (and every earlier entry is retired), then writes the file;
a rank that skips or stalls dumps once everything it issued is retired. Ranks exit only
after all live ranks' files exist (they meet on the rendezvous TCPStore, which keeps
working while the collectives hang), so no hung collective can lose a dump; the planted
collective then ends by the PG timeout or by a peer exiting.

Dead ranks (``Expected.missing_ranks``): the rank SIGKILLs itself once every survivor
waits in its blocking collective, and leaves no file. The survivors' collectives then end
(a direct peer of the dead rank sees "Connection closed by peer" at once, the rest the PG
timeout; a timed-out rank closes that group's connections, so its peers fail next), and
only then do they dump, as a dump on the PG timeout would: their planted entries are
retired, like completed ones, and ``pg_status``'s ``last_completed_collective`` counts
them too. Nothing in a dump names the dead rank; ``dead_rank`` also leaves out the
world all_gathers, whose output shape would give the world size away. Rank 0 serves the
store, so it never dies.

Mismatched sizes or dtypes cannot be planted as a clean hang with gloo: the rank that
receives more bytes than it posted aborts the process (``gloo::EnforceNotMet ...
Received data size doesn't match expected size``, SIGABRT from a transport thread)
within milliseconds, dump or no dump. So in ``size`` and ``dtype`` the majority enters
first and times out (a gloo timeout closes the group's connections), and only then does
the culprit enter: its collective fails at once, so its entry is already retired when it
dumps, while the majority's are not. An op mismatch (``op``) exchanges nothing, so there
all four enter together and all four dump while waiting.

What gloo records in torch 2.13 (found by running these scenarios; format version "2.10"):
  * Collectives only. ``send``/``recv``/``isend``/``irecv`` get no entry, and
    ``p2p_seq_id`` stays 0, ``is_p2p`` False. But ``pg_status`` counts them:
    ``last_enqueued_collective`` / ``last_completed_collective`` run ahead of the
    entries' ``collective_seq_id`` once a group has done point-to-point traffic.
  * ``profiling_name`` is ``gloo:<op>``: all_reduce, all_gather (also for
    all_gather_single / all_gather_into_tensor), broadcast, reduce, gather, all_to_all,
    barrier. ``reduce_scatter_single`` / ``reduce_scatter_tensor`` is recorded as
    ``gloo:all_reduce`` of the whole input (gloo implements it that way).
  * dtypes are c10 names ("Float", "Double"); sizes are lists of shapes;
    all_gather's output is ``[[world, *shape]]``.
  * ``state`` is always "scheduled" and ``time_discovered_*`` are None (JSON: 0);
    ``retired`` is the only completion signal, and it is also set when the collective
    fails (timeout, peer gone): a retired entry is finished, not necessarily successful.
    ``pg_status[g]["last_started_collective"]`` is always -1.
  * ``process_group`` is (name, desc): the world is ("0", "default_pg"), ``new_group``s
    are "1", "2", ... in creation order (on every rank, member or not) with their
    ``group_desc`` (else "undefined").
  * ``pg_status`` is keyed by the rank-local ``pg_id``, not by group name: ranks 2 and 3
    here have ``pg_status["1"]`` for their group "2" (pair23), which is their pg_id 1,
    while ranks 0 and 1 have ``pg_status["1"]`` for group "1" (pair01). Map a key to a
    group through the entries (``pg_id`` -> ``process_group[0]``). Its
    ``last_completed_collective`` can lag behind the entries' ``retired`` flags.
  * ``pg_config`` is useless: one entry keyed "" whose ``ranks`` is "[]" or the world's
    ranks; membership of a group must be inferred from which ranks have entries for it.
  * ``timeout_ms`` is per group: ``new_group`` does not inherit the world's timeout.
  * JSON dumps (``_dump_fr_trace_json``) carry the same entries, ``process_group`` as a
    list, ``pg_status`` values as strings, and an extra ``nccl_comm_state: {}``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

PG_TIMEOUT_S = 3.0
DUMP_PREFIX = "fr_dump_"
FR_BUFFER_SIZE = 2000
ROUNDS = 6            # per round: 4 world collectives (3 without all_gather), 1 all_reduce per own group
NUMEL = 64
COORD_TIMEOUT_S = 30.0  # bound on every wait for the other ranks


@dataclass(frozen=True)
class Layout:
    """The ranks and groups of a run. ``groups`` are created by every rank in this order
    (gloo names them "1", "2", ...), each as (member ranks, ``group_desc``; None for none);
    a rank all_reduces once per round in every group it belongs to. ``all_gather``: the
    normal traffic holds world all_gathers, whose output shape reveals the world size."""

    world_size: int
    groups: tuple[tuple[tuple[int, ...], str | None], ...]
    all_gather: bool = True

    def group_names(self) -> dict[str, tuple[int, ...]]:
        return {str(i): ranks for i, (ranks, _) in enumerate(self.groups, 1)}


#: Pair groups, created by every rank in this order: "1" = ranks 0 and 1, "2" = 2 and 3.
PAIRS = Layout(4, (((0, 1), "pair01"), ((2, 3), "pair23")))
#: Pairs plus a trio "3" = ranks 1, 2, 3 (rank 0 is not in it).
TRIO = Layout(4, (*PAIRS.groups, ((1, 2, 3), "trio123")))
#: Eight ranks, Megatron-style: tensor-parallel pairs "1".."4" (consecutive ranks, described
#: "tp"), data-parallel groups "5" = 0, 2, 4, 6 and "6" = 1, 3, 5, 7 (strided, no description).
TP_DP = Layout(8, (((0, 1), "tp"), ((2, 3), "tp"), ((4, 5), "tp"), ((6, 7), "tp"),
                   ((0, 2, 4, 6), None), ((1, 3, 5, 7), None)))


@dataclass(frozen=True)
class Blame:
    """A finding a correct diagnosis reports at a planted collective: its ``kind``, the
    collective's ``group`` (its sequence number is the run's, ``Scenario.planted``) and the
    ranks it names."""

    kind: str
    group: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Expected:
    """What a correct diagnosis of a case says, and the run's shape: ``findings`` at the
    planted collectives (none for healthy runs), ``missing_ranks`` the ranks that died
    and left no dump (``dead``: they are SIGKILLed)."""

    verdict: str
    culprit_ranks: tuple[int, ...] = ()
    findings: tuple[Blame, ...] = ()
    missing_ranks: tuple[int, ...] = ()
    layout: Layout = PAIRS

    @property
    def kind(self) -> str | None:
        return self.findings[0].kind if self.findings else None

    @property
    def group(self) -> str | None:
        return self.findings[0].group if self.findings else None


def _fault(verdict: str, culprit: int, kind: str, group: str, **kw) -> Expected:
    return Expected(verdict, (culprit,), (Blame(kind, group, (culprit,)),), **kw)


CASES: dict[str, Expected] = {
    "healthy": Expected("ok"),
    "skip": _fault("hang", 2, "missing", "0"),
    "size": _fault("mismatch", 1, "size_mismatch", "0"),
    "op": _fault("mismatch", 3, "op_mismatch", "0"),
    "dtype": _fault("mismatch", 0, "dtype_mismatch", "0"),
    "subgroup-hang": _fault("hang", 1, "missing", "1"),
    "healthy-json": Expected("ok"),
    # Rank 3 dies; no all_gather, so only the pair group "2" (rank 2 alone in the files)
    # says a fourth rank exists.
    "dead_rank": _fault("hang", 3, "no_trace", "0", missing_ranks=(3,),
                        layout=Layout(4, PAIRS.groups, all_gather=False)),
    # Rank 1 dies; rank 0 waits for it in pair "1", ranks 2 and 3 downstream in the world.
    "dead_rank_subgroup": _fault("hang", 1, "no_trace", "1", missing_ranks=(1,)),
    # Rank 3 stalls outside the trio's all_reduce; rank 0 is "ahead" in the world group.
    "blocked_majority": _fault("hang", 3, "missing", "3", layout=TRIO),
    # Ranks 1 and 3 stall at once, each leaving its pair partner waiting.
    "two_culprits": Expected("hang", (1, 3), (Blame("missing", "1", (1,)), Blame("missing", "2", (3,)))),
    # Rank 5 dies; rank 4 waits for it in tp group "3", ranks 1, 3 and 7 in dp group "6",
    # and 0, 2 and 6 downstream in dp group "5" (waiting for rank 4).
    "dead_rank_tp_dp": Expected("hang", (5,), (Blame("no_trace", "3", (5,)), Blame("no_trace", "6", (5,))),
                                missing_ranks=(5,), layout=TP_DP),
}

#: The ranks SIGKILLed in each case (they must be the ones expected missing).
DEAD = {case: exp.missing_ranks for case, exp in CASES.items() if exp.missing_ranks}


@dataclass(frozen=True)
class Scenario:
    """One finished run: where its dumps are and which collectives were planted."""

    case: str
    outdir: Path
    planted: dict[str, int]  # group -> sequence number of the planted collective in it
    elapsed_s: float
    rank_errors: dict[int, str]  # the exception each rank's planted collective ended with
    world_size: int
    dead: tuple[int, ...]    # ranks killed, without a dump

    @property
    def ranks(self) -> list[int]:
        """The ranks that wrote a dump."""
        return [r for r in range(self.world_size) if r not in self.dead]

    @property
    def group(self) -> str | None:
        """The planted collective's group when there is exactly one."""
        return next(iter(self.planted)) if len(self.planted) == 1 else None

    @property
    def seq(self) -> int | None:
        return next(iter(self.planted.values())) if len(self.planted) == 1 else None


def generate(case: str, outdir: Path | str, timeout_s: float = 60.0) -> Scenario:
    """Run ``case`` on local gloo ranks; their dumps land in ``outdir``."""
    from tests.unit.test_workers_support import run_ranks

    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; one of {', '.join(CASES)}")
    layout = CASES[case].layout
    dead = DEAD.get(case, ())
    assert 0 not in dead, "rank 0 serves the rendezvous store: it cannot die"
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results = run_ranks(_rank_main, layout.world_size, (case, str(outdir)), timeout_s=timeout_s,
                        expect_exit={r: -signal.SIGKILL for r in dead})
    files = {r for r in range(layout.world_size) if (outdir / f"{DUMP_PREFIX}{r}").is_file()}
    assert files == set(range(layout.world_size)) - set(dead), f"dumps written by ranks {sorted(files)}"
    planted: dict[str, int] = {}
    for res in results.values():
        for group, seq in res["planted"]:
            assert planted.setdefault(group, seq) == seq, f"ranks disagree on the planted collective of {group}"
    return Scenario(case, outdir, dict(sorted(planted.items())), time.monotonic() - start,
                    {r: res["error"] for r, res in results.items() if res["error"]}, layout.world_size, dead)


# --- inside a rank process ---------------------------------------------------------


def _rank_main(rank: int, world_size: int, port: int, case: str, outdir: str) -> dict:
    """One rank: normal traffic, then the case's fault; returns the planted collectives."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(FR_BUFFER_SIZE)  # before the recorder exists
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    from fleet.workers.rendezvous import loopback_store

    layout = CASES[case].layout
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    store = loopback_store(rank, world_size, port, COORD_TIMEOUT_S)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    groups = {}
    for name, (ranks, desc) in zip(layout.group_names(), layout.groups):
        groups[name] = dist.new_group(list(ranks), timeout=timeout, group_desc=desc)
        if rank in ranks:
            assert dist._get_process_group_name(groups[name]) == name, "groups are not named as assumed"
    mine = [groups[name] for name, ranks in layout.group_names().items() if rank in ranks]
    coord = dist.PrefixStore("desync-scenario/", store)
    alive = [r for r in range(world_size) if r not in DEAD.get(case, ())]
    rank_run = _RankRun(rank, alive, coord, Path(outdir) / f"{DUMP_PREFIX}{rank}",
                        json_dump=case == "healthy-json")
    try:
        _normal_traffic(rank, world_size, mine, layout.all_gather)
        _FAULTS.get(case, _healthy)(rank_run, groups)
        rank_run.finish()
    finally:
        # Left to interpreter exit, a group whose collective failed can abort the
        # process ("terminate called without an active exception").
        dist.destroy_process_group()
    return {"planted": rank_run.planted, "error": rank_run.error}


def _normal_traffic(rank: int, world_size: int, groups: list, with_all_gather: bool) -> None:
    import torch
    import torch.distributed as dist

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    x = torch.full((NUMEL,), float(rank))
    for i in range(ROUNDS):
        dist.all_reduce(x)
        gathered = torch.empty(world_size * NUMEL)
        if with_all_gather:
            all_gather(gathered, x)
        else:
            gathered.fill_(1.0)
        dist.broadcast(x, src=i % world_size)
        shard = torch.empty(NUMEL // world_size)
        reduce_scatter(shard, gathered[:NUMEL].clone())  # recorded as an all_reduce of its input
        for g in groups:
            dist.all_reduce(x, group=g)
        x.div_(world_size * 4.0)


class _RankRun:
    """One rank's dump and the meeting of the live ranks around it (over the TCPStore)."""

    def __init__(self, rank: int, alive: list[int], coord, path: Path, json_dump: bool) -> None:
        self.rank = rank
        self.alive = alive
        self.coord = coord
        self.path = path
        self.json_dump = json_dump
        self.planted: list[tuple[str, int]] = []
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None

    # ring access

    @staticmethod
    def ring() -> dict:
        import torch

        return pickle.loads(torch._C._distributed_c10d._dump_fr_trace(
            includeCollectives=True, includeStackTraces=False, onlyActive=False))

    def next_seq(self, group: str) -> int:
        """The sequence number the next collective on ``group`` will get."""
        seqs = [e["collective_seq_id"] for e in self.ring()["entries"] if e["process_group"][0] == group]
        return max(seqs, default=0) + 1

    def _wait_ring(self, group: str | None, seq: int | None) -> None:
        """Until the entry (group, seq) is in the ring (if given) and every other is retired."""
        deadline = time.monotonic() + COORD_TIMEOUT_S
        while True:
            entries = self.ring()["entries"]
            is_target = [(e["process_group"][0], e["collective_seq_id"]) == (group, seq) for e in entries]
            target = [e for e, hit in zip(entries, is_target) if hit]
            if (group is None or target) and all(e["retired"] for e, hit in zip(entries, is_target) if not hit):
                if target and target[0]["retired"]:
                    raise AssertionError(f"rank {self.rank}: collective {group}#{seq} ended before the dump "
                                         f"(PG timeout {PG_TIMEOUT_S}s too short for this machine?)")
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {self.rank}: after {COORD_TIMEOUT_S}s, collective {group}#{seq} is not "
                                     "in the ring or an earlier one is still unretired")
            time.sleep(0.005)

    def _write_dump(self) -> None:
        import torch

        c10d = torch._C._distributed_c10d
        data = (c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False) if self.json_dump
                else c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False))
        if isinstance(data, str):
            data = data.encode()
        tmp = self.path.with_name(f".tmp-{self.path.name}")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)

    # the dump, then the meeting

    def _dump_and_meet(self, group: str | None, seq: int | None) -> None:
        self._wait_ring(group, seq)
        self._write_dump()
        self.signal("dumped")
        self.wait_all("dumped")

    def dump_now(self) -> None:
        """This rank issued nothing outstanding: dump once it is all retired, meet the others."""
        self._dump_and_meet(None, None)

    def _in_thread(self, work) -> None:
        def run() -> None:
            try:
                work()
            except BaseException as e:  # re-raised by finish() in the rank's main thread
                self._thread_error = e

        self._thread = threading.Thread(target=run, name="desync-dumper", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join(COORD_TIMEOUT_S)
            assert not self._thread.is_alive(), f"rank {self.rank}: dumper thread still running"
            self._thread = None
            if self._thread_error is not None:
                raise self._thread_error

    def dump_when_entered(self, group: str, seq: int) -> None:
        """Start the dumper thread for a collective this thread is about to block in."""
        self._in_thread(lambda: self._dump_and_meet(group, seq))

    def plant(self, group: str, seq: int) -> None:
        """Name a planted collective (what the diagnosis must point at)."""
        self.planted.append((group, seq))

    def blocked_in(self, group: str, seq: int, collective) -> None:
        """Run a collective that must fail, dumping while it is outstanding."""
        self.dump_when_entered(group, seq)
        self.fails(seq, collective)

    def blocked_until_dead(self, group: str, seq: int, collective) -> None:
        """Run a collective that fails once a peer dies; say when it is entered, and dump
        after it ended (as a dump on the PG timeout would)."""
        def entered() -> None:
            self._wait_ring(group, seq)
            self.signal("entered")

        self._in_thread(entered)
        self.fails(seq, collective)
        self._join()
        self.dump_now()

    def die_when_entered(self, ranks: list[int]) -> None:
        """SIGKILL this rank once ``ranks`` are all in their blocking collectives."""
        self.wait_all("entered", ranks)
        os.kill(os.getpid(), signal.SIGKILL)

    def fails(self, seq: int, collective) -> None:
        """Run ``collective`` (number ``seq``), which must raise; keep its error."""
        try:
            collective()
        except RuntimeError as e:  # gloo: timeout, or a peer closed its connection
            self.error = str(e).splitlines()[0][:300]
        else:
            raise AssertionError(f"rank {self.rank}: collective #{seq} succeeded")

    # store meetings

    def signal(self, what: str) -> None:
        self.coord.set(f"{what}/{self.rank}", "1")

    def wait_all(self, what: str, ranks=None) -> None:
        """Until every rank in ``ranks`` (default: all live ranks) signalled ``what``.

        Polls with ``check``: a blocking ``TCPStore.wait`` holds the GIL, which would keep
        the rank's main thread from returning out of its failed collective meanwhile.
        """
        keys = [f"{what}/{r}" for r in (self.alive if ranks is None else ranks)]
        deadline = time.monotonic() + COORD_TIMEOUT_S
        while not self.coord.check(keys):
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {self.rank}: timed out waiting for {keys}")
            time.sleep(0.01)

    def finish(self) -> None:
        """Join the dumper, then leave; rank 0 serves the store, so it leaves last."""
        self._join()
        self.signal("finished")
        if self.rank == 0:
            self.wait_all("finished")


# --- the faults ----------------------------------------------------------------------


def _all_reduce(group=None):
    import torch
    import torch.distributed as dist

    return lambda: dist.all_reduce(torch.ones(NUMEL), group=group)


def _healthy(run: _RankRun, groups: dict) -> None:
    run.dump_now()


def _skip(run: _RankRun, groups: dict) -> None:
    """Rank 2 never calls the last world all_reduce; the others wait in it."""
    seq = run.next_seq("0")
    run.plant("0", seq)
    if run.rank == 2:
        run.dump_now()
    else:
        run.blocked_in("0", seq, _all_reduce())


def _mismatch(run: _RankRun, culprit: int, good, bad) -> None:
    """Every rank enters the same world collective, ``culprit`` with ``bad()``; all
    time out in it."""
    seq = run.next_seq("0")
    run.plant("0", seq)
    run.blocked_in("0", seq, bad if run.rank == culprit else good)


def _late_culprit(run: _RankRun, culprit: int, good, bad) -> None:
    """The others enter ``good()`` and time out in it; only then does ``culprit`` enter
    ``bad()``, which fails at once (see the module docstring for why not together)."""
    seq = run.next_seq("0")
    run.plant("0", seq)
    others = [r for r in run.alive if r != culprit]
    if run.rank != culprit:
        run.blocked_in("0", seq, good)
        run.signal("ended")
    else:
        run.wait_all("ended", others)
        run.fails(seq, bad)
        run.dump_now()


def _size(run: _RankRun, groups: dict) -> None:
    """Rank 1 all_reduces twice the elements the others do."""
    import torch
    import torch.distributed as dist

    _late_culprit(run, 1, lambda: dist.all_reduce(torch.ones(NUMEL)),
                  lambda: dist.all_reduce(torch.ones(2 * NUMEL)))


def _op(run: _RankRun, groups: dict) -> None:
    """Rank 3 broadcasts where the others all_reduce a tensor of the same size."""
    import torch
    import torch.distributed as dist

    _mismatch(run, 3, _all_reduce(), lambda: dist.broadcast(torch.ones(NUMEL), src=0))


def _dtype(run: _RankRun, groups: dict) -> None:
    """Rank 0 all_reduces float64 where the others all_reduce float32 (rank 0 is wrong)."""
    import torch
    import torch.distributed as dist

    _late_culprit(run, 0, lambda: dist.all_reduce(torch.ones(NUMEL, dtype=torch.float32)),
                  lambda: dist.all_reduce(torch.ones(NUMEL, dtype=torch.float64)))


def _subgroup_hang(run: _RankRun, groups: dict) -> None:
    """Rank 1 stalls outside any collective; rank 0 waits for it in the pair group "1";
    ranks 2 and 3 go on to a world all_reduce and wait there for ranks 0 and 1."""
    if run.rank in (0, 1):  # ranks 2 and 3 are not in group "1": they cannot know its seq
        seq = run.next_seq("1")
        run.plant("1", seq)
    if run.rank == 1:
        run.dump_now()
    elif run.rank == 0:
        run.blocked_in("1", seq, _all_reduce(groups["1"]))
    else:
        run.blocked_in("0", run.next_seq("0"), _all_reduce())


def _dead_rank(run: _RankRun, groups: dict) -> None:
    """Ranks 0-2 enter a world all_reduce; rank 3 is SIGKILLed once they all wait in it
    and leaves no dump. Their all_reduce fails (peer gone, or the PG timeout) and they
    dump after that, with its entry retired."""
    seq = run.next_seq("0")
    if run.rank == 3:
        run.die_when_entered([0, 1, 2])
    run.plant("0", seq)
    run.blocked_until_dead("0", seq, _all_reduce())


def _dead_rank_subgroup(run: _RankRun, groups: dict) -> None:
    """Rank 1 dies while rank 0 waits for it in pair "1"'s all_reduce and ranks 2 and 3
    wait downstream in a world all_reduce; the survivors dump after theirs failed."""
    if run.rank == 1:
        run.die_when_entered([0, 2, 3])
    if run.rank == 0:
        seq = run.next_seq("1")
        run.plant("1", seq)
        run.blocked_until_dead("1", seq, _all_reduce(groups["1"]))
    else:
        run.blocked_until_dead("0", run.next_seq("0"), _all_reduce())


def _blocked_majority(run: _RankRun, groups: dict) -> None:
    """Rank 3 stalls outside the trio's all_reduce, where ranks 1 and 2 wait for it;
    rank 0, not in the trio, enters a world all_reduce nobody else issues: it is
    "ahead" only because the majority is blocked elsewhere."""
    if run.rank in (1, 2, 3):
        seq = run.next_seq("3")
        run.plant("3", seq)
    if run.rank == 3:
        run.dump_now()
    elif run.rank in (1, 2):
        run.blocked_in("3", seq, _all_reduce(groups["3"]))
    else:
        run.blocked_in("0", run.next_seq("0"), _all_reduce())


def _two_culprits(run: _RankRun, groups: dict) -> None:
    """Rank 1 never enters pair "1"'s all_reduce, where rank 0 waits; rank 3 never
    enters pair "2"'s, where rank 2 waits: two independent hangs at once."""
    pair = "1" if run.rank in (0, 1) else "2"
    seq = run.next_seq(pair)
    run.plant(pair, seq)
    if run.rank in (1, 3):
        run.dump_now()
    else:
        run.blocked_in(pair, seq, _all_reduce(groups[pair]))


def _dead_rank_tp_dp(run: _RankRun, groups: dict) -> None:
    """One more tp-then-dp step on the 8-rank layout; rank 5 dies before it. Rank 4
    waits for it in tp group "3"; ranks 1, 3 and 7 finish their tp all_reduce and wait
    for it in dp group "6"; ranks 0, 2 and 6 wait in dp group "5" for rank 4 (whose tp
    all_reduce failed, so it never comes) until the PG timeout. All dump afterwards."""
    tp, dp = str(run.rank // 2 + 1), "5" if run.rank % 2 == 0 else "6"
    if run.rank == 5:
        run.die_when_entered(run.alive)
    if run.rank == 4:
        seq = run.next_seq(tp)
        run.plant(tp, seq)
        run.blocked_until_dead(tp, seq, _all_reduce(groups[tp]))
        return
    _all_reduce(groups[tp])()
    seq = run.next_seq(dp)
    if dp == "6":
        run.plant(dp, seq)
    run.blocked_until_dead(dp, seq, _all_reduce(groups[dp]))


_FAULTS = {"skip": _skip, "size": _size, "op": _op, "dtype": _dtype, "subgroup-hang": _subgroup_hang,
           "dead_rank": _dead_rank, "dead_rank_subgroup": _dead_rank_subgroup,
           "blocked_majority": _blocked_majority, "two_culprits": _two_culprits,
           "dead_rank_tp_dp": _dead_rank_tp_dp}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.desync_scenarios", description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=list(CASES))
    parser.add_argument("outdir", type=Path)
    args = parser.parse_args(argv)
    sc = generate(args.case, args.outdir)
    exp = CASES[args.case]
    planted = ", ".join(f"{g}#{s}" for g, s in sc.planted.items()) or "none"
    dead = f"; ranks {list(sc.dead)} killed" if sc.dead else ""
    print(f"{args.case}: {len(sc.ranks)} dumps in {sc.outdir} ({sc.elapsed_s:.1f}s){dead}; planted collectives "
          f"{planted}; expected verdict {exp.verdict}, culprits {list(exp.culprit_ranks)}, "
          f"findings {[(b.kind, b.group, list(b.ranks)) for b in exp.findings]}")
    for rank, err in sorted(sc.rank_errors.items()):
        print(f"  rank {rank}: {err}")
    return 0


if __name__ == "__main__":
    # Run as a module, this file is __main__; the ranks must unpickle _rank_main from
    # its importable name, so go through that.
    from tests import desync_scenarios

    sys.exit(desync_scenarios.main())
