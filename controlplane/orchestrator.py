"""Ray placement: the cluster, one agent per node, and one worker actor per rank.

Local mode starts a multi-raylet Ray cluster entirely on 127.0.0.1 (one raylet per
simulated node, each with a ``fleet-node-<i>`` custom resource); attach mode joins an
existing cluster at ``ray.address`` (started with ``ray start --head`` / ``ray start
--address``; its nodes are named ``<node IP>-<node id prefix>``). Every alive Ray node gets
one agent; agents and workers are pinned to their node with hard node-affinity. Agents
bind their worker channel on ``agent.host`` and dial the controller at the address
``addresses.dial_host`` gives. This is the only module of the controller that imports Ray.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from fleet.agent.settings import AgentSettings
from fleet.controlplane.addresses import dial_host, is_wildcard, join_host_port, port_of
from fleet.controlplane.config import ControllerConfig, RayConfig
from fleet.controlplane.errors import UnavailableError
from fleet.controlplane.runtime import NodeInfo, RankFailure
from fleet.controlplane.sdc import SdcFailure

# Ray resolves its node address to loopback only with this set (read at import time).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Raylets start worker processes at nice 15 by default; here the workers are the
# training ranks, which must not yield the CPU to everything else on the node (read by
# the raylets of a local cluster, which inherit this environment).
os.environ.setdefault("RAY_worker_niceness", "0")

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from fleet.agent.ray_actor import AgentActor  # noqa: E402
from fleet.workers.failures import NonFiniteLossError, RankExitError, SdcError  # noqa: E402
from fleet.workers.ray_actor import WorkerActor  # noqa: E402
from fleet.workers.spec import Launch, WorkerSpec  # noqa: E402

log = logging.getLogger(__name__)

NODE_RESOURCE_PREFIX = "fleet-node-"
_NODE_RESOURCE = re.compile(rf"^{NODE_RESOURCE_PREFIX}(\d+)$")


class RayRuntime:
    """Starts or attaches to Ray; lists nodes; shuts down only what it started."""

    def __init__(self, config: RayConfig) -> None:
        self._config = config
        self._cluster: Any = None

    def start(self) -> None:
        if ray.is_initialized():
            raise UnavailableError("Ray is already initialised in this process")
        common = dict(log_to_driver=False, include_dashboard=False, configure_logging=False)
        if self._config.address:
            try:
                ray.init(address=self._config.address, **common)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise UnavailableError(f"ray.address {self._config.address}: cannot connect ({exc})") from None
            return
        from ray.cluster_utils import Cluster

        mem = self._config.object_store_mb * 1024 * 1024
        self._cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(
                num_cpus=self._config.cpus_per_node,
                node_ip_address="127.0.0.1",
                include_dashboard=False,
                object_store_memory=mem,
                resources={f"{NODE_RESOURCE_PREFIX}0": 1},
            ),
        )
        for i in range(1, self._config.nodes):
            self._cluster.add_node(
                num_cpus=self._config.cpus_per_node,
                node_ip_address="127.0.0.1",
                object_store_memory=mem,
                resources={f"{NODE_RESOURCE_PREFIX}{i}": 1},
            )
        ray.init(address=self._cluster.address, **{k: v for k, v in common.items() if k != "include_dashboard"})
        self._cluster.wait_for_nodes(timeout=60)

    def nodes(self) -> list[NodeInfo]:
        """Alive nodes, ordered by name."""
        return alive_nodes(ray.nodes())

    def shutdown(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None


def alive_nodes(entries: list[dict[str, Any]]) -> list[NodeInfo]:
    """The alive nodes of ``ray.nodes()``'s entries, named as fleet names them (``node-<i>``
    for a local cluster's, ``<IP>-<node id prefix>`` otherwise), with their labels, ordered
    by name."""
    out = []
    for n in entries:
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        index = next((m.group(1) for k in res if (m := _NODE_RESOURCE.match(k))), None)
        name = f"node-{index}" if index is not None else f"{n['NodeManagerAddress']}-{n['NodeID'][:8]}"
        labels = {str(k): str(v) for k, v in (n.get("Labels") or {}).items()}
        out.append(NodeInfo(name, n["NodeID"], n["NodeManagerAddress"], float(res.get("CPU", 0)), labels))
    return sorted(out, key=lambda x: (len(x.name), x.name))


def _pinned(node: NodeInfo) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node.ray_node_id, soft=False)


class AgentSet:
    """One NodeAgent actor per node; a lost agent is started again on the same local port."""

    def __init__(self) -> None:
        self.actors: dict[str, Any] = {}
        self.local_addresses: dict[str, str] = {}
        self._nodes: dict[str, NodeInfo] = {}
        self._args: dict[str, Any] = {}
        self._start_timeout_s = 30.0

    def start(
        self,
        nodes: list[NodeInfo],
        controller_address: str,
        token: str,
        settings: AgentSettings,
        controller: ControllerConfig,
        bind_host: str = "127.0.0.1",
    ) -> None:
        """Start an agent on every node, each with ``settings`` (``ClusterConfig.agent_settings()``),
        serving its workers on ``bind_host`` (``agent.host``) and dialling the controller bound at
        ``controller_address`` (``host:port``) with ``controller``'s TLS files, at the host
        ``controller.advertise_host``, ``controller.host`` or, for a wildcard bind, this node's
        IP as Ray reports it; waits at most ``controller.agent_start_timeout_s`` for them."""
        self._start_timeout_s = controller.agent_start_timeout_s
        node_ip = ray.util.get_node_ip_address() if is_wildcard(controller.host) else ""
        host = dial_host(controller.host, controller.advertise_host, node_ip)
        self._args = dict(
            controller_address=join_host_port(host, port_of(controller_address)),
            token=token,
            settings=settings,
            tls=controller.tls.client_files(),
            bind_host=bind_host,
        )
        for node in nodes:
            self._nodes[node.name] = node
            self.actors[node.name] = self._new_actor(node, local_port=0)
        refs = {name: a.start.remote(self._start_timeout_s) for name, a in self.actors.items()}
        try:
            addresses = ray.get(list(refs.values()), timeout=self._start_timeout_s + 30)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
            raise UnavailableError(f"node agents did not start: {exc}") from None
        self.local_addresses = dict(zip(refs, addresses, strict=True))

    def _new_actor(self, node: NodeInfo, local_port: int) -> Any:
        remote_cls = ray.remote(num_cpus=0, max_restarts=0)(AgentActor)
        return remote_cls.options(scheduling_strategy=_pinned(node), name=None).remote(
            node_name=node.name, ray_node_id=node.ray_node_id, local_port=local_port, **self._args)

    def alive(self, node: str, timeout_s: float = 2.0) -> bool:
        """Whether the node's agent process answers (through Ray, not the lost stream)."""
        actor = self.actors.get(node)
        if actor is None:
            return False
        try:
            ray.get(actor.stats.remote(), timeout=timeout_s)
            return True
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return False

    def kill(self, node: str) -> None:
        """Kill the node's agent process (chaos: node-down)."""
        actor = self.actors.get(node)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    def restart(self, node: str) -> str:
        """Start a new agent on ``node`` serving the same local address (its workers'
        reporters reconnect by themselves); kills the old one first. Returns the address."""
        self.kill(node)
        port = port_of(self.local_addresses[node])
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            actor = self._new_actor(self._nodes[node], local_port=port)
            try:
                address = ray.get(actor.start.remote(self._start_timeout_s), timeout=self._start_timeout_s + 10)
                break
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
                ray.kill(actor, no_restart=True)
                if time.monotonic() >= deadline:  # e.g. the port is still held by the old process
                    raise UnavailableError(f"agent on {node} did not restart: {_one_line(exc)}") from None
                time.sleep(0.5)
        self.actors[node] = actor
        self.local_addresses[node] = address
        return address

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every agent has its received events committed by the controller."""
        refs = [a.flush.remote(timeout_s) for a in self.actors.values()]
        try:
            return all(ray.get(refs, timeout=timeout_s + 5))
        except ray.exceptions.RayError:
            return False

    def close(self, timeout_s: float = 15.0) -> None:
        refs = [a.close.remote() for a in self.actors.values()]
        try:
            ray.get(refs, timeout=timeout_s)
        except ray.exceptions.RayError as exc:
            log.warning("agents did not close cleanly: %s", exc)
        for a in self.actors.values():
            ray.kill(a, no_restart=True)
        self.actors.clear()


class WorkerPool:
    """The worker processes of one job, across its attempts.

    A process that survived a failed attempt (its ``run`` raised; the process lives) keeps
    torch loaded and its in-memory snapshots (workers/snapshot.py); the next attempt
    reuses it for the same rank when that rank stays on the same node and the world size
    stays. Every node of the
    job also keeps ``spares_per_node`` warm processes (torch imported) that replace dead
    ranks without a process start; a used spare is replaced in the background.
    """

    def __init__(self, spares_per_node: int, warm: Launch | None = None) -> None:
        """``warm``: a user program's launch, whose interpreter every process starts at once
        (None: the built-in trainer, imported at once)."""
        self._cls = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(WorkerActor)
        self._warm = warm
        self._spares_per_node = spares_per_node
        self._spares: dict[str, list[Any]] = {}
        self._survivors: dict[int, tuple[str, Any]] = {}  # rank -> (node name, actor)
        self._in_use: list[Any] = []
        self._world = 0  # world size of the last attempt
        self._filled = False  # fill_spares ran once

    def _new(self, node: NodeInfo, background: bool = False) -> Any:
        """A process on ``node``, warming up; ``background``: at the lowest CPU priority
        (a spare for later, not a process an attempt waits for)."""
        actor = self._cls.options(scheduling_strategy=_pinned(node)).remote()
        actor.warm.remote(self._warm, background)
        return actor

    def fill_spares(self, nodes: list[NodeInfo]) -> None:
        """Start warm spares on ``nodes`` up to ``spares_per_node`` each (non-blocking).

        The first fill (the first attempt's spares) warms at full priority, to be ready for
        an early failure; later fills replace spares a restart used and warm at the idle
        class, on what the ranks leave idle, never competing with the attempt that
        restarted."""
        self._start(nodes, self._spares_per_node, background=self._filled)
        self._filled = True

    def warm_up(self, nodes: list[NodeInfo], per_node: int) -> None:
        """Start idle processes on ``nodes`` up to ``per_node`` each (non-blocking): before
        a first placement, so that their start overlaps the pre-flight checks; ``acquire``
        takes them first."""
        self._start(nodes, per_node, background=False)

    def _start(self, nodes: list[NodeInfo], per_node: int, background: bool) -> None:
        for node in nodes:
            spares = self._spares.setdefault(node.name, [])
            while len(spares) < per_node:
                spares.append(self._new(node, background))

    def acquire(self, placement: list[NodeInfo]) -> tuple[list[Any], int]:
        """One process per rank of ``placement``; returns them and how many were reused
        from the previous attempt.

        A survivor is reused only for its own rank, on its own node, in a world of the
        same size: torch keeps per-process state of the rank it ran (device meshes,
        sharding), and a process that ran rank 2 misbehaves as rank 0. Other survivors
        end; spares (processes that never ran a rank) fill the gaps."""
        if self._warm is not None:
            return self._acquire_interpreters(placement)
        actors: list[Any] = []
        reused = 0
        survivors, self._survivors = self._survivors, {}
        same_world = len(placement) == self._world
        for rank, node in enumerate(placement):
            prev = survivors.pop(rank, None)
            if prev is not None and prev[0] == node.name and same_world:
                actors.append(prev[1])
                reused += 1
                continue
            if prev is not None:
                ray.kill(prev[1], no_restart=True)
            spares = self._spares.get(node.name)
            actors.append(spares.pop(0) if spares else self._new(node))
        for _, actor in survivors.values():
            ray.kill(actor, no_restart=True)
        self._in_use = actors
        self._world = len(placement)
        return actors, reused

    def _acquire_interpreters(self, placement: list[NodeInfo]) -> tuple[list[Any], int]:
        """A user program's ranks: any warm process of the node will do (the program's state
        is its own checkpoint, not the process). Spares first, since they have had time to
        import torch; then the last attempt's survivors, whose fresh interpreters started
        when their program ended; both count as reused. Survivors left over stay as spares."""
        for name, actor in self._survivors.values():
            self._spares.setdefault(name, []).append(actor)
        self._survivors = {}
        actors: list[Any] = []
        reused = 0
        for node in placement:
            idle = self._spares.get(node.name)
            if idle:
                actors.append(idle.pop(0))
                reused += 1
            else:
                actors.append(self._new(node))
        self._in_use = actors
        self._world = len(placement)
        return actors, reused

    def release(self, survivors: dict[int, tuple[str, Any]]) -> None:
        """Processes of the ended attempt that are alive and idle, by rank."""
        self._survivors = dict(survivors)

    def discard_node(self, node: str) -> None:
        """Kill idle processes on ``node`` (quarantined or lost)."""
        for actor in self._spares.pop(node, []):
            ray.kill(actor, no_restart=True)
        for rank, (name, actor) in list(self._survivors.items()):
            if name == node:
                ray.kill(actor, no_restart=True)
                del self._survivors[rank]

    def close(self) -> None:
        for actor in [a for spares in self._spares.values() for a in spares] + \
                [a for _, a in self._survivors.values()] + list(self._in_use):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._spares.clear()
        self._survivors.clear()
        self._in_use = []


class WorkerGroup:
    """The worker actors of one attempt: run, polled, and torn down rank by rank."""

    def __init__(self, placement: list[NodeInfo], actors: list[Any]) -> None:
        """``placement[r]`` is the node of rank r, ``actors[r]`` its process (WorkerPool)."""
        self.placement = placement
        self.actors = actors
        self._refs: dict[Any, int] = {}
        self.results: dict[int, dict[str, Any]] = {}
        self.died: set[int] = set()  # ranks whose process is gone
        self.killed: set[int] = set()

    def pids(self, timeout_s: float) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors], timeout=timeout_s)

    def rendezvous_port(self, host: str, timeout_s: float) -> int:
        """Rank 0 opens the process group's TCPStore socket on host; returns its port."""
        return ray.get(self.actors[0].free_port.remote(host), timeout=timeout_s)

    def run(self, specs: list[WorkerSpec]) -> None:
        self._refs = {a.run.remote(s): s.rank for a, s in zip(self.actors, specs, strict=True)}

    def poll(self, timeout_s: float) -> list[RankFailure]:
        """Wait up to timeout_s for ranks to finish; return the failures seen."""
        pending = [r for r in self._refs if self._refs[r] not in self.results]
        if not pending:
            return []
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        failures = []
        for ref in done:
            rank = self._refs[ref]
            try:
                self.results[rank] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self.died.add(rank)
                failures.append(RankFailure(rank, self.placement[rank].name, True, _one_line(exc)))
                self.results[rank] = {"error": str(exc)}
            except ray.exceptions.RayError as exc:
                failures.append(_raised(rank, self.placement[rank].name, exc))
                self.results[rank] = {"error": str(exc)}
        return failures

    @property
    def finished(self) -> bool:
        return len(self.results) == len(self.actors)

    def running(self) -> list[int]:
        return [r for r in range(len(self.actors)) if r not in self.results]

    def returned(self) -> dict[int, dict]:
        return {r: res for r, res in self.results.items() if "error" not in res}

    def kill_ranks(self, ranks: list[int]) -> None:
        """Kill these ranks' processes (a rank stuck in a collective never returns)."""
        for rank in ranks:
            self.killed.add(rank)
            ray.kill(self.actors[rank], no_restart=True)

    def wind_down(self, grace_s: float) -> list[RankFailure]:
        """Let the ranks still running end by themselves (their collectives fail once a
        peer is gone) for up to ``grace_s``; kill the rest. Returns the failures seen."""
        failures: list[RankFailure] = []
        deadline = time.monotonic() + grace_s
        while not self.finished and time.monotonic() < deadline:
            failures += self.poll(min(0.05, max(0.0, deadline - time.monotonic())))
        stuck = self.running()
        if stuck:
            self.kill_ranks(stuck)
            deadline = time.monotonic() + 10
            while not self.finished and time.monotonic() < deadline:
                failures += self.poll(0.1)
        return failures

    def survivors(self) -> dict[int, tuple[str, Any]]:
        """Ranks whose process is alive and idle: their run ended (raised or returned)."""
        return {r: (self.placement[r].name, self.actors[r]) for r in self.results
                if r not in self.died and r not in self.killed}

    def kill(self) -> None:
        """Kill every rank; a rank stuck in a gloo collective never exits by itself."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.killed.update(range(len(self.actors)))
        deadline = time.monotonic() + 10
        for ref in list(self._refs):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                ray.get(ref, timeout=left)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                pass


def _raised(rank: int, node: str, exc: BaseException) -> RankFailure:
    """The failure of a rank whose run raised (its actor lives): a user program's exit
    (``RankExitError``, with its exit code and traceback) or the built-in trainer's error
    (a non-finite loss and silent data corruption with their fields)."""
    cause = getattr(exc, "cause", exc)
    if isinstance(cause, RankExitError):
        return RankFailure(rank, node, False, str(cause), exit_code=cause.exit_code, traceback=cause.traceback,
                           exited_at=cause.exited_at, reached_pg=cause.reached_pg)
    return RankFailure(rank, node, False, _one_line(exc), *nonfinite_loss(exc), sdc=sdc_failure(exc))


def sdc_failure(exc: BaseException) -> SdcFailure | None:
    """The fields of a rank's ``SdcError`` as Ray hands it over (the task error's
    ``cause``); None for any other error."""
    cause = getattr(exc, "cause", exc)
    if isinstance(cause, SdcError):
        return SdcFailure(cause.step, cause.rank, cause.verdict, cause.rollback_step, cause.evidence)
    return None


def nonfinite_loss(exc: BaseException) -> tuple[int, tuple[int, ...]]:
    """``(step, ranks)`` of a rank's ``NonFiniteLossError`` as Ray hands it over (the
    task error's ``cause``, unpickled with its fields); ``(0, ())`` for any other error."""
    cause = getattr(exc, "cause", exc)
    if isinstance(cause, NonFiniteLossError):
        return cause.step, tuple(cause.ranks)
    return 0, ()


def _one_line(exc: BaseException) -> str:
    """A short, single-line account of a Ray error, for incident evidence."""
    text = " ".join(str(exc).split())
    if isinstance(exc, ray.exceptions.RayActorError):
        # Ray's text is a paragraph; keep the exit type and the first sentence of the detail
        m = re.search(r"Worker exit type: (\w+) Worker exit detail: ([^.]*\.)", text)
        if m:
            return f"process died ({m.group(1)}: {m.group(2)})"
        return "process died"
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    # the last line of a remote traceback is the exception itself
    return (lines[-1].strip() if lines else type(exc).__name__)[:300]
