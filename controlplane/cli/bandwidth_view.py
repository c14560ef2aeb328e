"""The collective bandwidth table of `fleet replay` and `fleet report` (from the JSON of
``diagnosis.bandwidth.BandwidthReport``, with ``link``/``scope`` per group when the
job's topology gave them). "not measured" is printed as such, never as a number."""

from __future__ import annotations

from typing import Any

from fleet.controlplane.cli.render import console, print_table

#: Most (group, op, size) rows shown; --json has them all.
ROWS_SHOWN = 40
_NOT = "[dim]not measured[/]"


def size_text(n: int | None, bucketed: bool = False) -> str:
    """Bytes as people read them (binary units): ``4.0 MiB``; ``<=`` for a bucket's bound."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            text = f"{n / scale:.1f} {unit}"
            break
    else:
        text = f"{n} B"
    return f"<={text}" if bucketed else text


def rate_text(bps: float | None) -> str:
    """Bytes/s in decimal units (nccl-tests prints busbw in GB/s): ``12.3 GB/s``, ``850 MB/s``."""
    if bps is None:
        return _NOT
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} B/s"


def _rate(row: dict[str, Any], bps: float | None) -> str:
    """A row's rate; "-" where its durations were measured but the op moves no rated
    payload (a barrier, gather, scatter), "not measured" where they were not."""
    if bps is None and row["measured"]:
        return "-"
    return rate_text(bps)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def print_bandwidth(bw: dict[str, Any] | None, title: str) -> None:
    """The per (group, op, size) table, one line per group on time shares, and where the
    durations come from."""
    if not bw or not bw["rows"]:
        return
    rows = sorted(bw["rows"], key=lambda r: -r["collectives"])[:ROWS_SHOWN]
    rows.sort(key=lambda r: (r["group"], r["op"], r["bytes"] if r["bytes"] is not None else -1))
    print_table(
        f"{title}: collective bandwidth (busbw as nccl-tests defines it)",
        ["group", "n", "op", "size", "#", "measured", "timing", "mean ms", "algbw", "busbw", "busbw p10-p90",
         "util", "skew ms (p90)", "last in"],
        [
            [r["group"] + (f" {r['desc']}" if r["desc"] else ""), r["group_size"], r["op"],
             size_text(r["bytes"], r.get("bucketed", False)), r["collectives"], r["measured"],
             ",".join(r["timing"]) or "-", _ms(r["t_s"]) if r["measured"] else _NOT,
             _rate(r, r["algbw_bps"]), _rate(r, r["busbw_bps"]),
             f"{rate_text(r['busbw_p10_bps'])}-{rate_text(r['busbw_p90_bps'])}" if r["busbw_bps"] is not None else "-",
             (f"{_pct(r['utilization'])} of {r['link']}" if r["utilization"] is not None else "-"),
             f"{_ms(r['skew_s'])} ({_ms(r['skew_p90_s'])})",
             "-" if r["last_rank"] is None else f"rank {r['last_rank']} ({_pct(r['last_share'])})"]
            for r in rows
        ],
    )
    if len(bw["rows"]) > len(rows):
        console.print(f"[dim]{len(bw['rows']) - len(rows)} more (group, op, size) rows: --json has them[/]",
                      highlight=False)
    for g in bw["groups"]:
        shares = [m for m in g["shares"] if m["comm_share"] is not None]
        if not shares:
            continue
        comm = sorted(m["comm_share"] for m in shares)
        exposed = [m["exposed_share"] for m in shares if m["exposed_share"] is not None]
        overlap = [m["overlap_capable_share"] for m in shares if m["overlap_capable_share"] is not None]
        parts = [f"{_pct(comm[len(comm) // 2])} of its members' time (median; {_pct(comm[0])}-{_pct(comm[-1])})"]
        if exposed:
            parts.append(f"exposed {_pct(sorted(exposed)[len(exposed) // 2])}")
        if any(overlap):
            parts.append(f"async/NCCL {_pct(sorted(overlap)[len(overlap) // 2])} (overlap with compute not known)")
        console.print(f"group {g['group']}{(' ' + g['desc']) if g['desc'] else ''}: collectives take "
                      + ", ".join(parts), highlight=False, soft_wrap=True)
    console.print(f"[dim]durations: {bw['timing_note']}[/]", highlight=False, soft_wrap=True)
