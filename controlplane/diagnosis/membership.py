"""Who belongs to which process group, when the dumps do not say.

NCCL dumps declare every group a rank is in (``pg_config``); the store has what each
worker declared. torch 2.13's gloo dumps declare nothing, so membership is inferred:

  * a group's members are the ranks whose entries name it;
  * the world (``default_pg``) is 0..N-1, N at least the highest rank seen and exactly
    what an all_gather on it implies (its output is N inputs);
  * a rank that left no file (it died) names no group, so the groups it was in look
    short. Groups come in families — the tensor-, data-, pipeline- or expert-parallel
    groups of one mesh dimension share a description and a shape, translated: {0, 1},
    {2, 3}, ... or {0, 4, 8, 12}, {1, 5, 9, 13}, ... A short group is completed with
    ranks without a trace when that makes it a translate of a bigger sibling (and an
    all_gather on it, where there is one, agrees on the size). Ranks past the highest
    seen may be added this way, which also grows the world.

Pure functions over ``TraceSet``; nothing here imports torch, Ray or gRPC.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass

from fleet.controlplane.diagnosis.traces import TraceSet

#: Descriptions that say nothing about a group's family.
_NO_DESC = frozenset({"", "undefined"})


@dataclass(frozen=True)
class GroupInfo:
    name: str
    desc: str
    members: tuple[int, ...]
    declared: bool                       # members from the backend/worker, not inferred

    def label(self) -> str:
        return f"{self.name} ({self.desc})" if self.desc and self.desc != self.name else self.name


def group_infos(traces: TraceSet) -> list[GroupInfo]:
    """Every process group seen, with its members (declared when any rank declared them,
    else inferred as the module docstring says)."""
    declared: dict[str, set[int]] = defaultdict(set)
    used: dict[str, set[int]] = defaultdict(set)
    desc: dict[str, str] = {}
    for rank, t in traces.ranks.items():
        for name, members in t.group_ranks.items():
            declared[name].update(members)
        for name in (*t.groups, *t.p2p, *t.status):
            used[name].add(rank)
        for name, d in t.group_desc.items():
            desc.setdefault(name, "" if d in _NO_DESC else d)
            if d not in _NO_DESC and not desc[name]:
                desc[name] = d
    names = sorted(set(declared) | set(used), key=group_order)
    members = {n: set(declared[n]) if declared.get(n) else set(used[n]) for n in names}
    world = _world_name(names, desc, declared)
    present = set(traces.ranks)
    size = max([max(present, default=-1) + 1] + [max(m) + 1 for m in members.values() if m])
    if world is not None and not declared.get(world):
        size = max(size, _gather_factor(traces, world))
    inferred = [n for n in names if not declared.get(n) and n != world]
    size = _complete_families(inferred, desc, members, present, size, traces)
    if world is not None and not declared.get(world):
        members[world] = set(range(max(size, max(members[world], default=-1) + 1)))
    return [GroupInfo(n, desc.get(n, ""), tuple(sorted(members[n])), bool(declared.get(n))) for n in names]


def group_order(name: str) -> tuple[int, int | str]:
    """Groups sort by creation order: numeric names first, as numbers."""
    return (0, int(name)) if name.isdigit() else (1, name)


def _world_name(names: list[str], desc: dict[str, str], declared: dict[str, set[int]]) -> str | None:
    for n in names:
        if desc.get(n) == "default_pg":
            return n
    return "0" if "0" in names and not desc.get("0") and not declared.get("0") else None


def _complete_families(names: list[str], desc: dict[str, str], members: dict[str, set[int]],
                       present: set[int], size: int, traces: TraceSet) -> int:
    """Fill short inferred groups with traceless ranks (see the module docstring);
    returns the world size, grown by any rank added past it. A group's siblings are the
    groups with its description; a group without any is compared with every inferred
    group (custom descriptions such as "pair01" name one group each)."""
    families: dict[str, list[str]] = defaultdict(list)
    for n in names:
        families[desc.get(n, "")].append(n)
    for n in names:
        m = members[n]
        if not m:
            continue
        want = _gather_factor(traces, n)
        if want and want <= len(m):
            continue
        family = families[desc.get(n, "")] if len(families[desc.get(n, "")]) > 1 else names
        siblings = [o for o in family if o != n and len(members[o]) > len(m)]
        shapes = Counter(_shape(members[o]) for o in siblings if members[o])
        for shape, _count in sorted(shapes.items(), key=lambda kv: (len(kv[0]), -kv[1])):
            if want and len(shape) != want:
                continue
            # the groups of that shape partition their ranks: the completed group shares no
            # rank with them (so a {1,2,3} does not make {2,3} into {2,3,4})
            taken = set().union(*(members[o] for o in siblings if _shape(members[o]) == shape))
            if m & taken:
                continue
            fill = _fit(m, shape, present | taken, size)
            if fill:
                m.update(fill)
                size = max(size, max(fill) + 1)
                break
    return size


def _shape(ranks: set[int]) -> tuple[int, ...]:
    lo = min(ranks)
    return tuple(r - lo for r in sorted(ranks))


def _fit(ranks: set[int], shape: tuple[int, ...], unavailable: set[int], size: int) -> set[int]:
    """The ranks that complete ``ranks`` into a translate of ``shape``, all of them free
    (no trace, in no sibling group); empty when none does. Of several, the one adding
    fewest ranks past the world (``size``), then the lowest."""
    lo = min(ranks)
    best: tuple[int, int] | None = None
    fill: set[int] = set()
    for offset in shape:
        base = lo - offset
        if base < 0:
            continue
        full = {base + o for o in shape}
        extra = full - ranks
        if ranks <= full and extra and not extra & unavailable:
            score = (sum(r >= size for r in extra), base)
            if best is None or score < best:
                best, fill = score, extra
    return fill


def _gather_factor(traces: TraceSet, group: str) -> int:
    """The group size an all_gather of ``group`` implies (0 if none was recorded)."""
    sigs = traces.table.sigs
    for t in traces.ranks.values():
        ops = t.groups.get(group)
        if not ops:
            continue
        for sid in set(ops.sigs[-200:]):
            sig = sigs[sid]
            if sig.op == "all_gather" and len(sig.input_sizes) == 1 and len(sig.output_sizes) == 1:
                n_in, n_out = math.prod(sig.input_sizes[0]), math.prod(sig.output_sizes[0])
                if n_in and n_out % n_in == 0:
                    return n_out // n_in
        return 0
    return 0
