"""The Megatron-style job of bench/fr_dumps.py and its hard failure cases.

A TP x PP x DP job with expert parallelism inside the data-parallel dimension, ranks
ordered as Megatron orders them: tensor-parallel fastest (``rank = t + tp * (d + dp * p)``),
so a TP group is ``tp`` consecutive ranks, DP and EP groups are strided by ``tp`` and a
pipeline (PP) group is strided by ``tp * dp``. Every rank calls ``new_group`` for every
group in one fixed order, so group names are creation indexes: "0" the world
("default_pg"), then the TP groups, the PP groups, the DP groups and the EP groups
(descs "tp", "pp", "dp", "ep"). An EP group is ``ep`` consecutive DP ranks of one stage.

One training step of stage ``p`` is a 1F1B schedule over ``2 * pp`` micro-batches: a
forward receives the activation from stage ``p - 1`` (``nccl:recv 1<-0`` on the PP
group, group-local ranks, own rank first), runs per layer a TP all_gather, two uneven EP
all_to_all (dispatch and combine; skipped when ``ep`` is 1) and a TP all_reduce, and
sends its output to stage ``p + 1``; a backward does the same the other way. The last
micro-batch's backward reduce-scatters each layer's gradients over the DP group as it
goes (overlapped gradient reduction); the step ends with a PP all_reduce of the grad
norm, a DP all_gather of each layer's parameters and a world all_reduce of the loss.

NCCL semantics of the entries: ``collective_seq_id`` counts the group's collectives (a
p2p op carries the current count, it does not bump it), ``p2p_seq_id`` counts that
rank's own p2p ops on the group, ``op_id`` counts both, ``record_id`` counts everything
the rank recorded. Sends are asynchronous (the rank goes on, the send stays "started"
until its receiver posts the recv); collectives and recvs block the rank until every
party posted. Where each rank ends up is found by simulating the fault step
(``simulate``), so the ground truth follows from the schedule rather than being written
by hand; the ring of ``entries`` entries has wrapped long before that step.

Cases (``CASES``; the default culprits, ``Layout.rank(t, d, p)``, are chosen per layout):
  megatron_healthy  nothing wrong; every entry completed
  pp_hang           rank (tp-1, dp/2, pp/2) never posts its recv of micro-batch 2's
                    activation: the sender's send stays pending; culprit the non-poster
  p2p_wrong_peer    rank (0, dp/2-1, 2) posts that recv from stage 0 of its PP group,
                    which never sends to it (with pp = 2: from global rank r-1 on the
                    world group); culprit the receiver (verdict "mismatch")
  dead_rank         rank (0, dp-1, 1) dies before a TP all_reduce and leaves no file;
                    the survivors of its groups are pending, the rest wait downstream
  dead_rank_gloo    the same dumps as gloo writes them: no p2p entries, pg_config
                    useless, state "scheduled", every survivor's timed-out collective
                    ``retired``, pg_status keyed by the rank-local pg_id
  blocked_majority  rank (tp-1, 1, pp-1) never enters a TP all_reduce; most ranks are
                    blocked in TP/EP collectives and p2p behind it, while a minority
                    (the other EP blocks of its stage) went ahead into the DP
                    reduce_scatter that the blocked ranks never issued
  stuck_kernel      rank (0, dp-1, 0) entered a TP all_reduce (state "started") that
                    its peers completed; they wait in the next TP collective
  stuck_kernel_active  the same as NCCL ``onlyActive`` dumps: every file holds only
                    its entries not completed; pg_status tells how far each rank got
  stuck_kernel_empty   the same, but the culprit's dump has entries [] (the rank held
                    the GIL) and only its pg_status
  two_culprits      rank (tp-1, 0, 0) never enters a TP all_reduce and rank
                    (0, dp-1, pp-1) never enters the first TP collective of its
                    backward: two independent hangs, both named, nobody else
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

CASES = ("megatron_healthy", "pp_hang", "p2p_wrong_peer", "dead_rank", "dead_rank_gloo",
         "blocked_majority", "stuck_kernel", "stuck_kernel_active", "stuck_kernel_empty",
         "two_culprits")

LAYERS_PER_STAGE = 2
SEQ = 4096              # tokens per micro-batch
HIDDEN = 8192
TOPK = 2
BUCKET = 50_331_648     # gradient elements of one layer's DP bucket (divisible by every dp here)
STEP_NS = 1_400_000_000
T0_NS = 1_795_000_000_000_000_000
INIT_RECORDS = 3
INIT_SEQ = {"world": 1}  # the init barrier; other groups start at 0
TIMEOUT_MS = 600_000
GLOO_SUBGROUP_TIMEOUT_MS = 1_800_000  # gloo's new_group does not inherit the world's timeout
KINDS = ("world", "tp", "pp", "dp", "ep")

_MG = "/workspace/Megatron-LM/megatron/core"
_TORCH = "/usr/local/lib/python3.11/site-packages/torch"
_C10D = f"{_TORCH}/distributed/distributed_c10d.py"
_LOG = ("wrapper", f"{_TORCH}/distributed/c10d_logger.py", 83)
_TRAIN = [("forward_backward_pipelining_without_interleaving", f"{_MG}/pipeline_parallel/schedules.py", 1912),
          ("train_step", "/workspace/Megatron-LM/megatron/training/training.py", 1141),
          ("train", "/workspace/Megatron-LM/megatron/training/training.py", 1873),
          ("pretrain", "/workspace/Megatron-LM/megatron/training/training.py", 681),
          ("<module>", "/workspace/Megatron-LM/pretrain_gpt.py", 318)]
_FWD = [("forward", f"{_MG}/transformer/transformer_layer.py", 451),
        ("forward", f"{_MG}/transformer/transformer_block.py", 549),
        ("forward_step", f"{_MG}/pipeline_parallel/schedules.py", 289)] + _TRAIN
_BWD = [("_engine_run_backward", f"{_TORCH}/autograd/graph.py", 829),
        ("backward", f"{_TORCH}/autograd/__init__.py", 354),
        ("backward_step", f"{_MG}/pipeline_parallel/schedules.py", 371)] + _TRAIN
_P2P = f"{_MG}/pipeline_parallel/p2p_communication.py"
_MAP = f"{_MG}/tensor_parallel/mappings.py"
_MOE = f"{_MG}/transformer/moe/token_dispatcher.py"
_BUF = f"{_MG}/distributed/param_and_grad_buffer.py"

STACKS: dict[str, list[tuple[str, str, int]]] = {
    "send_fwd": [("send", _C10D, 2412), _LOG, ("_p2p_ops", _P2P, 233), ("_communicate", _P2P, 402),
                 ("send_forward", _P2P, 517)] + _TRAIN,
    "recv_fwd": [("recv", _C10D, 2466), _LOG, ("_p2p_ops", _P2P, 251), ("_communicate", _P2P, 402),
                 ("recv_forward", _P2P, 471)] + _TRAIN,
    "send_bwd": [("send", _C10D, 2412), _LOG, ("_p2p_ops", _P2P, 233), ("_communicate", _P2P, 402),
                 ("send_backward", _P2P, 540)] + _TRAIN,
    "recv_bwd": [("recv", _C10D, 2466), _LOG, ("_p2p_ops", _P2P, 251), ("_communicate", _P2P, 402),
                 ("recv_backward", _P2P, 494)] + _TRAIN,
    "tp_ag_fwd": [("all_gather_into_tensor", _C10D, 4413), _LOG, ("_gather_along_first_dim", _MAP, 233),
                  ("forward", _MAP, 336)] + _FWD,
    "tp_ar_fwd": [("all_reduce", _C10D, 3245), _LOG, ("_reduce", _MAP, 26), ("forward", _MAP, 292)] + _FWD,
    "tp_ag_bwd": [("all_gather_into_tensor", _C10D, 4413), _LOG, ("_gather_along_first_dim", _MAP, 233),
                  ("backward", _MAP, 355)] + _BWD,
    "tp_ar_bwd": [("all_reduce", _C10D, 3245), _LOG, ("_reduce", _MAP, 26), ("backward", _MAP, 271)] + _BWD,
    "a2a_fwd": [("all_to_all_single", _C10D, 5131), _LOG, ("all_to_all", f"{_MG}/tensor_parallel/mappings.py", 417),
                ("token_permutation", _MOE, 603)] + _FWD,
    "a2a_bwd": [("all_to_all_single", _C10D, 5131), _LOG, ("all_to_all", f"{_MG}/tensor_parallel/mappings.py", 417),
                ("backward", f"{_MG}/tensor_parallel/mappings.py", 430)] + _BWD,
    "dp_rs": [("reduce_scatter_tensor", _C10D, 4860), _LOG, ("start_grad_sync", _BUF, 365),
              ("register_grad_ready", _BUF, 478), ("hook", f"{_MG}/distributed/distributed_data_parallel.py", 404)] + _BWD,
    "dp_ag": [("all_gather_into_tensor", _C10D, 4413), _LOG, ("start_param_sync", _BUF, 262),
              ("step", f"{_MG}/optimizer/distrib_optimizer.py", 2046)] + _TRAIN[1:],
    "pp_norm": [("all_reduce", _C10D, 3245), _LOG, ("get_grad_norm_fp32", f"{_MG}/optimizer/clip_grads.py", 139),
                ("clip_grad_norm", f"{_MG}/optimizer/optimizer.py", 209)] + _TRAIN[1:],
    "loss": [("all_reduce", _C10D, 3245), _LOG,
             ("average_losses_across_data_parallel_group", "/workspace/Megatron-LM/megatron/training/utils.py", 156),
             ("loss_func", "/workspace/Megatron-LM/pretrain_gpt.py", 171)] + _TRAIN[1:],
}


# --- the job ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """A ``world = tp * pp * dp`` job, EP groups of ``ep`` DP ranks (none when ``ep`` is 1)."""

    world: int
    tp: int
    pp: int
    dp: int
    ep: int

    @property
    def micro_batches(self) -> int:
        return 2 * self.pp

    def rank(self, t: int, d: int, p: int) -> int:
        return t + self.tp * (d + self.dp * p)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(t, d, p)`` of ``rank``."""
        t, rest = rank % self.tp, rank // self.tp
        return t, rest % self.dp, rest // self.dp

    def kinds(self) -> tuple[str, ...]:
        return KINDS if self.ep > 1 else KINDS[:-1]

    def group(self, kind: str, rank: int) -> tuple[str, str, list[int]]:
        """``(name, desc, ranks)`` of the group of ``kind`` that ``rank`` is in."""
        t, d, p = self.coords(rank)
        n_tp, n_pp, n_dp = self.pp * self.dp, self.tp * self.dp, self.pp * self.tp
        if kind == "world":
            return "0", "default_pg", list(range(self.world))
        if kind == "tp":
            return str(1 + p * self.dp + d), "tp", [self.rank(x, d, p) for x in range(self.tp)]
        if kind == "pp":
            return str(1 + n_tp + d * self.tp + t), "pp", [self.rank(t, d, x) for x in range(self.pp)]
        if kind == "dp":
            return str(1 + n_tp + n_pp + p * self.tp + t), "dp", [self.rank(t, x, p) for x in range(self.dp)]
        blocks = self.dp // self.ep
        b = d // self.ep
        name = 1 + n_tp + n_pp + n_dp + (p * self.tp + t) * blocks + b
        return str(name), "ep", [self.rank(t, x, p) for x in range(b * self.ep, (b + 1) * self.ep)]


