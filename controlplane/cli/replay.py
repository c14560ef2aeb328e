"""`fleet replay`: the desync verdict, wavefront and timelines of a job's collectives
(from the store) or of a folder of native flight-recorder dumps (`fleet replay DIR`, or
`--dumps DIR`).

The positional argument is a folder of dumps when it names an existing directory, else a
job id. With dumps, each finding also carries the Python stacks of the ranks it blames
(``diagnosis.stacks``). ``--exit-code`` makes the verdict the exit status
(``VERDICT_EXIT_CODES``), clear of the error codes (``fleet.controlplane.errors``: 1-7,
130; 2 for usage errors too).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.controlplane.cli.bandwidth_view import print_bandwidth
from fleet.controlplane.cli.common import ClusterOpt, JsonOpt, StoreOpt
from fleet.controlplane.cli.render import (
    console,
    err_console,
    exit_text,
    print_json,
    print_table,
    print_traceback,
    progress,
    step_text,
)
from fleet.controlplane.errors import ConfigError, DumpError, NotFoundError
from fleet.proto.flight_record import P2P_SUFFIX

#: Exit status of `fleet replay --exit-code` per verdict.
VERDICT_EXIT_CODES = {"ok": 0, "mismatch": 10, "hang": 11, "straggler": 12, "empty": 13}
#: Frames of one stack printed under a finding (``--json`` has them all).
STACK_LINES = 8
#: Incidents of one kind in one attempt listed in full (a reconnect storm may raise
#: thousands of agent_loss ones); the rest in one line.
INCIDENTS_SHOWN_PER_KIND = 5
#: Rows of a large job's pulled diagnosis's wavefront shown (the culprits' first).
LARGE_JOB_WAVE_ROWS = 32


def replay(
    target: Annotated[
        str | None, typer.Argument(metavar="JOB_ID|DIR", show_default=False,
                                   help="A folder of native flight-recorder dumps (when it names an existing "
                                        "folder), else a job id (see `fleet jobs`).")
    ] = None,
    dumps: Annotated[
        Path | None,
        typer.Option("--dumps", help="Analyse this folder of native PyTorch flight-recorder dumps "
                     "(one file per rank, named <prefix><rank> or <prefix><host>_<rank>) instead of a job."),
    ] = None,
    prefix: Annotated[
        str | None, typer.Option("--prefix", "-p", help="With dumps: read the files named <prefix><rank> "
                                 "(else <prefix><host>_<rank>) \\[default: inferred]")
    ] = None,
    attempt: Annotated[int | None, typer.Option("--attempt", "-a", help="Only this attempt.")] = None,
    ranks: Annotated[
        list[int] | None, typer.Option("--rank", "-r", help="Show only this rank (repeatable).")
    ] = None,
    groups: Annotated[
        list[str] | None, typer.Option("--group", "-g", help="Show only this process group, by name or "
                                       "description (repeatable).")
    ] = None,
    around_seq: Annotated[
        int | None, typer.Option("--around-seq", help="Show only collectives within --window of this "
                                 "sequence number.")
    ] = None,
    window: Annotated[int, typer.Option("--window", help="Half-width of --around-seq.")] = 5,
    perfetto: Annotated[
        Path | None, typer.Option("--perfetto", help="Write a Chrome/Perfetto trace JSON here "
                                  "(open it in ui.perfetto.dev).")
    ] = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="Write a self-contained HTML incident report here (one "
                                  "file, opens offline): the per-rank timeline with the culprit highlighted, "
                                  "the verdict and evidence, incidents and restarts, loss and lost time.")
    ] = None,
    last_steps: Annotated[
        int, typer.Option("--steps", help="Show the last N steps of each attempt (0 = all).")
    ] = 20,
    page: Annotated[
        int | None, typer.Option("--page", help="A large job (collective fronts): show this page of its "
                                 "fronts (rank order) or groups (--page-by group). \\[default: 1]",
                                 show_default=False)
    ] = None,
    page_size: Annotated[
        int | None, typer.Option("--page-size", help="A large job: rows per page. \\[default: 50]",
                                 show_default=False)
    ] = None,
    page_by: Annotated[
        str | None, typer.Option("--page-by", help="A large job: page through its fronts by rank, or "
                                 "through its groups (one row each): rank|group. \\[default: rank]",
                                 show_default=False)
    ] = None,
    exit_code: Annotated[
        bool, typer.Option("--exit-code", help="Exit non-zero unless the verdict is ok: mismatch 10, hang 11, "
                           "straggler 12, empty 13.")
    ] = False,
    store: StoreOpt = None,
    cluster: ClusterOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Desync verdict (which rank, which collective, why, and the culprit's stack),
    per-rank wavefront and step timeline of a job, every attempt; or the same analysis
    over a folder of dumps."""
    folder, job_id = _target(target, dumps)
    if window < 0:
        raise ConfigError(f"--window: must be >= 0, got {window}")
    if prefix is not None and folder is None:
        raise ConfigError("--prefix: only with a folder of dumps (fleet replay DIR -p PREFIX)")
    view = _View(set(ranks) if ranks else None, list(groups) if groups else None,
                 (around_seq - window, around_seq + window) if around_seq is not None else None)
    if html is not None:
        from fleet.controlplane.replay_html_doc import check_path

        view.html = check_path(html)  # refused before any analysis
    paging = {k: v for k, v in (("page", page), ("size", page_size), ("by", page_by)) if v is not None}
    if folder is not None:
        if paging:
            raise ConfigError("--page/--page-size/--page-by: only for a large job from the store "
                              "(one whose agents sent collective fronts)")
        verdict = _replay_dumps(folder, prefix, view, perfetto, json_out)
    else:
        verdict = _replay_job(job_id, attempt, view, perfetto, last_steps, store, cluster, json_out, paging)
    if exit_code and VERDICT_EXIT_CODES.get(verdict, 1):
        raise typer.Exit(VERDICT_EXIT_CODES.get(verdict, 1))


