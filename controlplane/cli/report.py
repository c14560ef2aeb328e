"""`fleet report`: a job's effective training time ratio and where the rest went."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from fleet.controlplane.cli.common import ClusterOpt, JsonOpt, StoreOpt, open_store
from fleet.controlplane.cli.render import console, print_json, print_table


def report(
    job_id: Annotated[str, typer.Argument(help="The job, as `fleet jobs` lists it.")],
    store: StoreOpt = None, cluster: ClusterOpt = None, json_out: JsonOpt = False,
) -> None:
    """ETTR (productive step time / wall time), lost time by category, incidents with
    their detection and recovery times, restarts and quarantines."""
    from fleet.controlplane.report import job_report

    with open_store(store, cluster) as st:
        job = st.get_job(job_id)
        out = job_report(job, st.get_attempts(job_id), st.steps(job_id), st.incidents(job_id),
                         st.actions(job_id), st.checkpoints(job_id), st.list_nodes(), time.time(),
                         st.recoveries(job_id))
    if json_out:
        print_json(out)
        return
    console.print(f"[bold]{out['job']}[/] {out['name']}: {out['state']}, step {out['final_step']}/"
                  f"{out['total_steps']}, {out['attempts']} attempt(s), {out['restarts']} restart(s)",
                  highlight=False)
    console.print(f"ETTR {out['ettr']:.1%}: {out['productive_s']:.1f} s of productive steps in "
                  f"{out['wall_s']:.1f} s", highlight=False)
    print_table("lost time", ["category", "seconds", "share of wall"],
                [[k.removesuffix("_s"), f"{v:.2f}", f"{v / out['wall_s']:.1%}"]
                 for k, v in out["lost_s"].items()])
    if out["incidents"]:
        print_table("incidents", ["attempt", "kind", "rank", "node", "detected after s", "recovery s",
                                  "steps lost", "restored from"],
                    [[i["attempt"], i["kind"], i["rank"], i["node"], _dash(i["detected_after_s"]),
                      _dash(i["recovery_s"]), _dash(i.get("steps_lost")), i.get("restored_from") or "-"]
                     for i in out["incidents"]])
        timed = [i for i in out["incidents"] if i.get("phases")]
        if timed:
            phases = list(timed[0]["phases"])
            print_table("recovery by phase (s)", ["attempt", *phases, "failure to first step"],
                        [[i["attempt"], *(f"{i['phases'][p]:.2f}" for p in phases),
                          f"{i['failure_to_first_step_s']:.2f}"] for i in timed])
    for cause in out["quarantines"]:
        console.print(f"[yellow]quarantine:[/] {cause}", highlight=False)
    if out["checkpoints"]:
        console.print("checkpoints: " + ", ".join(
            f"step {c['step']}" + ("" if c["valid"] else " [red]INVALID[/]") for c in out["checkpoints"]),
            highlight=False)
    for cause in out["invalid_checkpoints"]:
        console.print(f"[yellow]{cause}[/]", highlight=False)


def _dash(value: object) -> object:
    return "-" if value is None else value
