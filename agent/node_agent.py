"""NodeAgent: the per-node process between the node's workers and the controller.

It serves ``NodeAgent.Report`` on 127.0.0.1 for the workers of its node (the local
channel), forwards their events through one ``Uplink`` stream, and routes controller
commands to the addressed rank: a command waits in that rank's mailbox until the rank's
next report collects it. Commands for another attempt than the reporting worker's are
stale and dropped.

Two chaos faults are addressed to the agent itself (whatever the command's rank) and
applied on receipt: ``agent-down`` kills the agent's process with SIGKILL, like a crash
(workers keep their events and retry until an agent serves their address again), and
``partition`` cuts the agent off from the controller for ``fault.duration_s`` seconds
(``Uplink.partition``).

The local channel binds ``bind_host:local_port``; a port of 0 picks a free one. A
restarted agent passes its predecessor's port so the workers' reporters, which retry
the address they were given, reach it without being told anything. The bind fails
(``OSError``) while another process still serves that port: gRPC's SO_REUSEPORT is
off, so two agents never share one. A port freed by a dead agent binds at once (gRPC
sets SO_REUSEADDR; the dead agent's connections in TIME_WAIT do not block it).

Buffering and backpressure are the uplink's (memory, then a spill folder, then blocking
the workers' reports with RESOURCE_EXHAUSTED so they keep their events); the spill
folder defaults to ``<system temp>/fleet-spill-<uid>/<agent_id>/``.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from fleet.agent.host import host_metrics
from fleet.agent.settings import AgentSettings
from fleet.agent.uplink import Uplink
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.kinds import FaultKind
from fleet.proto.tls import TlsFiles

log = logging.getLogger(__name__)

#: A rank that has not reported for this long no longer counts as alive.
WORKER_STALE_S = 5.0

#: Fault kinds addressed to the agent, not to a rank.
#: How long a partition lasts when its command gives no ``duration_s``, seconds.
DEFAULT_PARTITION_S = 10.0


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def default_spill_dir() -> Path:
    """Where agents spill when not told: private to this user under the system temp dir."""
    return Path(tempfile.gettempdir()) / f"fleet-spill-{os.getuid()}"


class _Mailboxes:
    """Commands per (job, rank), collected by the rank's next report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[tuple[str, int], list[events_pb2.Command]] = collections.defaultdict(list)
        self._last_seen: dict[tuple[str, int], tuple[int, float]] = {}

    def post(self, cmd: events_pb2.Command) -> None:
        with self._lock:
            if cmd.rank >= 0:
                self._boxes[(cmd.job_id, cmd.rank)].append(cmd)
                return
            # rank -1: every rank of this node that belongs to the command's job
            for job_id, rank in self._last_seen:
                if job_id == cmd.job_id:
                    self._boxes[(job_id, rank)].append(cmd)

    def collect(self, job_id: str, attempt: int, rank: int) -> list[events_pb2.Command]:
        with self._lock:
            self._last_seen[(job_id, rank)] = (attempt, time.monotonic())
            cmds = self._boxes.pop((job_id, rank), [])
        return [c for c in cmds if c.attempt in (0, attempt)]

    def alive(self) -> int:
        now = time.monotonic()
        with self._lock:
            return sum(1 for _, seen in self._last_seen.values() if now - seen < WORKER_STALE_S)


class _NodeAgentServicer(agent_pb2_grpc.NodeAgentServicer):
    def __init__(self, uplink: Uplink, mailboxes: _Mailboxes) -> None:
        self._uplink = uplink
        self._mailboxes = mailboxes
        self._lock = threading.Lock()
        self._worker_dropped: dict[tuple[str, int, int], int] = {}  # cumulative, per rank

    def _note_worker_losses(self, request: agent_pb2.WorkerReport) -> None:
        key = (request.job_id, request.attempt, request.rank)
        with self._lock:
            new = request.dropped_events - self._worker_dropped.get(key, 0)
            if new > 0:
                self._worker_dropped[key] = request.dropped_events
        if new > 0:
            self._uplink.report_loss(new, f"rank {request.rank} of job {request.job_id} (attempt "
                                          f"{request.attempt}) dropped its oldest events: its "
                                          "report buffer was full while this agent was unreachable")

    def Report(self, request: agent_pb2.WorkerReport, context: grpc.ServicerContext) -> agent_pb2.WorkerReply:
        self._note_worker_losses(request)
        if request.events:
            try:
                self._uplink.submit(list(request.events), timeout_s=5.0)
            except TimeoutError as exc:
                # the worker keeps its events and retries: backpressure, not loss
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        cmds = self._mailboxes.collect(request.job_id, request.attempt, request.rank)
        return agent_pb2.WorkerReply(commands=cmds)