def _target(target: str | None, dumps: Path | None) -> tuple[Path | None, str]:
    """(folder of dumps, job id): exactly one of them."""
    if (target is None) == (dumps is None):
        raise ConfigError("fleet replay: give a JOB_ID, a folder of dumps, or --dumps DIR (exactly one)")
    if dumps is not None:
        return dumps, ""
    assert target is not None
    path = Path(target).expanduser()
    if path.is_dir():
        return path, ""
    if path.exists():
        raise DumpError(f"{target}: a file, not a folder of flight-recorder dumps (give the folder that holds it)")
    if "/" in target or target.startswith((".", "~")):
        raise DumpError(f"{target}: no such folder of flight-recorder dumps")
    return None, target


class _View:
    """The --rank/--group/--around-seq selection, applied to what is shown (the analysis
    always sees every rank: a culprit needs the others' evidence). ``--group`` values
    name a group or its description; ``resolve`` turns them into group names."""

    def __init__(self, ranks: set[int] | None, groups: list[str] | None, seqs: tuple[int, int] | None) -> None:
        self.ranks, self.wanted, self.seqs = ranks, groups, seqs
        self.groups: set[str] | None = None
        self.html: Path | None = None  # --html: where the HTML report goes

    def resolve(self, known: list[dict[str, Any]]) -> None:
        """Match the --group values against ``known`` ({"group", "desc"} rows); a value
        that matches none is an error listing the groups there are."""
        if self.wanted is None:
            return
        chosen: set[str] = set()
        for value in self.wanted:
            hits = {g["group"] for g in known if value in (g["group"], g.get("desc"))}
            if not hits:
                there = sorted({(g["group"], g.get("desc") or "") for g in known}, key=lambda gd: _group_key(gd[0]))
                names = ", ".join(f"{n} ({d})" if d and d != n else n for n, d in there[:30])
                more = f" and {len(there) - 30} more" if len(there) > 30 else ""
                raise ConfigError(f"--group {value}: no group has that name or description; "
                                  f"groups: {names or 'none'}{more}")
            chosen |= hits
        self.groups = chosen

    def keep(self, row: dict[str, Any], seq_key: str = "seq") -> bool:
        if self.groups is not None and row.get("group") not in self.groups:
            return False
        if self.ranks is not None:
            rs = set(row.get("ranks", [])) | set(row.get("waiting_ranks", []))
            if "rank" in row:
                rs.add(row["rank"])
            if not rs & self.ranks:
                return False
        if self.seqs is not None and seq_key in row and not self.seqs[0] <= row[seq_key] <= self.seqs[1]:
            return False
        return True

    def apply(self, diag: dict[str, Any]) -> dict[str, Any]:
        out = dict(diag)
        out["findings"] = [f for f in diag["findings"] if self.keep(f)]
        out["wavefront"] = [w for w in diag["wavefront"] if self.keep(w, "last_entered_seq")]
        return out


