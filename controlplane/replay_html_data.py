"""The plain data of the HTML incident report (``controlplane.replay_html``): `fleet replay
--html` turns what it analysed (the ``TraceSet`` and verdict the terminal output and
``--perfetto`` come from, a large job's fronts, ``load_report``'s lost time and
incidents, the attempts' losses) into one JSON-ready dict here.

``timeline`` gives one track per rank and, per track, its newest collectives as flat
number lists (``CELL`` fields each: start and duration in whole µs from ``t0_ns``,
group, seq, signature, flags), so a 512-rank job stays a few MB and draws in a browser within
a second. It also places the verdict's culprits (``highlights``): the collective a
culprit entered wrongly (a mismatch, a stuck kernel), or the gap where its peers wait in
a collective it never entered. ``job_section`` puts the job's attempts and incidents on
the same time axis (ms from ``t0_ns``).

Pure: plain values and diagnosis types in, dicts out; no store, torch, Ray or I/O.
Every float that goes out is finite (JSON has no NaN).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fleet.controlplane.diagnosis.traces import TraceSet

if TYPE_CHECKING:  # fleet.proto.fronts imports numpy: a report from dumps needs none
    from fleet.proto.fronts import FrontRow

#: Cells (collectives drawn) in the whole timeline: each rank keeps its newest
#: ``max(MIN_PER_RANK, MAX_CELLS // ranks)``.
MAX_CELLS = 120_000
MIN_PER_RANK = 24
#: Fields of one cell in a track's flat list.
CELL = ("start_us", "dur_us", "group", "seq", "sig", "flags")
#: ``flags`` bits: the op completed; the rank still waits in it; the cell is a front
#: (where the rank stands in a group), not a recorded collective; its end was measured
#: (else it is the group's next op: done by then, maybe long before).
DONE, WAITING, FRONT, MEASURED = 1, 2, 4, 8
#: Most culprit highlights drawn.
MAX_HIGHLIGHTS = 64

_Cell = tuple[int, int, str, int, str, int]  # enter_ns, end_ns (-1: waits to the end), group, seq, sig, flags


def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def group_labels(traces: TraceSet | None, diagnosis: Mapping[str, Any]) -> dict[str, str]:
    """Group name -> its description, from the diagnosis and what ranks declared."""
    out = {g["group"]: g.get("desc") or "" for g in diagnosis.get("groups", [])}
    for t in (traces.ranks.values() if traces is not None else ()):
        for g, d in t.group_desc.items():
            if d and not out.get(g):
                out[g] = d
    return out


def _trace_cells(traces: TraceSet, rank: int, keep: int, groups: Collection[str] | None,
                 seq_range: tuple[int, int] | None, described: dict[int, str]) -> list[_Cell]:
    """A rank's newest ``keep`` collectives of each group, ``end_ns`` as the Perfetto
    export takes it: the measured exit, else the next op of the group (done by then).
    ``described``: signature id -> its text, filled as met (a 512-rank trace has 10^5
    collectives and a few hundred signatures)."""
    t = traces.ranks[rank]
    sigs = traces.table.sigs
    out: list[_Cell] = []
    for gname, ops in t.groups.items():
        if groups is not None and gname not in groups:
            continue
        n = len(ops.seqs)
        for i in range(max(0, n - keep), n):
            seq = ops.seqs[i]
            if seq_range and not seq_range[0] <= seq <= seq_range[1]:
                continue
            enter, done = ops.enter_ns[i], bool(ops.done[i])
            flags = DONE if done else WAITING
            if ops.exit_ns[i]:
                end, flags = ops.exit_ns[i], flags | MEASURED
            elif done:
                end = ops.enter_ns[i + 1] if i + 1 < n else enter
            else:
                end = -1
            sid = ops.sigs[i]
            text = described.get(sid)
            if text is None:
                text = described[sid] = sigs[sid].describe()
            out.append((enter, end, gname, seq, text, flags))
    return out


def _front_cells(fronts: Iterable[FrontRow], covered: set[tuple[int, str]]) -> dict[int, list[_Cell]]:
    """Per rank, one cell per front of a group whose raw entries are not drawn: the seq it
    entered last, waiting in it (open) or done."""
    out: dict[int, list[_Cell]] = {}
    for f in fronts:
        if (f.rank, f.group) in covered or not f.entered_seq:
            continue
        if f.open:
            end, flags = -1, WAITING | FRONT
        else:
            end, flags = max(f.completed_ns, f.entered_ns), DONE | FRONT | (MEASURED if f.completed_ns else 0)
        out.setdefault(f.rank, []).append((f.entered_ns, end, f.group, f.entered_seq, f"{f.op or '?'} (front)",
                                           flags))
    return out


def timeline(traces: TraceSet | None, diagnosis: Mapping[str, Any], *, fronts: Sequence[FrontRow] = (),
             ranks: Iterable[int] | None = None, groups: Collection[str] | None = None,
             seq_range: tuple[int, int] | None = None, world: Iterable[int] = (), end_ns: int = 0,
             nodes: Mapping[int, str] | None = None, max_cells: int = MAX_CELLS) -> dict[str, Any]:
    """The timeline section (module docstring). ``world``: ranks that get a track even
    without a trace (a dead rank, a large job's placed ranks); ``ranks``/``groups``/
    ``seq_range`` keep only what they select (``--rank``, ``--group``, ``--around-seq``);
    ``end_ns``: where waits end (an incident's detection), at least a twentieth of the
    span past the newest time in the traces; ``nodes``: rank -> node, shown on the tracks."""
    wanted = None if ranks is None else set(ranks)
    traced = set(traces.ranks) if traces is not None else set()
    everyone = traced | set(world) | set(diagnosis.get("ranks", [])) | set(diagnosis.get("missing_ranks", []))
    everyone |= {f.rank for f in fronts}
    shown = sorted(r for r in everyone if wanted is None or r in wanted)
    keep = max(MIN_PER_RANK, max_cells // max(len(shown), 1))
    cells: dict[int, list[_Cell]] = {}
    described: dict[int, str] = {}
    for r in shown:
        if r in traced:
            cells[r] = _trace_cells(traces, r, keep, groups, seq_range, described)  # type: ignore[arg-type]
    covered = {(r, c[2]) for r, cs in cells.items() for c in cs}
    shown_set = set(shown)
    for r, cs in _front_cells((f for f in fronts if f.rank in shown_set and (groups is None or f.group in groups)),
                              covered).items():
        cells.setdefault(r, []).extend(cs)
    # what highlights look up: the cells of the groups where the culprits stand or are blamed
    culprits = set(diagnosis.get("culprit_ranks", [])) & shown_set
    relevant = {f.get("group", "").removesuffix(":p2p") for f in diagnosis.get("findings", [])
                if culprits & set(f.get("ranks", []))} | {c[2] for r in culprits for c in cells.get(r, ())}
    index = {(r, c[2], c[3]): c for r, cs in cells.items() for c in cs if c[2] in relevant}
    # a rank that recorded more than ``keep`` in one group lost some in ``_trace_cells`` already
    cut = traces is not None and any(len(o.seqs) > keep for r in cells if r in traced
                                     for o in traces.ranks[r].groups.values())
    for cs in cells.values():
        cs.sort(key=lambda c: c[0])
        if len(cs) > keep:
            cut = True
            del cs[:len(cs) - keep]
    starts = [c[0] for cs in cells.values() for c in cs]
    t0 = min(starts, default=0)
    newest = max([*starts, *(c[1] for cs in cells.values() for c in cs)], default=0)
    # waits run a little past the newest event (a dump's own time is no help: a copied
    # file's mtime can be anything), or to the incident's detection
    t_end = max(end_ns, newest + max((newest - t0) // 20, 1_000_000))
    labels = group_labels(traces, diagnosis)
    # group ids in name order (numbers as numbers): a lane's rows follow it
    names = sorted({c[2] for cs in cells.values() for c in cs}, key=lambda g: (0, int(g), "") if g.isdigit()
                   else (1, 0, g))
    gids = {g: i for i, g in enumerate(names)}
    sids: dict[str, int] = {}
    tracks: dict[str, list[float]] = {}
    for r in shown:
        flat: list[float] = []
        for enter, end, g, seq, sig, flags in cells.get(r, ()):
            stop = t_end if end < 0 else end
            flat += [(enter - t0) // 1000, max(stop - enter, 0) // 1000, gids[g], seq,
                     sids.setdefault(sig, len(sids)), flags]
        tracks[str(r)] = flat
    found = sum(len(cs) for cs in cells.values())
    note = ""
    if cut:
        most = max((sum(len(o.seqs) for o in traces.ranks[r].groups.values()) for r in shown if r in traced),
                   default=0)
        note = (f"showing each rank's newest {keep} collectives (a rank recorded up to {most}); "
                "--rank, --group and --around-seq choose others")
    return {
        "t0_ns": t0, "last_ms": _ms(max(newest - t0, 0)), "end_ms": _ms(max(t_end - t0, 0)), "ranks": shown,
        "absent": sorted(r for r in shown if r not in cells),
        "nodes": {str(r): n for r, n in sorted((nodes or {}).items()) if r in shown_set},
        "groups": [[g, labels.get(g, "")] for g in gids], "sigs": list(sids), "cell": list(CELL),
        "tracks": tracks, "cells": found, "note": note,
        "highlights": highlights(diagnosis, index, cells, t0, t_end, shown_set),
    }


def highlights(diagnosis: Mapping[str, Any], index: Mapping[tuple[int, str, int], _Cell],
               cells: Mapping[int, list[_Cell]], t0: int, t_end: int, shown: set[int]) -> list[dict[str, Any]]:
    """Where the culprits stand: per culprit and finding that blames it, the collective it
    entered (``entered``: a mismatch, a stuck op) or the gap from where its peers entered
    the collective it never did to the end (``missing``). A culprit no finding places (a
    fronts verdict, a cycle) gets the gap from its newest cell, or from where its group
    moved past it."""
    culprits = [r for r in diagnosis.get("culprit_ranks", []) if r in shown]
    out: list[dict[str, Any]] = []
    placed: set[int] = set()

    def add(rank: int, group: str, seq: int, kind: str, start: int, stop: int, finding: str, detail: str) -> None:
        out.append({"rank": rank, "group": group, "seq": seq, "kind": kind, "start_ms": _ms(start - t0),
                    "end_ms": _ms(max(stop, start) - t0), "finding": finding, "detail": detail})
        placed.add(rank)

    def newest_end(rank: int, group: str | None = None) -> int:
        """Where ``rank`` was last seen (in ``group``): its newest cell's end, else ``t0``."""
        return max((c[0] if c[1] < 0 else c[1] for c in cells.get(rank, ()) if group is None or c[2] == group),
                   default=t0)

    for f in diagnosis.get("findings", []):
        name, seq = f.get("group", ""), int(f.get("seq") or 0)
        p2p = name.endswith(":p2p")  # a point-to-point seq: no collective cell carries it
        g = name.removesuffix(":p2p")
        if not g or not seq:  # a cycle: placed below
            continue
        for r in f.get("ranks", []):
            if r not in culprits or len(out) >= MAX_HIGHLIGHTS:
                continue
            own = None if p2p else index.get((r, g, seq))
            if own is not None:
                add(r, g, seq, "entered", own[0], t_end if own[1] < 0 else own[1], f["kind"], f["detail"])
                continue
            peers = [] if p2p else [c[0] for (pr, pg, ps), c in index.items() if pg == g and ps == seq and pr != r]
            # from when the first peer entered it; peers not shown (--rank): from the culprit's last op there
            start = min(peers) if peers else max(newest_end(r, g), newest_end(r) if p2p else t0)
            add(r, name if p2p else g, seq, "missing", start, t_end, f["kind"], f["detail"])
    for r in culprits:
        if r in placed or len(out) >= MAX_HIGHLIGHTS:
            continue
        g, seq, start = _behind(r, index)
        if not seq:
            mine = cells.get(r, [])
            start = newest_end(r)
            g, seq = (mine[-1][2], mine[-1][3] + 1) if mine else ("", 0)
        add(r, g, seq, "missing", start, t_end, "culprit", diagnosis.get("summary", ""))
    return out


def _behind(rank: int, index: Mapping[tuple[int, str, int], _Cell]) -> tuple[str, int, int]:
    """(group, the seq ``rank`` never entered, when the first peer entered it or a later
    one) for a group where the others moved past ``rank``; ("", 0, 0) when none did."""
    newest: dict[str, int] = {}
    for (r, g, s) in index:
        if r == rank:
            newest[g] = max(newest.get(g, 0), s)
    for g, mine in sorted(newest.items()):
        ahead = [c[0] for (r, pg, s), c in index.items() if pg == g and r != rank and s > mine]
        if ahead:
            return g, mine + 1, min(ahead)
    return "", 0, 0


def job_section(report: Mapping[str, Any], t0_ns: int, *, losses: Mapping[int, Sequence[tuple[int, float]]],
                restored: Mapping[int, int | None] | None = None, attempt: int | None = None,
                note: str = "") -> dict[str, Any]:
    """The job's part: ``report`` is ``controlplane.report.job_report``'s dict (lost time,
    ``attempts_detail``, incidents); ``losses``: attempt -> (step, loss) in step order;
    ``restored``: attempt -> the step it restored; ``attempt``: the one the timeline shows;
    ``note``: a large job's paging hint. Times become ms from ``t0_ns``."""
    def at(ts: float | None) -> float | None:
        return None if ts is None else _ms(ts * 1e9 - t0_ns)

    restored = restored or {}
    return {
        "id": report["job"], "name": report["name"], "state": report["state"],
        "final_step": report["final_step"], "total_steps": report["total_steps"],
        "wall_s": _finite(report["wall_s"]), "productive_s": _finite(report["productive_s"]),
        "ettr": _finite(report["ettr"]), "restarts": report["restarts"], "attempt_shown": attempt,
        "lost_s": {k: _finite(v) or 0.0 for k, v in report["lost_s"].items()},
        "attempts": [{"number": a["number"], "state": a["state"], "start_ms": at(a["started_at"]),
                      "end_ms": at(a["ended_at"]), "wall_s": _finite(a["wall_s"]), "reason": a["reason"],
                      "restored_step": restored.get(a["number"])} for a in report["attempts_detail"]],
        "incidents": [{"attempt": i["attempt"], "kind": i["kind"], "rank": i["rank"], "node": i["node"],
                       "detector": i["detector"], "evidence": i["evidence"], "at_ms": at(i["detected_at"]),
                       "detected_at": i["detected_at"], "observed": bool(i.get("observed")),
                       "ended_attempt": bool(i.get("ended_attempt"))} for i in report["incidents"]],
        "loss": [{"attempt": n, "points": [[int(s), _finite(v)] for s, v in pts]} for n, pts in sorted(losses.items())],
        "note": note,
    }
