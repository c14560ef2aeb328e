"""The slow_comm detector and the collective bandwidth metrics: ``CommTracker`` fed literal
rows (exact bus bandwidth, skew, last arriver; what is never rated; its memory bound),
``judge_slow_comm`` on literal windows (each cause named; a rank late once per step named
from the window's few skewed collectives; healthy noise, small messages and sparse windows
left alone; the thresholds' boundaries; no topology), and the gauges ``CollectiveMetrics`` publishes from
real ``CollectiveColumns`` blocks, checked by promtool."""

from __future__ import annotations

import logging
import random
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fleet.controlplane.collective_metrics import CollectiveMetrics
from fleet.controlplane.collective_perf import (
    JUDGE_EVERY_S,
    MIN_RATED_SHARE,
    MIN_SKEWED,
    CommSample,
    CommTracker,
    SlowComm,
    SlowCommMonitor,
    format_bytes,
    format_ranks,
    judge_slow_comm,
    median_skew_s,
)
from fleet.controlplane.config import SlowCommSettings
from fleet.controlplane.store.ingest import prepare
from fleet.proto import columns, events_pb2
from fleet.proto.kinds import IncidentKind, Timing

pytestmark = pytest.mark.timeout(60)

MS = 1_000_000
S_1MIB = 1 << 20                 # all_reduce of [262144] float32
WRAPPER, NCCL, ASYNC = Timing.WRAPPER.wire, Timing.NCCL.wire, Timing.ASYNC.wire


class Row(NamedTuple):
    """``store.CollectiveRow``'s fields, as the watchdog reads them."""

    job_id: str
    attempt: int
    rank: int
    group: str
    seq: int
    group_size: int
    op: str
    input_sizes: str
    input_dtypes: str
    output_sizes: str
    output_dtypes: str
    enter_ns: int
    exit_ns: int | None
    state: str
    exit_estimated: bool
    step: int
    duration_ns: int | None
    timing: int


def row(rank: int, seq: int, enter_ms: float, dur_ms: float | None, *, timing: int = WRAPPER, group: str = "0",
        size: int = 4, state: str = "completed", job: str = "j", attempt: int = 1, op: str = "all_reduce",
        input_sizes: str = "[[262144]]", output_sizes: str = "[[262144]]") -> Row:
    enter = int(enter_ms * MS)
    dur = None if dur_ms is None else int(dur_ms * MS)
    return Row(job, attempt, rank, group, seq, size, op, input_sizes, '["float32"]', output_sizes,
               '["float32"]', enter, enter + (dur or MS), state, False, 0, dur, timing if dur else 0)


# -- the tracker ------------------------------------------------------------------------------

def test_a_collective_is_rated_once_every_member_completed_it() -> None:
    t = CommTracker("j", 1, window=8)
    rows = [row(0, 5, 100.0, 1.3), row(1, 5, 110.0, 1.2), row(2, 5, 120.0, 1.1)]
    others = [row(3, 5, 150.0, 0.5, state="started"), row(3, 5, 150.0, 0.5, job="k"),
              row(3, 5, 150.0, 0.5, attempt=2)]
    assert t.add(rows + others) == 0 and t.windows == {} and t.open == 1   # rank 3 not completed yet
    assert t.add([row(3, 5, 150.0, 1.0)]) == 1
    [s] = t.windows["0"]
    # the last arriver's duration is the transfer: t = 1.0 ms; all_reduce busbw factor 2(n-1)/n
    assert s == CommSample("0", 5, "all_reduce", S_1MIB, 4, 0.001, S_1MIB / 0.001 * 1.5, 0.05, 3)
    assert t.members == {"0": (0, 1, 2, 3)} and t.open == 0
    assert t.add([row(3, 5, 150.0, 1.0)]) == 0 and len(t.windows["0"]) == 1  # sent again: nothing new


def test_the_last_arriver_on_a_tie_is_the_lowest_rank_and_nccl_timing_is_rated() -> None:
    t = CommTracker("j", 1, window=8)
    t.add([row(2, 1, 10.0, 4.0, timing=NCCL, size=3), row(1, 1, 10.0, 2.0, timing=NCCL, size=3),
           row(0, 1, 5.0, 8.0, timing=NCCL, size=3)])
    [s] = t.windows["0"]
    assert (s.last_rank, s.skew_s, s.t_s) == (1, 0.005, 0.002)