def _group_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def _replay_dumps(folder: Path, prefix: str | None, view: _View, perfetto: Path | None, json_out: bool) -> str:
    from fleet.controlplane.diagnosis import diagnose, load_traces
    from fleet.controlplane.diagnosis.bandwidth import analyse
    from fleet.controlplane.diagnosis.stacks import finding_stacks

    with progress(f"reading dumps in {folder} ...") as say:  # stderr, on a terminal only
        traces = load_traces(folder, prefix, progress=lambda done, total: say(f"read {done}/{total} dumps"))
    diag = diagnose(traces)
    full = diag.to_json()
    view.resolve(full["groups"])
    stacks = finding_stacks(diag, traces)
    for i, f in enumerate(full["findings"]):
        f["stacks"] = stacks.get(i, [])
    if perfetto is not None:
        _write_perfetto(perfetto, traces, diag, view)
    if view.html is not None:
        from fleet.controlplane.replay_html_doc import dumps_page

        _write_html(view, json_out, *dumps_page(folder, traces, full, ranks=view.ranks, groups=view.groups,
                                                seq_range=view.seqs))
    out = view.apply(full)
    out["bandwidth"] = analyse(traces).to_json()
    if json_out:
        print_json(out)
    else:
        _print_diagnosis(out, title=f"{folder}: {len(diag.ranks)} ranks")
        print_bandwidth(out["bandwidth"], str(folder))
    return diag.verdict


def _replay_job(job_id: str, attempt: int | None, view: _View, perfetto: Path | None, last_steps: int,
                store: str | None, cluster: Path | None, json_out: bool, paging: dict[str, Any]) -> str:
    from fleet.controlplane.cli.common import open_store
    from fleet.controlplane.diagnosis import diagnose_attempt
    from fleet.controlplane.fronts_replay import has_fronts
    from fleet.controlplane.replay import replay_report

    with open_store(store, cluster) as st, progress(f"reading and analysing job {job_id} ..."):
        if has_fronts(st, job_id):
            report = _fronts_report(st, job_id, attempt, view, perfetto, last_steps, paging, json_out)
        elif paging:
            raise ConfigError(f"--page/--page-size/--page-by: job {job_id} sent every collective (no "
                              "collective fronts): its replay has no pages")
        else:
            report = _report(st, job_id, attempt, view, perfetto, replay_report, diagnose_attempt, json_out)
    return _show(report, view, last_steps, json_out)


def _report(st: Any, job_id: str, attempt: int | None, view: _View, perfetto: Path | None,
            replay_report: Any, diagnose_attempt: Any, json_out: bool = False) -> dict[str, Any]:
    """The ordinary report: a job that sent every collective."""
    report = replay_report(st, job_id, attempt)
    if attempt is not None and not report["attempts"]:
        raise NotFoundError(f"job {job_id} has no attempt {attempt}")
    view.resolve([g for a in report["attempts"] for g in a["diagnosis"].get("groups", [])])
    chosen = report["attempts"][-1]["attempt"] if report["attempts"] else None
    traces = None
    if (perfetto is not None or view.html is not None) and chosen is not None:
        traces, diag = diagnose_attempt(st, job_id, chosen)  # once, for both exports
        if perfetto is not None:
            _write_perfetto(perfetto, traces, diag, view)
    if view.html is not None:
        _write_job_html(st, job_id, report, chosen, traces, view, json_out)
    return report


def _fronts_report(st: Any, job_id: str, attempt: int | None, view: _View, perfetto: Path | None,
                   last_steps: int, paging: dict[str, Any], json_out: bool = False) -> dict[str, Any]:
    """A large job's report (``controlplane.fronts_replay``): --group resolved against the
    groups its ranks declared (names and descriptions only), the page chosen."""
    from fleet.controlplane.fronts_replay import Paging, fronts_report, pulled_traces

    numbers = [a.number for a in st.get_attempts(job_id)]
    if attempt is not None and attempt not in numbers:
        raise NotFoundError(f"job {job_id} has no attempt {attempt}")
    chosen = attempt if attempt is not None else (numbers[-1] if numbers else None)
    if chosen is not None:
        view.resolve(st.declared_group_names(job_id, chosen))
    pages = Paging(**paging, ranks=tuple(sorted(view.ranks)) if view.ranks else None,
                   groups=tuple(sorted(view.groups)) if view.groups is not None else None)
    report = fronts_report(st, job_id, attempt, pages, last_steps)
    traces = None
    if (perfetto is not None or view.html is not None) and chosen is not None:
        record = next(a for a in st.get_attempts(job_id) if a.number == chosen)
        traces, diag, _, _ = pulled_traces(st, job_id, record)
        if perfetto is not None and traces is None:
            raise ConfigError(f"--perfetto: attempt {chosen} of job {job_id} has no group whose raw entries "
                              "were pulled whole (a large job keeps them on its agents)")
        if perfetto is not None:
            _write_perfetto(perfetto, traces, diag, view)
    if view.html is not None:
        _write_job_html(st, job_id, report, chosen, traces, view, json_out)
    return report


