"""Bus bandwidth as fleet measures it from the traces vs a timed loop, in the same run.

    .venv/bin/python bench/collectives.py [--nodes 2] [--ranks-per-node 1] [--keep]

``fleet up`` runs ``bench/collectives_worker.py`` (a plain torch.distributed program on
gloo, no fleet import) on a local Ray cluster of ``--nodes`` simulated nodes. For
all_reduce and all_gather at S = 1 KiB, 4 KiB, ... 64 MiB (nccl-tests' S) the worker
times ``--reps`` repetitions of N back-to-back calls with ``time.perf_counter()``
(nccl-tests' method). Per (op, S):

  * loop: ``t`` = the slowest rank's time over all repetitions / all their N calls (a
    mean per call, as nccl-tests reports); busbw = S / t x bus factor
    (``diagnosis.bandwidth.bus_factor``);
  * fleet: ``diagnosis.bandwidth.analyse`` over the attempt's stored traces, the row of
    (op, S) on the world group: its collectives' summed S over their summed t, x bus
    factor (a mean time per call too), with t the smallest measured duration among the
    members (the last arriver's call to its return, timed by fleet's wrapper of the
    torch.distributed call). Both sides drop
    the warm-up: fleet's traces are cut to the collectives every rank entered inside its
    timed repetitions (``fleet_all`` in the table: the whole run's row, warm-up included).
  * rel error = |fleet - loop| / loop (target: within 10% at every size).

What the two figures differ by, by construction: the loop's time per call also holds
the Python loop and the wrapper's own cost between two calls and the barrier's release
skew spread over N; fleet's holds the call only. The table shows both times per call
(us) and their difference. Both are means: where call times are heavy-tailed (a loaded
machine) a median would part from the loop however exact the data. ``mean t`` /
``err mean`` recompute the mean from the traces outside ``analyse``, as a check of it.

Also the analytics' cost: ``bench_analytics(512, 2000)`` (synthetic, ~1M rank-entries)
and ``analyse`` on this run's real traces, both as seconds per million rank-entries
(target <= 2 s). Collectives a recorder lost (the worker's count of what it issued vs
the rows stored, and the ring's overwrite warnings in the rank logs) fail the bench.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleet.controlplane.diagnosis.bandwidth import analyse, bench_analytics, bus_factor, message_bytes  # noqa: E402
from fleet.controlplane.diagnosis.source import attempt_traces  # noqa: E402
from fleet.controlplane.diagnosis.traces import GroupOps, RankTrace, TraceSet  # noqa: E402
from fleet.controlplane.store import Store  # noqa: E402

WORKER = REPO / "bench" / "collectives_worker.py"
FLEET = [sys.executable, "-m", "fleet.controlplane.cli.main"]
OPS = ("all_reduce", "all_gather")
TARGET_REL_ERROR = 0.10
TARGET_S_PER_MILLION = 2.0
#: The ring's warning when it overwrote entries no read had seen (workers/native_fr.py).
OVERWRITE_WARNING = "flight recorder ring overwrote"


def cluster_yaml(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The cluster.yaml of the run: a local Ray cluster, one attempt, the worker as the program."""
    state = work / ".fleet"
    return {
        "name": "bench-collectives",
        "state_dir": str(state),
        "ray": {"address": None, "nodes": a.nodes, "cpus_per_node": max(2, a.ranks_per_node)},
        "store": {"url": f"sqlite:///{state}/fleet.db"},
        "job": {
            "nodes": a.nodes, "ranks_per_node": a.ranks_per_node, "max_restarts": 0,
            "pg_timeout_s": 600, "flight_recorder_entries": a.ring,
            "spare_workers_per_node": 0,
            "entrypoint": {
                "script": str(WORKER),
                "args": ["--out", str(work / "out"), "--reps", str(a.reps), "--rep-s", str(a.rep_s),
                         "--max-collectives", str(a.max_collectives), "--min-bytes", str(a.min_bytes),
                         "--max-bytes", str(a.max_bytes)],
                "env": {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
                "workdir": str(work),
                "tee": False,
            },
        },
    }


def run_fleet(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``fleet up`` on the worker; its JSON summary (exits on a failed job)."""
    path = work / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster_yaml(a, work), sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([*FLEET, "up", "--cluster", str(path), "--json"], cwd=work, capture_output=True,
                          text=True, timeout=a.timeout_s, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"fleet up failed with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout)
    if summary["state"] != "SUCCEEDED":
        raise SystemExit(f"fleet up ended {summary['state']}: {summary['reason']}")
    return summary


def read_ranks(out: Path) -> tuple[dict[int, list[dict]], dict[int, Counter]]:
    """Each rank's (op, S) lines in run order, and what it issued by op."""
    rows: dict[int, list[dict]] = {}
    issued: dict[int, Counter] = {}
    for f in sorted(out.glob("rank-*.jsonl")):
        rank = int(f.stem.split("-")[1])
        lines = [json.loads(line) for line in f.read_text().splitlines() if line]
        rows[rank] = [r for r in lines if "op" in r]
        totals = [r["issued"] for r in lines if "issued" in r]
        if not totals:
            raise SystemExit(f"{f}: the worker did not finish (no 'issued' line)")
        issued[rank] = Counter(totals[-1])
    return rows, issued


def loop_figures(rows: dict[int, list[dict]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (op, S): N, the world size and t (s per call): the sum over repetitions of the
    slowest rank's repetition, over all the repetitions' calls (a mean per call)."""
    ranks = sorted(rows)
    out = {}
    for i, first in enumerate(rows[ranks[0]]):
        per_rank = [rows[r][i] for r in ranks]
        if any((r["op"], r["bytes"], r["n"]) != (first["op"], first["bytes"], first["n"]) for r in per_rank):
            raise SystemExit(f"ranks disagree on line {i} of their output: {[(r['op'], r['bytes']) for r in per_rank]}")
        n = first["n"]
        per_rep = [max(r["reps"][k] for r in per_rank) / n for k in range(len(first["reps"]))]
        out[(first["op"], first["bytes"])] = {"n": n, "reps": len(per_rep), "world": first["world"],
                                              "t_s": statistics.fmean(per_rep)}
    return out


def world_group(traces: TraceSet, world: int) -> str:
    """The name of the group every rank belongs to."""
    for trace in traces.ranks.values():
        for name, members in trace.group_ranks.items():
            if len(members) == world and name in trace.groups:
                return name
    raise SystemExit(f"no group of all {world} ranks in the traces: {[t.group_ranks for t in traces.ranks.values()]}")


def stored_counts(traces: TraceSet, group: str) -> dict[int, Counter]:
    """Per rank, its stored collectives on ``group`` by op."""
    out = {}
    for rank, trace in traces.ranks.items():
        ops = trace.groups.get(group)
        out[rank] = Counter(traces.table.sigs[s].op for s in ops.sigs) if ops else Counter()
    return out


def timed_only(traces: TraceSet, group: str, rows: dict[int, list[dict]]) -> TraceSet:
    """``traces`` cut to the collectives on ``group`` each rank entered inside one of its
    timed repetitions (``analyse`` rates a collective only when every member kept it)."""
    ranks = {}
    for rank, trace in traces.ranks.items():
        windows = np.array(sorted(w for r in rows[rank] for w in r["windows"]), dtype=np.int64).reshape(-1, 2)
        ops = trace.groups[group]
        enter = np.asarray(ops.enter_ns, dtype=np.int64)
        i = np.searchsorted(windows[:, 0], enter, side="right") - 1
        keep = (i >= 0) & (enter <= windows[np.maximum(i, 0), 1])
        cut = GroupOps(**{f: [v for v, k in zip(getattr(ops, f), keep) if k] for f in
                          ("seqs", "sigs", "enter_ns", "exit_ns", "done", "delta", "dur_ns", "timing")})
        ranks[rank] = RankTrace(rank=rank, source=trace.source, groups={group: cut},
                                group_desc={group: trace.group_desc.get(group, "")},
                                group_ranks={group: trace.group_ranks[group]})
    return TraceSet(source=traces.source, ranks=ranks, table=traces.table, attempt=traces.attempt)


def fleet_rows(traces: TraceSet, group: str) -> dict[tuple[str, int], Any]:
    """``analyse``'s rows on ``group``, by (op, S)."""
    return {(r.op, r.bytes): r for r in analyse(traces).rows if r.group == group and r.bytes is not None}


def mean_times(traces: TraceSet, group: str, world: int) -> dict[tuple[str, int], float]:
    """Per (op, S): the *mean* over collectives of the smallest measured member duration
    (s), from the same traces, computed outside ``analyse``: a check of its figure."""
    per_seq: dict[int, list[int]] = {}
    sig_of: dict[int, int] = {}
    for trace in traces.ranks.values():
        ops = trace.groups[group]
        for seq, sig, dur in zip(ops.seqs, ops.sigs, ops.dur_ns):
            per_seq.setdefault(seq, []).append(dur)
            sig_of[seq] = sig
    sums: dict[tuple[str, int], list[float]] = {}
    for seq, durs in per_seq.items():
        if len(durs) != world or min(durs) <= 0:
            continue
        s = traces.table.sigs[sig_of[seq]]
        size = message_bytes(s.op, s.input_sizes, s.input_dtypes, s.output_sizes, s.output_dtypes, world)
        if size:
            sums.setdefault((s.op, size), []).append(min(durs) / 1e9)
    return {k: statistics.fmean(v) for k, v in sums.items()}


def lost_in_logs(state: Path, job_id: str) -> list[str]:
    """The ring's overwrite warnings in the job's rank logs."""
    return [line for f in sorted((state / "logs" / job_id).glob("attempt-*/rank-*.log"))
            for line in f.read_text(errors="replace").splitlines() if OVERWRITE_WARNING in line]


def _gbps(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:8.3f}"


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--reps", type=int, default=21, help="timed repetitions per (op, S)")
    p.add_argument("--rep-s", type=float, default=0.02, help="aimed wall time of one repetition, s")
    p.add_argument("--max-collectives", type=int, default=630, help="timed calls per (op, S) at most")
    p.add_argument("--ring", type=int, default=2048, help="job.flight_recorder_entries")
    p.add_argument("--min-bytes", type=int, default=1 << 10)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (printed)")
    a = p.parse_args()
    if a.nodes < 1 or a.ranks_per_node < 1 or a.nodes * a.ranks_per_node < 2:
        raise SystemExit("--nodes x --ranks-per-node: at least 2 ranks are needed")

    work = Path(tempfile.mkdtemp(prefix="fleet-bench-coll-"))
    try:
        t0 = time.monotonic()
        summary = run_fleet(a, work)
        print(f"fleet up: job {summary['job_id']} {summary['state']} in {time.monotonic() - t0:.1f} s", flush=True)
        result = evaluate(a, work, summary["job_id"])
    finally:
        if a.keep:
            print(f"kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    if result.get("failed"):
        sys.exit(1)


def evaluate(a: argparse.Namespace, work: Path, job_id: str) -> dict[str, Any]:
    """Compare, print the table, and return the JSON figures."""
    rows, issued = read_ranks(work / "out")
    world = a.nodes * a.ranks_per_node
    if sorted(rows) != list(range(world)):
        raise SystemExit(f"expected output of ranks 0..{world - 1}, got {sorted(rows)}")
    loop = loop_figures(rows)
    with Store(f"sqlite:///{work / '.fleet' / 'fleet.db'}") as store:
        traces = attempt_traces(store, job_id, 1)
    group = world_group(traces, world)
    stored = stored_counts(traces, group)
    missing = {f"rank {r} {op}": issued[r][op] - stored.get(r, Counter())[op]
               for r in sorted(issued) for op in sorted(issued[r]) if issued[r][op] > stored.get(r, Counter())[op]}
    lost = sum(missing.values())
    warnings = lost_in_logs(work / ".fleet", job_id)
    entries = sum(len(o.seqs) for t in traces.ranks.values() for o in t.groups.values())
    run_times = []
    for _ in range(3):  # the first call also pays numpy's and the table's one-off costs
        began = time.perf_counter()
        whole = fleet_rows(traces, group)
        run_times.append(time.perf_counter() - began)
    run_s = statistics.median(run_times)
    cut = timed_only(traces, group, rows)
    timed = fleet_rows(cut, group)
    means = mean_times(cut, group, world)
    synthetic_s = bench_analytics(512, 2000)

    print(f"\n{world} ranks ({a.nodes} nodes x {a.ranks_per_node}), gloo, float32; busbw in GB/s; "
          "t per call in us (loop: all reps / all calls, slowest rank; fleet: mean of the last arriver's call)")
    print(f"{'op':<11}{'size':>8}{'N':>5}{'reps':>5}{'loop':>10}{'fleet':>10}{'fleet_all':>10}{'rel err':>9}"
          f"{'loop t':>10}{'fleet t':>10}{'diff':>9}{'mean t':>10}{'err mean':>9}{'measured':>10}")
    out: dict[str, Any] = {"ranks": world, "sizes_bytes": sorted({s for _, s in loop})}
    errors = []
    for op in OPS:
        lb, fb, fa, re_, fm, rem = [], [], [], [], [], []
        for size in out["sizes_bytes"]:
            lf = loop[(op, size)]
            loop_bw = size / lf["t_s"] * bus_factor(op, world)
            row, row_all = timed.get((op, size)), whole.get((op, size))
            fleet_bw = row.busbw_bps if row is not None else None
            err = abs(fleet_bw - loop_bw) / loop_bw if fleet_bw is not None else None
            lb.append(loop_bw)
            fb.append(fleet_bw)
            fa.append(row_all.busbw_bps if row_all is not None else None)
            re_.append(None if err is None else round(err, 4))
            errors.append(float("inf") if err is None else err)
            ft = row.t_s if row is not None else None
            mt = means.get((op, size))
            fm.append(None if mt is None else size / mt * bus_factor(op, world))
            rem.append(None if mt is None else round(abs(fm[-1] - loop_bw) / loop_bw, 4))
            mean_cols = ("-", "-") if mt is None else (f"{mt * 1e6:.1f}", f"{rem[-1]:.1%}")
            diff = "-" if ft is None else f"{(lf['t_s'] - ft) * 1e6:+.1f}"
            print(f"{op:<11}{_size(size):>8}{lf['n']:>5}{lf['reps']:>5}{_gbps(loop_bw):>10}{_gbps(fleet_bw):>10}"
                  f"{_gbps(fa[-1]):>10}{'-' if err is None else f'{err:.1%}':>9}{lf['t_s'] * 1e6:>10.1f}"
                  f"{'-' if ft is None else f'{ft * 1e6:.1f}':>10}"
                  f"{diff:>9}{mean_cols[0]:>10}{mean_cols[1]:>9}"
                  f"{'-' if row is None else f'{row.measured}/{row.collectives}':>10}")
        out[op] = {"loop_busbw_bps": lb, "fleet_busbw_bps": fb, "fleet_all_busbw_bps": fa, "rel_error": re_,
                   "fleet_mean_busbw_bps": fm, "rel_error_mean": rem}

    out["max_busbw_rel_error"] = round(max(errors), 4)
    out["max_busbw_rel_error_mean"] = max((e for op in OPS for e in out[op]["rel_error_mean"] if e is not None),
                                          default=None)
    out["analytics_s_per_million"] = round(synthetic_s / (512 * 2000) * 1e6, 3)
    out["analytics_s_per_million_run"] = round(run_s / max(entries, 1) * 1e6, 3)
    out["run_rank_entries"] = entries
    out["lost_entries"] = lost
    out["lost_by_rank_op"] = missing
    out["overwrite_warnings"] = len(warnings)
    print(f"\nmax rel error {out['max_busbw_rel_error']:.1%} (target <= {TARGET_REL_ERROR:.0%}); analytics "
          f"{out['analytics_s_per_million']:.3f} s per 1M rank-entries (synthetic, bench_analytics(512, 2000)), "
          f"{out['analytics_s_per_million_run']:.3f} s per 1M on this run's {entries} rank-entries "
          f"({run_s * 1e3:.1f} ms; target <= {TARGET_S_PER_MILLION:g} s); lost entries {lost}")
    if lost or warnings:
        print(f"LOST: {lost} issued collectives are not in the store ({missing}); ring warnings: {warnings[:3]}",
              file=sys.stderr)
        out["failed"] = "collectives lost"
    return out


if __name__ == "__main__":
    main()