def test_a_duration_not_measured_on_every_member_is_never_rated() -> None:
    t = CommTracker("j", 1, window=8)
    t.add([row(0, 1, 0.0, 1.0, size=2), row(1, 1, 2.0, None, size=2)])             # rank 1 not measured
    t.add([row(0, 2, 0.0, 1.0, size=2), row(1, 2, 3.0, 1.0, size=2, timing=ASYNC)])  # issue to completion
    t.add([row(0, 3, 0.0, 1.0, size=2, op="barrier"), row(1, 3, 4.0, 1.0, size=2, op="barrier")])  # no payload
    assert [(s.t_s, s.busbw) for s in t.windows["0"]] == [(None, None), (None, None), (0.001, None)]
    assert [s.skew_s for s in t.windows["0"]] == [0.002, 0.003, 0.004]   # skew needs no duration
    assert [s.nbytes for s in t.windows["0"]] == [S_1MIB, S_1MIB, None]


def test_point_to_point_and_single_member_groups_are_left_out() -> None:
    t = CommTracker("j", 1, window=8)
    t.add([row(0, 1, 0.0, 1.0, group="0:p2p", size=2), row(1, 1, 0.0, 1.0, group="0:p2p", size=2),
           row(0, 1, 0.0, 1.0, group="solo", size=1)])
    assert t.completed == 0 and t.windows == {} and t.open == 0


def test_all_to_all_with_uneven_splits_rates_the_largest_send() -> None:
    t = CommTracker("j", 1, window=8)
    t.add([row(0, 1, 0.0, 2.0, op="all_to_all", size=2, input_sizes="[[1000]]", output_sizes="[[3000]]"),
           row(1, 1, 0.0, 2.0, op="all_to_all", size=2, input_sizes="[[3000]]", output_sizes="[[1000]]")])
    [s] = t.windows["0"]
    assert s.nbytes == 12_000 and s.busbw == pytest.approx(12_000 / 0.002 * 0.5)


def test_memory_is_bounded_when_a_rank_died() -> None:
    t = CommTracker("j", 1, window=4, max_open=3)
    for seq in range(1, 11):                       # rank 1 died: every collective waits for it
        t.add([row(0, seq, seq, 1.0, size=2)])
    assert t.open == 3
    t.add([row(1, 1, 1.0, 1.0, size=2)])           # seq 1 was dropped: it cannot complete
    assert t.completed == 0
    t.add([row(1, 10, 10.0, 1.0, size=2)])         # seq 10 is still open
    assert t.completed == 1
    for seq in range(11, 21):                      # a window keeps its newest samples
        t.add([row(0, seq, seq, 1.0, size=2), row(1, seq, seq, 1.0, size=2)])
    assert [s.seq for s in t.windows["0"]] == [17, 18, 19, 20]


# -- the judge --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Path:
    bandwidth_bps: float
    link: str
    scope: str
    racks: tuple[str, ...]


class Topo:
    """A stand-in for ``controlplane.topology.Topology``: racks of nodes; ``intra_bps`` inside
    a node, ``node_bps`` a node's link, ``uplink_bps`` a rack's (bytes/s); a path's slowest."""

    def __init__(self, racks: dict[str, str], uplink_bps: float = 100e9, node_bps: float = 400e9 / 8,
                 intra_bps: float = 100e9) -> None:
        self.racks, self.uplink_bps, self.node_bps, self.intra_bps = racks, uplink_bps, node_bps, intra_bps

    def rack_of(self, node: str) -> str | None:
        return self.racks.get(node)

    def path(self, nodes: Iterable[str]) -> Path | None:
        on = set(nodes)
        racks = tuple(sorted({self.racks[n] for n in on}))
        if len(on) == 1:
            return Path(self.intra_bps, f"the intra-node link ({self.intra_bps * 8 / 1e9:g} Gbit/s)", "node", racks)
        if len(racks) == 1:
            return Path(self.node_bps, self._node_link(), "rack", racks)
        if self.uplink_bps < self.node_bps:
            return Path(self.uplink_bps, f"rack {racks[-1]} uplink ({self.uplink_bps * 8 / 1e9:g} Gbit/s)",
                        "cross-rack", racks)
        return Path(self.node_bps, self._node_link(), "cross-rack", racks)

    def _node_link(self) -> str:
        return f"the node link ({self.node_bps * 8 / 1e9:g} Gbit/s)"


