"""`fleet replay` of a large job (16,384 ranks by default) from PostgreSQL: a store filled
the way the controller fills it for a job in fronts mode, then the CLI timed cold.

    python bench/replay_scale.py [--ranks 16384] [--store postgres|sqlite|URL] [--steps 30]
                                 [--runs 3] [--keep]

The store (``build``, also the fixture of tests/component/test_replay_fronts.py), written
only through the Store's own methods: a job and its attempt, every rank placed on its node
(``record_rank``), every rank's ProcessGroupInfo and StepEvents in agent batches
(``record_batches``: one agent per node of 8 ranks), one front per (rank, group)
(``record_fronts``), the raw entries the controller pulled around the suspect
(CollectiveColumns events, as agents answer a TracePull: every member of the culprit's
groups, its newest ``pull_last`` entries of each), and the hang incident
(``record_incident``); the attempt then ends FAILED, as after a hang.

The job is ``bench.scale_schedule``'s (TP 8 x PP 4 x DP R/32, groups tp<node>, pp<dp>.<tp>,
dp<pp>.<tp>; its op schedule, names, sizes and signatures). The hang: op N is the first
dp op of step ``steps`` + 1; the culprit never enters it, every other rank enters it and
waits (its DP group's 511 peers at seq s+1, the culprit at s; the other ranks blocked
behind them in their own groups' newest op).

Then ``fleet replay JOB --store URL`` and the same with ``--json`` run as fresh processes,
``--runs`` times each (median). The last line is one JSON object: ranks,
replay_s_<R>, replay_json_s_<R>, store, culprit_named (the text names "rank <culprit>" and
the JSON's culprit_ranks is [culprit]), build_s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.scale_schedule import DTYPES, KINDS, Layout, Schedule, agent_id  # noqa: E402
from fleet.controlplane.lifecycle import AttemptState, JobState  # noqa: E402
from fleet.controlplane.store import Store  # noqa: E402
from fleet.controlplane.store.ingest import prepare  # noqa: E402
from fleet.proto import events_pb2  # noqa: E402
from fleet.proto.columns import pack as pack_columns  # noqa: E402
from fleet.proto.fronts import FrontRow  # noqa: E402

#: Collectives per step of the simulated job (60 % tp, 10 % pp, 30 % dp).
PER_STEP = 10
#: Nodes whose batches one ``record_batches`` call commits together.
NODES_PER_COMMIT = 64


@dataclass(frozen=True)
class FrontsJob:
    """What ``build`` stored: the job, its attempt, the culprit, its node and groups."""

    job: str
    attempt: int
    ranks: int
    culprit: int
    node: str
    groups: tuple[str, ...]
    fronts: int


def _kind_seqs(schedule: Schedule, count: int) -> dict[int, int]:
    """Per kind: the seq of the newest of ``count`` global ops (0: none of that kind)."""
    import numpy as np

    return {k: int(schedule.seqs(np.asarray([count]), k)[0]) for k in range(len(KINDS))}


def _op_of(schedule: Schedule, kind: int, seq: int) -> tuple[int, str, str, int]:
    """(global op index, op name, sizes JSON, signature) of ``seq`` of a group of ``kind``."""
    import numpy as np

    index, p = schedule.seq_op(np.asarray([seq]), kind)
    op, sizes, sig = schedule.ops[kind][int(p[0])]
    return int(index[0]), op, sizes, sig


def build(store: Store, ranks: int, *, steps: int = 30, culprit: int | None = None, pull_last: int = 32,
          step_s: float = 1.0) -> FrontsJob:
    """Fill ``store`` with one large job in fronts mode that hung (module docstring)."""
    layout, schedule = Layout(ranks), Schedule(PER_STEP, step_s)
    culprit = ranks // 2 + 5 if culprit is None else culprit
    dp_kind = KINDS.index("dp")
    hang_op = steps * PER_STEP + int(schedule.index_of[dp_kind][0])  # op N
    t0 = time.time_ns() - int((steps + 2) * schedule.step_ns) - 10 * 10**9
    job = store.create_job(f"replay-scale-{ranks}", 1_000_000, "{}")
    store.set_job_state(job, JobState.PLACING, "bench")
    attempt = store.create_attempt(job)
    store.set_attempt_state(job, attempt, AttemptState.RUNNING)
    store.set_job_state(job, JobState.RUNNING, "bench")
    store.record_ranks(job, attempt, [(r, layout.node_of(r), 10_000 + r) for r in range(ranks)])

    # every node's agent: its ranks' groups, then their steps
    batches = []
    for node in range(layout.nodes):
        events = []
        for r in range(node * 8, node * 8 + 8):
            for g, members in layout.groups(r):
                events.append(events_pb2.Event(group=events_pb2.ProcessGroupInfo(
                    job_id=job, attempt=attempt, rank=r, group=g, desc=g.rstrip("0123456789."), ranks=members)))
            for step in range(1, steps + 1):
                events.append(events_pb2.Event(step=events_pb2.StepEvent(
                    job_id=job, attempt=attempt, rank=r, step=step, loss=10.0 / (1 + 0.01 * step),
                    step_time_s=step_s * (1.2 if r == culprit else 1.0), tokens_per_s=4096 / step_s,
                    end_ns=t0 + step * schedule.step_ns)))
        batches.append((agent_id(node), 1, 1, prepare(events)))
        if len(batches) == NODES_PER_COMMIT:
            store.record_batches(batches)
            batches = []
    if batches:
        store.record_batches(batches)

    # the fronts: where every rank stands in each of its groups
    fronts: list[FrontRow] = []
    for r in range(ranks):
        entered_n = hang_op if r == culprit else hang_op + 1   # global ops entered
        done_n = hang_op                                       # completed: all before op N
        e_seqs, c_seqs = _kind_seqs(schedule, entered_n), _kind_seqs(schedule, done_n)
        for k, (g, members) in enumerate(layout.groups(r)):
            kind = KINDS.index(g.rstrip("0123456789."))
            e, c = e_seqs[kind], c_seqs[kind]
            index, op, _, sig = _op_of(schedule, kind, e)
            c_index = _op_of(schedule, kind, c)[0]
            fronts.append(FrontRow(job, attempt, r, g, len(members), e, c, schedule.op_enter_ns(t0, index),
                                   schedule.op_enter_ns(t0, c_index) + schedule.dt_ns // 2 if c else 0,
                                   op, sig, index // PER_STEP + 1, 0))
    for i in range(0, len(fronts), 8192):
        store.record_fronts(fronts[i:i + 8192])

    # the pulled raw entries: every member of the culprit's groups, its newest of each
    suspect = layout.groups(culprit)
    names = tuple(g for g, _ in suspect)
    by_key = {(f.rank, f.group): f for f in fronts if f.group in names}
    pulled: dict[int, list[events_pb2.CollectiveEvent]] = {}
    for g, members in suspect:
        kind = KINDS.index(g.rstrip("0123456789."))
        for r in members:
            f = by_key[(r, g)]
            for seq in range(max(1, f.entered_seq - pull_last + 1), f.entered_seq + 1):
                index, op, sizes, _ = _op_of(schedule, kind, seq)
                enter = schedule.op_enter_ns(t0, index)
                done = seq <= f.completed_seq
                ev = events_pb2.CollectiveEvent(
                    job_id=job, attempt=attempt, rank=r, group=g, group_size=len(members), seq=seq, op=op,
                    enter_ns=enter, exit_ns=enter + schedule.dt_ns // 2 if done else 0,
                    state="completed" if done else "started", step=index // PER_STEP + 1)
                for shape in json.loads(sizes):
                    ev.input_sizes.add().dims.extend(shape)
                    ev.output_sizes.add().dims.extend(shape)
                ev.input_dtypes.extend(json.loads(DTYPES))
                ev.output_dtypes.extend(json.loads(DTYPES))
                pulled.setdefault(r // 8, []).append(ev)
    store.record_batches([(agent_id(node), 1, 2, prepare([events_pb2.Event(collectives=pack_columns(evs))]))
                          for node, evs in sorted(pulled.items())])

    node = layout.node_of(culprit)
    dp = next(g for g in names if g.startswith("dp"))
    store.record_incident(job, attempt, "hang", "hang", f"no rank finished a step; flight recorder: rank {culprit} "
                          f"never entered all_reduce of group {dp}, in which {len(dict(suspect)[dp]) - 1} members "
                          "wait", rank=culprit, node=node)
    store.set_attempt_state(job, attempt, AttemptState.FAILED, f"hang: rank {culprit} on {node}")
    return FrontsJob(job, attempt, ranks, culprit, node, names, len(fronts))


def _time_cli(fleet: str, url: str, job: str, extra: list[str], runs: int) -> tuple[float, str]:
    times, out = [], ""
    for _ in range(runs):
        t = time.monotonic()
        proc = subprocess.run([fleet, "replay", job, "--store", url, *extra], capture_output=True, text=True,
                              timeout=600, cwd=REPO)
        times.append(time.monotonic() - t)
        if proc.returncode != 0:
            raise SystemExit(f"fleet replay {' '.join(extra)} exited {proc.returncode}: {proc.stderr[-2000:]}")
        out = proc.stdout
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--store", default="postgres", help="postgres (a throwaway server), sqlite, or a URL")
    parser.add_argument("--steps", type=int, default=30, help="steps every rank finished before the hang")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="fleet-replay-scale-"))
    server = None
    try:
        if args.store == "postgres":
            from tests.pg import PostgresServer

            server = PostgresServer(crash_safe=True).start()
            url, kind = server.create_database(), "postgresql"
        elif args.store == "sqlite":
            url, kind = f"sqlite:///{folder}/fleet.db", "sqlite"
        else:
            url, kind = args.store, args.store.split(":", 1)[0].split("+", 1)[0]
        t = time.monotonic()
        with Store(url) as store:
            built = build(store, args.ranks, steps=args.steps)
        build_s = time.monotonic() - t
        print(f"built {args.ranks} ranks, {built.fronts} fronts in {build_s:.1f} s; culprit rank {built.culprit} "
              f"on {built.node}", flush=True)
        fleet = shutil.which("fleet", path=str(Path(sys.executable).parent)) or "fleet"
        text_s, text = _time_cli(fleet, url, built.job, [], args.runs)
        json_s, doc = _time_cli(fleet, url, built.job, ["--json"], args.runs)
        named = f"rank {built.culprit} " in text and json.loads(doc)["culprit_ranks"] == [built.culprit]
        print(f"fleet replay: {text_s:.2f} s, --json: {json_s:.2f} s (median of {args.runs}); culprit named: "
              f"{named}", flush=True)
        print(json.dumps({"ranks": args.ranks, f"replay_s_{args.ranks}": round(text_s, 3),
                          f"replay_json_s_{args.ranks}": round(json_s, 3), "store": kind,
                          "culprit_named": named, "build_s": round(build_s, 1)}))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
