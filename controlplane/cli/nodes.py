"""`fleet nodes`, `fleet quarantine`, `fleet release`: the nodes in the store, their health,
quarantine, last state change and lost events. Quarantine and release are stored with
actor ``operator`` (``node_transitions``)."""

from __future__ import annotations

from typing import Annotated

import typer

from fleet.controlplane.cli.common import ClusterOpt, JsonOpt, StoreOpt, open_store
from fleet.controlplane.cli.render import console, err_console, fmt_time, print_json, print_table
from fleet.controlplane.errors import ConfigError
from fleet.controlplane.lifecycle import NodeActor
from fleet.controlplane.store import NodeTransitionRecord

_RELEASED = "released by an operator"


def _transition(t: NodeTransitionRecord | None) -> dict | None:
    if t is None:
        return None
    return {"from_state": t.from_state, "to_state": t.to_state, "reason": t.reason,
            "actor": t.actor, "job_id": t.job_id, "at": t.at}


def nodes(store: StoreOpt = None, cluster: ClusterOpt = None, json_out: JsonOpt = False) -> None:
    """List nodes: state, quarantine reason, health, last heard from, and events lost on
    the way to the store (an agent's spill disk failed, or the controller refused a
    malformed batch)."""
    with open_store(store, cluster) as st:
        records = st.list_nodes()
        drops = st.ingest_drops()
        last = st.last_node_transitions()
    lost: dict[str, list] = {}
    for d in drops:
        lost.setdefault(d.node, []).append(d)
    rows = [
        {
            "name": n.name,
            "state": n.state,
            "quarantine_reason": n.quarantine_reason,
            "quarantined_since": n.quarantined_since,
            "health": n.health,
            "health_reason": n.health_reason,
            "hostname": n.hostname,
            "last_seen": n.last_seen,
            "events_lost": sum(d.events for d in lost.get(n.name, [])),
            "last_loss": lost[n.name][-1].reason if n.name in lost else "",
            "last_transition": _transition(last.get(n.name)),
        }
        for n in records
    ]
    if json_out:
        print_json(rows)
        return
    print_table(
        None,
        ["node", "state", "health", "last seen", "events lost", "reason"],
        [[r["name"], r["state"], r["health"], fmt_time(r["last_seen"]), r["events_lost"],
          r["quarantine_reason"] or r["health_reason"] or r["last_loss"]] for r in rows],
    )
    total = sum(r["events_lost"] for r in rows)
    if total:
        err_console.print(f"[yellow]warning:[/] {total} events never reached the store "
                          "(see the reason column; each loss is a row in ingest_drops)")


def quarantine(
    node: Annotated[str, typer.Argument(help="Node name, as `fleet nodes` lists it.")],
    reason: Annotated[str, typer.Option("--reason", help="Why (stored and shown by `fleet nodes`).")],
    store: StoreOpt = None, cluster: ClusterOpt = None,
) -> None:
    """Take a node out of placement: no attempt starts on it until `fleet release`. Kept in
    the store, so it outlives the controller; a running attempt is not moved."""
    if not reason.strip():
        raise ConfigError("--reason must say why the node is quarantined")
    with open_store(store, cluster) as st:
        st.quarantine_node(node, reason.strip(), actor=NodeActor.OPERATOR)
        record = next(n for n in st.list_nodes() if n.name == node)
    console.print(f"{node} quarantined since {fmt_time(record.quarantined_since)}: "
                  f"{record.quarantine_reason}", highlight=False)


def release(
    node: Annotated[str, typer.Argument(help="Node name, as `fleet nodes` lists it.")],
    reason: Annotated[str, typer.Option("--reason", help="Why (stored in the node's history).")] = _RELEASED,
    store: StoreOpt = None, cluster: ClusterOpt = None,
) -> None:
    """Return a quarantined node to placement (a healthy one is left as it is)."""
    with open_store(store, cluster) as st:
        moved = st.release_node(node, actor=NodeActor.OPERATOR, reason=reason.strip() or _RELEASED)
    if moved:
        console.print(f"{node} released: healthy, available to new attempts", highlight=False)
    else:
        console.print(f"{node} was not quarantined: healthy, available to new attempts", highlight=False)
