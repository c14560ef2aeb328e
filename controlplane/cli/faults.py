"""`fleet inject-fault`: ask the running controller to inject a fault (chaos)."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from fleet.controlplane.chaos import FAULT_KINDS, KIND_HELP, SDC_TARGETS, FaultOrder, validate_order
from fleet.controlplane.cli.common import ClusterOpt, JsonOpt, StateDirOpt, state_dir_of
from fleet.controlplane.cli.render import console, print_json
from fleet.controlplane.errors import ConfigError
from fleet.workers.faults import DEFAULT_SLOW_DELAY_S

_KINDS_HELP = "\n\n".join(f"[bold]{kind}[/]: {KIND_HELP[kind]}." for kind in FAULT_KINDS)


def inject_fault(
    job: Annotated[str, typer.Option("--job", "-j", help="Job id (see `fleet jobs`).")],
    kind: Annotated[str, typer.Option("--kind", "-k", help=f"Fault kind: {', '.join(FAULT_KINDS)} (see above).")],
    rank: Annotated[int | None, typer.Option(
        "--rank", "-r", help="Target rank (agent-down, partition, node-down: that rank's node).")] = None,
    node: Annotated[str | None, typer.Option("--node", "-n", help="Target node (every rank on it).")] = None,
    at_step: Annotated[int, typer.Option("--at-step", help="Fire when the job reaches this step (0 = now).")] = 0,
    after: Annotated[float, typer.Option(
        "--after", help="Or: fire this many seconds from now (0 = now).")] = 0.0,
    duration: Annotated[float, typer.Option(
        "--duration", help="hang, slow, agent-down, partition, node-down: seconds it lasts (0 = indefinitely).")] = 0.0,
    delay: Annotated[float, typer.Option(
        "--delay", help=f"slow: extra seconds per step (0 = {DEFAULT_SLOW_DELAY_S:g}).")] = 0.0,
    target: Annotated[str, typer.Option(
        "--target", help=f"sdc: what is corrupted, one of {', '.join(SDC_TARGETS)} (default weight).")] = "",
    bit: Annotated[int | None, typer.Option(
        "--bit", help="sdc: flip this bit of one float32 element (0 = lowest mantissa bit, 31 = sign).")] = None,
    value_error: Annotated[float, typer.Option(
        "--value-error", help="sdc: or multiply one element by 1 + this relative error (e.g. 1e-3).")] = 0.0,
    persistent: Annotated[bool, typer.Option(
        "--persistent", help="sdc: corrupt on every step from then on (a defective unit), not once.")] = False,
    controller: Annotated[str | None, typer.Option("--controller", help="Controller host:port.")] = None,
    state_dir: StateDirOpt = None,
    cluster: ClusterOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Inject a fault into a running job: CLI -> ControlService -> controller, agent or worker."""
    from fleet.controlplane.client import ControlClient  # gRPC: only when a controller is asked

    if rank is not None and rank < 0:
        raise ConfigError(f"--rank: must be >= 0 (got {rank})")
    order = FaultOrder(kind=kind, rank=-1 if rank is None else rank, node=node or "", at_step=at_step,
                       after_s=after, duration_s=duration, delay_s=delay, target=target, bit=bit,
                       value_error=value_error, persistent=persistent)
    validate_order(order)
    with ControlClient.from_state_dir(state_dir_of(state_dir, cluster), controller) as client:
        reply = client.inject_fault(job, kind, rank=order.rank, node=order.node, at_step=at_step,
                                    duration_s=duration, after_s=after, delay_s=delay, target=target, bit=bit,
                                    value_error=value_error, persistent=persistent)
    if json_out:
        print_json({"command_id": reply.command_id, "attempt": reply.attempt,
                    "ranks": list(reply.ranks), "node": reply.node})
        return
    if reply.ranks:
        aimed = f"rank(s) {list(reply.ranks)} on {reply.node}"
    else:
        aimed = reply.node or f"job {job}"
    when = f"at step {at_step}" if at_step else f"in {after:g} s" if after else "now"
    what = replace(order, rank=-1, node="", at_step=0, after_s=0.0).describe()  # the kind, and how for sdc
    console.print(f"injected [bold]{what}[/] into {aimed} (attempt {reply.attempt}, {when}); "
                  f"command {reply.command_id}", highlight=False)


inject_fault.__doc__ = f"{inject_fault.__doc__}\n\n{_KINDS_HELP}"
