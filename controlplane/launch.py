"""What each rank of an attempt is told: the WorkerSpecs built from the validated cluster.yaml.

The controller calls ``worker_specs`` once per attempt with the nodes it placed the
ranks on (rank i runs on ``placement[i]``). Everything a worker needs comes from the
config here and travels in the spec; the worker derives its environment variables from
the spec in one place (``fleet.workers.env.worker_env``), so a spec built here and one
built by ``workers.train.spec_from_torchrun`` yield the same environment for the same
settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from fleet.controlplane.config import ClusterConfig
from fleet.controlplane.sdc import copies_problem
from fleet.workers.spec import Launch, WorkerSpec


class _Node(Protocol):
    name: str


def program_launch(config: ClusterConfig, environ: Mapping[str, str], job_id: str = "",
                   attempt: int = 0) -> Launch | None:
    """The ``Launch`` of the job's user program (None: the built-in trainer).

    Its base environment is ``environ`` (the ``fleet`` command's) when
    ``entrypoint.inherit_env`` says so (by default on a local cluster), else empty (the
    node's own), then ``entrypoint.env``; paths are made absolute here, where the
    command's working directory is known. Without ``job_id`` it is the launch the warm
    interpreters are started for (no log folder yet)."""
    program = config.job.user_program
    if program is None:
        return None
    inherit = program.inherit_env if program.inherit_env is not None else config.ray.address is None
    env = {**(dict(environ) if inherit else {}), **program.env}
    workdir = Path(program.workdir or ".").resolve()
    log_dir = str((Path(config.state_dir) / "logs" / job_id / f"attempt-{attempt}").resolve()) if job_id else ""
    return Launch(module=program.module or "", script=program.script or "", args=tuple(program.args),
                  workdir=str(workdir), env=env, log_dir=log_dir, tee=program.tee)


def worker_specs(
    config: ClusterConfig,
    *,
    job_id: str,
    attempt: int,
    placement: Sequence[_Node],
    port: int,
    checkpoint_dir: str,
    local_addresses: Mapping[str, str],
    master_addr: str,
    launch: Launch | None = None,
    restore_at_most: int = 0,
) -> list[WorkerSpec]:
    """One WorkerSpec per rank: rank i on ``placement[i]``, reporting to that node's agent
    (``local_addresses[node.name]``), meeting at ``master_addr:port``; running ``launch``
    (``program_launch``) when the job is a user program. Ranks are numbered node by node,
    as torchrun does: LOCAL_RANK counts within a node, GROUP_RANK is the node's index.

    SDC fingerprint checks run every ``sdc.check_interval`` steps where this placement has
    copies to compare (``sdc.copies_problem``: none with fsdp, on one rank, or hsdp on one
    node, e.g. after a shrink), else not at all; triggers always. ``restore_at_most`` > 0:
    the ranks restore no state newer than that step (after silent data corruption)."""
    job, agent = config.job, config.agent
    model, train = job.model.args(), job.train_args()
    nodes = list(dict.fromkeys(n.name for n in placement))
    no_copies = copies_problem(train.data_parallel, len(placement), len(nodes), job.user_program is not None)
    check_interval = 0 if no_copies else config.sdc.check_interval
    local: dict[str, int] = {}
    places = []
    for node in placement:
        places.append((local.get(node.name, 0), nodes.index(node.name)))
        local[node.name] = local.get(node.name, 0) + 1
    return [
        WorkerSpec(
            job_id=job_id,
            attempt=attempt,
            rank=rank,
            world_size=len(placement),
            node_name=node.name,
            master_addr=master_addr,
            master_port=port,
            agent_address=local_addresses[node.name],
            checkpoint_dir=checkpoint_dir,
            model=model,
            train=train,
            pg_timeout_s=job.pg_timeout_s,
            report_interval_s=agent.report_interval_s,
            fr_buffer_entries=job.flight_recorder_entries,
            fr_poll_interval_s=agent.fr_poll_interval_s,
            launch=launch,
            local_rank=places[rank][0],
            local_world_size=local[node.name],
            group_rank=places[rank][1],
            group_world_size=len(nodes),
            max_restarts=job.max_restarts,
            sdc_check_interval=check_interval,
            sdc_trigger_factor=config.sdc.trigger_factor,
            restore_at_most=restore_at_most,
        )
        for rank, node in enumerate(placement)
    ]
