"""How the members of one process group stand, from their collective fronts: the part of
`fleet replay` that shows a large job's wavefront around an incident.

A front (``fleet.proto.fronts.FrontRow``) says where one rank stands in one group: the
newest sequence number it entered and completed, the op it entered, when. ``standing``
groups a group's fronts by (entered seq, completed seq, open, op): in a hang nearly every
member is in one cluster (waiting in the group's newest op) and the culprit in another
(behind, not waiting); ``standing_line`` says so in one sentence naming the outliers and
their nodes ("511 ranks wait in all_reduce seq 812 since 12:00:01.2; rank 77 (node n9)
is at seq 811, not waiting").

Pure: plain values in, plain dicts and strings out; no store, no I/O.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from fleet.proto.fronts import FrontRow

#: A cluster of at most this many ranks is listed rank by rank (with nodes); larger ones are counted.
LISTED_RANKS = 8
#: Clusters a standing line describes (the largest first); the rest are counted.
LINE_CLUSTERS = 6


def clock(ns: int | None) -> str:
    """A wall-clock time of day to a tenth of a second (local time), "-" for none."""
    if not ns:
        return "-"
    t = dt.datetime.fromtimestamp(ns / 1e9)
    return t.strftime("%H:%M:%S.") + str(t.microsecond // 100_000)


def standing(group: str, desc: str, members: Sequence[int], fronts: Sequence[FrontRow]) -> dict[str, Any]:
    """How the members of ``group`` stand: ``clusters`` of fronts that agree on
    (``entered_seq``, ``completed_seq``, ``open``, ``op``), the largest first, each with
    ``count``, its ``ranks`` and ``since_ns`` (the earliest entry among them);
    ``top_seq`` (the group's newest entered seq); ``missing`` (declared members that sent
    no front); ``outliers`` (the ranks outside the largest cluster, up to ``LISTED_RANKS``
    per cluster)."""
    mine = [f for f in fronts if f.group == group]
    by_key: dict[tuple[int, int, bool, str], list[FrontRow]] = {}
    for f in mine:
        by_key.setdefault((f.entered_seq, f.completed_seq, f.open, f.op), []).append(f)
    clusters = sorted(
        ({"entered_seq": e, "completed_seq": c, "open": o, "op": op, "count": len(fs),
          "ranks": sorted(f.rank for f in fs), "since_ns": min(f.entered_ns for f in fs)}
         for (e, c, o, op), fs in by_key.items()),
        key=lambda k: (-k["count"], -k["entered_seq"], k["ranks"][0]))
    seen = {f.rank for f in mine}
    outliers = [r for k in clusters[1:] for r in k["ranks"][:LISTED_RANKS]]
    return {"group": group, "desc": desc, "members": len(members) or len(seen), "fronts": len(mine),
            "top_seq": max((f.entered_seq for f in mine), default=0),
            "missing": sorted(set(members) - seen), "outliers": outliers, "clusters": clusters}


def _who(ranks: Sequence[int], count: int, nodes: Mapping[int, str]) -> str:
    if count > LISTED_RANKS:
        return f"{count} ranks"
    named = [f"{r} (node {nodes[r]})" if r in nodes else str(r) for r in ranks]
    return ("rank " if count == 1 else "ranks ") + ", ".join(named)


def cluster_text(k: Mapping[str, Any], top_seq: int, nodes: Mapping[int, str]) -> str:
    """One cluster in words: who, where, since when."""
    who = _who(k["ranks"], k["count"], nodes)
    one = k["count"] == 1
    op = k["op"] or "nothing"
    if k["entered_seq"] == 0:
        return f"{who} {'has' if one else 'have'} entered nothing yet"
    if k["open"]:
        done = "" if k["completed_seq"] == k["entered_seq"] - 1 else f", completed only seq {k['completed_seq']}"
        return f"{who} wait{'s' if one else ''} in {op} seq {k['entered_seq']} since {clock(k['since_ns'])}{done}"
    behind = f" ({top_seq - k['entered_seq']} behind)" if k["entered_seq"] < top_seq else ""
    return f"{who} {'is' if one else 'are'} at seq {k['entered_seq']}{behind} ({op} done), not waiting"


def standing_line(s: Mapping[str, Any], nodes: Mapping[int, str]) -> str:
    """``standing(...)`` in one sentence (see the module docstring)."""
    kind = f"{s['desc']}, " if s["desc"] and s["desc"] != s["group"] else ""
    parts = [cluster_text(k, s["top_seq"], nodes) for k in s["clusters"][:LINE_CLUSTERS]]
    rest = s["clusters"][LINE_CLUSTERS:]
    if rest:
        parts.append(f"{sum(k['count'] for k in rest)} more ranks elsewhere ({len(rest)} positions)")
    if s["missing"]:
        parts.append(f"{_who(s['missing'], len(s['missing']), nodes)} sent no front")
    return f"group {s['group']} ({kind}{s['members']} members): " + ("; ".join(parts) or "no fronts")


def kinds_lines(summary: Mapping[str, Any]) -> list[str]:
    """The whole attempt's fronts per group description (``Store.front_kinds``), a line each."""
    lines = [f"{summary['waiting']} of {summary['ranks']} ranks wait in a collective"]
    for k in summary["kinds"]:
        since = f" since {clock(k['oldest_open_ns'])}" if k["oldest_open_ns"] else ""
        lines.append(f"{k['desc'] or '(undeclared)'}: {k['groups']} groups, {k['open']} of {k['fronts']} fronts "
                     f"open (waiting){since}, {k['behind']} behind their group's newest seq")
    return lines


def pages(total: int, page_size: int) -> int:
    """How many pages of ``page_size`` hold ``total`` rows (at least 1: an empty first page)."""
    return max(1, -(-total // page_size))
