"""What the controller needs of its runtime (Ray), as Ray-free Protocols.

The controller drives a cluster (``Cluster``: start or attach, list nodes, shut down),
one agent per node (``Agents``), the worker processes of a job across its attempts
(``Pool``) and the ranks of one attempt (``Workers``). ``controlplane/orchestrator.py``
implements them with Ray (``RayRuntime``, ``AgentSet``, ``WorkerPool``, ``WorkerGroup``
satisfy them structurally); ``Runtime`` bundles the factories the controller builds them
with, and ``ray_runtime()`` gives the Ray ones, importing Ray only when called. Tests
pass in-memory ones: the controller is unit-testable without Ray.

``NodeInfo`` and ``RankFailure`` are the plain values that cross this boundary.
Nothing here imports Ray or gRPC.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fleet.agent.settings import AgentSettings
    from fleet.controlplane.config import ControllerConfig, RayConfig
    from fleet.controlplane.sdc import SdcFailure
    from fleet.workers.spec import Launch, WorkerSpec


@dataclass(frozen=True)
class NodeInfo:
    """A Ray node as fleet names it. ``labels``: its Ray node labels (``ray start --labels``;
    the rack of ``topology.rack_label``), not part of its hash."""

    name: str
    ray_node_id: str
    address: str
    cpus: float
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class RankFailure:
    """How one rank's run ended badly, as the runtime reported it."""

    rank: int
    node: str
    actor_died: bool      # the process is gone (exit, kill, OOM), not a Python exception
    error: str
    #: a non-finite loss (``fleet.workers.failures.NonFiniteLossError``'s fields): its
    #: step (0: the failure was something else) and the ranks whose loss was not finite
    nonfinite_step: int = 0
    nonfinite_ranks: tuple[int, ...] = ()
    #: a user entrypoint's process (``fleet.workers.failures.RankExitError``'s fields): its
    #: exit code (None: not known, e.g. the built-in trainer raised in-process; negative:
    #: killed by that signal), the traceback it left (``TORCHELASTIC_ERROR_FILE``, the
    #: launcher's capture, or the tail of its output), when it exited (Unix seconds, 0 =
    #: unknown) and whether it had created its process group before it ended
    exit_code: int | None = None
    traceback: str = ""
    exited_at: float = 0.0
    reached_pg: bool = True
    #: the rank raised ``fleet.workers.failures.SdcError`` (persistent silent data
    #: corruption, after its triage): its fields; None for any other failure
    sdc: SdcFailure | None = None


#: A worker process as the runtime knows it (a Ray actor handle); opaque to the controller.
Process = Any


class Cluster(Protocol):
    """The cluster the job runs on (``orchestrator.RayRuntime``)."""

    def start(self) -> None:
        """Start a local cluster or attach to ``ray.address``."""

    def nodes(self) -> list[NodeInfo]:
        """Alive nodes, ordered by name."""

    def shutdown(self) -> None:
        """Stop only what ``start`` started."""


class Agents(Protocol):
    """One node agent per node (``orchestrator.AgentSet``)."""

    @property
    def actors(self) -> Mapping[str, object]:
        """The agent of each node, by node name."""

    @property
    def local_addresses(self) -> Mapping[str, str]:
        """Where each node's workers report (host:port), by node name."""

    def start(self, nodes: list[NodeInfo], controller_address: str, token: str, settings: AgentSettings,
              controller: ControllerConfig, bind_host: str = "127.0.0.1") -> None:
        """Start an agent on every node, its worker channel on ``bind_host`` (``agent.host``),
        dialling the controller bound at ``controller_address``; wait for their local addresses."""

    def alive(self, node: str, timeout_s: float = 2.0) -> bool:
        """Whether the node's agent process answers (not through its gRPC stream)."""

    def kill(self, node: str) -> None:
        """Kill the node's agent process."""

    def restart(self, node: str) -> str:
        """A new agent on ``node`` serving the same local address; returns it."""

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every agent's received events are committed by the controller."""

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop every agent."""


class Workers(Protocol):
    """The ranks of one attempt (``orchestrator.WorkerGroup``)."""

    @property
    def placement(self) -> Sequence[NodeInfo]:
        """The node of each rank."""

    @property
    def died(self) -> Set[int]:
        """Ranks whose process is gone."""

    @property
    def killed(self) -> Set[int]:
        """Ranks the controller killed."""

    @property
    def finished(self) -> bool:
        """Every rank's run has ended."""

    def pids(self, timeout_s: float) -> list[int]:
        """The process id of each rank."""

    def rendezvous_port(self, host: str, timeout_s: float) -> int:
        """A free port on ``host`` opened by rank 0's process for the process group."""

    def run(self, specs: list[WorkerSpec]) -> None:
        """Start every rank's run (non-blocking)."""

    def poll(self, timeout_s: float) -> list[RankFailure]:
        """Wait up to ``timeout_s`` for runs to end; the failures seen."""

    def running(self) -> list[int]:
        """Ranks whose run has not ended."""

    def returned(self) -> dict[int, dict]:
        """Ranks whose run returned (a user program: exited 0), with what it returned."""

    def kill_ranks(self, ranks: list[int]) -> None:
        """Kill these ranks' processes."""

    def wind_down(self, grace_s: float) -> list[RankFailure]:
        """Let running ranks end by themselves for up to ``grace_s``, then kill the rest."""

    def survivors(self) -> dict[int, tuple[str, Process]]:
        """Ranks whose process is alive and idle: (node name, process) by rank."""

    def kill(self) -> None:
        """Kill every rank."""


class Pool(Protocol):
    """The worker processes of a job across its attempts (``orchestrator.WorkerPool``)."""

    def fill_spares(self, nodes: list[NodeInfo]) -> None:
        """Start warm spare processes on ``nodes`` (non-blocking)."""

    def warm_up(self, nodes: list[NodeInfo], per_node: int) -> None:
        """Start idle processes on ``nodes`` up to ``per_node`` each (non-blocking)."""

    def acquire(self, placement: list[NodeInfo]) -> tuple[list[Process], int]:
        """One process per rank of ``placement``, and how many were reused."""

    def release(self, survivors: dict[int, tuple[str, Process]]) -> None:
        """The ended attempt's live idle processes, by rank, for the next attempt."""

    def discard_node(self, node: str) -> None:
        """Kill the idle processes on ``node``."""

    def close(self) -> None:
        """Kill every process."""


@dataclass(frozen=True)
class Runtime:
    """The factories the controller builds its runtime pieces with."""

    cluster: Callable[[RayConfig], Cluster]
    agents: Callable[[], Agents]
    pool: Callable[[int, Launch | None], Pool]  # spare workers per node, a user program to warm for
    workers: Callable[[list[NodeInfo], list[Process]], Workers]


def ray_runtime() -> Runtime:
    """The Ray implementations; Ray is imported here, on first use."""
    from fleet.controlplane import orchestrator

    return Runtime(cluster=orchestrator.RayRuntime, agents=orchestrator.AgentSet,
                   pool=orchestrator.WorkerPool, workers=orchestrator.WorkerGroup)
