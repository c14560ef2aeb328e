"""The desync verdict over literal traces: one test per rule, none assuming rank 0 is right."""

from __future__ import annotations

import sys

import pytest

from fleet.controlplane.diagnosis import DiagnosisConfig, SignatureTable, TraceBuilder, TraceSet, diagnose

F32, F64 = "float32", "float64"


def op(group, seq, name, ins=((8,),), outs=None, dtype=F32, t=None, done=True):
    return (group, seq, name, ins, ins if outs is None else outs, dtype, t if t is not None else seq * 1000, done)


def traces(spec, members=None, p2p=None, missing_ok=False) -> TraceSet:
    """``spec``: rank -> list of ``op(...)``; ``members``: group -> declared ranks."""
    table = SignatureTable()
    out = {}
    for rank, ops in spec.items():
        b = TraceBuilder(rank, table, source="test")
        b.declare_group("0", "default_pg")  # what a native entry's process_group says
        for g, ranks in (members or {}).items():
            if rank in ranks:
                b.declare_group(g, "default_pg" if g == "0" else g, ranks)
        for g, seq, name, ins, outs, dtype, t, done in ops:
            in_dt = [dtype] * len(ins)
            out_dt = [dtype] * len(outs)
            b.add_collective(g, seq, table.intern(name, ins, outs, in_dt, out_dt), t, 0, done)
        for kind, peer, seq, size, done in (p2p or {}).get(rank, []):
            sizes = ((size,),)
            sig = table.intern(kind, sizes if kind == "send" else (), sizes if kind == "recv" else (),
                               [F32] if kind == "send" else [], [F32] if kind == "recv" else [])
            meta = f"{rank}->{peer}" if kind == "send" else f"{rank}<-{peer}"  # as the native entry names it
            b.add_p2p("0", kind, meta, seq, sig, seq * 1000, done)
        out[rank] = b.finish()
    return TraceSet(source="test", ranks=out, table=table)


def world(n, ops_per_rank):
    return {r: ops_per_rank(r) for r in range(n)}


def steady(n=10, group="0"):
    return [op(group, s, "all_reduce") for s in range(1, n + 1)]


WORLD4 = {"0": [0, 1, 2, 3]}


def test_healthy_run_is_ok():
    d = diagnose(traces(world(4, lambda r: steady()), WORLD4))
    assert (d.verdict, d.culprit_ranks, d.findings) == ("ok", [], [])
    assert {(w.rank, w.last_entered, w.last_completed) for w in d.wavefront} == {(r, 10, 10) for r in range(4)}


def test_rank_that_never_entered_is_the_hang_culprit():
    spec = world(4, lambda r: steady(9 if r == 2 else 10))
    d = diagnose(traces(spec, WORLD4))
    assert d.verdict == "hang" and d.culprit_ranks == [2]
    (f,) = d.findings
    assert (f.kind, f.group, f.seq, f.ranks, f.waiting) == ("missing", "0", 10, [2], [0, 1, 3])
    assert any(w.rank == 0 and w.waiting for w in d.wavefront)


def test_gloo_style_retired_timeouts_still_blame_the_absent_rank():
    # gloo retires a timed-out op as if done: the absent rank is still the culprit
    spec = world(4, lambda r: steady(9) if r == 3 else steady(10))
    d = diagnose(traces(spec, None))  # membership inferred, not declared
    assert d.verdict == "hang" and d.culprit_ranks == [3]


@pytest.mark.parametrize("culprit", [0, 1, 3])
def test_op_mismatch_blames_the_minority_even_rank_0(culprit):
    def ops(r):
        return steady(5) + [op("0", 6, "broadcast" if r == culprit else "all_reduce")]
    d = diagnose(traces(world(4, ops), WORLD4))
    assert d.verdict == "mismatch" and d.culprit_ranks == [culprit]
    assert d.findings[0].kind == "op_mismatch" and d.findings[0].seq == 6


def test_dtype_mismatch_on_rank_0():
    d = diagnose(traces(world(4, lambda r: steady(3) + [op("0", 4, "all_reduce", dtype=F64 if r == 0 else F32)]),
                        WORLD4))
    assert (d.verdict, d.culprit_ranks, d.findings[0].kind) == ("mismatch", [0], "dtype_mismatch")