NODES8 = ["node-0", "node-0", "node-1", "node-1", "node-2", "node-2", "node-3", "node-3"]  # rank -> node
TWO_RACKS = Topo({"node-0": "r1", "node-1": "r1", "node-2": "r2", "node-3": "r2"}, uplink_bps=800e9 / 8,
                 node_bps=1600e9 / 8)
CFG = SlowCommSettings()  # min_utilization 0.5, min_bytes 1 MiB, skew_s 0.1, late_share 0.8, window 128
W = CFG.window


def window(group: str, *, busbw: float | None, op: str = "all_gather", nbytes: int = 4 << 20, n: int = 8,
           count: int = W) -> list[CommSample]:
    """``count`` collectives of ``group``, each measured at ``busbw`` bytes/s (None: not measured),
    1 ms of arrival skew, each member last in turn (no one always last)."""
    return [CommSample(group, seq, op, nbytes, n, None if busbw is None else 0.001, busbw, 0.001, seq % n)
            for seq in range(count)]


def skewed(samples: list[CommSample], lasts: Sequence[int], skew_s: float, every: int = 1) -> list[CommSample]:
    """``samples`` with ``len(lasts)`` of them (every ``every``-th from the first) skewed by
    ``skew_s`` seconds, ``lasts[i]`` entering the i-th of them last."""
    out = list(samples)
    for i, last in enumerate(lasts):
        out[i * every] = replace(out[i * every], skew_s=skew_s, last_rank=last)
    return out


def test_the_defaults_the_boundaries_below_rely_on() -> None:
    assert (CFG.min_utilization, CFG.min_bytes, CFG.skew_s, CFG.late_share, CFG.window) == (0.5, 1 << 20, 0.1,
                                                                                            0.8, 128)
    assert (MIN_SKEWED, MIN_RATED_SHARE) == (4, 4)


def test_a_late_rank_is_named_with_its_node() -> None:
    # 8 collectives per step per group: rank 5 is late for the first of most steps, then on time
    windows = {"3": skewed(window("3", busbw=60e9), [5] * 15 + [1], 0.21, every=8),
               "4": skewed(window("4", busbw=60e9), [5] * 13 + [0] * 3, 0.3, every=8),
               "5": window("5", busbw=60e9)}
    assert median_skew_s(windows["3"]) == 0.001            # the median over all collectives shows nothing
    members = {"3": range(8), "4": range(8), "5": range(8)}
    [f] = judge_slow_comm(windows, members, NODES8, TWO_RACKS, CFG)
    assert (f.cause, f.subject, f.key) == ("late_rank", "5", ("late_rank", "5"))
    assert (f.incident.kind, f.incident.detector, f.incident.rank, f.incident.node) == (
        IncidentKind.SLOW_COMM, "slow_comm", 5, "node-2")
    assert f.incident.evidence == (
        "group 3 (all_gather 4.0 MiB over ranks 0-7): median busbw 60.0 GB/s = 0.60 of rack r2 uplink "
        "(800 Gbit/s); rank 5 (node-2) entered last in 15 of the 16 collectives of the last 128 whose arrival "
        "skew was >= detect.slow_comm.skew_s 0.1 s (median 0.21 s): a late rank, the others wait for it; "
        "also last in group 4 (13/16)")


