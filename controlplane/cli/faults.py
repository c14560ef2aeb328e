"""`fleet inject-fault`: ask the running controller to inject a fault (chaos)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli.common import JsonOpt, StateDirOpt
from controlplane.cli.render import console, print_json
from controlplane.client import ControlClient
from controlplane.errors import ConfigError


def inject_fault(
    job: Annotated[str, typer.Option("--job", "-j", help="Job id (see `fleet jobs`).")],
    kind: Annotated[str, typer.Option("--kind", "-k", help="Fault kind: crash (the process exits), "
                                      "hang (the rank stops before its next collective).")],
    rank: Annotated[int | None, typer.Option("--rank", "-r", help="Target rank.")] = None,
    node: Annotated[str | None, typer.Option("--node", "-n", help="Target node (every rank on it).")] = None,
    at_step: Annotated[int, typer.Option("--at-step", help="Fire when the rank reaches this step (0 = now).")] = 0,
    duration: Annotated[
        float, typer.Option("--duration", help="hang: seconds to stay stuck (0 = until killed).")
    ] = 0.0,
    controller: Annotated[str | None, typer.Option("--controller", help="Controller host:port.")] = None,
    state_dir: StateDirOpt = Path(".fleet"),
    json_out: JsonOpt = False,
) -> None:
    """Inject a fault into a running job: CLI -> ControlService -> agent -> worker."""
    if (rank is None) == (node is None):
        raise ConfigError("give exactly one of --rank or --node")
    if rank is not None and rank < 0:
        raise ConfigError("--rank must be >= 0")
    if at_step < 0:
        raise ConfigError("--at-step must be >= 0")
    if duration < 0:
        raise ConfigError("--duration must be >= 0")
    with ControlClient.from_state_dir(state_dir, controller) as client:
        reply = client.inject_fault(job, kind, rank=-1 if rank is None else rank, node=node or "",
                                    at_step=at_step, duration_s=duration)
    if json_out:
        print_json({"command_id": reply.command_id, "attempt": reply.attempt,
                    "ranks": list(reply.ranks), "node": reply.node})
        return
    when = f"at step {at_step}" if at_step else "now"
    console.print(
        f"injected [bold]{kind}[/] into rank(s) {list(reply.ranks)} on {reply.node} "
        f"(attempt {reply.attempt}, {when}); command {reply.command_id}"
    )
