"""Synthetic native flight-recorder dumps with a planted fault, in the format torch writes.

    python -m bench.fr_dumps --ranks 64 --entries 2000 --case hang OUT [--culprit R]

Writes one pickle per rank, ``OUT/<prefix><rank>`` (prefix ``fr_dump_``), shaped like
what ``torch._C._distributed_c10d._dump_nccl_trace`` writes in torch 2.13 (format
version "2.10", pickle protocol 2, strings shared, entry keys in alphabetical order,
stack frames as ``{filename, line, name}`` dicts), but NCCL-style so that
``torchfrtrace`` accepts them: ``pg_config`` lists every group the rank is a member of
with its ranks (gloo leaves it empty and torchfrtrace then fails). Prints the plant
(case, culprit ranks, expected verdict, group and sequence number of the fault) as one
JSON object. ``generate`` and ``rank_dump`` are the same thing for tests.

The job: a mixture-of-experts model trained with FSDP over the world group (per layer
an all_gather of the parameters forward and backward, a reduce_scatter of the
gradients), expert parallelism in groups of ``ep`` consecutive ranks (two uneven
all_to_all per layer and pass: token counts differ per rank, their sum does not), the
expert gradients all-reduced over strided data-parallel groups, and per step a
grad-norm and a loss all_reduce and a broadcast from rank 0 over the world group. Each
group has its own ``collective_seq_id``. The job has run for a long time: the ring
buffer of ``entries`` entries has wrapped, so record ids and sequence numbers do not
start at 0 and a rank that stopped early holds older entries the others have lost.
Arrival times jitter at random, no rank is consistently late.

Cases (the fault is in the last step of the dump; ``culprit`` defaults per case, see
``default_culprit``):
  healthy        nothing wrong, every entry completed (expected verdict "ok", no culprit)
  hang           the culprit never enters world all_reduce N; every other rank has N
                 started, not retired, and nothing after it
  op_mismatch    the culprit calls broadcast where the others call all_reduce (same
                 sizes and dtype) at world seq N; every rank has N started
  size_mismatch  the culprit's reduce_scatter at world seq N has another shard size
  dtype_mismatch the culprit's all_gather at world seq N is Float, the others' BFloat16
  subgroup_hang  the culprit never enters the all_reduce of its data-parallel group; the
                 rest of that group waits in it, every other rank finished it and waits
                 in the next world all_gather (which the stuck group never reaches)

A second job, Megatron-style TP x PP x DP with EP and pipeline send/recv, and its hard
cases (pp_hang, p2p_wrong_peer, dead_rank, dead_rank_gloo, blocked_majority,
stuck_kernel, stuck_kernel_active, stuck_kernel_empty, two_culprits, and
megatron_healthy) live in bench/fr_megatron.py; ``plant``, ``rank_dump`` and
``generate`` take them like the others. A dead rank's file is not written
(``Plant.missing_ranks``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

try:
    from bench import fr_megatron
except ImportError:  # run as a script from bench/
    import fr_megatron  # type: ignore[no-redef]

PREFIX = "fr_dump_"
VERSION = "2.10"
MOE_CASES = ("healthy", "hang", "op_mismatch", "size_mismatch", "dtype_mismatch", "subgroup_hang")
CASES = MOE_CASES + fr_megatron.CASES
FAULT_CASES = tuple(c for c in CASES if c not in ("healthy", "megatron_healthy"))

LAYERS = 4
HIDDEN = 4096
TOKENS = 8192          # tokens per rank and micro-batch, routed top-2
LAYER_PARAMS = 201_326_592  # dense parameters of one layer (FSDP-sharded over the world)
EXPERT_PARAMS = 3 * HIDDEN * 1024 * 2  # expert gradients all-reduced over a DP group
STEP_NS = 900_000_000
T0_NS = 1_795_000_000_000_000_000
INIT_RECORDS = 3       # init-time barrier and friends before the first step's ops
TIMEOUT_MS = 600_000
FRAMES = 4             # innermost stack frames kept per entry (sets file size and load time)

_TORCH = "/usr/local/lib/python3.11/site-packages/torch"
_APP = "/workspace/llm/train"


@dataclass(frozen=True)
class Topology:
    """Groups of a ``world``-rank job: the world group, expert-parallel groups of ``ep``
    consecutive ranks and data-parallel groups of ranks ``ep`` apart. Group names are
    what ``new_group`` hands out in creation order ("0" is the world)."""

    world: int
    ep: int

    @property
    def n_ep(self) -> int:
        return self.world // self.ep

    def group(self, kind: str, rank: int) -> tuple[str, str, list[int]]:
        """``(name, desc, ranks)`` of the group of ``kind`` (world/ep/dp) ``rank`` is in."""
        if kind == "world":
            return "0", "default_pg", list(range(self.world))
        if kind == "ep":
            i = rank // self.ep
            return str(1 + i), "mesh_ep", list(range(i * self.ep, (i + 1) * self.ep))
        j = rank % self.ep
        return str(1 + self.n_ep + j), "mesh_dp", list(range(j, self.world, self.ep))


def topology(world: int) -> Topology:
    """Expert-parallel groups of 8 ranks (4 below 16 ranks, 1 below 4)."""
    if world < 2:
        raise ValueError("--ranks must be at least 2")
    ep = 8 if world >= 16 else (4 if world >= 4 else 1)
    while world % ep:
        ep //= 2
    return Topology(world, ep)


def default_culprit(case: str, world: int) -> int | None:
    """The planted culprit of ``case``: rank 0 for hang and dtype_mismatch (rank 0 is
    wrong too, sometimes), others spread over the job."""
    return {
        "healthy": None,
        "hang": 0,
        "op_mismatch": (5 * world) // 8 + 1,
        "size_mismatch": world - 3,
        "dtype_mismatch": 0,
        "subgroup_hang": world // 2 + 1,
    }[case]


# --- the step's ops ---------------------------------------------------------------

_TRAIN = [("train_step", f"{_APP}/loop.py", 212), ("run", f"{_APP}/loop.py", 97),
          ("main", f"{_APP}/main.py", 41), ("<module>", f"{_APP}/main.py", 58)]
_FWD = [("_call_impl", f"{_TORCH}/nn/modules/module.py", 1784),
        ("_wrapped_call_impl", f"{_TORCH}/nn/modules/module.py", 1773),
        ("forward", f"{_APP}/model.py", 388), ("_call_impl", f"{_TORCH}/nn/modules/module.py", 1784),
        ("_wrapped_call_impl", f"{_TORCH}/nn/modules/module.py", 1773)] + _TRAIN
_BWD = [("_engine_run_backward", f"{_TORCH}/autograd/graph.py", 829),
        ("backward", f"{_TORCH}/autograd/__init__.py", 354),
        ("backward", f"{_TORCH}/_tensor.py", 648)] + _TRAIN
_C10D = f"{_TORCH}/distributed/distributed_c10d.py"
_LOG = ("wrapper", f"{_TORCH}/distributed/c10d_logger.py", 83)

STACKS: dict[str, list[tuple[str, str, int]]] = {
    "ag_fwd": [("all_gather_into_tensor", _C10D, 4413), _LOG,
               ("foreach_all_gather", f"{_TORCH}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 248),
               ("unshard", f"{_TORCH}/distributed/fsdp/_fully_shard/_fsdp_param_group.py", 325),
               ("_pre_forward", f"{_TORCH}/distributed/fsdp/_fully_shard/_fsdp_state.py", 240)] + _FWD,
    "ag_bwd": [("all_gather_into_tensor", _C10D, 4413), _LOG,
               ("foreach_all_gather", f"{_TORCH}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 248),
               ("unshard", f"{_TORCH}/distributed/fsdp/_fully_shard/_fsdp_param_group.py", 325),
               ("pre_backward", f"{_TORCH}/distributed/fsdp/_fully_shard/_fsdp_param_group.py", 462)] + _BWD,
    "rs": [("reduce_scatter_tensor", _C10D, 4860), _LOG,
           ("foreach_reduce", f"{_TORCH}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 487),
           ("post_backward", f"{_TORCH}/distributed/fsdp/_fully_shard/_fsdp_param_group.py", 512)] + _BWD,
    "a2a_fwd": [("all_to_all_single", _C10D, 5131), _LOG,
                ("forward", f"{_APP}/moe.py", 171), ("dispatch", f"{_APP}/moe.py", 122)] + _FWD,
    "a2a_bwd": [("all_to_all_single", _C10D, 5131), _LOG,
                ("backward", f"{_APP}/moe.py", 201), ("apply", f"{_TORCH}/autograd/function.py", 311)] + _BWD,
    "dp_ar": [("all_reduce", _C10D, 3245), _LOG,
              ("reduce_expert_grads", f"{_APP}/parallel.py", 144), ("hook", f"{_APP}/parallel.py", 131)] + _BWD,
    "norm": [("all_reduce", _C10D, 3245), _LOG,
             ("clip_grad_norm_", f"{_APP}/parallel.py", 203)] + _TRAIN,
    "loss": [("all_reduce", _C10D, 3245), _LOG, ("reduce_loss", f"{_APP}/metrics.py", 66)] + _TRAIN,
    "bcast": [("broadcast", _C10D, 2898), _LOG, ("should_stop", f"{_APP}/loop.py", 154)] + _TRAIN,
}


@dataclass(frozen=True)
class OpSpec:
    kind: str        # world / ep / dp
    op: str          # collective name without the backend prefix
    dtype: str
    stack: str
    backward: bool
    layer: int = 0
    kind_idx: int = 0  # position among this step's ops of the same kind


def step_schedule() -> list[OpSpec]:
    """The collectives of one training step, in issue order."""
    ops: list[OpSpec] = []
    for layer in range(LAYERS):
        ops += [OpSpec("world", "all_gather", "BFloat16", "ag_fwd", False, layer),
                OpSpec("ep", "all_to_all", "BFloat16", "a2a_fwd", False, layer),
                OpSpec("ep", "all_to_all", "BFloat16", "a2a_fwd", False, layer)]
    for layer in reversed(range(LAYERS)):
        ops += [OpSpec("world", "all_gather", "BFloat16", "ag_bwd", True, layer),
                OpSpec("ep", "all_to_all", "BFloat16", "a2a_bwd", True, layer),
                OpSpec("ep", "all_to_all", "BFloat16", "a2a_bwd", True, layer),
                OpSpec("world", "reduce_scatter", "Float", "rs", True, layer),
                OpSpec("dp", "all_reduce", "Float", "dp_ar", True, layer)]
    ops += [OpSpec("world", "all_reduce", "Float", "norm", False),
            OpSpec("world", "all_reduce", "Float", "loss", False),
            OpSpec("world", "broadcast", "Long", "bcast", False)]
    seen: dict[str, int] = {}
    out = []
    for o in ops:
        out.append(OpSpec(o.kind, o.op, o.dtype, o.stack, o.backward, o.layer, seen.get(o.kind, 0)))
        seen[o.kind] = seen.get(o.kind, 0) + 1
    return out


SCHEDULE = step_schedule()
PER_STEP = {k: sum(1 for o in SCHEDULE if o.kind == k) for k in ("world", "ep", "dp")}
INIT_SEQ = {"world": 1, "ep": 0, "dp": 0}  # the init barrier on the world group


def _pos(pred: Callable[[OpSpec], bool], nth: int = 0) -> int:
    return [i for i, o in enumerate(SCHEDULE) if pred(o)][nth]


# where each case's fault sits in the step
FAULT_POS = {
    "healthy": len(SCHEDULE) - 1,
    "hang": _pos(lambda o: o.stack == "norm"),
    "op_mismatch": _pos(lambda o: o.stack == "loss"),
    "size_mismatch": _pos(lambda o: o.op == "reduce_scatter", 1),
    "dtype_mismatch": _pos(lambda o: o.stack == "ag_fwd", 2),
    "subgroup_hang": _pos(lambda o: o.kind == "dp"),
}
assert SCHEDULE[FAULT_POS["subgroup_hang"] + 1].kind == "world"


# --- the plant --------------------------------------------------------------------

@dataclass
class Plant:
    """What was planted: the ground truth a diagnosis is checked against."""

    case: str
    ranks: int
    entries: int
    prefix: str
    culprit_ranks: list[int]
    verdict: str              # ok / hang / mismatch
    group: str                # name of the group the fault is in
    group_desc: str
    seq: int                  # collective_seq_id of the fault in that group (a send/recv: the
                              # culprit's p2p_seq_id of it)
    op: str
    ep: int
    record_id: int
    detail: str = ""
    layout: str = "moe"       # the job: "moe" (FSDP+EP+DP) or "megatron tpX ppY dpZ epW"
    backend: str = "nccl"     # the format of the dumps: nccl, or gloo (dead_rank_gloo)
    missing_ranks: list[int] = field(default_factory=list)  # ranks that left no file
    files: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("files")
        return d


def _fault_step(entries: int) -> int:
    # long enough a run that the ring has wrapped several times
    return max(1200, 3 * entries // len(SCHEDULE) + 10)


def _record_id(g: int) -> int:
    return INIT_RECORDS + g


def _seq(kind: str, step: int, spec: OpSpec) -> int:
    return INIT_SEQ[kind] + step * PER_STEP[kind] + spec.kind_idx + 1


def plant(case: str, ranks: int, entries: int, culprit: int | None = None,
          prefix: str = PREFIX) -> Plant:
    """The ground truth of ``case`` for a ``ranks``-rank job (no files written)."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; one of {', '.join(CASES)}")
    if case in fr_megatron.CASES:
        return Plant(case=case, ranks=ranks, entries=entries, prefix=prefix,
                     **fr_megatron.plant_fields(case, ranks, entries, culprit))
    topo = topology(ranks)
    if culprit is None:
        culprit = default_culprit(case, ranks)
    if case == "healthy":
        culprit = None
    elif not 0 <= culprit < ranks:
        raise ValueError(f"--culprit {culprit} is not a rank of a {ranks}-rank job")
    step = _fault_step(entries)
    pos = FAULT_POS[case]
    spec = SCHEDULE[pos]
    g = step * len(SCHEDULE) + pos
    name, desc, _ = topo.group(spec.kind, culprit or 0)
    detail = {
        "healthy": "all entries completed",
        "hang": f"rank {culprit} never entered world {spec.op} seq {_seq('world', step, spec)}",
        "op_mismatch": f"rank {culprit} called broadcast instead of all_reduce",
        "size_mismatch": f"rank {culprit} reduce_scatter shard of another size",
        "dtype_mismatch": f"rank {culprit} all_gather in Float instead of BFloat16",
        "subgroup_hang": f"rank {culprit} never entered the all_reduce of its mesh_dp group {name}",
    }[case]
    return Plant(case=case, ranks=ranks, entries=entries, prefix=prefix,
                 culprit_ranks=[] if culprit is None else [culprit],
                 verdict={"healthy": "ok", "hang": "hang", "subgroup_hang": "hang"}.get(case, "mismatch"),
                 group=name, group_desc=desc, seq=_seq(spec.kind, step, spec), op=spec.op, ep=topo.ep,
                 record_id=_record_id(g), detail=detail)


