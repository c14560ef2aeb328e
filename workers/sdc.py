"""Silent-data-corruption checks of the built-in trainer: fingerprints, copy comparison,
triggers, and the verdict of a triage.

Fingerprint. After the optimizer step a rank's training state is digested in four
lanes (``LANES``): dense weights (parameters and buffers such as MoE router biases),
dense optimizer state (AdamW's exp_avg, exp_avg_sq, step), and the same two for expert
parameters (those under a module named ``experts``). A lane's digest is the sum of the
state's bits read as 64-bit integers, with wrap-around, folded modulo ``FOLD_PRIME``
(< 2**52) so that it travels exactly in a float64 slot of the step's all-reduce. A float
sum could cancel; this one cannot for a single flipped bit: it changes the 64-bit sum by
+-2**j (j < 64), and neither 2**j nor 2**64 - 2**j is a multiple of the prime (2 has an
order above 64 modulo it, checked by the tests). The words are read from the
snapshot's packed buffers (workers/snapshot.py ``FlatState``): one sum per buffer.

Comparison. ``parallel.replica_sets`` says which ranks' state of each class must be
bit-identical; ``compare`` takes every rank's digests (all ranks hold all of them after
the all-reduce) and names, in each set with a strict majority, the ranks that differ
from it. Two copies that differ have no majority.

Triggers (``Triggers``): a global gradient norm, a global loss, or a rank's update size
above ``factor`` times its running median forces a check; ``judge`` turns the original
digests and those of the re-executed steps into a ``Verdict``. Everything here except
the digest sums is plain Python: the trainer (workers/trainer.py) runs the steps.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fleet.workers import parallel
from fleet.workers.snapshot import FlatState

#: Digest lanes of one rank, in slot order.
LANES = ("dense weights", "dense optimizer", "experts weights", "experts optimizer")
#: State classes and the lanes (weights, optimizer) of each.
CLASS_LANES = {"dense": (0, 1), "experts": (2, 3)}
#: Digests are folded modulo this prime (2**52 - 47) to fit a float64 exactly.
FOLD_PRIME = 2**52 - 47
_MASK64 = (1 << 64) - 1

#: Re-executions per triage, at most (a second one only when the first was ambiguous).
MAX_REPLAYS = 2
#: A trigger whose check finds the copies equal replays at most once per this many steps.
TRIGGER_TRIAGE_EVERY = 50
#: Triage replays at most this many steps (older verified state: the mismatch is reported).
MAX_REPLAY_STEPS = 100
#: Running medians: window and the samples needed before a trigger can fire.
MEDIAN_WINDOW = 20
MEDIAN_WARMUP = 10


# ---- digests ---------------------------------------------------------------------------

def fold(total: int) -> int:
    """A 64-bit word sum (any Python int, read modulo 2**64) folded below 2**52."""
    return (total & _MASK64) % FOLD_PRIME


def digests(state: FlatState) -> tuple[int, ...]:
    """This rank's digest per lane of a packed state copy."""
    return tuple(fold(s) for s in state.group_sums(len(LANES)))


def bit_sum(t: torch.Tensor) -> int:
    """The bits of ``t``'s elements read as integers of their width, summed (one call)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return int(t.contiguous().view(ints).sum(dtype=torch.int64).item())


def hex_digest(lanes: Sequence[int]) -> str:
    """A rank's lanes as text (55 characters): ``dddddddddddd-...``."""
    return "-".join(f"{d:013x}" for d in lanes)


