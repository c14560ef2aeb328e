"""`fleet report`: a job's effective training time ratio and where the rest went."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from fleet.controlplane.cli.bandwidth_view import print_bandwidth
from fleet.controlplane.cli.common import ClusterOpt, JsonOpt, StoreOpt, open_store
from fleet.controlplane.cli.render import (
    console,
    exit_text,
    fmt_time,
    print_json,
    print_table,
    print_traceback,
    progress,
    step_text,
)


def report(
    job_id: Annotated[str, typer.Argument(help="The job, as `fleet jobs` lists it.")],
    store: StoreOpt = None, cluster: ClusterOpt = None, json_out: JsonOpt = False,
) -> None:
    """ETTR (productive step time / wall time), lost time by category, wall time by
    attempt, incidents with their detection and recovery times, exit codes and
    tracebacks, what observed incidents would have done (detect.<kind>.action: observe), silent data corruption (checks, triage, verdict, rollback point),
    restarts, quarantines, with a topology why each attempt's nodes were chosen, and the
    newest attempt's collective bandwidth (measured durations only)."""
    from fleet.controlplane.collective_report import stored_attempt_bandwidth
    from fleet.controlplane.report import load_report

    with open_store(store, cluster) as st, progress(f"reading job {job_id} ..."):  # a long job's rows take a while
        out = load_report(st, job_id, time.time())
        last = out["attempts_detail"][-1]["number"] if out["attempts_detail"] else None
        # the newest attempt's collectives: what the job's groups run at now
        out["bandwidth"] = stored_attempt_bandwidth(st, job_id, last) if last is not None else None
    if json_out:
        print_json(out)
        return
    console.print(f"[bold]{out['job']}[/] {out['name']}: {out['state']}, "
                  f"{step_text(out['final_step'], out['total_steps'])}{out['attempts']} attempt(s), "
                  f"{out['restarts']} restart(s)", highlight=False)
    if out["ettr"] is None:
        console.print(f"ETTR: not measured, the program reported no steps (call fleet.step to count "
                      f"them); its {out['wall_s']:.1f} s of wall time by attempt and incident:",
                      highlight=False)
    else:
        paused = f" (and {out['stopped_s']:.1f} s stopped, not counted)" if out.get("stopped_s") else ""
        console.print(f"ETTR {out['ettr']:.1%}: {out['productive_s']:.1f} s of productive steps in "
                      f"{out['wall_s']:.1f} s{paused}", highlight=False)
        print_table("lost time", ["category", "seconds", "share of wall"],
                    [[k.removesuffix("_s"), f"{v:.2f}", f"{v / out['wall_s']:.1%}"]
                     for k, v in out["lost_s"].items()])
    print_table("attempts", ["attempt", "state", "started", "ended", "wall s", "reason"],
                [[a["number"], a["state"], fmt_time(a["started_at"]), fmt_time(a["ended_at"]),
                  f"{a['wall_s']:.2f}", a["reason"] or "-"] for a in out["attempts_detail"]])
    if out["incidents"]:
        print_table("incidents", ["attempt", "kind", "rank", "node", "exit", "detected after s", "recovery s",
                                  "steps lost", "restored from"],
                    [[i["attempt"], i["kind"] + (" (observed)" if i["observed"] else ""), i["rank"], i["node"],
                      _dash(i["exit_code"]),
                      _dash(i["detected_after_s"]), _dash(i["recovery_s"]), _dash(i.get("steps_lost")),
                      i.get("restored_from") or "-"]
                     for i in out["incidents"]])
        for i in out["incidents"]:
            if i["observed"]:
                console.print(f"[cyan]observed[/] attempt {i['attempt']}, {i['kind']} of rank {i['rank']} on "
                              f"{i['node'] or 'no node'}: {i['would']}; {i['evidence']}", highlight=False)
            if i["exit_code"] is not None or i["traceback"]:
                how = exit_text(i["exit_code"]) or "no exit code"
                console.print(f"[red]attempt {i['attempt']}[/], {i['kind']} of rank {i['rank']} on "
                              f"{i['node']}: {how}", highlight=False)
                if i["traceback"]:
                    print_traceback(i["traceback"])
        timed = [i for i in out["incidents"] if i.get("phases")]
        if timed:
            phases = list(timed[0]["phases"])
            print_table("recovery by phase (s)", ["attempt", *phases, "failure to first step"],
                        [[i["attempt"], *(f"{i['phases'][p]:.2f}" for p in phases),
                          f"{i['failure_to_first_step_s']:.2f}"] for i in timed])
    print_sdc(out["sdc"])
    for cause in out["quarantines"]:
        console.print(f"[yellow]quarantine:[/] {cause}", highlight=False)
    for p in out["placements"]:  # stored as one line, its reasons joined by "; "
        console.print(f"placement of attempt {p['attempt']}:", highlight=False)
        for reason in p["reasons"].split("; "):
            console.print(f"  {reason}", highlight=False)
    if out["bandwidth"] is not None:
        print_bandwidth(out["bandwidth"], f"attempt {out['attempts_detail'][-1]['number']}")
    if out["checkpoints"]:
        console.print("checkpoints: " + ", ".join(
            f"step {c['step']}" + ("" if c["valid"] else " [red]INVALID[/]") for c in out["checkpoints"]),
            highlight=False)
    for cause in out["invalid_checkpoints"]:
        console.print(f"[yellow]{cause}[/]", highlight=False)


def print_sdc(sdc: dict) -> None:
    """The SDC section: check counts, then one row per SDC incident (or triage without one)."""
    if not (sdc["fingerprint_checks"] or sdc["triggers"] or sdc["verdicts"] or sdc["incidents"]):
        return
    console.print(f"silent data corruption: {sdc['fingerprint_checks']} fingerprint check(s) "
                  f"({sdc['fingerprints']} fingerprints), {sdc['mismatches']} mismatch(es), "
                  f"{sdc['triggers']} trigger(s), {sdc['replays']} replay(s)", highlight=False)
    rows = sdc["incidents"] or [v for v in sdc["verdicts"] if v["verdict"] != "clean"]
    if rows:
        print_table("SDC incidents", ["attempt", "verdict", "first bad step", "suspect", "node", "state",
                                      "replays", "rolled back to", "triage"],
                    [sdc_row(v) for v in rows])
    clean = sum(1 for v in sdc["verdicts"] if v["verdict"] == "clean")
    if clean:
        console.print(f"{clean} trigger triage(s) found no corruption (clean)", highlight=False)


def sdc_row(v: dict) -> list[object]:
    """One SDC incident (or verdict) as a table row."""
    suspect = "-" if v["suspect_rank"] is None or v["suspect_rank"] < 0 else f"rank {v['suspect_rank']}"
    triage = "\n".join(v["triage"] or []) or v["evidence"] or v.get("incident_evidence") or "-"
    return [v["attempt"], v["verdict"], _dash(v["first_bad_step"]), suspect, v["suspect_node"] or "-",
            v["state"] or "-", _dash(v["replays"]), _dash(v["rollback_step"]), triage]


def _dash(value: object) -> object:
    return "-" if value is None else value
