"""What `fleet replay --html FILE` writes, and how: the report's data gathered from what the
command analysed (a folder of dumps, or a job in the store), rendered
(``controlplane.replay_html``) and written atomically.

The verdict and the traces are the ones the terminal output and ``--perfetto`` use:
nothing is diagnosed twice. From a store this adds only reads through the Store's domain
methods: ``load_report`` (lost time, attempts, incidents), each attempt's losses
(``Store.step_aggregates``, aggregated in SQL), and for a large job its fronts (bounded
by ``FRONTS_MAX``) and the nodes of its ranks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from fleet.controlplane.errors import ConfigError
from fleet.controlplane.replay_html import render_html
from fleet.controlplane.replay_html_data import job_section, timeline

#: Most fronts a large job's page draws (its ranks' fronts in rank order past that are left out).
FRONTS_MAX = 200_000


def check_path(path: Path) -> Path:
    """``path`` expanded, refused up front (before any analysis) when it cannot be written."""
    path = path.expanduser()
    if path.is_dir():
        raise ConfigError(f"--html {path}: a folder; give the file to write (e.g. {path / 'replay.html'})")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"--html {path}: no folder {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--html {path}: cannot write into {parent} (permission denied)")
    return path


def write(path: Path, text: str) -> int:
    """Write ``text`` to ``path`` atomically (a temporary file beside it, then a rename:
    a reader never sees half a page); returns the bytes written."""
    path = path.expanduser()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = text.encode("utf-8")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise ConfigError(f"--html {path}: cannot write ({exc.strerror or exc})") from None
    return len(data)


def dumps_page(folder: Path, traces: Any, diagnosis: dict[str, Any], *, ranks: Collection[int] | None = None,
               groups: Collection[str] | None = None, seq_range: tuple[int, int] | None = None) -> tuple[str, str]:
    """(the page, a one-line description) of a folder of dumps; ``diagnosis`` is the
    engine's JSON with each finding's ``stacks``."""
    tl = timeline(traces, diagnosis, ranks=ranks, groups=groups, seq_range=seq_range)
    doc = {"source": f"dumps:{folder}", "diagnosis": diagnosis, "timeline": tl, "job": None,
           "generated_at": time.time()}
    return render_html(doc), f"{len(tl['ranks'])} ranks, {tl['cells']} collectives"


def job_page(store: Any, job_id: str, report: dict[str, Any], attempt: int | None, traces: Any, *,
             ranks: Collection[int] | None = None, groups: Collection[str] | None = None,
             seq_range: tuple[int, int] | None = None) -> tuple[str, str]:
    """(the page, a one-line description) of a job: ``report`` is `fleet replay`'s
    (``replay_report`` or ``fronts_report``), ``attempt`` the one the timeline shows (the
    last, or --attempt), ``traces`` its traces (None for a large job none of whose groups
    was pulled whole)."""
    from fleet.controlplane.report import load_report

    shown = next((a for a in report["attempts"] if a["attempt"] == attempt), None)
    diagnosis = shown["diagnosis"] if shown else {
        "verdict": "empty", "summary": "the job has no attempt yet", "culprit_ranks": [], "findings": []}
    summary = load_report(store, job_id, time.time())
    ended = [i["detected_at"] for i in summary["incidents"] if i["attempt"] == attempt and i.get("ended_attempt")]
    fronts, notes, world, nodes = [], [], [], {}
    if shown is not None:
        world = [r["rank"] for r in shown.get("ranks", [])]
        nodes = {r["rank"]: r["node"] for r in shown.get("ranks", [])}
        if shown.get("mode") == "fronts":
            fronts = store.fronts(job_id, attempt, limit=FRONTS_MAX)
            world = list(range(shown["ranks_placed"]))
            nodes = {int(r): n for r, n in shown["nodes"].items()}
            nodes.update({r: n for r, n in store.rank_nodes(job_id, attempt, world).items()})
            notes.append(_fronts_note(job_id, shown, len(fronts)))
    tl = timeline(traces, diagnosis, fronts=fronts, ranks=ranks, groups=groups, seq_range=seq_range, world=world,
                  end_ns=int(min(ended) * 1e9) if ended else 0, nodes=nodes)
    t0 = tl["t0_ns"] or int(summary["attempts_detail"][0]["started_at"] * 1e9 if summary["attempts_detail"] else 0)
    tl["t0_ns"] = t0
    losses = {a.number: [(s["step"], s["loss"]) for s in store.step_aggregates(job_id, a.number)[1]]
              for a in store.get_attempts(job_id)}
    restored = {a["attempt"]: a["restored_step"] for a in report["attempts"]}
    doc = {"source": f"store:{job_id}" + (f" attempt {attempt}" if attempt is not None else ""),
           "diagnosis": diagnosis, "timeline": tl, "notes": notes, "generated_at": time.time(),
           "job": job_section(summary, t0, losses=losses, restored=restored, attempt=attempt)}
    return render_html(doc), f"{len(tl['ranks'])} ranks, {tl['cells']} collectives, " \
        f"{len(summary['incidents'])} incident(s), {len(summary['attempts_detail'])} attempt(s)"


def _fronts_note(job_id: str, attempt: dict[str, Any], drawn: int) -> str:
    fr = attempt["fronts"]
    pulled = attempt.get("diagnosed_groups") or []
    raw = (f"the raw entries the controller pulled for {len(pulled)} group(s) ({', '.join(pulled[:6])}"
           f"{' ...' if len(pulled) > 6 else ''})" if pulled else "no raw entries (no group was pulled whole)")
    cut = f"; the first {drawn} of {fr['count']} fronts are drawn" if drawn < fr["count"] else ""
    return (f"A large job: its agents sent collective fronts (where each rank stands in each group), not every "
            f"collective. Each rank's track shows its fronts, outlined, and {raw}{cut}. In a terminal, "
            f"`fleet replay {job_id} --page N --page-size K --page-by rank|group` pages through all "
            f"{fr['count']} fronts ({fr['page']['pages']} page(s) of {fr['page']['page_size']}).")