class NodeAgent:
    """One node's agent. Use as a context manager, or call ``start``/``close``."""

    def __init__(
        self,
        *,
        node_name: str,
        controller_address: str,
        token: str,
        settings: AgentSettings | None = None,
        ray_node_id: str = "",
        bind_host: str = "127.0.0.1",
        local_port: int = 0,
        tls: TlsFiles | None = None,
        on_ack: Callable[[int, int], None] | None = None,
        die: Callable[[], None] = _sigkill_self,
    ) -> None:
        """``local_port``: where workers report (0: any free port; a restarted agent
        passes its predecessor's). ``settings``: batching, buffering, heartbeats (None: the
        defaults of ``AgentSettings``); an empty ``settings.spill_dir`` means
        ``<system temp>/fleet-spill-<uid>``, and the agent spills under
        ``<spill_dir>/<agent_id>/`` (created, mode 0700). ``tls``:
        the CA, client certificate and key for mutual TLS to the controller (None:
        plaintext). ``on_ack(seq, n_events)``: called as each batch is committed (see
        ``Uplink``). ``die``: what the agent-down fault calls (SIGKILL to this process;
        in-process tests pass their own)."""
        settings = settings if settings is not None else AgentSettings()
        if not 0 <= local_port <= 65535:
            raise ValueError(f"local_port must be in 0..65535, not {local_port}")
        self.node_name = node_name
        self.agent_id = f"agent-{node_name}"
        self._bind_host = bind_host
        self._local_port = local_port
        self._die = die
        self._mailboxes = _Mailboxes()
        self._server: grpc.Server | None = None
        self.local_address = ""
        self._hello = agent_pb2.Hello(
            agent_id=self.agent_id,
            node_name=node_name,
            ray_node_id=ray_node_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            token=token,
            epoch=time.time_ns(),
        )
        self._uplink = Uplink(
            controller_address=controller_address,
            token=token,
            hello=self._hello,
            on_command=self._on_command,
            heartbeat=self._heartbeat,
            settings=settings.replace(spill_dir=settings.spill_dir or str(default_spill_dir())),
            tls=tls,
            on_ack=on_ack,
        )

    def start(self, connect_timeout_s: float = 30.0) -> str:
        """Serve the local channel, connect to the controller; return the local address."""
        self._executor = futures.ThreadPoolExecutor(
            max_workers=16, thread_name_prefix=f"fleet-agent-{self.node_name}"
        )
        self._server = grpc.server(
            self._executor,
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.so_reuseport", 0),   # a port still served elsewhere must fail to bind
            ],
        )
        agent_pb2_grpc.add_NodeAgentServicer_to_server(
            _NodeAgentServicer(self._uplink, self._mailboxes), self._server
        )
        address = f"{self._bind_host}:{self._local_port}"
        detail = "bind failed"
        try:
            port = self._server.add_insecure_port(address)
        except RuntimeError as exc:   # grpcio >= 1.59 raises, older ones return 0
            detail, port = str(exc), 0
        if port == 0:
            self._server = None
            self._executor.shutdown(wait=False)
            self._uplink.close()   # releases its spill folder
            raise OSError(f"{self.agent_id} cannot serve workers on {address} (is another agent "
                          f"of this node still running there?): {detail}")
        self._server.start()
        self.local_address = f"{self._bind_host}:{port}"
        self._hello.local_address = self.local_address
        self._uplink.start()
        if not self._uplink.wait_welcomed(connect_timeout_s):
            self.close()
            raise TimeoutError(f"{self.agent_id}: controller did not accept the connection")
        return self.local_address

    def _on_command(self, cmd: events_pb2.Command) -> None:
        """A command from the controller: a fault for the agent itself is applied now,
        anything else waits for its rank's next report."""
        kind = cmd.fault.kind if cmd.WhichOneof("kind") == "fault" else 0
        if kind == FaultKind.AGENT_DOWN.wire:
            log.warning("%s: agent-down fault (command %s): killing this agent", self.agent_id, cmd.command_id)
            self._die()
        elif kind == FaultKind.PARTITION.wire:
            self._uplink.partition(cmd.fault.duration_s if cmd.fault.duration_s > 0 else DEFAULT_PARTITION_S)
        else:
            self._mailboxes.post(cmd)

    def partition(self, duration_s: float) -> None:
        """Cut this agent off from the controller for ``duration_s`` seconds
        (``Uplink.partition``); workers' reports are still taken and buffered."""
        self._uplink.partition(duration_s)

    def end_partition(self) -> None:
        """End a partition now (no-op when there is none)."""
        self._uplink.end_partition()

    def partitioned(self) -> bool:
        """True while a partition cuts this agent off from the controller."""
        return self._uplink.partitioned()

    def _heartbeat(self) -> agent_pb2.Heartbeat:
        return agent_pb2.Heartbeat(
            agent_id=self.agent_id,
            time_ns=time.time_ns(),
            host=host_metrics(self._mailboxes.alive()),
        )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every event received so far is committed by the controller."""
        return self._uplink.flush(timeout_s)

    def stats(self) -> dict[str, int]:
        """The uplink's counters (``Uplink.stats``)."""
        return self._uplink.stats()

    def close(self) -> None:
        """Stop serving workers, flush what is buffered (bounded), close the stream."""
        if self._server is not None:
            self._server.stop(grace=1.0).wait(timeout=5)
            self._server = None
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._uplink.close()

    def __enter__(self) -> NodeAgent:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
