"""Real 4-rank gloo runs that plant one kind of desync each and leave native dumps.

``generate(case, outdir)`` starts four rank processes (``tests.unit.test_workers_support.Ranks``)
that form a gloo process group on 127.0.0.1, run a few dozen normal collectives on the
world group and on two pair groups, then misbehave as ``case`` says; every rank writes
its native flight-recorder dump (``torch._C._distributed_c10d._dump_fr_trace``, pickle;
JSON for ``healthy-json``) to ``outdir/fr_dump_<rank>``, the naming torchfrtrace reads.
``CASES`` says what a correct diagnosis of each run is. From a shell:
``python -m tests.desync_scenarios CASE OUTDIR``.

Every rank dumps while its planted collective is still outstanding, as a reporter thread
would: a ``desync-dumper`` thread polls the rank's ring until its own entry for the
planted collective is there (and every earlier entry is retired), then writes the file;
a rank that skips or stalls dumps once everything it issued is retired. Ranks exit only
after all four files exist (they meet on the rendezvous TCPStore, which keeps working
while the collectives hang), so no hung collective can lose a dump; the planted
collective then ends by the PG timeout or by a peer exiting.

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
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

WORLD_SIZE = 4
PG_TIMEOUT_S = 3.0
DUMP_PREFIX = "fr_dump_"
FR_BUFFER_SIZE = 2000
ROUNDS = 6            # 4 world collectives and 1 pair-group all_reduce per round
NUMEL = 64
COORD_TIMEOUT_S = 30.0  # bound on every wait for the other ranks


@dataclass(frozen=True)
class Expected:
    """What a correct diagnosis of a case says; ``kind`` / ``group`` name the finding
    that must be reported at the planted collective (None for healthy runs)."""

    verdict: str
    culprit_ranks: tuple[int, ...] = ()
    kind: str | None = None
    group: str | None = None


#: Pair groups, created by every rank in this order: "1" = ranks 0 and 1, "2" = 2 and 3.
PAIR_GROUPS = {"1": (0, 1), "2": (2, 3)}

CASES: dict[str, Expected] = {
    "healthy": Expected("ok"),
    "skip": Expected("hang", (2,), "missing", "0"),
    "size": Expected("mismatch", (1,), "size_mismatch", "0"),
    "op": Expected("mismatch", (3,), "op_mismatch", "0"),
    "dtype": Expected("mismatch", (0,), "dtype_mismatch", "0"),
    "subgroup-hang": Expected("hang", (1,), "missing", "1"),
    "healthy-json": Expected("ok"),
}


@dataclass(frozen=True)
class Scenario:
    """One finished run: where its dumps are and which collective was planted."""

    case: str
    outdir: Path
    group: str | None       # the planted collective's group and sequence number
    seq: int | None
    elapsed_s: float
    rank_errors: dict[int, str]  # the exception each rank's planted collective ended with


def generate(case: str, outdir: Path | str, timeout_s: float = 60.0) -> Scenario:
    """Run ``case`` on four local gloo ranks; their dumps land in ``outdir``."""
    from tests.unit.test_workers_support import run_ranks

    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; one of {', '.join(CASES)}")
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results = run_ranks(_rank_main, WORLD_SIZE, (case, str(outdir)), timeout_s=timeout_s)
    missing = [r for r in range(WORLD_SIZE) if not (outdir / f"{DUMP_PREFIX}{r}").is_file()]
    assert not missing, f"ranks {missing} wrote no dump"
    planted = {(r["group"], r["seq"]) for r in results.values() if r["seq"] is not None}
    assert len(planted) <= 1, f"ranks disagree on the planted collective: {planted}"
    group, seq = planted.pop() if planted else (None, None)
    return Scenario(case, outdir, group, seq, time.monotonic() - start,
                    {r: res["error"] for r, res in results.items() if res["error"]})


# --- inside a rank process ---------------------------------------------------------


def _rank_main(rank: int, world_size: int, port: int, case: str, outdir: str) -> dict:
    """One rank: normal traffic, then the case's fault; returns the planted collective."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(FR_BUFFER_SIZE)  # before the recorder exists
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    from fleet.workers.rendezvous import loopback_store

    timeout = timedelta(seconds=PG_TIMEOUT_S)
    store = loopback_store(rank, world_size, port, COORD_TIMEOUT_S)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    pairs = {name: dist.new_group(list(ranks), timeout=timeout, group_desc=f"pair{ranks[0]}{ranks[1]}")
             for name, ranks in PAIR_GROUPS.items()}
    for name, g in pairs.items():
        if rank in PAIR_GROUPS[name]:
            assert dist._get_process_group_name(g) == name, "pair groups are not named as assumed"
            my_pair = g
    coord = dist.PrefixStore("desync-scenario/", store)
    rank_run = _RankRun(rank, world_size, coord, Path(outdir) / f"{DUMP_PREFIX}{rank}",
                        json_dump=case == "healthy-json")
    try:
        _normal_traffic(rank, world_size, my_pair)
        _FAULTS.get(case, _healthy)(rank_run, pairs)
        rank_run.finish()
    finally:
        # Left to interpreter exit, a group whose collective failed can abort the
        # process ("terminate called without an active exception").
        dist.destroy_process_group()
    return {"group": rank_run.planted_group, "seq": rank_run.planted_seq, "error": rank_run.error}