def state_lanes(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    """The lane of every tensor of ``snapshot.state_tensors(model, optimizer)``, same order."""
    experts = parallel.expert_param_ids(model)
    out = [2 if id(p) in experts else 0 for p in model.parameters()]
    for name, _ in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        out.append(2 if f".{parallel.EXPERTS}." in f".{name}" else 0)
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            lane = 3 if id(p) in experts else 1
            out.extend(lane for key in sorted(state) if isinstance(state[key], torch.Tensor))
    return out


# ---- comparison ------------------------------------------------------------------------

@dataclass
class Comparison:
    """What one check found. ``expected[r]``: the majority lanes for rank r's copies
    (None where some set of r has no majority)."""

    ok: bool
    suspects: list[int] = field(default_factory=list)      # differ from a majority
    undecided: list[list[int]] = field(default_factory=list)  # sets that differ without a majority
    state: str = ""                                         # "weights" | "optimizer" | "weights+optimizer"
    expected: dict[int, tuple[int, ...] | None] = field(default_factory=dict)
    detail: dict[int, str] = field(default_factory=dict)


def _majority(values: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    best = max(set(values), key=values.count)
    return best if values.count(best) * 2 > len(values) else None


def compare(lanes: Sequence[Sequence[int]], sets: dict[str, list[list[int]]]) -> Comparison:
    """Compare every rank's digests (``lanes[rank]``) across the copies of each class."""
    world = len(lanes)
    expected: dict[int, list[int | None]] = {r: list(lanes[r]) for r in range(world)}
    copies: dict[int, list[str]] = {r: [] for r in range(world)}
    bad_lanes: set[int] = set()
    suspects: set[int] = set()
    undecided: list[list[int]] = []
    for cls, (w, o) in CLASS_LANES.items():
        for members in sets.get(cls, []):
            values = [(lanes[r][w], lanes[r][o]) for r in members]
            if len(members) > 1:
                for r in members:
                    copies[r].append(f"{cls} ranks {members}")
            if len(set(values)) == 1:
                continue
            major = _majority(values)
            for r, v in zip(members, values, strict=True):
                if major is None:
                    expected[r][w] = expected[r][o] = None
                elif v != major:
                    suspects.add(r)
                    expected[r][w], expected[r][o] = major
                ref = major if major is not None else values[0]
                if v[0] != ref[0]:
                    bad_lanes.add(0)
                if v[1] != ref[1]:
                    bad_lanes.add(1)
            if major is None:
                undecided.append(list(members))
    state = "+".join(k for i, k in enumerate(("weights", "optimizer")) if i in bad_lanes)
    exp = {r: (tuple(v) if all(x is not None for x in v) else None) for r, v in expected.items()}  # type: ignore[misc]
    detail = {}
    for r in range(world):
        if not copies[r]:
            detail[r] = "no copies to compare"
        elif exp[r] is None:
            detail[r] = f"differs, no majority: {'; '.join(copies[r])}"
        elif tuple(lanes[r]) != exp[r]:
            wrong = [LANES[i] for i in range(len(LANES)) if lanes[r][i] != exp[r][i]]
            detail[r] = f"{', '.join(wrong)} differ from the majority: {'; '.join(copies[r])}"
        else:
            detail[r] = f"weights+optimizer agree: {'; '.join(copies[r])}"
    return Comparison(ok=not suspects and not undecided, suspects=sorted(suspects), undecided=undecided,
                      state=state, expected=exp, detail=detail)


# ---- triggers --------------------------------------------------------------------------

class RunningMedian:
    """The median of the last ``MEDIAN_WINDOW`` values (None before ``MEDIAN_WARMUP``)."""

    def __init__(self) -> None:
        self._values: deque[float] = deque(maxlen=MEDIAN_WINDOW)

    def median(self) -> float | None:
        return statistics.median(self._values) if len(self._values) >= MEDIAN_WARMUP else None

    def add(self, value: float) -> None:
        self._values.append(value)

    def clear(self) -> None:
        self._values.clear()


@dataclass(frozen=True)
class Trigger:
    """A trigger that forced a check: measured at ``step`` (a check follows at ``step``
    for the gradient norm, at ``step + 1`` otherwise)."""

    name: str          # "grad_norm" | "loss" | "update_size"
    step: int
    measured: float
    threshold: float
    detail: str


class Triggers:
    """Running medians of the cheap signals; same values on every rank except the update
    size, which each rank votes on through the step's all-reduce."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._grad = RunningMedian()
        self._loss = RunningMedian()
        self._update = RunningMedian()

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def _check(self, median: RunningMedian, name: str, label: str, step: int, value: float) -> Trigger | None:
        m = median.median()
        median.add(value)
        if not self.enabled or m is None:
            return None
        threshold = self.factor * m
        if value == value and value <= threshold:  # NaN compares false: a trigger
            return None
        return Trigger(name, step, value, threshold,
                       f"{label} {value:.4g} > {self.factor:g} x running median {m:.4g}")

    def grad_norm(self, step: int, value: float) -> Trigger | None:
        return self._check(self._grad, "grad_norm", "grad norm", step, value)

    def loss(self, step: int, value: float) -> Trigger | None:
        return self._check(self._loss, "loss", "loss", step, value)

    def update_size(self, step: int, value: float) -> Trigger | None:
        return self._check(self._update, "update_size", "update size", step, value)

    def reset(self) -> None:
        for m in (self._grad, self._loss, self._update):
            m.clear()


# ---- verdicts --------------------------------------------------------------------------

@dataclass
class Verdict:
    """The outcome of one triage (the "verdict" event and the trainer's ``sdc`` log)."""

    value: str                  # "transient" | "persistent" | "ambiguous" | "clean"
    suspects: list[int]
    first_bad_step: int
    detected_step: int
    rollback_step: int
    state: str                  # "weights" | "optimizer" | "weights+optimizer" | "loss" | ""
    replays: int
    mechanism: str              # "fingerprint" | "trigger:<name>"
    triage: list[str] = field(default_factory=list)
    evidence: str = ""

    @property
    def suspect(self) -> int:
        return self.suspects[0] if self.suspects else -1

    def detail(self) -> str:
        return json.dumps({
            "first_bad_step": self.first_bad_step, "suspects": self.suspects, "state": self.state,
            "replays": self.replays, "rollback_step": self.rollback_step, "triage": self.triage,
            "evidence": self.evidence})

    def record(self) -> dict:
        """The entry of ``run()``'s ``"sdc"`` list."""
        return {"first_bad_step": self.first_bad_step, "detected_step": self.detected_step,
                "suspects": list(self.suspects), "verdict": self.value, "replays": self.replays,
                "rollback_step": self.rollback_step, "state": self.state, "mechanism": self.mechanism}


@dataclass
class Replay:
    """One re-execution of steps ``base + 1 .. step``: every rank's digests after it, and
    per replayed step the ranks whose local loss differed from the original run."""

    lanes: list[tuple[int, ...]]
    loss_changed: dict[int, list[int]]
    first_mismatch: int | None = None   # the first replayed step whose copies differed


def first_loss_change(replay: Replay) -> tuple[int, list[int]] | None:
    changed = sorted((s, r) for s, r in replay.loss_changed.items() if r)
    return changed[0] if changed else None


def judge(original: Sequence[Sequence[int]], found: Comparison, replays: list[Replay],
          sets: dict[str, list[list[int]]], *, step: int, base: int,
          trigger: Trigger | None = None) -> Verdict:
    """Decide what the re-executions of steps ``base + 1 .. step`` showed.

    A mismatch (``found`` not ok): the replayed copies all agree -> "transient" (the
    suspects: the original minority, or in a set without majority the copies that
    changed); a suspect differs from the replayed majority again -> "persistent"; two
    copies that each reproduce their own digests -> "ambiguous". A trigger whose check
    found the copies equal: a rank whose local loss changed on replay -> "transient" on
    that rank (an activation or gradient fault spreads to every copy through the
    gradient all-reduce); nothing changed -> "clean".
    """
    last = replays[-1]
    again = compare(last.lanes, sets)
    mechanism = f"trigger:{trigger.name}" if trigger is not None else "fingerprint"
    change = first_loss_change(last)
    # a wrong local loss at step j: the state after j - 1 (or step j's forward) was wrong
    first_bad = step
    if change is not None:
        first_bad = max(base + 1, change[0] - (0 if found.ok else 1))
    reproduced = [r for r in range(len(original)) if tuple(last.lanes[r]) == tuple(original[r])]
    triage = [_line_found(found, step, trigger)]
    for i, rep in enumerate(replays, 1):
        c = compare(rep.lanes, sets)
        same = sum(tuple(rep.lanes[r]) == tuple(original[r]) for r in range(len(original)))
        triage.append(f"replay {i} of steps {base + 1}..{step} from the snapshot of step {base}: "
                      f"{'copies agree' if c.ok else 'copies differ, suspects ' + str(c.suspects or c.undecided)}, "
                      f"{same}/{len(original)} ranks reproduced their digests"
                      + (f", local loss changed on ranks {change[1]} at step {change[0]}"
                         if change is not None and rep is last else ""))

    def verdict(value: str, suspects: list[int], state: str, evidence: str) -> Verdict:
        triage.append(f"verdict {value}" + (f": suspect ranks {suspects}" if suspects else ""))
        return Verdict(value, sorted(suspects), first_bad, step, base, state, len(replays), mechanism,
                       triage, evidence)

    if found.ok:  # a trigger: the copies agreed
        if change is not None:
            return verdict("transient", change[1], "loss",
                           f"{trigger.detail if trigger else 'trigger'}; the replay changed the local loss of "
                           f"ranks {change[1]} at step {change[0]} and the copies agree")
        if len(reproduced) < len(original) and again.ok:
            return verdict("transient", [], found.state or "weights+optimizer",
                           "the replay changed the state on every copy alike; no rank named")
        return verdict("clean", [], "", f"{trigger.detail if trigger else 'trigger'}; the replay reproduced every "
                       "rank's loss and digests: the spike is the data's")
    if again.ok:
        suspects = set(found.suspects)
        for members in found.undecided:
            suspects.update(r for r in members if tuple(original[r]) != tuple(last.lanes[r]))
        return verdict("transient", sorted(suspects), found.state,
                       f"copies differed ({found.state}) at step {step}; the replay from step {base} made them "
                       f"agree" + ("" if len(reproduced) == len(original) else
                                   f"; {len(original) - len(reproduced)} of {len(original)} ranks' replayed state "
                                   "differs from their original (the corruption had spread through the gradients)"))
    if last.first_mismatch is not None:
        first_bad = last.first_mismatch  # the repeating fault showed where it strikes
    if again.suspects:
        return verdict("persistent", again.suspects, found.state or again.state,
                       f"ranks {again.suspects} differ from the majority again after {len(replays)} "
                       f"replay(s) from step {base}")
    erratic = sorted({r for members in again.undecided for r in members if r not in reproduced})
    undecided = sorted({r for members in again.undecided for r in members})
    if erratic and len(erratic) < len(undecided):
        return verdict("persistent", erratic, found.state or again.state,
                       f"ranks {erratic} neither reproduce nor agree with their copy after {len(replays)} replay(s)")
    return verdict("ambiguous", undecided, found.state or again.state,
                   f"copies {undecided} differ and each reproduces its own digests after {len(replays)} "
                   "replay(s): no majority decides")


def _line_found(found: Comparison, step: int, trigger: Trigger | None) -> str:
    head = f"trigger {trigger.detail} at step {trigger.step}; " if trigger is not None else ""
    if found.ok:
        return f"{head}check of step {step}: every copy agrees"
    who = f"ranks {found.suspects} differ from the majority" if found.suspects else ""
    if found.undecided:
        who += ("; " if who else "") + f"copies {found.undecided} differ without a majority"
    return f"{head}check of step {step}: {found.state} {who}"