def test_a_rank_late_once_per_step_is_named_once_the_window_holds_four_such_steps() -> None:
    """16 collectives per step on one group of 4 ranks; rank 2 enters the step's first one 0.3 s
    late and the other 15 on time (the others waited for it in the first): 1 in 16 is skewed."""
    rng = random.Random(19)
    monitor = SlowCommMonitor("j", 1, ["node-0", "node-0", "node-1", "node-1"], None, CFG)
    seqs = iter(range(1, 10_000))

    def step(k: int, late: bool) -> list[SlowComm]:
        rows = []
        for i, seq in zip(range(16), seqs):
            for r in range(4):
                enter_ms = 10_000.0 * k + 20.0 * i + rng.uniform(0.0, 2.0)   # members within 2 ms
                rows.append(row(r, seq, enter_ms + (300.0 if late and i == 0 and r == 2 else 0.0), 1.0))
        monitor.add(rows)
        return monitor.judge(now=10.0 * k)

    assert [f for k in range(8) for f in step(k, late=False)] == []      # a full window of healthy steps
    assert [f for k in range(8, 11) for f in step(k, late=True)] == []   # 3 skewed collectives: too few
    [f] = step(11, late=True)
    assert (f.cause, f.incident.rank, f.incident.node) == ("late_rank", 2, "node-1")
    assert "rank 2 (node-1) entered last in 4 of the 4 collectives of the last 128 whose arrival skew was >= " \
           "detect.slow_comm.skew_s 0.1 s (median 0.30 s)" in f.incident.evidence
    skews = [s.skew_s for s in monitor.tracker.windows["0"]]
    assert len(skews) == W and sum(s >= CFG.skew_s for s in skews) == 4
    assert median_skew_s(monitor.tracker.windows["0"]) < 0.01           # what the median alone would see


def test_healthy_noise_and_too_few_skewed_collectives_name_no_one() -> None:
    members = {"dp": tuple(range(8)), "ep": (0, 2, 4, 6)}
    for seed in range(20):
        rng = random.Random(seed)
        windows = {g: [CommSample(g, seq, "all_reduce", 4 << 20, len(ranks), 0.001, 90e9,
                                  rng.uniform(0.0, 0.0999), rng.choice(ranks)) for seq in range(W)]
                   for g, ranks in members.items()}
        spots = rng.sample(range(W), MIN_SKEWED)
        late = windows["dp"]
        for i in spots[:-1]:                   # MIN_SKEWED - 1 skewed collectives, all rank 3's
            late[i] = replace(late[i], skew_s=rng.uniform(CFG.skew_s, 2.0), last_rank=3)
        assert judge_slow_comm(windows, members, NODES8, TWO_RACKS, CFG) == [], seed
        late[spots[-1]] = replace(late[spots[-1]], skew_s=CFG.skew_s, last_rank=3)   # the fourth
        assert [f.key for f in judge_slow_comm(windows, members, NODES8, TWO_RACKS, CFG)] == [
            ("late_rank", "3")], seed


def test_a_slow_node_is_named_where_healthy_groups_of_its_size_do_not_reach() -> None:
    # pairs of nodes in one rack: node-1's link is slow, so both groups it is in are
    members = {"01": (0, 2), "12": (2, 4), "23": (4, 6), "30": (6, 0)}
    windows = {g: window(g, busbw=10e9 if "1" in g else 45e9, n=2, op="all_reduce") for g in members}
    topo = Topo(dict.fromkeys(["node-0", "node-1", "node-2", "node-3"], "r1"))
    [f] = judge_slow_comm(windows, members, NODES8, topo, CFG)
    assert (f.cause, f.subject, f.incident.rank, f.incident.node) == ("slow_node", "node-1", 2, "node-1")
    assert f.incident.evidence == (
        "node-1: it is in all 2 groups below detect.slow_comm.min_utilization 0.5 and in none of the 2 healthy "
        "groups of their size: a slow node (its links or NIC); group 01 (all_reduce 4.0 MiB over ranks 0, 2): "
        "median busbw 10.0 GB/s = 0.20 of the node link (400 Gbit/s); group 12 (all_reduce 4.0 MiB over ranks "
        "2, 4): median busbw 10.0 GB/s = 0.20 of the node link (400 Gbit/s)")


def test_a_group_on_one_node_below_its_link_names_that_node() -> None:
    [f] = judge_slow_comm({"tp": window("tp", busbw=20e9, n=2)}, {"tp": (6, 7)}, NODES8, TWO_RACKS, CFG)
    assert (f.cause, f.incident.rank, f.incident.node) == ("slow_node", 6, "node-3")
    assert f.incident.evidence.startswith("node-3: group tp runs on it alone: a slow node")