@functools.lru_cache(maxsize=None)
def layout(world: int) -> Layout:
    """tp2 pp2 below 64 ranks, tp2 pp4 below 512, tp8 pp4 from 512; dp the rest and
    ``ep = dp / 2`` (8: tp2 pp2 dp2 ep1, 64: tp2 pp4 dp8 ep4, 512: tp8 pp4 dp16 ep8)."""
    if world < 8:
        raise ValueError(f"--ranks {world}: the Megatron cases need at least 8 ranks")
    tp, pp = (8, 4) if world >= 512 else ((2, 4) if world >= 64 else (2, 2))
    if world % (tp * pp):
        raise ValueError(f"--ranks {world}: not a multiple of tp * pp = {tp * pp}")
    dp = world // (tp * pp)
    ep = dp // 2 if dp >= 4 and dp % 2 == 0 else 1
    return Layout(world, tp, pp, dp, ep)


@dataclass(frozen=True)
class Op:
    """One op of a stage's step program."""

    kind: str        # coll / send / recv
    gkind: str       # world / tp / pp / dp / ep
    op: str          # all_gather, all_reduce, reduce_scatter, all_to_all, send, recv
    stack: str
    mb: int = -1
    layer: int = 0
    backward: bool = False
    peer: int = 0    # p2p: the peer's stage minus ours
    half: int = 0    # all_to_all: 0 dispatch, 1 combine


