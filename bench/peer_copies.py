"""What peer copies of sharded state cost: step time and memory per rank.

    python bench/peer_copies.py [--steps 80] [--warmup-steps 15] [--pairs 3] [--ranks-per-node 2]

Trains the local example's job shape (tiny preset, FSDP2 + expert parallelism over pairs
of ranks, 2 simulated nodes) with fleet's loop (``workers.train.run``) in one process per
rank on real gloo, with ``job.memory_snapshots`` set to each of

  * **local**: every rank keeps its own two newest snapshots (today's sharded restore,
    which works only while every rank survives);
  * **peer**: the same, and after every step each rank sends its snapshot to its buddy
    on the other node and keeps its ward's (workers/buddy.py);
  * **off**: no snapshots, the baseline.

Runs alternate (off, local, peer, then the reverse, ``--pairs`` times) so machine noise
hits every mode alike. Per run: the median step time (the worker's own measure, the
slowest rank per step) after ``--warmup-steps``; per mode the median over runs. Memory:
the bytes every rank's snapshot holder and peer holder keep at the end (own copies,
ward copies, spare buffers), the most of any rank. Telemetry is off (no agent), so the
difference is the copies' alone. The last line of output is one JSON object:
``step_s_<mode>``, ``peer_step_ratio_vs_local``, ``peer_step_ratio_vs_off``,
``snapshot_bytes_per_rank_<mode>``, ``state_bytes_per_rank``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("off", "local", "peer")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, per_node: int, port: int, mode: str, steps: int, ckpt: str, out) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fleet.workers import buddy, snapshot, train
    from fleet.workers.spec import TrainArgs, WorkerSpec

    recipe = TrainArgs(steps=steps, checkpoint_interval=0, data_parallel="fsdp", ep_size=2, memory_snapshots=mode)
    spec = WorkerSpec(job_id=f"peer-bench-{mode}", attempt=1, rank=rank, world_size=world,
                      node_name=f"n{rank // per_node}", master_addr="127.0.0.1", master_port=port,
                      agent_address="", checkpoint_dir=ckpt, train=recipe, pg_timeout_s=60.0,
                      env={"GLOO_SOCKET_IFNAME": "lo"}, fr_buffer_entries=0,
                      local_rank=rank % per_node, local_world_size=per_node, group_rank=rank // per_node,
                      group_world_size=world // per_node)
    times: dict[int, float] = {}
    train.run(spec, on_step=lambda r: times.update({r.step: r.step_time_s}))
    out.put((rank, times, snapshot.holder().nbytes() + buddy.holder().nbytes()))


def run_mode(mode: str, world: int, per_node: int, steps: int, warmup: int) -> tuple[float, int]:
    """One run of ``mode``: (median step time s, most snapshot bytes held by a rank)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="fleet-peer-bench-") as ckpt:
        procs = [ctx.Process(target=_rank, args=(r, world, per_node, port, mode, steps, ckpt, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            got = [out.get(timeout=600) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    per_step = {}
    for _, times, _ in got:
        for step, t in times.items():
            per_step[step] = max(per_step.get(step, 0.0), t)
    after = [t for s, t in per_step.items() if s > warmup]
    return statistics.median(after), max(b for _, _, b in got)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup-steps", type=int, default=15)
    parser.add_argument("--pairs", type=int, default=3, help="rounds of (off, local, peer) / (peer, local, off)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks on each of the 2 nodes")
    args = parser.parse_args()
    if args.warmup_steps >= args.steps:
        parser.error("--warmup-steps must be < --steps")
    from fleet.workers import buddy, flops
    from fleet.workers.spec import PRESETS

    world = 2 * args.ranks_per_node
    total, _ = flops.param_counts(PRESETS["tiny"])
    state = buddy.state_bytes(total, world, sharded=True)
    print(f"{world} ranks on 2 nodes, tiny preset ({total / 1e6:.2f}M parameters), fsdp + ep 2; "
          f"{state / 2**20:.2f} MiB of state per rank; {args.steps} steps, {args.pairs} pair(s)", flush=True)
    step_s: dict[str, list[float]] = {m: [] for m in MODES}
    held: dict[str, int] = {}
    for i in range(args.pairs):
        for mode in MODES if i % 2 == 0 else tuple(reversed(MODES)):
            t, b = run_mode(mode, world, args.ranks_per_node, args.steps, args.warmup_steps)
            step_s[mode].append(t)
            held[mode] = b
            print(f"  round {i + 1} {mode:5}: median step {t * 1e3:.1f} ms, snapshots held {b / 2**20:.2f} MiB "
                  "per rank (most)", flush=True)
    med = {m: statistics.median(v) for m, v in step_s.items()}
    result = {f"step_s_{m}": round(v, 5) for m, v in med.items()}
    result.update(peer_step_ratio_vs_local=round(med["peer"] / med["local"], 3),
                  peer_step_ratio_vs_off=round(med["peer"] / med["off"], 3),
                  state_bytes_per_rank=state, world_size=world, pairs=args.pairs)
    result.update({f"snapshot_bytes_per_rank_{m}": b for m, b in held.items()})
    print(f"median step: off {med['off'] * 1e3:.1f} ms, local {med['local'] * 1e3:.1f} ms, peer "
          f"{med['peer'] * 1e3:.1f} ms (peer/local {result['peer_step_ratio_vs_local']}); held per rank: local "
          f"{held['local'] / 2**20:.2f} MiB, peer {held['peer'] / 2**20:.2f} MiB")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
