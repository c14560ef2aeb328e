"""The node agent's settings: one validated object, defined once, owned by the agent.

``AgentSettings`` holds everything a ``NodeAgent`` and its ``Uplink`` are tuned by
(batching, buffering and spilling, heartbeats, the largest message the controller
takes, and whether a large job's collectives travel as fronts). It travels as
one frozen object from the controller (``ClusterConfig.agent_settings()``) through
``AgentSet.start``, the agent's Ray actor and ``NodeAgent`` to the ``Uplink``; none
of them restates a default.

cluster.yaml does not copy these fields: its ``agent:`` section embeds
``AGENT_SECTION_FIELDS`` of this model (next to the workers' two reporting intervals,
which ``WorkerSpec`` owns), and ``controller.heartbeat_interval_s`` /
``controller.max_message_bytes`` the two link fields (``controlplane/config.py``), so
the keys, defaults, bounds and descriptions exist only here. ``GEMM_FIELDS`` (the node's
known-answer GEMM test) belong in cluster.yaml's ``sdc:`` section; ``JOB_FIELDS`` are
derived by the controller for each job (``ClusterConfig.agent_settings()``).

Invariant checked at construction: ``batch_max_bytes <= memory_max_bytes``.
This module is not part of the agent's runtime: it imports neither grpc nor the uplink,
so the controller's config can import it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Fields that cluster.yaml's ``agent:`` section embeds, in the reference's order.
AGENT_SECTION_FIELDS = (
    "batch_max_events", "batch_max_bytes", "batch_interval_s", "memory_max_bytes",
    "spill_max_bytes", "wal", "spill_dir", "ring_entries",
)
#: Fields that cluster.yaml keeps in its ``controller:`` section (the controller sets them
#: for every agent it starts).
LINK_FIELDS = ("heartbeat_interval_s", "max_message_bytes")
#: Fields the controller derives for each job rather than reading them from cluster.yaml
#: (``collective_fronts``: from ``agent.raw_ingest_max_ranks`` and the job's size).
JOB_FIELDS = ("collective_fronts",)
#: Fields of the node's known-answer GEMM test (``agent.gemm_check``), cluster.yaml's ``sdc:``.
GEMM_FIELDS = ("gemm_size", "gemm_interval_s")


def check_batch_fits_memory(batch_max_bytes: int, memory_max_bytes: int) -> None:
    """Raise ``ValueError`` unless one batch fits the agent's memory buffer."""
    if batch_max_bytes > memory_max_bytes:
        raise ValueError(
            f"batch_max_bytes ({batch_max_bytes}) must be <= memory_max_bytes ({memory_max_bytes})"
        )


class AgentSettings(BaseModel):
    """Batching on the agent -> controller stream and the worker -> agent channel."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    batch_max_events: int = Field(
        2000, ge=1, le=1_000_000, description="Most events in one batch to the controller."
    )
    batch_max_bytes: int = Field(
        1 << 20, ge=1024, le=1 << 30,
        description="Most serialized bytes of events in one batch (a larger single event goes alone).",
    )
    batch_interval_s: float = Field(
        0.2, gt=0, le=60, description="Longest an event waits on the agent before being sent."
    )
    memory_max_bytes: int = Field(
        64 << 20, ge=64 << 10, le=1 << 40,
        description="Unacknowledged batches an agent keeps in memory, bytes. With agent.wal every batch "
        "is also on disk and this bounds the copies kept to send from; without it, batches beyond this "
        "spill to disk.",
    )
    spill_max_bytes: int = Field(
        1 << 30, ge=0, le=1 << 50,
        description="Unacknowledged batches an agent keeps on disk, bytes (0 = no disk: no write-ahead "
        "log, no spill). Past it, workers' reports block: backpressure, never loss. A write that fails "
        "(disk full or broken) keeps that batch in memory if it fits, else drops it and reports the loss "
        "to the controller.",
    )
    wal: bool = Field(
        True, description="Write-ahead log: an agent answers a worker's report only once its events are "
        "written to the spill folder, and a restarted agent resends what its predecessor left there, so "
        "an agent killed mid-run loses no event (the controller stores each batch once). Needs "
        "agent.spill_max_bytes > 0; spill_max_bytes then bounds everything unacknowledged. Protects "
        "against the agent process dying, not the machine (no fsync).",
    )
    spill_dir: str = Field(
        "", description="Folder agents spill to, one subfolder per agent (empty: `<state_dir>/spill`). "
        "A restarted agent resends the batches its predecessor left there.",
    )
    heartbeat_interval_s: float = Field(
        1.0, gt=0, le=600, description="Seconds between agent heartbeats."
    )
    max_message_bytes: int = Field(
        16 << 20, ge=1 << 20, le=(1 << 31) - 1,
        description="Largest gRPC message the controller accepts, bytes. Must exceed "
        "agent.batch_max_bytes by 64 KiB; a single event larger than this minus 64 KiB is "
        "dropped by its agent (and reported).",
    )

    collective_fronts: bool = Field(
        False, description="Send collective fronts (per rank and group: the newest op entered and completed) "
        "instead of every collective, keeping the raw entries on the agent for the controller to pull. The "
        "controller sets it for jobs larger than agent.raw_ingest_max_ranks.",
    )
    ring_entries: int = Field(
        1024, ge=1, le=1 << 20,
        description="Raw collective entries an agent keeps per rank and process group for a job that sends "
        "fronts (the most one trace pull can return).",
    )

    gemm_size: int = Field(
        256, ge=16, le=8192, description="Known-answer GEMM test: size of its square matrices.")
    gemm_interval_s: float = Field(
        600.0, ge=0, le=30 * 86400,
        description="Seconds between known-answer GEMM tests an agent runs while its node has no ranks "
        "(0 = only on demand, before placement and before release).",
    )

    @model_validator(mode="after")
    def _batch_fits_memory(self) -> AgentSettings:
        check_batch_fits_memory(self.batch_max_bytes, self.memory_max_bytes)
        return self

    def replace(self, **changes: Any) -> AgentSettings:
        """A validated copy with ``changes`` applied (``model_copy`` would skip validation)."""
        return type(self).model_validate({**self.model_dump(), **changes})
