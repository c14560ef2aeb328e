"""The hard failure classes over literal traces: point-to-point pairing, ranks that left
no file, blocked majorities, entered-never-completed, several culprits at once."""

from __future__ import annotations

from fleet.controlplane.diagnosis import SignatureTable, TraceBuilder, TraceSet, diagnose
from fleet.controlplane.diagnosis.traces import GroupStatus

F32 = "float32"


def build(spec, declared=None, p2p=None, status=None, dumped_ns=0, timeout_ms=0, descs=None) -> TraceSet:
    """``spec``: rank -> [(group, seq, op, done, t)]; ``p2p``: rank -> [(kind, peer, done, t, size)];
    ``status``: rank -> {group: (enqueued, completed)}; ``descs``: group -> desc."""
    table = SignatureTable()
    out = {}
    ranks = set(spec) | set(status or {})
    for rank in sorted(ranks):
        b = TraceBuilder(rank, table, source="test")
        b.declare_group("0", "default_pg")
        for g, d in (descs or {}).items():
            b.declare_group(g, d)
        for g, members in (declared or {}).items():
            if rank in members:
                b.declare_group(g, "", members)
        for g, seq, name, done, t in spec.get(rank, []):
            b.add_collective(g, seq, table.intern(name, ((8,),), ((8,),), [F32], [F32]), t, 0, done)
        for kind, peer, done, t, size in (p2p or {}).get(rank, []):
            sizes = ((size,),)
            sig = table.intern(kind, sizes if kind == "send" else (), sizes if kind == "recv" else (),
                               [F32] if kind == "send" else [], [F32] if kind == "recv" else [])
            meta = f"{rank}->{peer}" if kind == "send" else f"{rank}<-{peer}"
            b.add_p2p("0", kind, meta, 0, sig, t, done)
        trace = b.finish()
        for g, (enq, comp) in (status or {}).get(rank, {}).items():
            trace.status[g] = GroupStatus(enq, enq, comp)
        trace.dumped_ns = dumped_ns
        for g in trace.groups:
            trace.group_timeout_ms[g] = timeout_ms
        out[rank] = trace
    return TraceSet(source="test", ranks=out, table=table)


def steady(group, n, t0=0, done=True):
    return [(group, s, "all_reduce", done, t0 + s * 1000) for s in range(1, n + 1)]


def explain(d):
    return f"{d.verdict} {d.culprit_ranks}: " + " | ".join(f"{f.kind} {f.ranks} w{f.waiting}" for f in d.findings)


# -- point to point ----------------------------------------------------------------------

def test_pending_recv_waits_on_its_sender():
    # pipeline: 0 sends to 1 every micro-batch; at the last one 0 never sends, 1 waits in recv
    n = 6
    p2p = {0: [("send", 1, True, i * 10, 4) for i in range(n - 1)],
           1: [("recv", 0, True, i * 10, 4) for i in range(n - 1)] + [("recv", 0, False, n * 10, 4)]}
    spec = {0: steady("0", 3), 1: steady("0", 3)}
    d = diagnose(build(spec, {"0": [0, 1]}, p2p=p2p))
    assert (d.verdict, d.culprit_ranks) == ("hang", [0]), explain(d)
    f = next(f for f in d.findings if f.kind == "p2p_unmatched")
    assert f.ranks == [0] and f.waiting == [1]


def test_p2p_pairs_by_nth_op_between_the_pair_not_by_p2p_seq_id():
    # rank 1 talks to 0 and 2 alternately; its p2p counter runs twice as fast as either peer's,
    # and the pending ops match one to one: no finding
    p2p = {0: [("send", 1, True, i * 10, 4) for i in range(5)],
           1: [x for i in range(5) for x in (("recv", 0, True, i * 10, 4), ("send", 2, True, i * 10 + 5, 4))],
           2: [("recv", 1, True, i * 10 + 5, 4) for i in range(5)]}
    spec = {r: steady("0", 3) for r in range(3)}
    d = diagnose(build(spec, {"0": [0, 1, 2]}, p2p=p2p))
    assert d.verdict == "ok", explain(d)


