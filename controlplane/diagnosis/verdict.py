"""The verdict: the root causes in the wait-for graph, and nobody else.

Every finding adds "waiter -> awaited" edges (``checks``, ``p2p``). A rank that waits on
somebody is a consequence; the culprits are the ranks a finding blames that wait on
nobody — reached from every waiter by following the edges, across all groups and
point-to-point ops. So a rank stuck in a sub-group is blamed, not the world-group ranks
that then wait on it; two independent hangs give two culprits.

  * A minority waiting in a collective a standing majority never entered
    (``ExtraCandidate``) is a consequence when that majority waits elsewhere (it is
    blocked, so it never issued the collective): the minority then waits on it. When the
    majority waits on nobody it never issued the collective at all, and the minority's
    extra collective is the cause (``extra``).
  * Ranks that wait on each other with no way out form a cycle: a deadlock (``cycle``),
    unless the cycle runs through an extra candidate, whose minority is then the cause.
  * Mismatches (``op_mismatch`` / ``size_mismatch`` / ``dtype_mismatch`` / ``extra`` /
    ``p2p_mismatch``) are causes of their own; the members that entered the mismatched
    collective with the majority wait on the ones blamed.

Verdict: ``mismatch`` when a culprit is blamed by a mismatch, else ``hang``, else
``straggler`` when a straggler was found, else ``ok``.
"""

from __future__ import annotations

from fleet.controlplane.diagnosis.checks import Analysis, ExtraCandidate, Finding, _ranks

MISMATCH_KINDS = frozenset({"op_mismatch", "size_mismatch", "dtype_mismatch", "extra", "p2p_mismatch"})
HANG_KINDS = frozenset({"missing", "stuck", "p2p_unmatched", "no_trace", "cycle"})


def decide(a: Analysis) -> tuple[list[int], str]:
    """Resolve the extra candidates, then read the culprits and verdict off the graph."""
    extras = _resolve_extras(a)
    blamed = {r for f in a.findings if f.kind in MISMATCH_KINDS | HANG_KINDS for r in f.ranks}
    culprits = {r for r in blamed if not a.waits.get(r)}
    for scc in _stuck_cycles(a.waits):
        minority = sorted({r for c in extras if set(c.front) & scc for r in c.front})
        if minority:
            c = next(c for c in extras if set(c.front) & scc)
            _add_extra(a, c)
            culprits.update(minority)
        else:
            ranks = sorted(scc)
            a.findings.append(Finding("cycle", "", 0, ranks,
                                      f"{_ranks(ranks)} wait on each other across groups (a deadlock)"))
            culprits.update(ranks)
    if culprits:
        mism = any(f.kind in MISMATCH_KINDS and set(f.ranks) & culprits for f in a.findings)
        return sorted(culprits), "mismatch" if mism else "hang"
    slow = [f for f in a.findings if f.kind == "straggler"]
    if slow:
        return sorted({r for f in slow for r in f.ranks}), "straggler"
    return [], "ok"


def _resolve_extras(a: Analysis) -> list[ExtraCandidate]:
    """Turn each candidate into a wait (its majority is blocked elsewhere) or an
    ``extra`` finding; returns the ones that became waits (a cycle may reach them)."""
    as_waits = []
    blocked = {w for w, targets in a.waits.items() if targets}
    for c in a.extra:
        if not any(r in blocked for r in c.behind):
            _add_extra(a, c)
            continue
        elsewhere = sorted(r for r in c.behind if r in blocked)
        a.add(Finding(
            "missing", c.group.name, c.seq, c.behind,
            f"{_ranks(c.behind)} never entered collective {c.seq} ({c.op}) of group {c.group.label()}: "
            f"{'it is' if len(c.behind) == 1 else 'they are'} blocked elsewhere ({_ranks(elsewhere)} "
            f"{'waits' if len(elsewhere) == 1 else 'wait'} on other ranks); {_ranks(c.front)} went ahead "
            f"and {'waits' if len(c.front) == 1 else 'wait'} there", c.front))
        as_waits.append(c)
    return as_waits


def _add_extra(a: Analysis, c: ExtraCandidate) -> None:
    for r in c.front:  # the minority waits on nobody: its own collective is the fault
        a.waits.pop(r, None)
    a.findings.append(Finding(
        "extra", c.group.name, c.seq, c.front,
        f"{_ranks(c.front)} entered collective {c.seq} ({c.op}) of group {c.group.label()}, which the "
        f"majority ({_ranks(c.behind)}) never issued"))


def _stuck_cycles(waits: dict[int, set[int]]) -> list[set[int]]:
    """Strongly connected sets of waiters with no edge leaving them (Tarjan, iterative)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    sccs: list[set[int]] = []
    counter = 0
    for start in sorted(waits):
        if start in index:
            continue
        work = [(start, iter(sorted(waits.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(waits.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = set()
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    scc.add(x)
                    if x == node:
                        break
                sccs.append(scc)
    out = []
    for scc in sccs:
        if len(scc) == 1 and next(iter(scc)) not in waits.get(next(iter(scc)), set()):
            continue  # a single node is a cycle only with a self-edge (never added)
        if all(t in scc for r in scc for t in waits.get(r, ())):
            out.append(scc)
    return out
