"""FrontKeeper: the fronts a node agent sends for a large job, and the raw rows it keeps for a pull."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.agent.fronts import DEFAULT_PULL_LAST, FrontKeeper
from fleet.proto import columns, events_pb2
from fleet.proto.fronts import FrontRow, newest, pack, signature, unpack

pytestmark = pytest.mark.timeout(60)

JOB = "job-1"


def _ev(seq: int, state: str = "started", *, rank: int = 0, group: str = "0", attempt: int = 1,
        op: str = "all_reduce", size: int = 128, step: int = 0, job: str = JOB) -> events_pb2.CollectiveEvent:
    c = events_pb2.CollectiveEvent(
        job_id=job, attempt=attempt, rank=rank, group=group, group_size=4, seq=seq, op=op,
        enter_ns=seq * 1000, exit_ns=seq * 1000 + 500 if state != "started" else 0, state=state,
        step=step or seq)
    c.input_sizes.add().dims.extend([size])
    c.input_dtypes.append("float32")
    c.output_sizes.add().dims.extend([size])
    c.output_dtypes.append("float32")
    return c


def _add(keeper: FrontKeeper, *evs: events_pb2.CollectiveEvent) -> None:
    keeper.add(columns.pack(evs))


def _fronts(keeper: FrontKeeper) -> dict[tuple[int, str], FrontRow]:
    block = keeper.take()
    return {} if block is None else {(r.rank, r.group): r for r in unpack(block)}


def _sig(op: str = "all_reduce", size: int = 128) -> int:
    sizes, dtypes = columns.shapes_json([[size]]), columns.dtypes_json(["float32"])
    return signature(op, sizes, dtypes, sizes, dtypes)


def test_fronts_of_open_and_completed_ops_in_several_groups_and_ranks() -> None:
    k = FrontKeeper()
    _add(k, _ev(1), _ev(1, "completed"), _ev(2),                       # rank 0, group 0: 2 open
         _ev(1, rank=0, group="dp", op="all_gather"), _ev(1, "completed", rank=0, group="dp", op="all_gather"),
         _ev(1, rank=1), _ev(1, "completed", rank=1), _ev(2, rank=1), _ev(2, "failed", rank=1))
    f = _fronts(k)
    assert set(f) == {(0, "0"), (0, "dp"), (1, "0")}
    a = f[(0, "0")]
    assert (a.job_id, a.attempt, a.group_size) == (JOB, 1, 4)
    assert (a.entered_seq, a.completed_seq, a.entered_ns, a.completed_ns, a.op, a.step, a.entered) == \
        (2, 1, 2000, 1500, "all_reduce", 2, 2)
    assert a.open and a.signature == _sig()
    dp = f[(0, "dp")]
    assert (dp.entered_seq, dp.completed_seq, dp.op, dp.open) == (1, 1, "all_gather", False)
    assert dp.signature == _sig("all_gather")
    b = f[(1, "0")]
    assert (b.entered_seq, b.completed_seq, b.completed_ns, b.open) == (2, 2, 2500, False)   # failed counts as done


def test_signature_differs_for_a_different_op_or_size() -> None:
    k = FrontKeeper()
    _add(k, _ev(1, rank=0), _ev(1, rank=1, op="broadcast"), _ev(1, rank=2, size=256), _ev(1, rank=3))
    f = _fronts(k)
    sigs = [f[(r, "0")].signature for r in range(4)]
    assert sigs[0] == sigs[3] == _sig()
    assert len({sigs[0], sigs[1], sigs[2]}) == 3
    assert sigs[1] == _sig("broadcast") and sigs[2] == _sig(size=256)


def test_take_returns_only_changes_and_entered_counts_since_the_last_take() -> None:
    k = FrontKeeper()
    assert k.take() is None
    _add(k, *[_ev(s) for s in (1, 2, 3)], _ev(1, rank=1))
    assert {key: r.entered for key, r in _fronts(k).items()} == {(0, "0"): 3, (1, "0"): 1}
    assert k.take() is None
    _add(k, _ev(1), _ev(2), _ev(1, rank=1))        # repeated rows move nothing
    assert k.take() is None
    _add(k, _ev(3, "completed"))                   # completion only: a change, nothing newly entered
    f = _fronts(k)
    assert list(f) == [(0, "0")] and (f[(0, "0")].completed_seq, f[(0, "0")].entered) == (3, 0)
    _add(k, _ev(4), _ev(5), _ev(6))
    assert _fronts(k)[(0, "0")].entered == 3
    _add(k, _ev(2, "completed"))                   # late, below the front: no change
    assert k.take() is None


def test_untake_sends_the_rows_again_counting_from_before() -> None:
    k = FrontKeeper()
    _add(k, _ev(1), _ev(2))
    lost = k.take()
    _add(k, _ev(3))
    k.untake(lost)
    f = _fronts(k)
    assert (f[(0, "0")].entered_seq, f[(0, "0")].entered) == (3, 3)


def test_pull_returns_the_newest_rows_per_group_in_seq_order() -> None:
    k = FrontKeeper()
    rows = []
    for s in range(1, 11):
        rows += [_ev(s), _ev(s, "completed"), _ev(s, group="dp"), _ev(s, rank=1)]
    _add(k, *rows, _ev(11))
    got = columns.unpack(k.pull(events_pb2.TracePull(job_id=JOB, attempt=1, ranks=[0, 7], last=3)))
    assert [(e.rank, e.group, e.seq, e.state) for e in got] == [
        (0, "0", 9, "completed"), (0, "0", 10, "completed"), (0, "0", 11, "started"),
        (0, "dp", 8, "started"), (0, "dp", 9, "started"), (0, "dp", 10, "started")]
    first = got[0]
    assert (first.job_id, first.attempt, first.op, list(first.input_sizes[0].dims), list(first.input_dtypes),
            first.enter_ns, first.exit_ns, first.step) == (JOB, 1, "all_reduce", [128], ["float32"], 9000, 9500, 9)
    only_dp = columns.unpack(k.pull(events_pb2.TracePull(job_id=JOB, attempt=1, groups=["dp"], last=1)))
    assert [(e.rank, e.group, e.seq) for e in only_dp] == [(0, "dp", 10)]
    every_rank = columns.unpack(k.pull(events_pb2.TracePull(job_id=JOB, attempt=1, last=2)))
    assert {(e.rank, e.group) for e in every_rank} == {(0, "0"), (0, "dp"), (1, "0")}
    assert len(k.pull(events_pb2.TracePull(job_id=JOB, attempt=2)).seq) == 0
    assert len(k.pull(events_pb2.TracePull(job_id="other", attempt=1)).seq) == 0
    assert len(k.pull(events_pb2.TracePull(job_id=JOB, attempt=1, ranks=[5])).seq) == 0


def test_pull_default_and_ring_bound() -> None:
    k = FrontKeeper(ring_entries=100)
    for first in range(1, 301, 50):
        _add(k, *[e for s in range(first, first + 50) for e in (_ev(s), _ev(s, "completed"))])
    default = k.pull(events_pb2.TracePull(job_id=JOB, attempt=1))
    assert list(default.seq) == list(range(300 - DEFAULT_PULL_LAST + 1, 301))
    everything = k.pull(events_pb2.TracePull(job_id=JOB, attempt=1, last=10_000))
    assert list(everything.seq) == list(range(201, 301))
    assert {everything.strings[i] for i in everything.state} == {"completed"}
    assert _fronts(k)[(0, "0")].entered_seq == 300   # the front does not depend on the ring
    with pytest.raises(ValueError, match="ring_entries"):
        FrontKeeper(ring_entries=0)


def test_a_newer_attempt_forgets_the_older_one() -> None:
    k = FrontKeeper()
    _add(k, _ev(1), _ev(2), _ev(1, job="other"))
    _add(k, _ev(1, attempt=2))
    f = unpack(k.take())
    assert sorted((r.job_id, r.attempt, r.entered_seq) for r in f) == [(JOB, 2, 1), ("other", 1, 1)]
    assert len(k.pull(events_pb2.TracePull(job_id=JOB, attempt=1)).seq) == 0
    _add(k, _ev(5, attempt=1))   # a late row of the old attempt is ignored
    assert k.take() is None
    assert len(k.pull(events_pb2.TracePull(job_id=JOB, attempt=1)).seq) == 0
    assert list(k.pull(events_pb2.TracePull(job_id="other", attempt=1)).seq) == [1]


# -- random interleavings against a reference model ------------------------------------------

def _reference(rows: list[tuple[int, int, str]]) -> dict[int, tuple[int, int]]:
    """rank -> (entered_seq, completed_seq) from the rows (rank, seq, state)."""
    out: dict[int, tuple[int, int]] = {}
    for rank, seq, state in rows:
        entered, completed = out.get(rank, (0, 0))
        out[rank] = (max(entered, seq), max(completed, seq) if state != "started" else completed)
    return out


@st.composite
def _interleavings(draw: st.DrawFn) -> list[tuple[int, int, str]]:
    """Rows of 1-3 ranks: each rank enters its ops in order, each completes after it started
    (completions in order), some never complete; ranks interleave at random; some rows repeat."""
    queues = []
    for rank in range(draw(st.integers(1, 3))):
        n = draw(st.integers(0, 12))
        done = draw(st.integers(0, n))
        starts = [(rank, s, "started") for s in range(1, n + 1)]
        ends = [(rank, s, draw(st.sampled_from(["completed", "failed"]))) for s in range(1, done + 1)]
        q: list[tuple[int, int, str]] = []
        while starts or ends:   # a completion never before its start
            if ends and (not starts or ends[0][1] < starts[0][1]) and draw(st.booleans()):
                q.append(ends.pop(0))
            elif starts:
                q.append(starts.pop(0))
            else:
                q.append(ends.pop(0))
        queues.append(q)
    rows: list[tuple[int, int, str]] = []
    while any(queues):
        q = draw(st.sampled_from([q for q in queues if q]))
        rows.append(q.pop(0))
        if draw(st.integers(0, 9)) == 0:
            rows.append(rows[-1])
    return rows


@settings(max_examples=150, deadline=None)
@given(rows=_interleavings(), cut=st.lists(st.integers(0, 60), max_size=4), ring=st.integers(1, 8))
def test_random_interleavings_give_the_reference_front(rows: list[tuple[int, int, str]], cut: list[int],
                                                       ring: int) -> None:
    k = FrontKeeper(ring_entries=ring)
    latest: dict[int, FrontRow] = {}
    entered_total: dict[int, int] = {}
    bounds = sorted({0, len(rows), *[min(c, len(rows)) for c in cut]})
    for lo, hi in zip(bounds, bounds[1:]):   # blocks of random lengths, a take after each
        _add(k, *[_ev(seq, state, rank=rank) for rank, seq, state in rows[lo:hi]])
        for (rank, _), row in _fronts(k).items():
            latest[rank] = row
            entered_total[rank] = entered_total.get(rank, 0) + row.entered
    want = {r: v for r, v in _reference(rows).items()}
    assert {r: (row.entered_seq, row.completed_seq) for r, row in latest.items()} == want
    assert entered_total == {r: v[0] for r, v in want.items()}
    for rank, (entered, _) in want.items():
        kept = k.pull(events_pb2.TracePull(job_id=JOB, attempt=1, ranks=[rank], last=100))
        assert list(kept.seq) == list(range(max(1, entered - ring + 1), entered + 1))


def test_a_job_larger_than_raw_ingest_max_ranks_gets_collective_fronts() -> None:
    from pathlib import Path

    from fleet.controlplane.config import parse_cluster_yaml

    def agent_settings(text: str):  # noqa: ANN202
        return parse_cluster_yaml(text, Path("cluster.yaml")).agent_settings()

    assert not agent_settings("job: {nodes: 2, ranks_per_node: 2}").collective_fronts   # 4 <= 512
    small = agent_settings("agent: {raw_ingest_max_ranks: 4}\njob: {nodes: 2, ranks_per_node: 2}")
    assert not small.collective_fronts
    large = agent_settings("agent: {raw_ingest_max_ranks: 3, ring_entries: 16}\njob: {nodes: 2, ranks_per_node: 2}")
    assert (large.collective_fronts, large.ring_entries) == (True, 16)
    assert agent_settings("{}").ring_entries == 1024
    # a large job batches less often (agent.large_job_batch_interval_s), unless told to batch rarer still
    assert (small.batch_interval_s, large.batch_interval_s) == (0.2, 1.0)
    assert agent_settings("agent: {raw_ingest_max_ranks: 3, batch_interval_s: 2.5}\n"
                          "job: {nodes: 2, ranks_per_node: 2}").batch_interval_s == 2.5
    assert agent_settings("agent: {raw_ingest_max_ranks: 3, large_job_batch_interval_s: 0.1}\n"
                          "job: {nodes: 2, ranks_per_node: 2}").batch_interval_s == 0.2


_front_rows = st.lists(st.tuples(st.sampled_from(["j1", "j2"]), st.integers(1, 2), st.integers(0, 3),
                                 st.sampled_from(["tp0", "dp1"]), st.integers(0, 5), st.integers(0, 5),
                                 st.integers(0, 3)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(rows=_front_rows, cuts=st.lists(st.integers(0, 40), max_size=4))
def test_newest_folds_blocks_like_a_row_by_row_reference(rows: list[tuple], cuts: list[int]) -> None:
    fronts_rows = [FrontRow(j, a, r, g, 4, max(e, c), c, 10 * e, 10 * c, f"op{e}", e, e, n)
                   for j, a, r, g, e, c, n in rows]
    bounds = sorted({0, len(fronts_rows), *(min(c, len(fronts_rows)) for c in cuts)})
    blocks = [pack(fronts_rows[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    want: dict[tuple, FrontRow] = {}
    total: dict[tuple, int] = {}
    for row in fronts_rows:  # later rows win ties, as a report sent later does
        key = row[:4]
        total[key] = total.get(key, 0) + row.entered
        have = want.get(key)
        if have is None or (row.entered_seq, row.completed_seq) >= (have.entered_seq, have.completed_seq):
            want[key] = row
    got = newest(blocks)
    assert len(got) == len(want)
    assert {r[:4]: r._replace(entered=0) for r in got} == {k: r._replace(entered=0) for k, r in want.items()}
    assert {r[:4]: r.entered for r in got} == total