def test_recv_from_a_peer_that_never_sends_to_it_names_the_receiver():
    # 2 should receive from 1; it posts a recv from 0, which only ever sends to 1
    p2p = {0: [("send", 1, True, i * 10, 4) for i in range(4)],
           1: [x for i in range(4) for x in (("recv", 0, True, i * 10, 4), ("send", 2, i < 3, i * 10 + 5, 4))],
           2: [("recv", 1, True, i * 10 + 5, 4) for i in range(3)] + [("recv", 0, False, 40, 4)]}
    spec = {r: steady("0", 3) for r in range(3)}
    d = diagnose(build(spec, {"0": [0, 1, 2]}, p2p=p2p))
    assert (d.verdict, d.culprit_ranks) == ("mismatch", [2]), explain(d)
    assert any(f.kind == "p2p_mismatch" and f.ranks == [2] for f in d.findings)


# -- a rank that left no file --------------------------------------------------------------

def test_dead_rank_in_an_inferred_subgroup_is_the_culprit_even_after_gloo_timeouts():
    # gloo-style: no declared members; pairs {0,1}, {2,3}; rank 3 died (no file). Rank 2 timed out
    # in pair "2" (retired, dumped a timeout later); 0 and 1 wait in the world collective 5
    t_dump = 10_000_000_000
    spec = {0: steady("0", 4) + [("0", 5, "all_reduce", False, 9000)] + steady("1", 3),
            1: steady("0", 4) + [("0", 5, "all_reduce", False, 9000)] + steady("1", 3),
            2: steady("0", 4) + steady("2", 3) + [("2", 4, "all_reduce", True, 8000)]}
    d = diagnose(build(spec, dumped_ns=t_dump, timeout_ms=3000))
    assert d.missing_ranks == [3], explain(d)
    assert (d.verdict, d.culprit_ranks) == ("hang", [3]), explain(d)
    pair = next(g for g in d.groups if g.name == "2")
    assert pair.members == (2, 3)


def test_a_rank_without_a_file_is_named_only_for_groups_it_is_in():
    # 0, 1, 2 all stopped in group "T" = {0, 1, 2}; rank 3 (no file) is not in it
    spec = {r: steady("0", 5) + [("T", s, "all_reduce", True, 9000 + s) for s in (1, 2)] for r in (0, 1, 2)}
    d = diagnose(build(spec, {"0": [0, 1, 2, 3], "T": [0, 1, 2]}))
    assert d.missing_ranks == [3] and d.verdict == "ok", explain(d)
    spec = {r: [("T", s, "all_reduce", True, s) for s in (1, 2)] + steady("0", 5, t0=100) for r in (0, 1, 2)}
    d = diagnose(build(spec, {"0": [0, 1, 2, 3], "T": [0, 1, 2]}))
    assert (d.verdict, d.culprit_ranks) == ("hang", [3]), explain(d)  # they stopped in the world group


def test_gloo_ranks_blocked_in_unrecorded_point_to_point_ops_are_not_root_causes():
    # rank 3 died inside its pair {2, 3}; rank 2 stopped there. Ranks 0 and 1 show every entry
    # retired, but their counters on group "1" count an op enqueued and never completed (a recv
    # gloo does not record): they wait, they are not culprits
    spec = {0: steady("0", 4) + steady("1", 3), 1: steady("0", 4) + steady("1", 3),
            2: steady("0", 4) + steady("2", 3, t0=10_000)}
    t = build(spec)
    for r in (0, 1):
        t.ranks[r].status["1"] = GroupStatus(5, 5, 4, counts_p2p=True)
    d = diagnose(t)
    assert (d.verdict, d.culprit_ranks, d.missing_ranks) == ("hang", [3], [3]), explain(d)
    assert any(f.kind == "p2p_unrecorded" and f.waiting == [0, 1] for f in d.findings)


# -- a blocked majority -------------------------------------------------------------------

