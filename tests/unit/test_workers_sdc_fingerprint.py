"""workers/sdc.py without ranks: the fingerprint sees every single flipped bit and a
relative error of 1e-3 and fits a float64 exactly; copies are compared by majority;
triage verdicts; triggers against running medians; the snapshot holder keeps the newest
verified snapshot; sdc faults corrupt the element they say."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.proto import events_pb2
from fleet.proto.kinds import FaultKind
from fleet.workers import sdc, snapshot
from fleet.workers.faults import FaultHooks, corrupt_element

pytestmark = pytest.mark.timeout(60)


def _state(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 5, generator=g), torch.randn(3, generator=g) * 1e6, torch.tensor(11.0),
            torch.randn(4, 4, generator=g, dtype=torch.float64)]


_LANES = [0, 2, 1, 3]  # one tensor per lane


def _digests(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    flat = snapshot.FlatState(tensors, _LANES)
    flat.copy_from(tensors)
    return sdc.digests(flat)


def test_fold_prime_sees_every_power_of_two_and_its_wrap_around():
    p = sdc.FOLD_PRIME
    assert p < 2**52 and all(pow(2, j, p) != 1 for j in range(1, 65))  # 2 has order > 64
    assert all((2**j) % p and (2**64 - 2**j) % p for j in range(64))


@settings(max_examples=200, deadline=None)
@given(tensor=st.integers(0, 3), element=st.integers(0, 10**6), bit=st.integers(0, 63))
def test_every_single_bit_flip_changes_the_fingerprint(tensor, element, bit):
    state = _state()
    before = _digests(state)
    t = state[tensor]
    bits = 8 * t.element_size()
    corrupt_element(t, element % t.numel(), bit % bits, 0.0)
    after = _digests(state)
    assert after != before
    # exactly the lane that holds the tensor changed
    assert [i for i in range(4) if after[i] != before[i]] == [_LANES[tensor]]


def test_fingerprint_sees_a_relative_error_and_is_stable_for_equal_state():
    a, b = _state(), _state()
    assert _digests(a) == _digests(b)                    # identical state, identical digests
    corrupt_element(b[0], 17, None, 1e-3)
    assert _digests(a) != _digests(b)
    assert _digests(_state(1)) != _digests(a)
    for d in _digests(a):                                 # exact in a float64 slot
        assert 0 <= d < 2**52 and int(float(d)) == d and int(torch.tensor(float(d), dtype=torch.float64).item()) == d


def test_corrupt_element_flips_the_bit_or_scales():
    t = torch.tensor([1.5, 0.0, -2.0])
    before, after = corrupt_element(t, 0, 31, 0.0)
    assert (before, after) == (1.5, -1.5)                 # the sign bit
    corrupt_element(t, 2, 0, 0.0)
    assert struct.pack("<f", t[2].item()) != struct.pack("<f", -2.0)
    assert corrupt_element(t, 1, None, 1e-3) == (0.0, pytest.approx(1e-3))  # zero becomes rel
    assert corrupt_element(t, 0, None, 0.5) == (-1.5, -2.25)


SETS3 = {"dense": [[0, 1, 2]], "experts": [[0, 1, 2]]}
GOOD = (1, 2, 3, 4)


def test_compare_names_the_minority_and_reports_two_copies_as_undecided():
    assert sdc.compare([GOOD] * 3, SETS3).ok
    found = sdc.compare([GOOD, (1, 9, 3, 4), GOOD], SETS3)
    assert not found.ok and found.suspects == [1] and found.state == "optimizer"
    assert found.expected[1] == GOOD and "dense optimizer" in found.detail[1]
    two = sdc.compare([GOOD, (7, 2, 3, 4)], {"dense": [[0, 1]], "experts": [[0, 1]]})
    assert not two.ok and two.suspects == [] and two.undecided == [[0, 1]] and two.expected[0] is None
    # fully sharded: no copies, nothing to disagree with
    alone = sdc.compare([GOOD, (5, 6, 7, 8)], {"dense": [[0], [1]], "experts": [[0], [1]]})
    assert alone.ok and alone.detail[1] == "no copies to compare"


def test_judge_transient_persistent_ambiguous_clean():
    orig = [GOOD, (9, 2, 3, 4), GOOD]
    found = sdc.compare(orig, SETS3)
    clean = sdc.Replay([GOOD] * 3, {5: [], 6: []})
    v = sdc.judge(orig, found, [clean], SETS3, step=6, base=4)
    assert (v.value, v.suspects, v.rollback_step, v.replays, v.state) == ("transient", [1], 4, 1, "weights")
    again = sdc.Replay([GOOD, (8, 2, 3, 4), GOOD], {5: [], 6: []}, first_mismatch=5)
    v = sdc.judge(orig, found, [again], SETS3, step=6, base=4)
    assert (v.value, v.suspect, v.first_bad_step) == ("persistent", 1, 5)
    assert v.record()["mechanism"] == "fingerprint" and '"rollback_step": 4' in v.detail()

    two = {"dense": [[0, 1]], "experts": [[0, 1]]}
    orig2 = [GOOD, (9, 2, 3, 4)]
    same = sdc.Replay(list(orig2), {5: []})
    v = sdc.judge(orig2, sdc.compare(orig2, two), [same, same], two, step=5, base=4)
    assert (v.value, v.suspects, v.replays) == ("ambiguous", [0, 1], 2)
    healed = sdc.Replay([GOOD, GOOD], {5: []})
    assert sdc.judge(orig2, sdc.compare(orig2, two), [healed], two, step=5, base=4).suspects == [1]

    trig = sdc.Trigger("loss", 5, 60.0, 50.0, "loss 60 > 10 x running median 5")
    ok = sdc.compare([GOOD] * 3, SETS3)
    v = sdc.judge([GOOD] * 3, ok, [sdc.Replay([GOOD] * 3, {5: [], 6: []})], SETS3, step=6, base=4, trigger=trig)
    assert (v.value, v.mechanism, v.suspects) == ("clean", "trigger:loss", [])
    moved = sdc.Replay([(5, 5, 5, 5)] * 3, {5: [2], 6: [0, 1, 2]})
    v = sdc.judge([GOOD] * 3, ok, [moved], SETS3, step=6, base=4, trigger=trig)
    assert (v.value, v.suspects, v.first_bad_step, v.state) == ("transient", [2], 5, "loss")


def test_triggers_need_history_and_fire_above_factor_times_median():
    t = sdc.Triggers(10.0)
    assert all(t.grad_norm(s, 1.0) is None for s in range(1, sdc.MEDIAN_WARMUP + 1))
    assert t.grad_norm(11, 9.9) is None
    hit = t.grad_norm(12, 53.1)
    assert hit is not None and hit.threshold == 10.0 and hit.detail.startswith("grad norm 53.1 > 10 x")
    assert t.loss(1, float("nan")) is None                # no history yet
    off = sdc.Triggers(0.0)
    assert not off.enabled and all(off.loss(s, 1e9 * s) is None for s in range(1, 30))


def test_holder_keeps_the_newest_verified_snapshot_beyond_the_two_newest():
    h, key = snapshot.SnapshotHolder(), ("job", "sdc")
    live = [torch.zeros(3)]
    for step in range(1, 8):
        live[0].fill_(step)
        snap = h.stage(key, step, live, None)
        snap.verified = step == 2
        h.commit(key, snap)
    assert h.newest(key).step == 7 and h.get(key, 6) is not None and h.get(key, 5) is None
    assert h.newest_verified(key).step == 2 and h.get(key, 2).tensors[0].tolist() == [2.0] * 3
    assert h.newest(key, at_most=3).step == 2
    h.drop_newer(key, 2)
    assert h.newest(key).step == 2


def test_sdc_fault_arming_one_shot_and_persistent():
    hooks = FaultHooks(3)
    spec = events_pb2.FaultSpec(kind=FaultKind.SDC.wire, at_step=4, target="grad", bit=7)
    hooks.on_command(events_pb2.Command(command_id="a", fault=spec))
    hooks.on_command(events_pb2.Command(command_id="b", fault=events_pb2.FaultSpec(
        kind=FaultKind.SDC.wire, at_step=2, value_error=1e-3, persistent=True)))
    assert hooks.sdc_due(3, "grad") is None
    f = hooks.sdc_due(5, "grad")
    assert f is not None and f.bit == 7 and hooks.sdc_due(6, "grad") is None   # once
    w = [hooks.sdc_due(s, "weight") for s in (2, 3, 9)]
    assert all(x is not None and x.target == "weight" and x.bit is None for x in w)  # "" = weight, every step
    a, b = torch.ones(10, 10), torch.ones(10, 10)
    hooks.inject_sdc(w[0], 2, [a])
    hooks.inject_sdc(w[0], 3, [b])
    assert torch.equal(a, b) and (a != 1).sum() == 1      # the same element every time
    stuck = FaultHooks(0)
    stuck.on_command(events_pb2.Command(command_id="c", fault=events_pb2.FaultSpec(
        kind=FaultKind.SDC.wire, at_step=1, bit=30, persistent=True)))
    f = stuck.sdc_due(1, "weight")
    t = torch.full((4,), 0.5)
    for step in (1, 2, 3):                                 # a stuck bit, not a toggle
        stuck.inject_sdc(f, step, [t])
        assert (t != 0.5).sum() == 1 and t.max() > 1e30
