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
from typing import Protocol

from fleet.controlplane.config import ClusterConfig
from fleet.workers.spec import WorkerSpec


class _Node(Protocol):
    name: str


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
) -> list[WorkerSpec]:
    """One WorkerSpec per rank: rank i on ``placement[i]``, reporting to that node's agent
    (``local_addresses[node.name]``), meeting at ``master_addr:port``."""
    job, agent = config.job, config.agent
    model, train = job.model.args(), job.train_args()
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
        )
        for rank, node in enumerate(placement)
    ]