def _show(report: dict[str, Any], view: _View, last_steps: int, json_out: bool) -> str:
    for a in report["attempts"]:
        for f in a["diagnosis"]["findings"]:
            f["stacks"] = []  # the store keeps no Python stacks
        a["diagnosis"] = view.apply(a["diagnosis"])
        if "collectives" in a:
            a["collectives"] = [c for c in a["collectives"] if view.keep(c, seq_key="")]
    top = report["attempts"][-1]["diagnosis"] if report["attempts"] else {
        "source": f"store:{report['job']['id']}", "attempt": None, "verdict": "empty", "culprit_ranks": [],
        "findings": []}
    if json_out:
        print_json({**top, "job": report["job"], "attempts": report["attempts"],
                    "incidents": report["incidents"], "checkpoints": report["checkpoints"],
                    "events_lost": report["events_lost"], "sdc": report["sdc"]})
    else:
        _print_job(report, last_steps)
    return str(top["verdict"])


def _write_perfetto(path: Path, traces: Any, diag: Any, view: _View) -> None:
    from fleet.controlplane.diagnosis.perfetto import perfetto_trace

    group = None
    if view.groups is not None and len(view.groups) == 1:
        group = next(iter(view.groups))
    elif view.groups is not None:  # several: the trace of those groups only
        traces = replace(traces, ranks={r: replace(t, groups={g: o for g, o in t.groups.items() if g in view.groups})
                                        for r, t in traces.ranks.items()})
    doc = perfetto_trace(traces, diag, ranks=view.ranks, group=group, seq_range=view.seqs)
    try:
        path.write_text(json.dumps(doc, separators=(",", ":")))
    except OSError as exc:
        raise ConfigError(f"--perfetto {path}: cannot write ({exc.strerror or exc})") from None
    err_console.print(f"wrote {path} ({len(doc['traceEvents'])} events); open it in https://ui.perfetto.dev")


def _write_job_html(st: Any, job_id: str, report: dict[str, Any], chosen: int | None, traces: Any,
                    view: _View, json_out: bool) -> None:
    from fleet.controlplane.replay_html_doc import job_page

    _write_html(view, json_out, *job_page(st, job_id, report, chosen, traces, ranks=view.ranks, groups=view.groups,
                                       seq_range=view.seqs))


def _write_html(view: _View, json_out: bool, page: str, what: str) -> None:
    """Write the HTML report (atomically) and say where (on stderr with --json: its
    stdout stays one document)."""
    from fleet.controlplane.replay_html_doc import write

    assert view.html is not None
    size = write(view.html, page)
    kb = f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"
    (err_console if json_out else console).print(f"wrote {view.html} ({what}, {kb}); open it in a browser, offline",
                                                 highlight=False, soft_wrap=True)


#: Findings the text output lists (causes first); --json has them all.
MAX_FINDINGS_SHOWN = 40

_VERDICT_STYLE = {"ok": "green", "hang": "red", "mismatch": "red", "straggler": "yellow", "empty": "dim"}