@dataclass(frozen=True)
class Program:
    """A stage's step program and its per-op counters (all per step)."""

    ops: tuple[Op, ...]
    colls: dict[str, int]          # collectives per group kind
    p2ps: dict[str, int]           # p2p ops per group kind
    coll_before: tuple[int, ...]   # collectives of the op's group kind before it
    p2p_before: tuple[int, ...]
    recorded: int                  # ops gloo records (collectives)
    recorded_before: tuple[int, ...]


def _layer_ops(lay: Layout, mb: int, layer: int, backward: bool) -> list[Op]:
    tag = "bwd" if backward else "fwd"
    a2a = [Op("coll", "ep", "all_to_all", f"a2a_{tag}", mb, layer, backward, half=h) for h in (0, 1)]
    if lay.ep == 1:
        a2a = []
    ag = Op("coll", "tp", "all_gather", f"tp_ag_{tag}", mb, layer, backward)
    ar = Op("coll", "tp", "all_reduce", f"tp_ar_{tag}", mb, layer, backward)
    return [ar, *a2a, ag] if backward else [ag, *a2a, ar]


@functools.lru_cache(maxsize=None)
def program(lay: Layout, p: int) -> Program:
    """Stage ``p``'s step: 1F1B over ``lay.micro_batches`` micro-batches, then the optimizer."""
    m, last = lay.micro_batches, lay.pp - 1
    warm = min(lay.pp - p - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(m - warm, m)]
    ops: list[Op] = []
    for phase, mb in order:
        if phase == "F":
            if p > 0:
                ops.append(Op("recv", "pp", "recv", "recv_fwd", mb, peer=-1))
            for layer in range(LAYERS_PER_STAGE):
                ops += _layer_ops(lay, mb, layer, False)
            if p < last:
                ops.append(Op("send", "pp", "send", "send_fwd", mb, peer=1))
        else:
            if p < last:
                ops.append(Op("recv", "pp", "recv", "recv_bwd", mb, backward=True, peer=1))
            for layer in reversed(range(LAYERS_PER_STAGE)):
                ops += _layer_ops(lay, mb, layer, True)
                if mb == m - 1:
                    ops.append(Op("coll", "dp", "reduce_scatter", "dp_rs", mb, layer, True))
            if p > 0:
                ops.append(Op("send", "pp", "send", "send_bwd", mb, backward=True, peer=-1))
    ops.append(Op("coll", "pp", "all_reduce", "pp_norm"))
    ops += [Op("coll", "dp", "all_gather", "dp_ag", layer=layer) for layer in range(LAYERS_PER_STAGE)]
    ops.append(Op("coll", "world", "all_reduce", "loss"))
    colls = dict.fromkeys(KINDS, 0)
    p2ps = dict.fromkeys(KINDS, 0)
    cb, pb, rb = [], [], []
    rec = 0
    for o in ops:
        cb.append(colls[o.gkind])
        pb.append(p2ps[o.gkind])
        rb.append(rec)
        if o.kind == "coll":
            colls[o.gkind] += 1
            rec += 1
        else:
            p2ps[o.gkind] += 1
    return Program(tuple(ops), colls, p2ps, tuple(cb), tuple(pb), rec, tuple(rb))