def test_minority_ahead_of_a_blocked_majority_is_a_consequence():
    # trio {1,2,3}: 3 never enters trio collective 3; 1 and 2 wait there. Rank 0 (not in the trio)
    # went ahead into world collective 5, which 1, 2, 3 never issued.
    trio = [1, 2, 3]
    spec = {0: steady("0", 4) + [("0", 5, "all_reduce", False, 9000)]}
    for r in trio:
        spec[r] = steady("0", 4) + steady("1", 2) + ([] if r == 3 else [("1", 3, "all_reduce", False, 8000)])
    d = diagnose(build(spec, {"0": [0, 1, 2, 3], "1": trio}))
    assert (d.verdict, d.culprit_ranks) == ("hang", [3]), explain(d)


def test_minority_ahead_of_an_idle_majority_issued_an_extra_collective():
    spec = {r: steady("0", 4) for r in range(4)}
    spec[1] = spec[1] + [("0", 5, "broadcast", False, 9000)]
    d = diagnose(build(spec, {"0": [0, 1, 2, 3]}))
    assert (d.verdict, d.culprit_ranks) == ("mismatch", [1]), explain(d)
    assert d.findings[0].kind == "extra"


# -- entered but never completed ----------------------------------------------------------

def test_rank_that_entered_and_never_completed_while_peers_did_is_stuck():
    # NCCL-style: everyone entered 5 and 6; rank 2 never completed 5; the others completed 5, wait in 6
    spec = {r: steady("0", 4) + [("0", 5, "all_reduce", r != 2, 5000), ("0", 6, "all_reduce", False, 6000)]
            for r in range(4)}
    d = diagnose(build(spec, {"0": [0, 1, 2, 3]}))
    assert (d.verdict, d.culprit_ranks) == ("hang", [2]), explain(d)
    f = d.findings[0]
    assert f.kind == "stuck" and f.seq == 5 and f.waiting == [0, 1, 3]


def test_only_active_and_empty_dumps_are_read_from_their_counters():
    # onlyActive: ranks 0, 1, 3 hold only their open collective 6; rank 2's dump is empty (it held
    # the GIL); the counters say 0, 1, 3 completed 5 and rank 2 completed 4 and enqueued 6
    spec = {r: [("0", 6, "all_reduce", False, 6000)] for r in (0, 1, 3)}
    status = {r: {"0": (6, 5)} for r in (0, 1, 3)}
    status[2] = {"0": (6, 4)}
    d = diagnose(build(spec, {"0": [0, 1, 2, 3]}, status=status))
    assert (d.verdict, d.culprit_ranks) == ("hang", [2]), explain(d)
    assert d.findings[0].kind == "stuck"


# -- several at once ----------------------------------------------------------------------

def test_two_independent_hangs_name_both_and_nobody_else():
    # pairs {0,1} and {2,3}: 1 never enters pair-A collective 3, 3 never enters pair-B collective 3
    spec = {0: steady("0", 4) + steady("A", 2) + [("A", 3, "all_reduce", False, 9000)],
            1: steady("0", 4) + steady("A", 2),
            2: steady("0", 4) + steady("B", 2) + [("B", 3, "all_reduce", False, 9000)],
            3: steady("0", 4) + steady("B", 2)}
    d = diagnose(build(spec, {"0": [0, 1, 2, 3], "A": [0, 1], "B": [2, 3]}))
    assert (d.verdict, d.culprit_ranks) == ("hang", [1, 3]), explain(d)


def test_a_mismatch_and_an_independent_hang_are_both_named():
    spec = {0: steady("0", 4) + steady("A", 2) + [("A", 3, "all_reduce", False, 9000)],
            1: steady("0", 4) + steady("A", 2) + [("A", 3, "broadcast", False, 9000)],
            2: steady("0", 4) + steady("B", 2) + [("B", 3, "all_reduce", False, 9000)],
            3: steady("0", 4) + steady("B", 2)}
    d = diagnose(build(spec, {"0": [0, 1, 2, 3], "A": [0, 1], "B": [2, 3]}))
    assert d.verdict == "mismatch" and d.culprit_ranks == [0, 1, 3], explain(d)  # a tie names both sides