def _few(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (" ..." if len(names) > n else "")


def _print_diagnosis(d: dict[str, Any], title: str, wave_rows: int = 200) -> None:
    """The verdict, its findings and stacks, and up to ``wave_rows`` wavefront rows (the
    culprits' first)."""
    style = _VERDICT_STYLE.get(d["verdict"], "bold")
    console.print(f"{title}: [{style}]{d['verdict'].upper()}[/] {d['summary']}", highlight=False)
    if d.get("missing_ranks"):
        console.print(f"[yellow]no trace from ranks {d['missing_ranks']}[/]")
    if d["findings"]:
        shown = d["findings"][:MAX_FINDINGS_SHOWN]  # causes come first
        print_table("findings", ["#", "kind", "group", "seq", "ranks", "waiting", "detail"],
                    [[n, f["kind"], f["group"], f["seq"], _short(f["ranks"]), _short(f.get("waiting_ranks", [])),
                      f["detail"]] for n, f in enumerate(shown, 1)])
        if len(d["findings"]) > len(shown):
            console.print(f"... {len(d['findings']) - len(shown)} more findings, the waits the ones above explain "
                          "(use --rank/--group or --json)")
        _print_stacks(shown)
    waves = d["wavefront"]
    if waves:
        culprits = set(d["culprit_ranks"])
        waves = sorted(waves, key=lambda w: w["rank"] not in culprits)  # stable: the culprits' rows first
        print_table("wavefront: where each rank stands in each group",
                    ["rank", "group", "last entered", "op", "last completed", "state"],
                    [[f"[red]{w['rank']}[/]" if w["rank"] in culprits else w["rank"], w["group"],
                      w["last_entered_seq"], w["last_entered_op"], w["last_completed_seq"],
                      "waiting" if w["waiting"] else "-"] for w in waves[:wave_rows]])
        if len(waves) > wave_rows:
            console.print(f"... {len(waves) - wave_rows} more rows (use --rank/--group or --json)")


def _print_stacks(findings: list[dict[str, Any]]) -> None:
    """Under the findings table: per finding, where each blamed rank's Python code stands
    (innermost frame first); ranks with the same stack share one block."""
    for n, f in enumerate(findings, 1):
        blocks: dict[tuple, list[dict[str, Any]]] = {}
        for st in f.get("stacks", []):
            key = (st["group"], st["seq"], st["op"], st["state"],
                   tuple((fr["name"], fr["filename"], fr["line"]) for fr in st["frames"]))
            blocks.setdefault(key, []).append(st)
        for sts in blocks.values():
            st = sts[0]
            who = ", ".join(str(s["rank"]) for s in sts)
            stands = f"stands at {st['op']} #{st['seq']} of group {st['group']}"
            if (st["group"], st["seq"]) == (f["group"].removesuffix(P2P_SUFFIX), f["seq"]):
                at = f"in {st['op']} #{st['seq']}"
            else:
                at = f"never entered #{f['seq']}; {stands}" if f["group"] and f["seq"] > 0 else stands
            console.print(f"[bold]#{n} {f['kind']}[/] rank{'s' if len(sts) > 1 else ''} {who} {at} "
                          f"({st['state']}):", highlight=False, soft_wrap=True)
            frames = st["frames"]
            skipped = 0
            while skipped < len(frames) - 1 and "/torch/distributed/" in frames[skipped]["filename"]:
                skipped += 1  # the c10d call plumbing: the user's code is what tells where
            for fr in frames[skipped:skipped + STACK_LINES]:
                console.print(f"    {fr['name']} ({fr['filename']}:{fr['line']})", highlight=False,
                              soft_wrap=True, markup=False)
            rest = len(frames) - skipped - STACK_LINES
            notes = ([f"{skipped} torch.distributed frame{'s' if skipped > 1 else ''} above"] if skipped else []) + \
                ([f"{rest} more below"] if rest > 0 else [])
            if not frames:
                console.print("    [dim](no frames in the dump: it was written without stack traces)[/]")
            elif notes:
                console.print(f"    [dim]({'; '.join(notes)}; --json has every frame)[/]", highlight=False)


def sdc_line(v: dict[str, Any]) -> str:
    """One SDC incident in a line: verdict, first bad step, suspect, triage, rollback point."""
    if v["first_bad_step"] is None:  # no verdict row matched it: its evidence says what is known
        return f"{v['verdict'].upper()} {v['incident_evidence']}"
    suspect = f"rank {v['suspect_rank']}" + (f" on {v['suspect_node']}" if v["suspect_node"] else "") \
        if v["suspect_rank"] >= 0 else "no suspect"
    line = f"{v['verdict'].upper()} from step {v['first_bad_step']}, {suspect}"
    if v["state"]:
        line += f" ({v['state']})"
    line += f", {v['replays']} replay(s)"
    if v["rollback_step"] is not None:
        line += f", rolled back to step {v['rollback_step']}"
    if v["triage"]:
        line += "; triage: " + "; ".join(v["triage"])
    return line


def _short(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{len(ranks)} ranks"


def _print_job(report: dict[str, Any], last_steps: int) -> None:
    job = report["job"]
    console.print(
        f"[bold]{job['id']}[/] {job['name']}: {job['state']}, "
        f"{step_text(job['steps_completed'], job['total_steps'])}{job['attempts']} attempt(s). {job['reason']}"
    )
    lost = report["events_lost"]
    if lost:
        console.print(
            f"[yellow]warning:[/] {sum(d['events'] for d in lost)} events from nodes "
            f"{sorted({d['node'] for d in lost})} never reached the store while this job ran "
            f"({lost[-1]['reason']}); a rank may look behind because of it (fleet nodes)")
    by_kind: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for inc in report["incidents"]:
        same = by_kind.setdefault((inc["attempt"], inc["kind"]), [])
        same.append(inc)
        if len(same) > INCIDENTS_SHOWN_PER_KIND:
            continue
        how = exit_text(inc["exit_code"])
        console.print(
            f"[red]incident[/] attempt {inc['attempt']}: {inc['kind']} rank {inc['rank']} on {inc['node']} "
            f"({inc['detector']}): {inc['evidence']}" + (f"; {how}" if how else "")
        )
        if inc["traceback"]:
            print_traceback(inc["traceback"])
    for (attempt, kind), same in by_kind.items():
        if len(same) > INCIDENTS_SHOWN_PER_KIND:
            nodes = sorted({i["node"] for i in same if i["node"]})
            console.print(f"[red]incident[/] attempt {attempt}: ... {len(same) - INCIDENTS_SHOWN_PER_KIND} more "
                          f"{kind} incidents ({len(same)} in all, on {len(nodes)} node(s): {_few(nodes)}; --json "
                          "lists every one)", highlight=False)
    if report["checkpoints"]:
        console.print("checkpoints: " + ", ".join(
            f"step {c['step']}" + ("" if c["valid"] else " [red]INVALID[/]") for c in report["checkpoints"]))
    for a in report["attempts"]:
        restored = a["restored_step"]
        console.rule(
            f"attempt {a['attempt']}: {a['state']}, restored from "
            f"{'step ' + str(restored) if restored else 'scratch'}, final step {a['final_step']}"
        )
        if a.get("mode") == "fronts":
            _print_fronts_attempt(a, report["sdc"])
            continue
        nodes = {r["rank"]: r["node"] for r in a["ranks"]}
        _print_diagnosis(a["diagnosis"], title=f"attempt {a['attempt']}")
        for v in report["sdc"]["incidents"]:
            if v["attempt"] == a["attempt"]:
                console.print(f"attempt {a['attempt']}: [red]SDC[/] {sdc_line(v)}", highlight=False,
                              soft_wrap=True)
        print_table(
            "collectives per rank and group (mean ms: of the measured durations only)",
            ["rank", "node", "group", "#ops", "seq range", "consecutive", "#done", "last done", "ops", "mean ms",
             "timing"],
            [
                [c["rank"], nodes.get(c["rank"], "?"), c["group"], c["count"],
                 f"{c['first_seq']}..{c['last_seq']}", "yes" if c["consecutive"] else "[red]GAP[/]",
                 c["completed"], c["last_completed_seq"],
                 " ".join(f"{k}:{v}" for k, v in sorted(c["ops"].items())),
                 f"{c['mean_duration_ms']:.2f}" if c["mean_duration_ms"] is not None else "[dim]not measured[/]",
                 f"{','.join(c['timings'])} ({c['measured']}/{c['count']})" if c["measured"] else "-"]
                for c in a["collectives"]
            ],
        )
        print_bandwidth(a.get("bandwidth"), f"attempt {a['attempt']}")
        steps = a["steps"][-last_steps:] if last_steps else a["steps"]
        print_table(
            f"steps ({len(steps)} of {len(a['steps'])} shown)",
            ["step", "loss", "grad norm", "lr", "aux", "ranks", "median s", "max s", "slowest",
             "tokens/s", "MFU", "imbalanced MoE layers"],
            [
                [s["step"], f"{s['loss']:.4f}", f"{s['grad_norm']:.3f}", f"{s['lr']:.2e}",
                 f"{s['aux_loss']:.4f}", s["ranks"], f"{s['step_time_s_median']:.4f}",
                 f"{s['step_time_s_max']:.4f}", s["slowest_rank"], f"{s['tokens_per_s']:.0f}",
                 f"{s['mfu']:.1%}", ",".join(map(str, s["imbalanced_layers"])) or "-"]
                for s in steps
            ],
        )


def _print_fronts_attempt(a: dict[str, Any], sdc: dict[str, Any]) -> None:
    """A large job's attempt: the verdict over the pulled groups, the wavefront around the
    incident, the whole job's fronts per group kind, one page of the rest, the steps."""
    from fleet.controlplane.fronts_view import clock, kinds_lines, standing_line

    fr = a["fronts"]
    nodes = {int(r): n for r, n in a["nodes"].items()}
    console.print(f"{a['ranks_placed']} ranks, {fr['count']} collective fronts (a large job: raw collectives "
                  f"stay on the agents; the controller pulled {len(a['pulled'])} group(s))", highlight=False)
    # the wavefront around the incident below says where the groups stand: the pulled
    # diagnosis's own rows (hundreds of members) are shown for the culprits and a few more
    _print_diagnosis(a["diagnosis"], title=f"attempt {a['attempt']}", wave_rows=LARGE_JOB_WAVE_ROWS)
    if a["diagnosed_groups"]:
        console.print(f"diagnosed on the pulled entries of groups {', '.join(a['diagnosed_groups'][:12])}"
                      + (" ..." if len(a["diagnosed_groups"]) > 12 else ""), highlight=False)
    for g, missing in a["pulled_partial"].items():
        console.print(f"[dim]group {g}: left out of the diagnosis, {missing} member(s) have no pulled entries[/]",
                      highlight=False)
    culprits = a["diagnosis"]["culprit_ranks"]
    if culprits:
        console.print("culprit" + ("s" if len(culprits) > 1 else "") + ": " + ", ".join(
            f"rank {r}" + (f" (node {nodes[r]})" if r in nodes else "") for r in culprits[:16]), highlight=False)
    for v in sdc["incidents"]:
        if v["attempt"] == a["attempt"]:
            console.print(f"attempt {a['attempt']}: [red]SDC[/] {sdc_line(v)}", highlight=False, soft_wrap=True)
    if fr["around_incident"]:
        console.rule("wavefront around the incident")
        for s in fr["around_incident"]:
            console.print(standing_line(s, nodes), highlight=False, soft_wrap=True)
    console.rule("the whole job's fronts")
    for line in kinds_lines(fr["summary"]):
        console.print(line, highlight=False)
    p = fr["page"]
    first = (p["page"] - 1) * p["page_size"] + 1
    title = (f"{p['unit']} {first}..{first + len(p['rows']) - 1} of {p['total']}: page {p['page']} of "
             f"{p['pages']} (--page N, --page-size K, --page-by rank|group)")
    if p["by"] == "group":
        print_table(title, ["group", "desc", "fronts", "seq range", "open", "behind", "oldest open", "ops"],
                    [[g["group"], g["desc"], g["fronts"], f"{g['min_seq']}..{g['top_seq']}", g["open"],
                      g["behind"], clock(g["oldest_open_ns"]), g["ops"]] for g in p["rows"]])
    else:
        print_table(title, ["rank", "node", "group", "entered", "op", "completed", "state", "entered at", "step"],
                    [[f"[red]{f['rank']}[/]" if f["rank"] in culprits else f["rank"], f["node"] or "?", f["group"],
                      f["entered_seq"], f["op"], f["completed_seq"], "waiting" if f["open"] else "-",
                      clock(f["entered_ns"]), f["step"]] for f in p["rows"]])
    steps = a["steps"]
    print_table(
        f"steps ({len(steps)} of {a['steps_recorded']} shown; means over ranks)",
        ["step", "loss", "grad norm", "lr", "aux", "ranks", "mean s", "max s", "slowest", "tokens/s", "MFU",
         "imbalanced ranks"],
        [[s["step"], f"{s['loss']:.4f}", f"{s['grad_norm']:.3f}", f"{s['lr']:.2e}", f"{s['aux_loss']:.4f}",
          s["ranks"], f"{s['step_time_s_mean']:.4f}", f"{s['step_time_s_max']:.4f}", s["slowest_rank"],
          f"{s['tokens_per_s']:.0f}", f"{s['mfu']:.1%}", s["imbalanced_ranks"] or "-"] for s in steps])