def test_a_cross_rack_group_no_node_explains_is_blamed_on_the_rack_link() -> None:
    members = {"a": (0, 1, 2, 3), "b": (4, 5, 6, 7), "x": tuple(range(8))}
    windows = {"a": window("a", busbw=150e9, n=4), "b": window("b", busbw=150e9, n=4),
               "x": window("x", busbw=30e9, op="all_reduce", nbytes=64 << 20)}
    [f] = judge_slow_comm(windows, members, NODES8, TWO_RACKS, CFG)
    assert (f.cause, f.subject, f.incident.rank, f.incident.node) == ("cross_rack", "x", -1, "")
    assert f.incident.evidence == (
        "group x (all_reduce 64.0 MiB over ranks 0-7): median busbw 30.0 GB/s = 0.30 of rack r2 uplink "
        "(800 Gbit/s), below detect.slow_comm.min_utilization 0.5; the group spans racks r1, r2 and no "
        "single node explains it: the cross-rack link")


def test_nodes_always_in_the_same_slow_groups_are_not_told_apart() -> None:
    # node-0 and node-1 are both in both slow groups, and in no healthy one: no single node
    members = {"p": (0, 2), "q": (1, 3), "r": (4, 6)}
    windows = {"p": window("p", busbw=5e9, n=2), "q": window("q", busbw=5e9, n=2), "r": window("r", busbw=45e9, n=2)}
    found = judge_slow_comm(windows, members, NODES8, Topo(dict.fromkeys(set(NODES8), "r1")), CFG)
    assert sorted((f.cause, f.subject) for f in found) == [("slow_group", "p"), ("slow_group", "q")]
    assert all(f.incident.node == "" and f.incident.rank == -1 for f in found)
    assert "no single node explains it: the group's own links (rack scope)" in found[0].incident.evidence


def test_healthy_groups_and_short_or_sparsely_measured_windows_are_not_flagged() -> None:
    members = {"ok": tuple(range(8)), "short": tuple(range(8)), "sparse": tuple(range(8))}
    rated = W // MIN_RATED_SHARE - 1                          # under a quarter measured: utilization unknown
    windows = {"ok": window("ok", busbw=90e9),
               "short": skewed(window("short", busbw=1e9, count=W - 1), [3] * (W - 1), 1.0),
               "sparse": window("sparse", busbw=1e9)[:rated] + window("sparse", busbw=None)[rated:]}
    assert judge_slow_comm(windows, members, NODES8, TWO_RACKS, CFG) == []


def test_small_messages_never_put_a_group_below_its_floor() -> None:
    members = {"x": tuple(range(8)), "tp": (6, 7)}
    rng = random.Random(19)
    for nbytes in (4, 4 << 10, 256 << 10, CFG.min_bytes - 1):
        # latency-bound: a tiny busbw, far below every link on the path
        windows = {g: [replace(s, busbw=rng.uniform(1e3, 1e8)) for s in window(g, busbw=1.0, nbytes=nbytes,
                                                                                  n=len(ranks))]
                   for g, ranks in members.items()}
        assert judge_slow_comm(windows, members, NODES8, TWO_RACKS, CFG) == [], nbytes
        # the size alone spares them: rated at any size, node-3 (tp's only node, and in x) is blamed
        found = judge_slow_comm(windows, members, NODES8, TWO_RACKS, SlowCommSettings(min_bytes=0))
        assert [f.key for f in found] == [("slow_node", "node-3")], nbytes


