"""`fleet jobs`: the jobs in the store."""

from __future__ import annotations

from fleet.controlplane.cli.common import ClusterOpt, JsonOpt, StoreOpt, open_store
from fleet.controlplane.cli.render import fmt_time, print_json, print_table


def jobs(store: StoreOpt = None, cluster: ClusterOpt = None, json_out: JsonOpt = False) -> None:
    """List jobs, newest first."""
    with open_store(store, cluster) as st:
        records = st.list_jobs()
    rows = [
        {
            "id": j.id,
            "name": j.name,
            "state": j.state.value,
            "steps_completed": j.steps_completed,
            "total_steps": j.total_steps,
            "attempts": j.attempts,
            "created_at": j.created_at,
            "ended_at": j.ended_at,
            "reason": j.reason,
        }
        for j in records
    ]
    if json_out:
        print_json(rows)
        return
    print_table(
        None,
        ["job", "name", "state", "steps", "attempts", "created", "reason"],
        [
            [r["id"], r["name"], r["state"], f"{r['steps_completed']}/{r['total_steps']}",
             r["attempts"], fmt_time(r["created_at"]), r["reason"]]
            for r in rows
        ],
    )
