"""`fleet replay <job-id>`: a job's collective traces and step timeline from the store."""

from __future__ import annotations

from typing import Annotated

import typer

from controlplane.cli.common import ClusterOpt, JsonOpt, StoreOpt, open_store
from controlplane.cli.render import console, print_json, print_table
from controlplane.replay import replay_report


def replay(
    job_id: Annotated[str, typer.Argument(help="Job id (see `fleet jobs`).")],
    attempt: Annotated[int | None, typer.Option("--attempt", "-a", help="Only this attempt.")] = None,
    last_steps: Annotated[
        int, typer.Option("--steps", help="Show the last N steps of each attempt (0 = all).")
    ] = 20,
    store: StoreOpt = None,
    cluster: ClusterOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Per-rank collective summary and per-step table of a job, every attempt."""
    with open_store(store, cluster) as st:
        report = replay_report(st, job_id, attempt)
    if json_out:
        print_json(report)
        return
    job = report["job"]
    console.print(
        f"[bold]{job['id']}[/] {job['name']}: {job['state']}, step {job['steps_completed']}/"
        f"{job['total_steps']}, {job['attempts']} attempt(s). {job['reason']}"
    )
    for inc in report["incidents"]:
        console.print(
            f"[red]incident[/] attempt {inc['attempt']}: {inc['kind']} rank {inc['rank']} on {inc['node']} "
            f"({inc['detector']}): {inc['evidence']}"
        )
    for a in report["attempts"]:
        restored = a["restored_step"]
        console.rule(
            f"attempt {a['attempt']}: {a['state']}, restored from "
            f"{'step ' + str(restored) if restored else 'scratch'}, final step {a['final_step']}"
        )
        nodes = {r["rank"]: r["node"] for r in a["ranks"]}
        print_table(
            "collectives per rank and group",
            ["rank", "node", "group", "#ops", "seq range", "consecutive", "#done", "last done", "ops", "mean ms"],
            [
                [c["rank"], nodes.get(c["rank"], "?"), c["group"], c["count"],
                 f"{c['first_seq']}..{c['last_seq']}", "yes" if c["consecutive"] else "[red]GAP[/]",
                 c["completed"], c["last_completed_seq"],
                 " ".join(f"{k}:{v}" for k, v in sorted(c["ops"].items())),
                 f"{c['mean_duration_ms']:.2f}" if c["mean_duration_ms"] is not None else "-"]
                for c in a["collectives"]
            ],
        )
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