def test_size_mismatch():
    d = diagnose(traces(world(4, lambda r: steady(3) + [op("0", 4, "all_reduce", ins=((9,) if r == 1 else (8,),))]),
                        WORLD4))
    assert (d.verdict, d.culprit_ranks, d.findings[0].kind) == ("mismatch", [1], "size_mismatch")


def test_size_rules_per_op_accept_legal_differences():
    def ops(r):
        return [
            op("0", 1, "all_gather", ins=((8,),), outs=((32,),)),
            op("0", 2, "reduce_scatter", ins=((32,),), outs=((8,),)),
            # rooted: only the root (rank 2) has the scatter list / gather output
            op("0", 3, "scatter", ins=((8,),) * 4 if r == 2 else (), outs=((8,),)),
            op("0", 4, "gather", ins=((8,),), outs=((8,),) * 4 if r == 2 else ()),
            # uneven all_to_all splits that add up
            op("0", 5, "all_to_all", ins=((4 + r,),), outs=((7 - r,),)),
        ]
    d = diagnose(traces(world(4, ops), WORLD4))
    assert d.verdict == "ok", d.findings


def test_all_to_all_whose_totals_disagree():
    d = diagnose(traces(world(4, lambda r: [op("0", 1, "all_to_all", ins=((4 + r,),), outs=((4,),))]), WORLD4))
    assert d.verdict == "mismatch" and d.findings[0].kind == "size_mismatch"


def test_gather_output_size_on_non_root_must_not_count_but_input_must():
    def ops(r):
        return [op("0", 1, "gather", ins=((5,) if r == 3 else (8,),), outs=((8,),) * 4 if r == 0 else ())]
    d = diagnose(traces(world(4, ops), WORLD4))
    assert (d.verdict, d.culprit_ranks) == ("mismatch", [3])


def test_two_sided_tie_names_both_sides():
    d = diagnose(traces({0: [op("0", 1, "all_reduce")], 1: [op("0", 1, "broadcast")]}, {"0": [0, 1]}))
    assert d.verdict == "mismatch" and d.culprit_ranks == [0, 1]
    assert "no majority" in d.findings[0].detail


def test_subgroup_hang_blames_who_nobody_waits_for():
    # G = {0, 1}: rank 1 never enters G#5 where rank 0 waits; ranks 2, 3 then wait in world #11
    def ops(r):
        world_ops = steady(11 if r in (2, 3) else 10)
        sub = [op("1", s, "all_reduce", t=10_500 + s) for s in range(1, 6 if r == 0 else 5)] if r in (0, 1) else []
        return world_ops + sub
    d = diagnose(traces(world(4, ops), {**WORLD4, "1": [0, 1]}))
    assert d.verdict == "hang" and d.culprit_ranks == [1]
    kinds = {(f.group, f.seq): (f.ranks, f.waiting) for f in d.findings}
    assert kinds[("1", 5)] == ([1], [0])
    assert kinds[("0", 11)] == ([0, 1], [2, 3])


def test_extra_collective_of_a_minority_is_a_mismatch():
    d = diagnose(traces(world(4, lambda r: steady(11 if r == 0 else 10)), WORLD4))
    assert (d.verdict, d.culprit_ranks, d.findings[0].kind) == ("mismatch", [0], "extra")


def test_a_rank_through_a_rooted_op_does_not_hide_the_rank_that_never_came():
    # DDP under a hung rank 1: the step's buffer broadcast (seq 10) let rank 2 through (it
    # got its data from the root) into the first gradient all-reduce (seq 11), while 0 and
    # 3 still wait in the broadcast; rank 1 never entered it
    def ops(r):
        if r == 1:
            return steady(9)
        out = [*steady(9), op("0", 10, "broadcast", done=r == 2)]
        return out + [op("0", 11, "all_reduce", done=False)] if r == 2 else out
    d = diagnose(traces(world(4, ops), WORLD4))
    assert (d.verdict, d.culprit_ranks) == ("hang", [1]), d.findings


def test_deadlock_across_groups_is_a_cycle():
    # rank 0 waits for rank 1 in group A, rank 1 waits for rank 0 in group B
    spec = {0: [op("A", 1, "all_reduce", t=1), op("A", 2, "all_reduce", t=5, done=False), op("B", 1, "all_reduce", t=2)],
            1: [op("A", 1, "all_reduce", t=1), op("B", 1, "all_reduce", t=2), op("B", 2, "all_reduce", t=6, done=False)]}
    d = diagnose(traces(spec, {"A": [0, 1], "B": [0, 1]}))
    assert d.verdict == "hang" and d.culprit_ranks == [0, 1]
    assert any(f.kind == "cycle" for f in d.findings)