# --- one rank's dump ----------------------------------------------------------------

_STRS: dict[str, str] = {}


def _s(x: str) -> str:
    """One string object per value, so pickle memoizes it as torch's pickler does."""
    return _STRS.setdefault(x, x)


def _a2a_counts(seed: int, step: int, layer: int, backward: bool, group: int, size: int) -> list[int]:
    """Tokens each member of an expert-parallel group receives: uneven, same total."""
    rng = random.Random((((seed * 100_003 + step) * 64 + layer) * 2 + backward) * 1_000_003 + group)
    base = 2 * TOKENS
    deltas = [rng.randint(-base // 4, base // 4) for _ in range(size - 1)]
    deltas.append(-sum(deltas))
    return [base + d for d in deltas]


def _fault_window(case: str, rank: int, topo: Topology, culprit: int | None, fault_g: int):
    """``(last op index, {op index: state})`` of ``rank`` in ``case``: where its dump
    ends and which of its last entries are not completed."""
    if case == "healthy":
        return fault_g, {}
    if case == "hang":
        return (fault_g - 1, {}) if rank == culprit else (fault_g, {fault_g: "started"})
    if case == "subgroup_hang":
        stuck = set(topo.group("dp", culprit)[2])
        if rank == culprit:
            return fault_g - 1, {}
        if rank in stuck:
            return fault_g, {fault_g: "started"}
        return fault_g + 1, {fault_g + 1: "started"}
    return fault_g, {fault_g: "started"}  # mismatches: everyone is stuck in it


def rank_dump(rank: int, ranks: int, entries: int, case: str, culprit: int | None = None,
              seed: int = 0, frames: int = FRAMES) -> dict[str, Any]:
    """The dump dict of one rank, as ``pickle.load`` returns it from a torch dump
    (``ValueError`` for a rank that died and leaves none)."""
    if case in fr_megatron.CASES:
        return fr_megatron.rank_dump(rank, ranks, entries, case, culprit, seed, frames)
    p = plant(case, ranks, entries, culprit)
    culprit = p.culprit_ranks[0] if p.culprit_ranks else None
    topo = topology(ranks)
    n = len(SCHEDULE)
    fault_g = _fault_step(entries) * n + FAULT_POS[case]
    last, states = _fault_window(case, rank, topo, culprit, fault_g)
    first = max(0, last - entries + 1)
    groups = {k: topo.group(k, rank) for k in ("world", "ep", "dp")}
    pg_ids = {"world": 0, "ep": 1, "dp": 2}
    pgs = {k: (_s(name), _s(desc)) for k, (name, desc, _) in groups.items()}
    ep_index = groups["ep"][2].index(rank)
    shard = -(-LAYER_PARAMS // ranks)
    rng = random.Random(seed * 1_000_003 + rank)
    stacks = {k: [(_s(a), _s(b), c) for a, b, c in v[:frames]] for k, v in STACKS.items()}
    K = {k: _s(k) for k in ("filename", "line", "name")}
    main_tid, bwd_tid = _s(str(139_900_000_000_000 + rank * 4096)), _s(str(139_800_000_000_000 + rank * 4096))
    main_name, bwd_name = _s("python"), _s("pt_autograd_0")
    prof = {}
    out: list[dict[str, Any]] = []
    pg_status: dict[str, dict[str, int]] = {}
    for g in range(first, last + 1):
        step, pos = divmod(g, n)
        spec = SCHEDULE[pos]
        op, dtype = spec.op, spec.dtype
        if spec.stack in ("ag_fwd", "ag_bwd"):
            ins, outs = [[shard]], [[shard * ranks]]
        elif op == "reduce_scatter":
            ins, outs = [[shard * ranks]], [[shard]]
        elif op == "all_to_all":
            counts = _a2a_counts(seed, step, spec.layer, spec.backward, rank // topo.ep, topo.ep)
            # dispatch (first of the pair) sends 2*TOKENS rows and receives counts[i]
            mine = counts[ep_index]
            a, b = (2 * TOKENS, mine) if spec.kind_idx % 2 == 0 else (mine, 2 * TOKENS)
            ins, outs = [[a, HIDDEN]], [[b, HIDDEN]]
        elif spec.kind == "dp":
            ins = outs = [[EXPERT_PARAMS]]
        elif spec.stack == "norm":
            ins = outs = [[1]]
        elif spec.stack == "loss":
            ins = outs = [[2]]
        else:
            ins = outs = [[4]]
        stack = spec.stack
        if g == fault_g and rank == culprit:
            if case == "op_mismatch":
                op = "broadcast"
                stack = "bcast"
            elif case == "size_mismatch":
                bad = shard + 128
                ins, outs = [[bad * ranks]], [[bad]]
            elif case == "dtype_mismatch":
                dtype = "Float"
        state = states.get(g, "completed")
        created = (T0_NS + step * STEP_NS + pos * (STEP_NS // (n + 1))
                   + rng.randrange(0, 400_000))
        started = created + rng.randrange(20_000, 200_000) if state != "scheduled" else None
        completed = started + rng.randrange(500_000, 6_000_000) if state == "completed" else None
        seq = _seq(spec.kind, step, spec)
        name = prof.get(op) or prof.setdefault(op, _s(f"nccl:{op}"))
        dt = _s(dtype)
        out.append({
            "collective_seq_id": seq,
            "frames": [{K["filename"]: f, K["line"]: ln, K["name"]: fn} for fn, f, ln in stacks[stack]],
            "input_dtypes": [dt],
            "input_sizes": ins,
            "is_p2p": False,
            "op_id": seq,
            "output_dtypes": [dt],
            "output_sizes": outs,
            "p2p_seq_id": 0,
            "pg_id": pg_ids[spec.kind],
            "process_group": pgs[spec.kind],
            "profiling_name": name,
            "record_id": _record_id(g),
            "retired": state == "completed",
            "state": _s(state),
            "thread_id": bwd_tid if spec.backward else main_tid,
            "thread_name": bwd_name if spec.backward else main_name,
            "time_created_ns": created,
            "time_discovered_completed_ns": completed,
            "time_discovered_started_ns": started,
            "timeout_ms": TIMEOUT_MS,
        })
        st = pg_status.setdefault(pgs[spec.kind][0], {"last_enqueued_collective": -1,
                                                     "last_started_collective": -1,
                                                     "last_completed_collective": -1})
        st["last_enqueued_collective"] = seq
        if state in ("started", "completed"):
            st["last_started_collective"] = seq
        if state == "completed":
            st["last_completed_collective"] = seq
    pg_config = {name: {"name": name, "desc": desc, "ranks": str(members)}
                 for name, desc, members in groups.values()}
    return {"version": VERSION, "pg_config": pg_config, "comm_lib_version": "2.27.5",
            "pg_status": pg_status, "entries": out}


def write_rank(out_dir: str, prefix: str, rank: int, ranks: int, entries: int, case: str,
               culprit: int | None, seed: int, frames: int) -> int:
    """Write one rank's dump; returns its size in bytes."""
    data = pickle.dumps(rank_dump(rank, ranks, entries, case, culprit, seed, frames), protocol=2)
    path = os.path.join(out_dir, f"{prefix}{rank}")
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
    return len(data)


def _write_star(args: tuple) -> int:
    return write_rank(*args)


def generate(out_dir: str | Path, ranks: int, entries: int, case: str, culprit: int | None = None,
             prefix: str = PREFIX, seed: int = 0, frames: int = FRAMES, workers: int = 1,
             progress: Callable[[int, int], None] | None = None) -> Plant:
    """Write the dump files of ``ranks`` ranks into ``out_dir`` (created), all but those of
    ``plant.missing_ranks``; returns the plant."""
    p = plant(case, ranks, entries, culprit, prefix)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if case in fr_megatron.CASES:
        c = culprit
        fr_megatron.prepare(case, ranks, culprit)  # once, before the writers fork
    else:
        c = p.culprit_ranks[0] if p.culprit_ranks else None
    present = [r for r in range(ranks) if r not in p.missing_ranks]
    jobs = [(str(out), prefix, r, ranks, entries, case, c, seed, frames) for r in present]
    done = 0
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers) as pool:
            for _ in pool.imap_unordered(_write_star, jobs, chunksize=4):
                done += 1
                if progress:
                    progress(done, len(jobs))
    else:
        for j in jobs:
            _write_star(j)
            done += 1
            if progress:
                progress(done, len(jobs))
    p.files = [f"{prefix}{r}" for r in present]
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder to write the dumps into (created)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--case", choices=CASES, default="hang")
    ap.add_argument("--culprit", type=int, default=None, help="planted culprit (default: per case)")
    ap.add_argument("--prefix", default=PREFIX)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--frames", type=int, default=FRAMES, help="stack frames per entry")
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args(argv)
    try:
        p = generate(a.out, a.ranks, a.entries, a.case, a.culprit, a.prefix, a.seed, a.frames,
                     a.workers)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(p.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