def test_the_thresholds_boundaries() -> None:
    members = {"g": (0, 2)}
    topo = Topo(dict.fromkeys(set(NODES8), "r1"))             # the node link: 50 GB/s

    def flagged(samples: list[CommSample], cfg: SlowCommSettings = CFG) -> list[str]:
        return [f.cause for f in judge_slow_comm({"g": samples}, members, NODES8, topo, cfg)]

    assert flagged(window("g", busbw=25e9, n=2)) == []                  # exactly min_utilization: not below
    assert flagged(window("g", busbw=24.9e9, n=2)) == ["slow_group"]
    assert flagged(window("g", busbw=24.9e9, n=2), SlowCommSettings(min_utilization=0)) == []
    assert flagged(window("g", busbw=1e9, n=2, nbytes=CFG.min_bytes)) == ["slow_group"]   # exactly min_bytes
    assert flagged(window("g", busbw=1e9, n=2, nbytes=CFG.min_bytes - 1)) == []

    def mixed(rated: int, busbw: float) -> list[CommSample]:
        """``rated`` large collectives at ``busbw``, the rest small ones at 1 MB/s."""
        return window("g", busbw=busbw, n=2)[:rated] + window("g", busbw=1e6, n=2, nbytes=64 << 10)[rated:]

    quarter = W // MIN_RATED_SHARE
    assert flagged(mixed(quarter, 24.9e9)) == ["slow_group"]            # exactly a quarter rated
    assert flagged(mixed(quarter - 1, 24.9e9)) == []
    assert flagged(mixed(quarter, 40e9)) == []                           # the median is of the large ones

    def late(n_skewed: int, last_in: int, skew_s: float = CFG.skew_s) -> list[tuple[str, int]]:
        samples = skewed(window("g", busbw=None, n=2), [1] * last_in + [0] * (n_skewed - last_in), skew_s, every=3)
        return [(f.cause, f.incident.rank) for f in judge_slow_comm({"g": samples}, members, NODES8, None, CFG)]

    assert late(MIN_SKEWED, MIN_SKEWED) == [("late_rank", 1)]           # exactly MIN_SKEWED at exactly skew_s
    assert late(MIN_SKEWED - 1, MIN_SKEWED - 1) == []
    assert late(MIN_SKEWED, MIN_SKEWED, skew_s=0.0999) == []
    assert late(10, 8) == [("late_rank", 1)]                             # exactly late_share of the skewed
    assert late(10, 7) == []
    assert late(5, 4) == [("late_rank", 1)]
    assert late(5, 3) == []


def test_without_a_topology_only_skew_is_judged() -> None:
    windows = {"g": skewed(window("g", busbw=1e6), [7] * 8, 0.5, every=16)}
    found = judge_slow_comm(windows, {"g": tuple(range(8))}, NODES8, None, CFG)
    assert [(f.cause, f.incident.rank, f.incident.node) for f in found] == [("late_rank", 7, "node-3")]
    assert "busbw" not in found[0].incident.evidence


def test_the_monitor_judges_after_new_samples_at_most_every_interval() -> None:
    cfg = SlowCommSettings(window=4)
    m = SlowCommMonitor("j", 1, ["node-0", "node-1"], None, cfg)
    assert m.judge(now=0.0) == []                                  # nothing yet
    for seq in range(4):                                           # rank 1 last by 0.1 s every time
        m.add([row(0, seq, 1000.0 * seq, 1.0, size=2), row(1, seq, 1000.0 * seq + 100, 1.0, size=2)])
    [f] = m.judge(now=10.0)
    assert (f.key, f.incident.node) == (("late_rank", "1"), "node-1")
    assert m.judge(now=10.0 + JUDGE_EVERY_S) == []                 # no new sample
    m.add([row(0, 9, 9000.0, 1.0, size=2), row(1, 9, 9100.0, 1.0, size=2)])
    assert m.judge(now=10.0 + JUDGE_EVERY_S / 2) == []             # not due
    assert [f.key for f in m.judge(now=10.0 + JUDGE_EVERY_S)] == [("late_rank", "1")]


def test_evidence_formats() -> None:
    assert [format_bytes(n) for n in (512, 1536, 4 << 20, 3 << 30)] == ["512 B", "1.5 KiB", "4.0 MiB", "3.0 GiB"]
    assert format_ranks([3, 0, 1, 2, 8, 10, 9, 12]) == "0-3, 8-10, 12"
    assert format_ranks([]) == "unknown"


# -- the metrics ------------------------------------------------------------------------------

