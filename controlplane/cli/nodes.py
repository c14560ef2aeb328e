"""`fleet nodes`, `fleet quarantine`, `fleet release`: the nodes in the store, their health,
last known-answer GEMM test, quarantine, last state change and lost events. Quarantine
and release are stored with actor ``operator`` (``node_transitions``).

`fleet release` is gated by the GEMM test when a controller is running: the node's agent
runs it first (ControlService ``CheckNode``) and a node that fails stays quarantined
(``--force`` skips the test). With no controller running there is no agent to run it:
the node is released, with a warning, and the pre-flight test runs before an attempt is
placed on it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fleet.controlplane.cli.common import ClusterOpt, JsonOpt, StateDirOpt, StoreOpt, open_store, state_dir_of
from fleet.controlplane.cli.render import console, err_console, fmt_time, print_json, print_table, progress
from fleet.controlplane.errors import ConfigError, NotFoundError, StateError, UnavailableError
from fleet.controlplane.lifecycle import NodeActor, NodeState

if TYPE_CHECKING:  # the store imports SQLAlchemy: only the commands that read it pay for it
    from fleet.controlplane.store import NodeTransitionRecord, SdcCheckRecord

_RELEASED = "released by an operator"
#: How long `fleet release` waits for the GEMM test by default (the first one on a node
#: imports torch, and on a GPU initialises CUDA), seconds.
RELEASE_CHECK_TIMEOUT_S = 60.0


def _transition(t: NodeTransitionRecord | None) -> dict | None:
    if t is None:
        return None
    return {"from_state": t.from_state, "to_state": t.to_state, "reason": t.reason,
            "actor": t.actor, "job_id": t.job_id, "at": t.at}


def _gemm(c: SdcCheckRecord | None) -> dict | None:
    if c is None:
        return None
    try:
        detail = json.loads(c.detail)
    except ValueError:
        detail = {}
    detail = detail if isinstance(detail, dict) else {}
    return {"ok": c.ok, "at": c.time_ns / 1e9, "error": c.value, "bound": c.expected,
            "summary": detail.get("summary", c.detail), "job_id": c.job_id or None,
            "trigger": detail.get("trigger", "")}


def _age(seconds: float) -> str:
    """A short age: 45s, 12m, 3h, 2d."""
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _gemm_text(g: dict | None, now: float) -> str:
    if g is None:
        return "-"
    return f"{'ok' if g['ok'] else 'FAILED'} {_age(now - g['at'])} ago"


def nodes(store: StoreOpt = None, cluster: ClusterOpt = None, json_out: JsonOpt = False) -> None:
    """List nodes: state, quarantine reason, health, the last known-answer GEMM test
    (verdict, age), last heard from, and events lost on the way to the store (an agent's
    spill disk failed, or the controller refused a malformed batch)."""
    with open_store(store, cluster) as st:
        records = st.list_nodes()
        drops = st.ingest_drops()
        last = st.last_node_transitions()
        gemm = st.last_gemm_checks()
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
            "gemm_check": _gemm(gemm.get(n.name)),
        }
        for n in records
    ]
    if json_out:
        print_json(rows)
        return
    now = time.time()
    print_table(
        None,
        ["node", "state", "health", "gemm test", "last seen", "events lost", "reason"],
        [[r["name"], r["state"], r["health"], _gemm_text(r["gemm_check"], now), fmt_time(r["last_seen"]),
          r["events_lost"], r["quarantine_reason"] or r["health_reason"] or r["last_loss"]] for r in rows],
    )
    total = sum(r["events_lost"] for r in rows)
    if total:
        err_console.print(f"[yellow]warning:[/] {total} events never reached the store "
                          "(see the reason column; each loss is a row in ingest_drops)")


def quarantine(
    node: Annotated[str, typer.Argument(help="Node name, as `fleet nodes` lists it.")],
    reason: Annotated[str, typer.Option("--reason", help="Why (stored and shown by `fleet nodes`).")],
    store: StoreOpt = None, cluster: ClusterOpt = None, json_out: JsonOpt = False,
) -> None:
    """Take a node out of placement: no attempt starts on it until `fleet release`. Kept in
    the store, so it outlives the controller; a running attempt is not moved. --json:
    ``{"node", "state", "reason", "quarantined_since"}``."""
    if not reason.strip():
        raise ConfigError("--reason must say why the node is quarantined",
                          hint="--reason is stored and shown by `fleet nodes`: e.g. --reason 'ECC errors'")
    with open_store(store, cluster) as st:
        st.quarantine_node(node, reason.strip(), actor=NodeActor.OPERATOR)
        record = next(n for n in st.list_nodes() if n.name == node)
    if json_out:
        print_json({"node": node, "state": record.state.value, "reason": record.quarantine_reason,
                    "quarantined_since": record.quarantined_since})
        return
    console.print(f"{node} quarantined since {fmt_time(record.quarantined_since)}: "
                  f"{record.quarantine_reason}", highlight=False)


def release(
    node: Annotated[str, typer.Argument(help="Node name, as `fleet nodes` lists it.")],
    reason: Annotated[str, typer.Option("--reason", help="Why (stored in the node's history).")] = _RELEASED,
    force: Annotated[bool, typer.Option(
        "--force", help="Release without running the known-answer GEMM test first.")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds to wait for the node's GEMM test.")] = RELEASE_CHECK_TIMEOUT_S,
    controller: Annotated[str | None, typer.Option("--controller", help="Controller host:port.")] = None,
    state_dir: StateDirOpt = None,
    store: StoreOpt = None, cluster: ClusterOpt = None, json_out: JsonOpt = False,
) -> None:
    """Return a quarantined node to placement (a healthy one is left as it is). With a
    controller running, the node's agent runs the known-answer GEMM test first and a
    node that fails it stays quarantined; --force skips the test. With none running the
    node is released untested, and the pre-flight test runs before its next attempt.
    --json: ``{"node", "released", "gemm_check"}`` (the test's verdict and line, or null
    when none ran)."""
    if not 0 < timeout <= 600:
        raise ConfigError(f"--timeout: must be in (0, 600] seconds (got {timeout:g})")
    reason = reason.strip() or _RELEASED
    gemm: dict | None = None
    with open_store(store, cluster) as st:
        record = next((n for n in st.list_nodes() if n.name == node), None)
        if record is None:
            raise NotFoundError(f"node {node!r} not found", hint="`fleet nodes` lists the nodes in the store")
        if record.state is NodeState.QUARANTINED and not force:
            gemm = _gemm_gate(node, state_dir_of(state_dir, cluster), controller, timeout, quiet=json_out)
            if gemm is not None:
                reason = f"{reason} (GEMM test passed: {gemm['reason']})"
        moved = st.release_node(node, actor=NodeActor.OPERATOR, reason=reason)
    if json_out:
        print_json({"node": node, "released": moved, "gemm_check": gemm})
    elif moved:
        console.print(f"{node} released: healthy, available to new attempts", highlight=False)
    else:
        console.print(f"{node} was not quarantined: healthy, available to new attempts", highlight=False)


def _gemm_gate(node: str, state_dir: Path, address: str | None, timeout_s: float,
               quiet: bool = False) -> dict | None:
    """Run the node's GEMM test through the running controller: None when no controller
    runs here (warned on stderr), ``{"verdict": "ok", "reason"}`` when it passes (also
    printed, unless ``quiet``); a FleetError when it fails or cannot run (the node stays
    quarantined)."""
    from fleet.controlplane.client import ControlClient  # grpc: only when a controller is asked

    if address is None and not (state_dir / "controller.json").exists():
        err_console.print(f"[yellow]warning:[/] no controller is running ({state_dir / 'controller.json'} does "
                          f"not exist): {node} is released without a known-answer GEMM test; the pre-flight "
                          "test runs before an attempt is placed on it", highlight=False, soft_wrap=True)
        return None
    try:
        with ControlClient.from_state_dir(state_dir, address) as client, \
                progress(f"{node}: running the known-answer GEMM test (up to {timeout_s:g} s)"):
            check = client.check_node(node, timeout_s)
    except UnavailableError as exc:
        raise UnavailableError(f"cannot release {node}: its GEMM test did not run: {exc}",
                               hint="is `fleet up` running with its agent on that node? "
                                    "--force releases it without the test") from None
    if check.verdict == "ok":
        if not quiet:
            console.print(f"{node}: {check.reason}", highlight=False)
        return {"verdict": check.verdict, "reason": check.reason}
    if check.verdict == "failed":
        raise StateError(f"cannot release {node}: {check.reason}; it stays quarantined",
                         hint="a node that fails the known-answer GEMM test computes wrong results; "
                              "--force releases it anyway")
    raise UnavailableError(f"cannot release {node}: {check.reason}",
                           hint="--force releases it without the test")