# --- faults and their simulation ----------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    """``how`` rank ``rank`` misbehaves at op ``at`` of its fault-step program: "stop"
    (never posts it), "dead" (the same, and no dump), "stuck" (posts it, never completes
    it, though its peers do), "wrong_peer" (posts a recv from a rank that never sends)."""

    rank: int
    at: int
    how: str


@dataclass(frozen=True)
class Spec:
    case: str
    verdict: str
    backend: str                    # nccl / gloo
    dump: str                       # full / active (onlyActive) / empty (culprit's entries [])
    faults: tuple[Fault, ...]
    detail: str


def _find(lay: Layout, rank: int, case: str, **want: Any) -> int:
    ops = program(lay, lay.coords(rank)[2]).ops
    for i, o in enumerate(ops):
        if all(getattr(o, k) == v for k, v in want.items()):
            return i
    raise ValueError(f"--culprit {rank}: case {case} needs a rank whose pipeline stage has "
                     f"a {want.get('op', want.get('kind'))} there (stage {lay.coords(rank)[2]} has none)")


def _wrong_peer(lay: Layout, rank: int) -> tuple[str, int, int]:
    """``(group kind, global peer, local peer)`` of the wrong recv: stage p-2 of the PP
    group where there is one (it only ever sends to p-1), else global rank r-1 on the
    world group (a rank computed the source as ``rank - 1``)."""
    t, d, p = lay.coords(rank)
    if p >= 2:
        return "pp", lay.rank(t, d, p - 2), p - 2
    return "world", (rank - 1) % lay.world, (rank - 1) % lay.world


def spec(case: str, world: int, culprit: int | None = None) -> Spec:
    """What ``case`` plants in a ``world``-rank job; ``culprit`` moves the (first) culprit."""
    lay = layout(world)
    if culprit is not None and not 0 <= culprit < world:
        raise ValueError(f"--culprit {culprit} is not a rank of a {world}-rank job")
    tp, pp, dp = lay.tp, lay.pp, lay.dp

    def at(default: tuple[int, int, int]) -> int:
        return lay.rank(*default) if culprit is None else culprit

    if case == "megatron_healthy":
        return Spec(case, "ok", "nccl", "full", (), "all entries completed")
    if case == "pp_hang":
        r = at((tp - 1, dp // 2, pp // 2))
        i = _find(lay, r, case, kind="recv", backward=False, mb=2)
        return Spec(case, "hang", "nccl", "full", (Fault(r, i, "stop"),),
                    f"rank {r} never posted its recv of micro-batch 2's activation; the sender's send waits")
    if case == "p2p_wrong_peer":
        r = at((0, max(0, dp // 2 - 1), min(2, pp - 1)))
        i = _find(lay, r, case, kind="recv", backward=False, mb=1)
        kind, peer, _ = _wrong_peer(lay, r)
        return Spec(case, "mismatch", "nccl", "full", (Fault(r, i, "wrong_peer"),),
                    f"rank {r} posted a recv from rank {peer} on its {kind} group, which never sends to it")
    if case in ("dead_rank", "dead_rank_gloo"):
        r = at((0, dp - 1, 1))
        i = _find(lay, r, case, gkind="tp", op="all_reduce", backward=False, mb=1, layer=0)
        return Spec(case, "hang", "gloo" if case.endswith("gloo") else "nccl", "full", (Fault(r, i, "dead"),),
                    f"rank {r} died before a TP all_reduce and left no dump")
    if case == "blocked_majority":
        r = at((tp - 1, 1, pp - 1))
        i = _find(lay, r, case, gkind="tp", op="all_reduce", backward=False, mb=1, layer=0)
        return Spec(case, "hang", "nccl", "full", (Fault(r, i, "stop"),),
                    f"rank {r} never entered a TP all_reduce; a minority went ahead into a DP reduce_scatter")
    if case in ("stuck_kernel", "stuck_kernel_active", "stuck_kernel_empty"):
        r = at((0, dp - 1, 0))
        i = _find(lay, r, case, gkind="tp", op="all_reduce", backward=False, mb=2, layer=0)
        dump = {"stuck_kernel": "full", "stuck_kernel_active": "active", "stuck_kernel_empty": "empty"}[case]
        return Spec(case, "hang", "nccl", dump, (Fault(r, i, "stuck"),),
                    f"rank {r} is stuck in a TP all_reduce its peers completed")
    if case == "two_culprits":
        a = at((tp - 1, 0, 0))
        b = lay.rank(0, dp - 1, pp - 1)
        if b == a or lay.group("tp", b)[0] == lay.group("tp", a)[0]:
            b = lay.rank(0, 0 if lay.coords(a)[1] else dp - 1, pp - 1)
        ia = _find(lay, a, case, gkind="tp", op="all_reduce", backward=False, mb=1, layer=0)
        ib = _find(lay, b, case, gkind="tp", backward=True, mb=0)
        return Spec(case, "hang", "nccl", "full", (Fault(a, ia, "stop"), Fault(b, ib, "stop")),
                    f"ranks {a} and {b} never entered their TP collectives (two independent hangs)")
    raise ValueError(f"unknown case {case!r}; one of {', '.join(CASES)}")


@dataclass(frozen=True)
class Outcome:
    """Where every rank ended the simulated step: ``posted[r]`` ops posted (the last may
    be pending), the round each op was posted and completed in (-1: never)."""

    posted: tuple[int, ...]
    post_round: tuple[tuple[int, ...], ...]
    done_round: tuple[tuple[int, ...], ...]
    rounds: int


def _keys(lay: Layout, rank: int, wrong: dict[int, int]) -> list[tuple]:
    """Match keys of ``rank``'s step ops: a collective by (group, index in the step), a
    p2p op by (group, src, dst, n-th op of that pair and direction in the step)."""
    t, d, p = lay.coords(rank)
    prog = program(lay, p)
    names = {k: lay.group(k, rank)[0] for k in lay.kinds()}
    seen: dict[tuple, int] = {}
    keys = []
    for i, o in enumerate(prog.ops):
        if o.kind == "coll":
            keys.append(("c", names[o.gkind], prog.coll_before[i]))
            continue
        group, peer = names["pp"], lay.rank(t, d, p + o.peer)
        if wrong.get(rank) == i:
            kind, peer, _ = _wrong_peer(lay, rank)
            group = names[kind]
        src, dst = (rank, peer) if o.kind == "send" else (peer, rank)
        pair = (group, src, dst)
        n = seen.get(pair, 0)
        seen[pair] = n + 1
        keys.append(("p", group, src, dst, n))
    return keys


@functools.lru_cache(maxsize=None)
def simulate(lay: Layout, faults: tuple[Fault, ...]) -> Outcome:
    """Run one step of every rank's program with ``faults``, round by round: a rank posts
    its next op; a send lets it go on at once, anything else blocks it until every party
    of the op posted (a collective: every member; a p2p op: its partner)."""
    stop = {f.rank: f.at for f in faults if f.how in ("stop", "dead")}
    stuck = {f.rank: f.at for f in faults if f.how == "stuck"}
    wrong = {f.rank: f.at for f in faults if f.how == "wrong_peer"}
    progs = [program(lay, lay.coords(r)[2]).ops for r in range(lay.world)]
    keys = [_keys(lay, r, wrong) for r in range(lay.world)]
    need: dict[tuple, int] = {}
    for r in range(lay.world):
        for k, o in zip(keys[r], progs[r]):
            if k not in need:
                need[k] = 2 if k[0] == "p" else len(lay.group(o.gkind, r)[2])
    ptr = [0] * lay.world
    post = [[-1] * len(p) for p in progs]
    done = [[-1] * len(p) for p in progs]
    waiting: dict[tuple, list[tuple[int, int]]] = {}
    ready = list(range(lay.world))
    rnd = 0
    while ready:
        nxt: list[int] = []
        for r in ready:
            i = ptr[r]
            if i >= len(progs[r]) or stop.get(r) == i:
                continue
            post[r][i] = rnd
            ptr[r] = i + 1
            key = keys[r][i]
            parties = waiting.setdefault(key, [])
            parties.append((r, i))
            blocking = progs[r][i].kind != "send"
            if len(parties) == need[key]:
                del waiting[key]
                for q, j in parties:
                    if stuck.get(q) == j:
                        continue
                    done[q][j] = rnd
                    if progs[q][j].kind != "send" and q != r:
                        nxt.append(q)
                if stuck.get(r) != i:
                    nxt.append(r)
            elif not blocking:
                nxt.append(r)
        ready = nxt
        rnd += 1
    if not faults and any(ptr[r] < len(progs[r]) or -1 in done[r] for r in range(lay.world)):
        raise RuntimeError(f"the step schedule of {lay} deadlocks")
    return Outcome(tuple(ptr), tuple(map(tuple, post)), tuple(map(tuple, done)), rnd)


# --- the plant's facts -----------------------------------------------------------------------

def fault_step(lay: Layout, entries: int) -> int:
    """The step the fault is in: late enough that every ring has wrapped several times."""
    shortest = min(len(program(lay, p).ops) for p in range(lay.pp))
    return max(1200, 3 * entries // shortest + 10)


def seqs(lay: Layout, rank: int, step: int, i: int) -> tuple[int, int, int]:
    """``(collective_seq_id, p2p_seq_id, op_id)`` of op ``i`` of ``rank``'s step ``step``
    on its own group (a wrong-peer recv on the world group: see ``_seqs_wrong``)."""
    prog = program(lay, lay.coords(rank)[2])
    o = prog.ops[i]
    k = o.gkind
    base = INIT_SEQ.get(k, 0) + step * prog.colls[k] + prog.coll_before[i]
    p2p = step * prog.p2ps[k] + prog.p2p_before[i]
    if o.kind == "coll":
        return base + 1, 0, base + p2p + 1
    return base, p2p + 1, base + p2p + 1


def fault_facts(lay: Layout, entries: int, f: Fault) -> dict[str, Any]:
    """Group, desc, seq, op and record id of fault ``f``'s op (the one never posted, stuck in
    or posted to the wrong peer)."""
    prog = program(lay, lay.coords(f.rank)[2])
    o = prog.ops[f.at]
    step = fault_step(lay, entries)
    name, desc, _ = lay.group(o.gkind, f.rank)
    seq, p2p, _ = seqs(lay, f.rank, step, f.at)
    if f.how == "wrong_peer":
        kind, _, _ = _wrong_peer(lay, f.rank)
        name, desc, _ = lay.group(kind, f.rank)
        if kind == "world":
            p2p = 1
    return {"group": name, "group_desc": desc, "seq": p2p if o.kind != "coll" else seq, "op": o.op,
            "record_id": INIT_RECORDS + step * len(prog.ops) + f.at}


# --- one rank's dump ------------------------------------------------------------------------

_STRS: dict[str, str] = {}


def _s(x: str) -> str:
    return _STRS.setdefault(x, x)


def _a2a_counts(seed: int, step: int, mb: int, layer: int, backward: bool, group: str, size: int,
                rows: int) -> list[int]:
    """Rows each member of an EP group receives: uneven, same total as sent (the same on
    every member: seeded by numbers only, never by ``hash`` of a string)."""
    rng = random.Random(((((seed * 100_003 + step) * 64 + mb) * 8 + layer) * 2 + backward) * 1_000_003
                        + int(group))
    deltas = [rng.randint(-rows // 4, rows // 4) for _ in range(size - 1)]
    deltas.append(-sum(deltas))
    return [rows + x for x in deltas]


def _sizes(lay: Layout, o: Op, gloo: bool, seed: int, step: int, group: str,
           ep_index: int) -> tuple[list, list, str]:
    """``(input_sizes, output_sizes, dtype)`` of op ``o``."""
    local = SEQ // lay.tp
    if o.kind != "coll":
        return [[local, 1, HIDDEN]], [[local, 1, HIDDEN]], "BFloat16"
    if o.gkind == "tp":
        if o.op == "all_reduce":
            return [[SEQ, HIDDEN]], [[SEQ, HIDDEN]], "BFloat16"
        return [[local, HIDDEN]], ([[lay.tp, local, HIDDEN]] if gloo else [[SEQ, HIDDEN]]), "BFloat16"
    if o.gkind == "ep":
        rows = TOPK * local
        mine = _a2a_counts(seed, step, o.mb, o.layer, o.backward, group, lay.ep, rows)[ep_index]
        a, b = (rows, mine) if o.half == 0 else (mine, rows)
        return [[a, HIDDEN]], [[b, HIDDEN]], "BFloat16"
    if o.gkind == "dp":
        shard = BUCKET // lay.dp
        if o.op == "reduce_scatter":
            return [[BUCKET]], ([[BUCKET]] if gloo else [[shard]]), "Float"
        return [[shard]], ([[lay.dp, shard]] if gloo else [[BUCKET]]), "BFloat16"
    return [[1]], [[1]], "Float"


@functools.lru_cache(maxsize=None)
def _setup(case: str, world: int, culprit: int | None) -> tuple[Layout, Spec, Outcome, Outcome]:
    lay = layout(world)
    sp = spec(case, world, culprit)
    return lay, sp, simulate(lay, ()), simulate(lay, sp.faults)


def prepare(case: str, world: int, culprit: int | None = None) -> None:
    """Compute the simulation once (before forking writers, which then inherit it)."""
    _setup(case, world, culprit)


def rank_dump(rank: int, world: int, entries: int, case: str, culprit: int | None = None,
              seed: int = 0, frames: int = 4) -> dict[str, Any]:
    """The dump dict of ``rank`` in ``case``, as ``pickle.load`` returns it."""
    lay, sp, healthy, fault = _setup(case, world, culprit)
    if any(f.rank == rank and f.how == "dead" for f in sp.faults):
        raise ValueError(f"rank {rank} died in case {case}: it leaves no dump")
    gloo = sp.backend == "gloo"
    prog = program(lay, lay.coords(rank)[2])
    ops, n = prog.ops, len(prog.ops)
    step_f = fault_step(lay, entries)
    posted = fault.posted[rank]
    wrong_at = {f.at for f in sp.faults if f.rank == rank and f.how == "wrong_peer"}
    slot = STEP_NS // (healthy.rounds + 2)
    # the ops this dump covers: NCCL records every op, gloo only collectives
    last_g = step_f * n + posted - 1
    if gloo:
        want, gs, g = entries, [], last_g
        while g >= 0 and len(gs) < want:
            if ops[g % n].kind == "coll":
                gs.append(g)
            g -= 1
        gs.reverse()
        window_start = min(gs[0] if gs else last_g, (step_f - 1) * n)
    else:
        first = max(0, last_g - entries + 1)
        gs = range(first, last_g + 1)
        window_start = min(first, (step_f - 1) * n)
    keep = set(gs) if gloo else None
    first_kept = gs[0] if len(gs) else last_g + 1

    groups = {k: lay.group(k, rank) for k in lay.kinds()}
    pg_ids = {k: i for i, k in enumerate(lay.kinds())}
    pgs = {k: (_s(groups[k][0]), _s(groups[k][1])) for k in lay.kinds()}
    local = {k: groups[k][2].index(rank) for k in lay.kinds()}
    rng = random.Random(seed * 1_000_003 + rank)
    stacks = {k: [(_s(a), _s(b), c) for a, b, c in v[:frames]] for k, v in STACKS.items()}
    K = {k: _s(k) for k in ("filename", "line", "name")}
    main_tid, bwd_tid = _s(str(139_900_000_000_000 + rank * 4096)), _s(str(139_800_000_000_000 + rank * 4096))
    main_name, bwd_name = _s("python"), _s("pt_autograd_0")
    backend = "gloo" if gloo else "nccl"
    names: dict[tuple, str] = {}
    timeouts = {k: TIMEOUT_MS if (k == "world" or not gloo) else GLOO_SUBGROUP_TIMEOUT_MS for k in lay.kinds()}
    world_colls = prog.colls["world"]
    out: list[dict[str, Any]] = []
    status: dict[str, dict[str, int]] = {}
    for g in range(window_start, last_g + 1):
        step, i = divmod(g, n)
        o = ops[i]
        if gloo and o.kind != "coll":
            k = o.gkind
            st = status.setdefault(str(pg_ids[k]), {"last_enqueued_collective": -1, "last_started_collective": -1,
                                                    "last_completed_collective": -1})
            _, _, op_id = seqs(lay, rank, step, i)
            st["last_enqueued_collective"] = op_id
            if step < step_f or fault.done_round[rank][i] >= 0:
                st["last_completed_collective"] = op_id
            continue
        in_fault = step == step_f
        rounds = fault if in_fault else healthy
        pr, dr = rounds.post_round[rank][i], rounds.done_round[rank][i]
        completed = dr >= 0
        gk = o.gkind
        seq, p2p_seq, op_id = seqs(lay, rank, step, i)
        pg, pg_id, peer_local = pgs[gk], pg_ids[gk], None
        if o.kind != "coll":
            peer_local = local["pp"] + o.peer
            if i in wrong_at and in_fault:
                kind, _, peer_local = _wrong_peer(lay, rank)
                pg, pg_id = pgs[kind], pg_ids[kind]
                if kind == "world":  # the world's current collective count; its first p2p op
                    seq = INIT_SEQ["world"] + step * world_colls + _world_before(prog, i)
                    p2p_seq, op_id = 1, seq + 1
        base = T0_NS + step * STEP_NS
        if o.kind == "send" or not completed:
            created = base + pr * slot + rng.randrange(0, slot // 4)
        else:
            created = base + dr * slot - rng.randrange(1, slot // 4)
        started = created + rng.randrange(slot // 64, slot // 16)
        # completion comes after the last party posted and started (at most 5/16 of a slot
        # into the round), before the rank's next op
        finished = base + dr * slot + rng.randrange(5 * slot // 16 + 1, slot // 2) if completed else None
        k = pg[0]
        st = status.setdefault(str(pg_id) if gloo else k, {"last_enqueued_collective": -1,
                                                           "last_started_collective": -1,
                                                           "last_completed_collective": -1})
        st["last_enqueued_collective"] = op_id if gloo else seq
        if not gloo:
            st["last_started_collective"] = max(st["last_started_collective"], seq)
        if completed:
            st["last_completed_collective"] = max(st["last_completed_collective"], op_id if gloo else seq)
        if g < first_kept or (keep is not None and g not in keep):
            continue
        if o.kind == "coll":
            key = (o.op,)
        else:
            arrow = "->" if o.kind == "send" else "<-"
            key = (o.op, local[gk] if pg[0] == pgs[gk][0] else rank, arrow, peer_local)
        name = names.get(key)
        if name is None:
            name = names[key] = _s(f"{backend}:{o.op}" if o.kind == "coll" else
                                   f"{backend}:{o.op} {key[1]}{arrow}{peer_local}")
        if gloo and o.op == "reduce_scatter":
            name = names.setdefault(("gloo_rs",), _s("gloo:all_reduce"))
        ins, outs, dtype = _sizes(lay, o, gloo, seed, step, pgs[gk][0], local.get("ep", 0))
        state = "completed" if completed else "started"
        dt = _s(dtype)
        out.append({
            "collective_seq_id": seq,
            "frames": [{K["filename"]: f, K["line"]: ln, K["name"]: fn} for fn, f, ln in stacks[o.stack]],
            "input_dtypes": [dt],
            "input_sizes": ins,
            "is_p2p": o.kind != "coll",
            "op_id": op_id,
            "output_dtypes": [dt],
            "output_sizes": outs,
            "p2p_seq_id": p2p_seq,
            "pg_id": pg_id,
            "process_group": pg,
            "profiling_name": name,
            "record_id": INIT_RECORDS + (step * prog.recorded + prog.recorded_before[i] if gloo else g),
            # gloo: a collective that timed out is retired like one that completed
            "retired": True if gloo else completed,
            "state": _s("scheduled" if gloo else state),
            "thread_id": bwd_tid if o.backward and o.kind == "coll" else main_tid,
            "thread_name": bwd_name if o.backward and o.kind == "coll" else main_name,
            "time_created_ns": created,
            "time_discovered_completed_ns": None if gloo else finished,
            "time_discovered_started_ns": None if gloo else started,
            "timeout_ms": timeouts[gk],
        })
    if sp.dump == "active" or (sp.dump == "empty" and any(f.rank == rank for f in sp.faults)):
        out = [] if sp.dump == "empty" else [e for e in out if e["state"] != "completed"]
    if gloo:
        pg_config = {"": {"name": "", "desc": "", "ranks": "[]"}}
        version = ""
    else:
        pg_config = {groups[k][0]: {"name": groups[k][0], "desc": groups[k][1], "ranks": str(groups[k][2])}
                     for k in lay.kinds()}
        version = "2.27.5"
    return {"version": "2.10", "pg_config": pg_config, "comm_lib_version": version,
            "pg_status": status, "entries": out}


def _world_before(prog: Program, i: int) -> int:
    """World collectives before op ``i`` of a step (a wrong-peer recv on the world group
    carries the world's current count)."""
    return sum(1 for o in prog.ops[:i] if o.kind == "coll" and o.gkind == "world")


def plant_fields(case: str, world: int, entries: int, culprit: int | None = None) -> dict[str, Any]:
    """The plant of ``case``: culprits, verdict, missing ranks and the first fault's facts."""
    lay, sp, _, _ = _setup(case, world, culprit)
    facts = fault_facts(lay, entries, sp.faults[0]) if sp.faults else {
        "group": "0", "group_desc": "default_pg",
        "seq": INIT_SEQ["world"] + (fault_step(lay, entries) + 1) * program(lay, 0).colls["world"],
        "op": "all_reduce",
        "record_id": INIT_RECORDS + (fault_step(lay, entries) + 1) * len(program(lay, 0).ops) - 1}
    return {"culprit_ranks": sorted(f.rank for f in sp.faults), "verdict": sp.verdict, "ep": lay.ep,
            "detail": sp.detail, "layout": f"megatron tp{lay.tp} pp{lay.pp} dp{lay.dp} ep{lay.ep}",
            "backend": sp.backend, "missing_ranks": sorted(f.rank for f in sp.faults if f.how == "dead"),
            **facts}