def _block(rows: list[Row]) -> events_pb2.Event:
    """The rows as one ``CollectiveColumns`` block, as the reporter packs it."""
    events = []
    for r in rows:
        c = events_pb2.CollectiveEvent(
            job_id=r.job_id, attempt=r.attempt, rank=r.rank, group=r.group, group_size=r.group_size, seq=r.seq,
            op="allreduce", enter_ns=r.enter_ns, exit_ns=r.exit_ns or 0, state=r.state, input_dtypes=["float32"],
            output_dtypes=["float32"], duration_ns=r.duration_ns or 0, timing=r.timing)
        c.input_sizes.add().dims.extend([262144])
        c.output_sizes.add().dims.extend([262144])
        events.append(c)
    block = columns.pack(events)
    if not len(block.duration_ns):  # a packer older than the duration columns
        block.duration_ns.extend(r.duration_ns or 0 for r in rows)
        block.timing.extend(r.timing for r in rows)
    return events_pb2.Event(collectives=block)


def _fed(topology: Topo | None) -> tuple[CollectorRegistry, CollectiveMetrics]:
    registry = CollectorRegistry()
    feed = CollectiveMetrics(registry, "j", topology=topology)
    feed.set_nodes(1, ["node-0", "node-0", "node-1", "node-1"])
    rows = []
    # arrival sample 8: seqs 8, 16, 24 are rated (t = 2, 1, 4 ms), seq 9's 0.1 ms is not looked at
    for seq, t_ms in ((8, 2.0), (9, 0.1), (16, 1.0), (24, 4.0)):
        rows += [row(r, seq, 1000.0 * seq + 10 * r, t_ms + r) for r in range(4)]
    rows += [row(r, 8, 5.0 * r, 1.0, group="tp", size=2) for r in (0, 1)]       # both on node-0
    feed.observe("node-0", prepare([_block(rows)]))
    assert feed.drain() == 1
    return registry, feed


def test_the_bandwidth_gauges_after_feeding_rows(caplog: pytest.LogCaptureFixture) -> None:
    slow_links = Topo({"node-0": "r1", "node-1": "r1"}, node_bps=1e9, intra_bps=1e8)  # 8, 0.8 Gbit/s
    with caplog.at_level(logging.WARNING, logger="fleet.controlplane.collective_metrics"):
        registry, feed = _fed(slow_links)
    value = registry.get_sample_value
    median_busbw = S_1MIB / 0.002 * 1.5                                  # seq 8's: t = 2 ms
    assert value("fleet_collective_busbw_bytes_per_second", {"job_id": "j", "group": "0", "op": "all_reduce"}) \
        == pytest.approx(median_busbw)
    assert value("fleet_collective_utilization_ratio", {"job_id": "j", "group": "0", "op": "all_reduce"}) \
        == pytest.approx(median_busbw / 1e9)
    assert value("fleet_collective_arrival_skew_seconds", {"job_id": "j", "group": "0"}) == pytest.approx(0.03)
    # tp: 1 MiB in 1 ms x 1 (two members: 2(n-1)/n = 1) is above the declared 0.1 GB/s: shown as 1, and said
    assert value("fleet_collective_busbw_bytes_per_second", {"job_id": "j", "group": "tp", "op": "all_reduce"}) \
        == pytest.approx(S_1MIB / 0.001)
    assert value("fleet_collective_utilization_ratio", {"job_id": "j", "group": "tp", "op": "all_reduce"}) == 1.0
    assert [r.getMessage() for r in caplog.records if "above its slowest link" in r.getMessage()] == [
        "group tp all_reduce: median busbw 1.05e+09 bytes/s is above its slowest link, the intra-node link "
        "(0.8 Gbit/s) (1e+08 bytes/s): the topology understates it; utilization shown as 1"]
    feed.start_attempt(2)                                                 # a new attempt's gauges start empty
    assert value("fleet_collective_busbw_bytes_per_second", {"job_id": "j", "group": "0", "op": "all_reduce"}) is None
    assert value("fleet_collective_arrival_skew_seconds", {"job_id": "j", "group": "0"}) is None


def test_without_a_topology_there_is_no_utilization_and_promtool_accepts_the_gauges() -> None:
    registry, _ = _fed(None)
    text = generate_latest(registry).decode()
    assert "fleet_collective_busbw_bytes_per_second{" in text and "fleet_collective_arrival_skew_seconds{" in text
    assert "fleet_collective_utilization_ratio{" not in text
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing (Debian's prometheus package; scripts/test.sh installs it)"
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), check.stdout + check.stderr