def _normal_traffic(rank: int, world_size: int, pair) -> None:
    import torch
    import torch.distributed as dist

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    x = torch.full((NUMEL,), float(rank))
    for i in range(ROUNDS):
        dist.all_reduce(x)
        gathered = torch.empty(world_size * NUMEL)
        all_gather(gathered, x)
        dist.broadcast(x, src=i % world_size)
        shard = torch.empty(NUMEL // world_size)
        reduce_scatter(shard, gathered[:NUMEL].clone())
        dist.all_reduce(x, group=pair)
        x.div_(world_size * 4.0)


class _RankRun:
    """One rank's dump and the meeting of all ranks around it (over the TCPStore)."""

    def __init__(self, rank: int, world_size: int, coord, path: Path, json_dump: bool) -> None:
        self.rank = rank
        self.world_size = world_size
        self.coord = coord
        self.path = path
        self.json_dump = json_dump
        self.planted_group: str | None = None
        self.planted_seq: int | None = None
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

    def dump_when_entered(self, group: str, seq: int) -> None:
        """Start the dumper thread for a collective this thread is about to block in."""

        def run() -> None:
            try:
                self._dump_and_meet(group, seq)
            except BaseException as e:  # re-raised by finish() in the rank's main thread
                self._thread_error = e

        self._thread = threading.Thread(target=run, name="desync-dumper", daemon=True)
        self._thread.start()

    def plant(self, group: str, seq: int) -> None:
        """Name the planted collective (what the diagnosis must point at)."""
        self.planted_group, self.planted_seq = group, seq

    def blocked_in(self, group: str, seq: int, collective) -> None:
        """Run a collective that must fail, dumping while it is outstanding."""
        self.dump_when_entered(group, seq)
        self.fails(seq, collective)

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
        """Until every rank in ``ranks`` (default: all) signalled ``what``.

        Polls with ``check``: a blocking ``TCPStore.wait`` holds the GIL, which would keep
        the rank's main thread from returning out of its failed collective meanwhile.
        """
        keys = [f"{what}/{r}" for r in (range(self.world_size) if ranks is None else ranks)]
        deadline = time.monotonic() + COORD_TIMEOUT_S
        while not self.coord.check(keys):
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {self.rank}: timed out waiting for {keys}")
            time.sleep(0.01)

    def finish(self) -> None:
        """Join the dumper, then leave; rank 0 serves the store, so it leaves last."""
        if self._thread is not None:
            self._thread.join(COORD_TIMEOUT_S)
            assert not self._thread.is_alive(), f"rank {self.rank}: dumper thread still running"
            if self._thread_error is not None:
                raise self._thread_error
        self.signal("finished")
        if self.rank == 0:
            self.wait_all("finished")


# --- the faults ----------------------------------------------------------------------


def _healthy(run: _RankRun, pairs: dict) -> None:
    run.dump_now()


def _skip(run: _RankRun, pairs: dict) -> None:
    """Rank 2 never calls the last world all_reduce; the others wait in it."""
    import torch
    import torch.distributed as dist

    seq = run.next_seq("0")
    run.plant("0", seq)
    if run.rank == 2:
        run.dump_now()
    else:
        run.blocked_in("0", seq, lambda: dist.all_reduce(torch.ones(NUMEL)))


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
    if run.rank != culprit:
        run.blocked_in("0", seq, good)
        run.signal("ended")
    else:
        run.wait_all("ended", [r for r in range(run.world_size) if r != culprit])
        run.fails(seq, bad)
        run.dump_now()


def _size(run: _RankRun, pairs: dict) -> None:
    """Rank 1 all_reduces twice the elements the others do."""
    import torch
    import torch.distributed as dist

    _late_culprit(run, 1, lambda: dist.all_reduce(torch.ones(NUMEL)),
                  lambda: dist.all_reduce(torch.ones(2 * NUMEL)))


def _op(run: _RankRun, pairs: dict) -> None:
    """Rank 3 broadcasts where the others all_reduce a tensor of the same size."""
    import torch
    import torch.distributed as dist

    _mismatch(run, 3, lambda: dist.all_reduce(torch.ones(NUMEL)),
              lambda: dist.broadcast(torch.ones(NUMEL), src=0))


def _dtype(run: _RankRun, pairs: dict) -> None:
    """Rank 0 all_reduces float64 where the others all_reduce float32 (rank 0 is wrong)."""
    import torch
    import torch.distributed as dist

    _late_culprit(run, 0, lambda: dist.all_reduce(torch.ones(NUMEL, dtype=torch.float32)),
                  lambda: dist.all_reduce(torch.ones(NUMEL, dtype=torch.float64)))


def _subgroup_hang(run: _RankRun, pairs: dict) -> None:
    """Rank 1 stalls outside any collective; rank 0 waits for it in the pair group "1";
    ranks 2 and 3 go on to a world all_reduce and wait there for ranks 0 and 1."""
    import torch
    import torch.distributed as dist

    if run.rank in (0, 1):  # ranks 2 and 3 are not in group "1": they cannot know its seq
        run.plant("1", run.next_seq("1"))
    if run.rank == 1:
        run.dump_now()
    elif run.rank == 0:
        run.blocked_in("1", run.planted_seq, lambda: dist.all_reduce(torch.ones(NUMEL), group=pairs["1"]))
    else:
        run.blocked_in("0", run.next_seq("0"), lambda: dist.all_reduce(torch.ones(NUMEL)))


_FAULTS = {"skip": _skip, "size": _size, "op": _op, "dtype": _dtype, "subgroup-hang": _subgroup_hang}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.desync_scenarios", description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=list(CASES))
    parser.add_argument("outdir", type=Path)
    args = parser.parse_args(argv)
    sc = generate(args.case, args.outdir)
    exp = CASES[args.case]
    planted = f"{sc.group}#{sc.seq}" if sc.seq is not None else "none"
    print(f"{args.case}: {WORLD_SIZE} dumps in {sc.outdir} ({sc.elapsed_s:.1f}s); planted collective {planted}; "
          f"expected verdict {exp.verdict}, culprits {list(exp.culprit_ranks)}, finding {exp.kind}")
    for rank, err in sorted(sc.rank_errors.items()):
        print(f"  rank {rank}: {err}")
    return 0


if __name__ == "__main__":
    # Run as a module, this file is __main__; the ranks must unpickle _rank_main from
    # its importable name, so go through that.
    from tests import desync_scenarios

    sys.exit(desync_scenarios.main())
