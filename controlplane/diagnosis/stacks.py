"""The Python stacks of the ranks a diagnosis blames, from their native dumps.

A flight-recorder entry carries ``frames``: the Python stack that issued the op,
innermost first (``[{"name", "filename", "line"}]``). The traces the engine reads keep
no frames (they would cost memory on every entry of every rank), so ``finding_stacks``
re-reads only the files of the ranks the findings blame, a handful whatever the world
size, one file alive at a time.

Which entry gives a rank's stack for a finding at (group, seq):
  * the rank entered it: its entry there (``collective_seq_id``; ``p2p_seq_id`` for the
    point-to-point kinds);
  * it never did (``missing``, a partner that never posted its send or recv): where it
    stands instead, its newest entry on that group, else its newest entry at all.

Ranks without a file (``no_trace``; traces from the store) get no stack. Nothing here
raises on a dump whose frames are malformed: a stack is evidence, not a requirement.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from fleet.controlplane.diagnosis.dumps import read_document
from fleet.controlplane.diagnosis.engine import Diagnosis
from fleet.controlplane.diagnosis.traces import TraceSet
from fleet.controlplane.errors import DumpError
from fleet.proto.flight_record import P2P_SUFFIX, entry_done, entry_op
from fleet.proto.vocab import split_op

#: Finding kinds whose ``seq`` counts point-to-point ops (``p2p_seq_id``).
P2P_KINDS = frozenset({"p2p_unmatched", "p2p_mismatch"})


def finding_stacks(diag: Diagnosis, traces: TraceSet, max_ranks: int = 4, *,
                   max_files: int = 4) -> dict[int, list[dict[str, Any]]]:
    """Finding index -> the stacks of (up to ``max_ranks`` of) the ranks it blames, each
    ``{"rank", "group", "seq", "op", "state", "frames": [{"name", "filename", "line"}]}``,
    ``state`` one of scheduled|started|completed. Every finding has a key (an empty list
    when no blamed rank has a dump). At most ``max_files`` files are read, the culprits'
    first: many findings over many groups must not turn into reading every dump again."""
    out: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(diag.findings))}
    if not traces.source.startswith("dumps:"):
        return out
    wanted: dict[int, list[int]] = defaultdict(list)  # rank -> finding indexes
    for i, f in enumerate(diag.findings):
        for r in f.ranks[:max_ranks]:
            wanted[r].append(i)
    culprits = set(diag.culprit_ranks)
    for rank in sorted(wanted, key=lambda r: (r not in culprits, r))[:max_files]:
        entries = _entries(traces, rank)
        if not entries:
            continue
        for i in wanted[rank]:
            f = diag.findings[i]
            entry = _where(entries, f.group.removesuffix(P2P_SUFFIX), f.seq, f.kind in P2P_KINDS)
            if entry is not None:
                out[i].append(_stack(rank, entry))
    for i, stacks in out.items():  # in the finding's order of ranks
        order = {r: n for n, r in enumerate(diag.findings[i].ranks)}
        stacks.sort(key=lambda s: order[s["rank"]])
    return out


def _entries(traces: TraceSet, rank: int) -> list[dict[str, Any]]:
    t = traces.ranks.get(rank)
    if t is None or not t.source:
        return []
    path = Path(t.source)
    try:
        doc = read_document(path)
    except DumpError:  # the file changed since it was read: no stack, the verdict stands
        return []
    return [e for e in doc.get("entries") or [] if isinstance(e, dict)]


def _group_of(entry: dict[str, Any]) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0])
    return ""


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _where(entries: list[dict[str, Any]], group: str, seq: int, p2p: bool) -> dict[str, Any] | None:
    """The rank's entry at (group, seq), else its newest on ``group``, else its newest."""
    newest_on_group = None
    if group:
        for e in reversed(entries):
            if _group_of(e) != group:
                continue
            if newest_on_group is None:
                newest_on_group = e
            if seq > 0 and bool(e.get("is_p2p")) == p2p and \
                    _int(e.get("p2p_seq_id" if p2p else "collective_seq_id")) == seq:
                return e
    return newest_on_group or (entries[-1] if entries else None)


def _stack(rank: int, e: dict[str, Any]) -> dict[str, Any]:
    try:
        op = split_op(entry_op(e))[0]
    except (KeyError, TypeError):
        op = "?"
    p2p = bool(e.get("is_p2p"))
    state = "completed" if entry_done(e) else str(e.get("state") or "scheduled")
    return {"rank": rank, "group": _group_of(e),
            "seq": _int(e.get("p2p_seq_id" if p2p else "collective_seq_id")),
            "op": op, "state": state, "frames": _frames(e.get("frames"))}


def _frames(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        return []
    return [{"name": str(f.get("name", "?")), "filename": str(f.get("filename", "?")), "line": _int(f.get("line"))}
            for f in raw if isinstance(f, dict)]
