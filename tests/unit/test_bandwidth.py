"""Bandwidth analytics (controlplane/diagnosis/bandwidth.py): nccl-tests' message sizes and
bus factors, and the per-group figures over hand-built traces with known sizes and times."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.controlplane.diagnosis.bandwidth import (
    DTYPE_BYTES,
    LATE_SKEW_S,
    analyse,
    base_op,
    bench_analytics,
    bus_factor,
    message_bytes,
    tensors_bytes,
)
from fleet.controlplane.diagnosis.traces import SignatureTable, TraceBuilder, TraceSet
from fleet.proto.kinds import Timing
from fleet.proto.vocab import DTYPE_NAMES

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


# --- formulas -------------------------------------------------------------------------

def test_every_dtype_fleet_names_has_a_width():
    missing = set(DTYPE_NAMES.values()) - set(DTYPE_BYTES)
    assert not missing
    assert DTYPE_BYTES["bfloat16"] == 2 and DTYPE_BYTES["float8_e4m3fn"] == 1 and DTYPE_BYTES["complex128"] == 16


@pytest.mark.parametrize("op,n,factor", [
    ("all_reduce", 4, 1.5), ("all_reduce", 2, 1.0), ("all_reduce_coalesced", 8, 1.75),
    ("all_gather", 4, 0.75), ("all_gather_coalesced", 4, 0.75), ("reduce_scatter", 8, 0.875),
    ("all_to_all", 4, 0.75), ("broadcast", 4, 1.0), ("reduce", 16, 1.0), ("send 0->1", 2, 1.0),
    ("coalesced(all_reduce+all_reduce)", 4, 1.5),
])
def test_bus_factor(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


@pytest.mark.parametrize("op,n", [("barrier", 4), ("gather", 4), ("scatter", 4), ("all_reduce", 1),
                                  ("coalesced(all_reduce+broadcast)", 4), ("unknown_op", 4)])
def test_bus_factor_not_rated(op, n):
    assert bus_factor(op, n) is None


def test_all_reduce_size_is_the_buffer():
    assert message_bytes("all_reduce", [(MIB,)], ["float32"], [(MIB,)], ["float32"], 4) == 4 * MIB
    # a coalesced all_reduce: the sum of its tensors, each with its own dtype
    assert message_bytes("all_reduce_coalesced", [(10,), (4, 5)], ["float32", "bfloat16"], [], [], 4) == 40 + 40


def test_all_gather_size_is_the_gathered_output_in_both_forms():
    into_tensor = message_bytes("all_gather", [(100,)], ["bfloat16"], [(400,)], ["bfloat16"], 4)
    list_form = message_bytes("all_gather", [(100,)], ["bfloat16"], [(100,)] * 4, ["bfloat16"] * 4, 4)
    no_output = message_bytes("all_gather", [(100,)], ["bfloat16"], [], [], 4)
    assert into_tensor == list_form == no_output == 800


def test_reduce_scatter_size_is_the_whole_input():
    assert message_bytes("reduce_scatter", [(400,)], ["float32"], [(100,)], ["float32"], 4) == 1600
    assert message_bytes("reduce_scatter", [(100,)] * 4, ["float32"] * 4, [(100,)], ["float32"], 4) == 1600
    assert message_bytes("reduce_scatter", [], [], [(100,)], ["float32"], 4) == 1600


def test_all_to_all_size_is_what_one_rank_sends():
    assert message_bytes("all_to_all", [(8, 16)], ["float16"], [(6, 16)], ["float16"], 4) == 8 * 16 * 2
    # the dump reader's all_to_all keeps the first dimension unknown: not rated
    assert message_bytes("all_to_all", [(-1, 16)], ["float16"], [(-1, 16)], ["float16"], 4) is None


def test_broadcast_and_reduce_sizes():
    assert message_bytes("broadcast", [(3, 3)], ["int64"], [(3, 3)], ["int64"], 8) == 72
    assert message_bytes("reduce", [(5,)], ["float64"], [(5,)], ["float64"], 8) == 40


@pytest.mark.parametrize("args", [
    ("barrier", [], [], [], [], 4),
    ("gather", [(4,)], ["float32"], [(4,)] * 4, ["float32"] * 4, 4),
    ("all_reduce", [(4,)], ["mystery"], [(4,)], ["mystery"], 4),
    ("all_reduce", [(0,)], ["float32"], [(0,)], ["float32"], 4),
    ("coalesced(all_reduce+broadcast)", [(4,), (4,)], ["float32"] * 2, [(4,), (4,)], ["float32"] * 2, 4),
])
def test_message_bytes_not_rated(args):
    assert message_bytes(*args) is None


def test_coalesced_same_op_is_the_sum_of_its_parts():
    assert base_op("coalesced(all_gather+all_gather)") == "all_gather"
    assert message_bytes("coalesced(all_gather+all_gather)", [(2,), (3,)], ["float32"] * 2,
                         [(8,), (12,)], ["float32"] * 2, 4) == 80


def test_tensors_bytes_pairs_dtypes_or_fails():
    assert tensors_bytes([(2, 3), (4,)], ["int32"]) == 40
    assert tensors_bytes([(2,), (4,)], ["int32", "int64", "int8"]) is None


# --- analytics ------------------------------------------------------------------------

MS = 1_000_000  # ns
WRAPPER, ASYNC, NCCL = Timing.WRAPPER.wire, Timing.ASYNC.wire, Timing.NCCL.wire


def traces_of(table: SignatureTable, entries: dict[int, list[tuple]], group: str = "0",
              members: tuple[int, ...] | None = None, compact: bool = False) -> TraceSet:
    """A TraceSet of one group from ``{rank: [(seq, sig, enter_ns, dur_ns, timing), ...]}``."""
    ranks = {}
    for rank, ops in entries.items():
        b = TraceBuilder(rank, table)
        b.declare_group(group, "world", members if members is not None else ())
        for seq, sig, enter, dur, timing in ops:
            b.add_collective(group, seq, sig, enter, enter + max(dur, 1), True, dur_ns=dur, timing=timing)
        trace = b.finish()
        if compact:
            for g in trace.groups.values():
                g.compact()
        ranks[rank] = trace
    return TraceSet(source="test", ranks=ranks, table=table)


def all_reduce_4mib(table: SignatureTable) -> int:
    return table.intern("all_reduce", [(MIB,)], [(MIB,)], ["float32"], ["float32"])


def test_all_reduce_is_rated_with_the_smallest_member_duration():
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    durs = {0: 1.3 * MS, 1: 1.2 * MS, 2: 1.0 * MS, 3: 1.1 * MS}
    enters = {0: 100 * MS, 1: 100 * MS + 200_000, 2: 100 * MS + 300_000, 3: 100 * MS + 100_000}
    traces = traces_of(table, {r: [(1, sig, enters[r], int(durs[r]), NCCL)] for r in range(4)},
                       members=(0, 1, 2, 3))
    report = analyse(traces)
    [row] = report.rows
    assert (row.group, row.desc, row.group_size, row.op, row.bytes) == ("0", "world", 4, "all_reduce", 4 * MIB)
    assert (row.collectives, row.measured, row.timing) == (1, 1, (Timing.NCCL,))
    assert row.t_s == pytest.approx(1e-3)
    assert row.algbw_bps == pytest.approx(4 * MIB / 1e-3)          # 4.194304e9 B/s
    assert row.busbw_bps == pytest.approx(4 * MIB / 1e-3 * 1.5)    # 2(n-1)/n = 1.5
    assert row.busbw_p10_bps == row.busbw_p90_bps == row.busbw_bps
    assert row.skew_s == pytest.approx(300e-6) and row.last_rank == 2 and row.last_share == 1.0
    assert row.utilization is None
    assert report.measured and report.timing_note.startswith("NCCL device timing")


def test_utilization_against_the_groups_link():
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    traces = traces_of(table, {r: [(1, sig, MS, MS, WRAPPER)] for r in range(2)})
    report = analyse(traces, link_bps={"0": 8e9, "other": 1.0})
    [row] = report.rows
    assert row.busbw_bps == pytest.approx(4 * MIB / 1e-3)          # n=2: factor 1
    assert row.utilization == pytest.approx(4 * MIB / 1e-3 / 8e9)
    assert report.timing_note.startswith("wrapper timing (gloo)")


def test_both_all_gather_forms_rate_as_the_gathered_output():
    table = SignatureTable()
    into = table.intern("all_gather", [(1024,)], [(4096,)], ["bfloat16"], ["bfloat16"])
    listed = table.intern("all_gather", [(1024,)], [(1024,)] * 4, ["bfloat16"], ["bfloat16"] * 4)
    traces = traces_of(table, {r: [(1, into, MS, 2 * MS, NCCL), (2, listed, 5 * MS, 2 * MS, NCCL)] for r in range(4)})
    [row] = analyse(traces).rows
    assert (row.op, row.bytes, row.collectives, row.measured) == ("all_gather", 8192, 2, 2)
    assert row.algbw_bps == pytest.approx(8192 / 2e-3)
    assert row.busbw_bps == pytest.approx(8192 / 2e-3 * 0.75)


@pytest.mark.parametrize("op,ins,outs,size,factor", [
    ("reduce_scatter", [(800,)], [(100,)], 3200, 7 / 8),
    ("all_to_all", [(80, 10)], [(80, 10)], 3200, 7 / 8),
    ("broadcast", [(800,)], [(800,)], 3200, 1.0),
    ("reduce", [(800,)], [(800,)], 3200, 1.0),
])
def test_bus_factor_of_each_op_on_eight_ranks(op, ins, outs, size, factor):
    table = SignatureTable()
    sig = table.intern(op, ins, outs, ["float32"] * len(ins), ["float32"] * len(outs))
    traces = traces_of(table, {r: [(1, sig, MS, 4 * MS - r, ASYNC)] for r in range(8)})
    [row] = analyse(traces).rows
    t = (4 * MS - 7) / 1e9
    # an all_to_all's row is the power-of-two bucket its S falls in (S changes with the routing)
    assert (row.bytes, row.group_size, row.bucketed) == ((4096, 8, True) if op == "all_to_all" else (size, 8, False))
    assert row.algbw_bps == pytest.approx(size / t)
    assert row.busbw_bps == pytest.approx(size / t * factor)


def test_uneven_all_to_all_takes_the_largest_send():
    table = SignatureTable()
    sends = {0: 30, 1: 10, 2: 20}
    sigs = {r: table.intern("all_to_all", [(n, 4)], [(20, 4)], ["int32"], ["int32"]) for r, n in sends.items()}
    traces = traces_of(table, {r: [(1, sigs[r], MS, MS, NCCL)] for r in sends})
    [row] = analyse(traces).rows
    assert (row.bytes, row.bucketed) == (512, True)  # S = 30 x 4 x 4 = 480, in the bucket up to 512
    assert row.busbw_bps == pytest.approx(480 / 1e-3 * 2 / 3)


def test_all_to_all_rows_are_buckets_of_their_sizes_each_rated_with_its_own():
    table = SignatureTable()
    # three steps of a 2-rank exchange with routing-dependent sizes: 40, 50 and 100 float32 rows
    entries: dict[int, list] = {0: [], 1: []}
    for seq, rows in ((1, 40), (2, 50), (3, 100)):
        sig = table.intern("all_to_all", [(rows, 1)], [(rows, 1)], ["float32"], ["float32"])
        for r in (0, 1):
            entries[r].append((seq, sig, seq * 10 * MS, MS, WRAPPER))
    rows = analyse(traces_of(table, entries)).rows
    assert [(r.bytes, r.collectives, r.bucketed) for r in rows] == [(256, 2, True), (512, 1, True)]
    # 160 and 200 bytes share the 256 bucket; each collective's busbw uses its own S
    assert rows[0].busbw_bps == pytest.approx((160 + 200) / 2 / 1e-3 * 0.5)
    assert rows[1].busbw_bps == pytest.approx(400 / 1e-3 * 0.5)


def test_skew_percentiles_and_the_usual_last_arriver():
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    # skews 1, 2, 3, 4 ms; rank 3 last in three of four, rank 1 in one
    late = {1: 3, 2: 3, 3: 1, 4: 3}
    entries = {r: [(s, sig, s * 100 * MS + (s * MS if r == late[s] else 0), MS, WRAPPER) for s in late]
               for r in range(4)}
    report = analyse(traces_of(table, entries))
    [row], [group] = report.rows, report.groups
    assert row.skew_s == pytest.approx(2.5e-3)
    assert row.skew_p90_s == pytest.approx(3.7e-3)
    assert (row.last_rank, row.last_share) == (3, 0.75)
    assert (group.skew_s, group.last_rank, group.last_share) == (row.skew_s, 3, 0.75)


def test_last_in_is_counted_over_the_skewed_collectives_where_there_are_any():
    # rank 3 arrives 0.3 s late at the first of each step's 5 collectives; in the other 4,
    # rank 2 is last by a few microseconds (a busy host): counted alike rank 2 would win 12
    # to 3, but of the skewed collectives (>= LATE_SKEW_S) rank 3 is last in every one
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    entries: dict[int, list] = {r: [] for r in range(4)}
    for step in range(3):
        for k in range(5):
            seq = step * 5 + k + 1
            late = {3: 300 * MS} if k == 0 else {2: 5_000}
            for r in range(4):
                entries[r].append((seq, sig, seq * 1000 * MS + late.get(r, 0), MS, WRAPPER))
    report = analyse(traces_of(table, entries))
    [row], [group] = report.rows, report.groups
    assert LATE_SKEW_S <= 0.3
    assert (row.last_rank, row.last_share) == (3, 1.0)
    assert (group.last_rank, group.last_share) == (3, 1.0)


def test_a_tie_for_last_goes_to_the_lowest_rank():
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    entries = {r: [(1, sig, MS if r in (0, 1) else 2 * MS, MS, WRAPPER)] for r in range(3)}
    [row] = analyse(traces_of(table, entries)).rows
    assert (row.last_rank, row.skew_s) == (2, pytest.approx(1e-3))
    entries = {r: [(1, sig, 2 * MS if r in (1, 2) else MS, MS, WRAPPER)] for r in range(3)}
    [row] = analyse(traces_of(table, entries)).rows
    assert row.last_rank == 1


def test_not_measured_is_none_never_a_number():
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    # seq 1: no member measured; seq 2: one member without a duration (its wait is unknown)
    entries = {r: [(1, sig, MS, 0, 0), (2, sig, 9 * MS, 0 if r == 1 else MS, WRAPPER if r != 1 else 0)]
               for r in range(3)}
    report = analyse(traces_of(table, entries))
    [row], [group] = report.rows, report.groups
    assert (row.collectives, row.measured, row.timing) == (2, 0, ())
    for value in (row.t_s, row.algbw_bps, row.busbw_bps, row.busbw_p10_bps, row.busbw_p90_bps, row.utilization):
        assert value is None
    assert row.skew_s == 0.0 and row.bytes == 4 * MIB
    assert not report.measured and report.timing_note.startswith("none: gloo records no completion time")
    # the members' time shares count what they measured themselves
    assert [m.comm_share is None for m in group.shares] == [False, True, False]
    data = report.to_json()
    json.dumps(data)
    assert data["rows"][0]["busbw_bps"] is None and data["measured"] is False


def test_a_collective_missing_a_member_is_not_rated():
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    entries = {r: [(s, sig, s * MS, MS // (s if r == 0 else 1), NCCL) for s in (1, 2, 3) if not (r == 2 and s == 2)]
               for r in range(3)}
    report = analyse(traces_of(table, entries))
    [row], [group] = report.rows, report.groups
    assert (group.collectives, group.incomplete, group.measured) == (2, 1, 2)
    assert row.collectives == 2
    # seqs 1 and 3 rated at 1 ms and 1/3 ms: the median of 1 and 1/3 ms
    assert row.t_s == pytest.approx((1e-3 + 1e-3 / 3) / 2)


def test_a_declared_member_without_a_trace_leaves_the_group_unrated():
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    report = analyse(traces_of(table, {r: [(1, sig, MS, MS, NCCL)] for r in range(3)}, members=(0, 1, 2, 3)))
    [group] = report.groups
    assert (report.rows, group.members, group.collectives, group.incomplete) == ((), (0, 1, 2, 3), 0, 1)
    assert group.skew_s is None and group.last_rank is None
    assert not report.measured


def test_point_to_point_groups_are_left_out():
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    send = table.intern("send 0->1", [(10,)], [], ["float32"], [])
    world = traces_of(table, {r: [(1, sig, MS, MS, NCCL)] for r in range(2)})
    p2p = traces_of(table, {r: [(1, send, MS, MS, NCCL)] for r in range(2)}, group="0:p2p")
    for r, trace in p2p.ranks.items():
        world.ranks[r].groups.update(trace.groups)
    report = analyse(world)
    assert [r.group for r in report.rows] == ["0"] and [g.group for g in report.groups] == ["0"]


def test_time_shares_split_exposed_and_overlap_capable():
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    # rank 0: 2 ms wrapper + 3 ms async inside [0, 100 ms]; an entry past the window is left out
    # rank 1: 4 ms nccl, default window: its first to last enter (10 ms to 50 ms)
    entries = {0: [(1, sig, 10 * MS, 2 * MS, WRAPPER), (2, sig, 50 * MS, 3 * MS, ASYNC),
                   (3, sig, 200 * MS, 7 * MS, WRAPPER)],
               1: [(1, sig, 10 * MS, 4 * MS, NCCL), (2, sig, 50 * MS, 0, 0)]}
    report = analyse(traces_of(table, entries), windows_ns={0: (0, 100 * MS)})
    [group] = report.groups
    s0, s1 = group.shares
    assert (s0.rank, s0.window_s) == (0, 0.1)
    assert s0.comm_share == pytest.approx(0.05)
    assert s0.exposed_share == pytest.approx(0.02) and s0.overlap_capable_share == pytest.approx(0.03)
    assert (s1.rank, s1.window_s) == (1, pytest.approx(0.04))
    assert s1.comm_share == pytest.approx(0.1)
    assert s1.exposed_share == 0.0 and s1.overlap_capable_share == pytest.approx(0.1)
    assert (group.collectives, group.incomplete, group.measured) == (2, 1, 1)


def test_members_come_from_the_ranks_when_undeclared():
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    [group] = analyse(traces_of(table, {r: [(1, sig, MS, MS, NCCL)] for r in (3, 5, 9)})).groups
    assert group.members == (3, 5, 9) and group.collectives == 1


def test_rows_are_sorted_by_group_op_and_bytes():
    table = SignatureTable()
    small = table.intern("all_reduce", [(10,)], [(10,)], ["float32"], ["float32"])
    big = all_reduce_4mib(table)
    gather = table.intern("all_gather", [(10,)], [(20,)], ["float32"], ["float32"])
    barrier = table.intern("barrier", [], [], [], [])
    a = traces_of(table, {r: [(1, big, MS, MS, NCCL), (2, gather, 2 * MS, MS, NCCL), (3, small, 3 * MS, MS, NCCL),
                              (4, barrier, 4 * MS, MS, NCCL)] for r in range(2)}, group="b")
    b = traces_of(table, {r: [(1, small, MS, MS, NCCL)] for r in range(2)}, group="a")
    for r, trace in b.ranks.items():
        a.ranks[r].groups.update(trace.groups)
    report = analyse(a)
    assert [(r.group, r.op, r.bytes) for r in report.rows] == [
        ("a", "all_reduce", 40), ("b", "all_gather", 80), ("b", "all_reduce", 40),
        ("b", "all_reduce", 4 * MIB), ("b", "barrier", None)]
    assert report.rows[-1].busbw_bps is None and report.rows[-1].t_s == pytest.approx(1e-3)
    json.dumps(report.to_json())


def test_compacted_traces_give_the_same_report():
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    entries = {r: [(s, sig, s * 10 * MS + r * 1000, MS + r * s, NCCL if s % 2 else WRAPPER) for s in range(1, 9)]
               for r in range(4)}
    plain = analyse(traces_of(table, entries)).to_json()
    compact = analyse(traces_of(table, entries, compact=True)).to_json()
    assert compact == plain and plain["rows"][0]["measured"] == 8
    assert plain["rows"][0]["timing"] == ["wrapper", "nccl"]


@settings(max_examples=40, deadline=None)
@given(offset=st.integers(min_value=-10**12, max_value=10**12), rank=st.integers(0, 3),
       durs=st.lists(st.integers(1, 10**9), min_size=12, max_size=12))
def test_busbw_does_not_depend_on_a_ranks_clock(offset, rank, durs):
    table = SignatureTable()
    sig = all_reduce_4mib(table)

    def entries(shift: int) -> dict[int, list[tuple]]:
        return {r: [(s, sig, 10**13 + s * 10**10 + r * 1000 + (shift if r == rank else 0), durs[(r * 3 + s) % 12],
                     NCCL) for s in range(1, 4)] for r in range(4)}

    before, after = analyse(traces_of(table, entries(0))), analyse(traces_of(table, entries(offset)))
    fields = ("t_s", "algbw_bps", "busbw_bps", "busbw_p10_bps", "busbw_p90_bps", "measured")
    assert [getattr(before.rows[0], f) for f in fields] == [getattr(after.rows[0], f) for f in fields]
    if offset > 10_000:
        assert after.rows[0].last_rank == rank and after.rows[0].skew_s != before.rows[0].skew_s


def test_a_million_rank_entries_in_seconds():
    seconds = bench_analytics(512, 2000)
    print(f"bandwidth analytics: 512 ranks x 2000 collectives in {seconds:.2f} s")
    assert seconds < 6.0


def test_a_rows_bandwidth_is_its_bytes_over_its_time_as_a_timed_loop_reports_it():
    """nccl-tests times N back-to-back ops and divides: a mean. One slow collective in four
    weighs on the row's busbw as it does on such a loop; the spread shows in p10/p90."""
    table = SignatureTable()
    sig = all_reduce_4mib(table)
    durations = {1: MS, 2: MS, 3: MS, 4: 5 * MS}
    entries = {r: [(s, sig, s * 100 * MS, d, WRAPPER) for s, d in durations.items()] for r in range(4)}
    [row] = analyse(traces_of(table, entries)).rows
    size = 4 << 20
    assert row.t_s == pytest.approx(2e-3)  # (1 + 1 + 1 + 5) / 4 ms
    assert row.algbw_bps == pytest.approx(4 * size / 8e-3)
    assert row.busbw_bps == pytest.approx(4 * size / 8e-3 * 1.5)
    assert row.busbw_p90_bps == pytest.approx(size / 1e-3 * 1.5)  # the fast three
    assert row.busbw_p10_bps < row.busbw_bps < row.busbw_p90_bps
