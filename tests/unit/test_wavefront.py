"""Wavefronts: the controller's live fronts of a large job and the suspects they show.
Pure: literal rows and timestamps, no clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.controlplane.wavefront import Wavefronts
from fleet.proto.fronts import FrontRow, pack

S = 1_000_000_000
NOW = 100 * S


def row(rank: int, group: str, entered: int, completed: int, at_s: float = 90.0, sig: int = 1,
        op: str = "all_reduce", size: int = 4, job: str = "j", attempt: int = 1) -> FrontRow:
    return FrontRow(job, attempt, rank, group, size, entered, completed, int(at_s * S), int(at_s * S),
                    op, sig, entered, 1)


def fronts(*rows: FrontRow) -> Wavefronts:
    w = Wavefronts("j", 1, capacity=2)  # small: the columns must grow
    w.apply([pack(rows)])
    return w


def test_the_member_that_never_entered_is_the_culprit() -> None:
    w = fronts(*(row(r, "g", 8, 7) for r in (0, 1, 3)), row(2, "g", 7, 7))
    v = w.verdict(NOW, settle_s=3.0)
    assert (v.verdict, v.culprits, v.groups, v.waiting) == ("hang", [2], ["g"], 3)
    assert "rank 2 never entered all_reduce seq 8 of group g, in which 3 of 4 members wait" in v.summary
    assert v.members == {"g": [0, 1, 2, 3]}


def test_waits_younger_than_settle_show_nothing() -> None:
    w = fronts(*(row(r, "g", 8, 7, at_s=98.0) for r in (0, 1, 3)), row(2, "g", 7, 7))
    assert w.verdict(NOW, settle_s=3.0) is None


def test_a_rank_blocked_by_another_is_not_blamed() -> None:
    # rank 1 is behind in group b (0 waits on it), but it waits itself in group a on rank 2
    w = fronts(row(0, "b", 5, 4, size=2), row(1, "b", 4, 4, size=2),
               row(1, "a", 9, 8, size=2), row(2, "a", 8, 8, size=2))
    v = w.verdict(NOW, settle_s=1.0)
    assert (v.verdict, v.culprits, v.groups) == ("hang", [2], ["a"])


def test_a_wait_cycle_names_no_culprit() -> None:
    w = fronts(row(0, "a", 5, 4, size=2), row(1, "a", 4, 4, size=2),
               row(1, "b", 3, 2, size=2), row(0, "b", 2, 2, size=2))
    assert w.verdict(NOW, settle_s=1.0) is None


def test_a_different_op_at_the_same_seq_is_a_desync() -> None:
    w = fronts(*(row(r, "g", 8, 7) for r in (0, 1, 2)), row(3, "g", 8, 7, sig=2, op="broadcast"))
    v = w.verdict(NOW, settle_s=3.0)
    assert (v.verdict, v.culprits, v.groups) == ("mismatch", [3], ["g"])
    assert "rank 3 entered broadcast, unlike the other 3 member(s)" in v.summary


def test_a_declared_member_without_fronts_is_behind() -> None:
    w = fronts(*(row(r, "g", 1, 0) for r in (0, 1, 2)))
    w.declare("g", [0, 1, 2, 3])
    v = w.verdict(NOW, settle_s=3.0)
    assert (v.verdict, v.culprits) == ("hang", [3])


def test_point_to_point_groups_and_other_jobs_are_left_out() -> None:
    w = Wavefronts("j", 1)
    w.apply([pack([row(0, "pp:p2p", 9, 8), row(1, "pp:p2p", 3, 3)]),
             pack([row(0, "g", 9, 8, job="other"), row(1, "g", 3, 3, attempt=2)])])
    assert len(w) == 2 and w.verdict(NOW, settle_s=1.0) is None
    w.declare("pp:p2p", [0, 1, 5])
    assert len(w) == 2


def test_a_front_never_moves_back() -> None:
    w = fronts(row(0, "g", 9, 9))
    w.apply([pack([row(0, "g", 8, 8), row(0, "g", 9, 7)])])
    assert [(r.entered_seq, r.completed_seq) for r in w.rows()] == [(9, 9)]
    w.apply([pack([row(0, "g", 9, 9, sig=5), row(0, "g", 10, 9)])])
    assert [(r.entered_seq, r.completed_seq) for r in w.rows()] == [(10, 9)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["a", "b"]), st.integers(0, 20),
                          st.integers(0, 20)), min_size=1, max_size=40),
       st.integers(1, 8), st.randoms(use_true_random=False))
def test_any_split_and_order_of_blocks_gives_the_furthest_front(spec, cut, rnd) -> None:
    rows = [row(r, g, max(e, c), min(e, c)) for r, g, e, c in spec]
    blocks = [rows[i:i + cut] for i in range(0, len(rows), cut)]
    rnd.shuffle(blocks)
    w = Wavefronts("j", 1, capacity=1)
    for b in blocks:
        w.apply([pack(b)])
    want: dict[tuple, tuple] = {}
    for r in rows:
        key = (r.rank, r.group)
        want[key] = max(want.get(key, (-1, -1)), (r.entered_seq, r.completed_seq))
    assert {(r.rank, r.group): (r.entered_seq, r.completed_seq) for r in w.rows()} == want


def test_a_silent_member_is_blamed_only_once_its_nodes_agent_reports() -> None:
    """Declared members no front was heard of: lag while their node's agent sent nothing of
    the attempt (a new attempt under a backlog), the culprit once it did."""
    nodes = ["a", "a", "b", "b"]
    w = Wavefronts("j", 1, nodes=nodes)
    w.declare("g", [0, 1, 2, 3])
    w.apply([pack([row(0, "g", 5, 4), row(1, "g", 5, 4)])])
    assert w.verdict(NOW, settle_s=3.0) is None          # node b: nothing heard yet
    w.apply([pack([row(3, "g", 5, 4)])])                # b's agent reports: rank 2 is silent
    v = w.verdict(NOW, settle_s=3.0)
    assert (v.verdict, v.culprits) == ("hang", [2])
    unguarded = Wavefronts("j", 1)                       # without the node map: the old rule
    unguarded.declare("g", [0, 1, 2, 3])
    unguarded.apply([pack([row(0, "g", 5, 4), row(1, "g", 5, 4)])])
    assert unguarded.verdict(NOW, settle_s=3.0).culprits == [2, 3]