def test_unmatched_send_blames_the_silent_partner():
    p2p = {0: [("send", 1, 1, 4, True), ("send", 1, 2, 4, False)], 1: [("recv", 0, 1, 4, True)]}
    d = diagnose(traces(world(2, lambda r: steady(3)), {"0": [0, 1]}, p2p=p2p))
    assert d.verdict == "hang" and d.culprit_ranks == [1]
    assert d.findings[0].kind == "p2p_unmatched" and d.findings[0].waiting == [0]


def test_p2p_size_mismatch():
    p2p = {0: [("send", 1, 1, 4, True)], 1: [("recv", 0, 1, 5, True)]}
    d = diagnose(traces(world(2, lambda r: steady(3)), {"0": [0, 1]}, p2p=p2p))
    assert d.verdict == "mismatch" and d.findings[0].kind == "size_mismatch"


def test_missing_trace_with_everyone_waiting():
    spec = {r: steady(9) + [op("0", 10, "all_reduce", done=False)] for r in (0, 1, 3)}
    d = diagnose(traces(spec, WORLD4))
    assert d.missing_ranks == [2]
    assert d.verdict == "hang" and d.culprit_ranks == [2] and d.findings[0].kind == "no_trace"


def test_missing_trace_inferred_from_rank_numbers():
    # every other rank stopped at world collective 5: in gloo a retired op may be one that
    # failed because a peer died, so the rank that left no file is named, with that evidence
    spec = {r: steady(5) for r in (0, 1, 3)}
    d = diagnose(traces(spec))
    assert d.missing_ranks == [2] and (d.verdict, d.culprit_ranks) == ("hang", [2])
    assert d.findings[0].kind == "no_trace" and "stopped at" in d.findings[0].detail
    assert "no trace from rank 2" in d.summary


def test_straggler_arrives_last_most_of_the_time():
    def ops(r):
        return [op("0", s, "all_reduce", t=s * 100_000_000 + (20_000_000 if r == 2 else r * 1000))
                for s in range(1, 41)]
    d = diagnose(traces(world(4, ops), WORLD4))
    assert d.verdict == "straggler" and d.culprit_ranks == [2]
    assert "20.0 ms" in d.findings[0].detail


def test_no_straggler_when_lateness_is_tiny():
    def ops(r):
        return [op("0", s, "all_reduce", t=s * 100_000_000 + (2000 if r == 2 else 0)) for s in range(1, 41)]
    assert diagnose(traces(world(4, ops), WORLD4)).verdict == "ok"


def test_live_traces_treat_young_waits_as_in_flight():
    spec = world(4, lambda r: steady(9 if r == 2 else 10))
    young = diagnose(traces(spec, WORLD4), now_ns=10_000 + 1_000_000_000)
    old = diagnose(traces(spec, WORLD4), now_ns=10_000 + 60 * 1_000_000_000)
    assert young.verdict == "ok" and old.verdict == "hang"


def test_coalesced_entries_merge_into_one_collective():
    def ops(r):
        out = [op("0", 1, "all_reduce"), op("0", 1, "all_reduce", ins=((4,),))]
        if r == 1:
            out[1] = op("0", 1, "all_reduce", ins=((5,),))
        return out
    d = diagnose(traces(world(3, ops), {"0": [0, 1, 2]}))
    assert (d.verdict, d.culprit_ranks) == ("mismatch", [1])
    assert d.findings[0].kind == "size_mismatch" and "coalesced" in d.findings[0].detail


def test_config_thresholds_apply():
    def ops(r):
        return [op("0", s, "all_reduce", t=s * 100_000_000 + (3_000_000 if r == 2 else 0)) for s in range(1, 41)]
    spec = traces(world(4, ops), WORLD4)
    assert diagnose(spec).verdict == "ok"
    assert diagnose(spec, DiagnosisConfig(straggler_min_lateness_ms=1.0)).verdict == "straggler"


def test_engine_imports_neither_torch_nor_ray():
    import subprocess

    code = ("import sys, controlplane.diagnosis, controlplane.diagnosis.perfetto; "
            "print([m for m in ('torch', 'ray') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
