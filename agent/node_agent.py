"""NodeAgent: the per-node process between the node's workers and the controller.

It serves ``NodeAgent.Report`` on 127.0.0.1 for the workers of its node (the local
channel), forwards their events through one ``Uplink`` stream, and routes controller
commands to the addressed rank: a command waits in that rank's mailbox until the rank's
next report collects it. Commands for another attempt than the reporting worker's are
stale and dropped.

Three chaos faults are addressed to the agent itself (whatever the command's rank) and
applied on receipt: ``agent-down`` kills the agent's process with SIGKILL, like a crash
(workers keep their events and retry until an agent serves their address again),
``partition`` cuts the agent off from the controller for ``fault.duration_s`` seconds
(``Uplink.partition``), and ``sdc-gemm`` makes the node's matrix products wrong in one
element (``gemm_check.Defect``) until the agent restarts.

Node checks: a ``health_check`` command runs the known-answer GEMM test
(``agent.gemm_check``) at once, and while no rank reports to this agent the test also
runs every ``settings.gemm_interval_s`` (0: never). Each run is one ``SdcCheckEvent``
(kind "gemm", rank -1, this node; the command's job and attempt, none for an idle run)
on the uplink like any event; ``GemmChecker`` says what it carries. The tests run on one
named thread, one at a time; torch is imported there, at the first test.

The local channel binds ``bind_host:local_port``; a port of 0 picks a free one. A
restarted agent passes its predecessor's port so the workers' reporters, which retry
the address they were given, reach it without being told anything. The bind fails
(``OSError``) while another process still serves that port: gRPC's SO_REUSEPORT is
off, so two agents never share one. A port freed by a dead agent binds at once (gRPC
sets SO_REUSEADDR; the dead agent's connections in TIME_WAIT do not block it).

Large jobs (``settings.collective_fronts``): the workers' collectives do not go up. A
``FrontKeeper`` (``agent.fronts``) takes them out of each report and keeps the newest
``settings.ring_entries`` per rank and group; the report goes up with the rest of its
events and one ``Event(fronts=...)`` of the fronts that changed. A ``pull`` command
(``TracePull``) is answered, on the agent's pull thread, by submitting the kept rows it
asks for as one ``Event(collectives=...)``, stored like any collectives.

Buffering and backpressure are the uplink's (memory, then a spill folder, then blocking
the workers' reports with RESOURCE_EXHAUSTED so they keep their events); the spill
folder defaults to ``<system temp>/fleet-spill-<uid>/<agent_id>/``.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
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

from fleet.agent.fronts import FrontKeeper
from fleet.agent.host import host_metrics
from fleet.agent.settings import AgentSettings
from fleet.agent.uplink import Uplink
from fleet.proto import agent_pb2, agent_pb2_grpc, columns, events_pb2
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
    def __init__(self, uplink: Uplink, mailboxes: _Mailboxes, keeper: FrontKeeper | None = None) -> None:
        """``keeper``: with collective fronts, where a report's collectives go instead of up."""
        self._uplink = uplink
        self._mailboxes = mailboxes
        self._keeper = keeper
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
                                          f"{request.attempt}) lost events before they reached this agent "
                                          "(its report buffer was full while this agent was unreachable, "
                                          "or its flight-recorder ring overwrote entries before they were read)")

    def Report(self, request: agent_pb2.WorkerReport, context: grpc.ServicerContext) -> agent_pb2.WorkerReply:
        self._note_worker_losses(request)
        events, fronts = list(request.events), None
        if self._uplink.durable(request.reporter, request.report_id):
            # the worker's retry of a report this agent's predecessor wrote to its log and
            # died before answering: those events are being resent from the log already
            events = []
        if self._keeper is not None and events:
            events, fronts = self._keep_collectives(events)
        if events:
            try:
                self._uplink.submit(events, timeout_s=5.0, mark=agent_pb2.ReportMark(
                    reporter=request.reporter, report_id=request.report_id))
            except TimeoutError as exc:
                if fronts is not None:   # sent with the next report instead
                    self._keeper.untake(fronts)
                # the worker keeps its events and retries: backpressure, not loss (the keeper
                # takes the same collectives again without moving any front)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        cmds = self._mailboxes.collect(request.job_id, request.attempt, request.rank)
        return agent_pb2.WorkerReply(commands=cmds)

    def _keep_collectives(self, events: list[events_pb2.Event]
                          ) -> tuple[list[events_pb2.Event], events_pb2.CollectiveFronts | None]:
        """``events`` without their collectives (given to the keeper), plus one event of the
        fronts that changed, last; and those fronts (None when none changed)."""
        keeper = self._keeper
        rest: list[events_pb2.Event] = []
        singles: list[events_pb2.CollectiveEvent] = []
        for event in events:
            which = event.WhichOneof("kind")
            if which == "collectives":
                keeper.add(event.collectives)
            elif which == "collective":
                singles.append(event.collective)
            else:
                rest.append(event)
        if singles:
            keeper.add(columns.pack(singles))
        fronts = keeper.take()
        if fronts is not None:
            rest.append(events_pb2.Event(fronts=fronts))
        return rest, fronts


class GemmChecker:
    """Runs the node's known-answer GEMM test on request and, every ``interval_s`` (0:
    never) while ``idle()``, on its own; ``submit``s one event per run, with ``urgent``
    true when someone waits for it (a command: the controller's pre-flight gate before
    every attempt's placement, a restart's too; ``run_now``).

    The event (``SdcCheckEvent``, kind "gemm", rank -1, step 0): ``value`` / ``expected``
    the worst element's error and bound (``gemm_check.worst``) as text, ``ok`` whether
    every element of every device and dtype is within its bound, ``detail`` a JSON
    object: ``command_id`` (the health_check command's, "" for an idle run), ``trigger``
    ("command" | "idle"), ``summary`` (one line), ``worst`` and ``results`` (each
    ``GemmResult.to_dict()``). A test that cannot run at all is reported not ok with
    ``error`` true, why in ``summary`` (and ``worst`` null)."""

    def __init__(self, node_name: str, size: int, interval_s: float,
                 submit: Callable[[events_pb2.Event, bool], None], idle: Callable[[], bool]) -> None:
        self.node_name = node_name
        self._size = size
        self._interval_s = interval_s
        self._submit = submit
        self._idle = idle
        self._requests: queue.Queue[tuple[events_pb2.Command | None, queue.Queue | None]] = queue.Queue()
        self._stop = threading.Event()
        self._defective = False
        self._thread = threading.Thread(target=self._run, name=f"fleet-agent-gemm-{node_name}", daemon=True)

    @property
    def defective(self) -> bool:
        return self._defective

    def make_defective(self) -> None:
        """From now on the node's products are wrong in one element (chaos sdc-gemm)."""
        self._defective = True

    def start(self) -> None:
        self._thread.start()

    def request(self, cmd: events_pb2.Command) -> None:
        """Run the test for ``cmd`` (a health_check command) as soon as the thread is free."""
        self._requests.put((cmd, None))

    def run_now(self, timeout_s: float) -> events_pb2.SdcCheckEvent:
        """Run the test (after any queued one), wait for it; its event (also submitted)."""
        done: queue.Queue[events_pb2.SdcCheckEvent] = queue.Queue(maxsize=1)
        self._requests.put((None, done))
        try:
            return done.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the GEMM test on {self.node_name} did not finish in {timeout_s:g} s") from None

    def close(self) -> None:
        self._stop.set()
        self._requests.put((None, None))
        if self._thread.ident is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        wait = self._interval_s if self._interval_s > 0 else None
        while not self._stop.is_set():
            try:
                cmd, done = self._requests.get(timeout=wait)
            except queue.Empty:
                if self._idle():
                    self._check(None, None)
                continue
            if self._stop.is_set():
                return
            self._check(cmd, done)

    def _check(self, cmd: events_pb2.Command | None, done: queue.Queue | None) -> None:
        try:
            event = self.test(cmd)
            self._submit(events_pb2.Event(sdc=event), cmd is not None or done is not None)
        except Exception:  # the checker thread must never die silently
            log.exception("%s: reporting the GEMM test failed", self.node_name)
            return
        if done is not None:
            done.put(event)

    def test(self, cmd: events_pb2.Command | None) -> events_pb2.SdcCheckEvent:
        """Run the test now, on this thread; its event."""
        detail: dict[str, object] = {"command_id": cmd.command_id if cmd is not None else "",
                                     "trigger": "idle" if cmd is None else "command"}
        try:
            from fleet.agent import gemm_check  # torch: only once a test runs

            results = gemm_check.run_node_check(
                self._size, gemm_check.Defect() if self._defective else None)
            worst = gemm_check.worst(results)
            ok, value, expected = all(r.ok for r in results), f"{worst.error:.6g}", f"{worst.bound:.6g}"
            detail.update(summary=worst.summary(), worst=worst.to_dict(), results=[r.to_dict() for r in results])
        except Exception as exc:
            log.exception("%s: the GEMM test could not run", self.node_name)
            ok, value, expected = False, "", ""
            detail.update(summary=f"the GEMM test could not run: {type(exc).__name__}: {exc}", worst=None,
                          results=[], error=True)
        if not ok:
            log.error("%s: known-answer GEMM test failed: %s", self.node_name, detail["summary"])
        return events_pb2.SdcCheckEvent(
            job_id=cmd.job_id if cmd is not None else "", attempt=cmd.attempt if cmd is not None else 0,
            rank=-1, node=self.node_name, step=0, kind="gemm", value=value, expected=expected, ok=ok,
            detail=json.dumps(detail, separators=(",", ":")), time_ns=time.time_ns())


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
        self._keeper = FrontKeeper(settings.ring_entries) if settings.collective_fronts else None
        self._pulls: futures.ThreadPoolExecutor | None = None
        self._checker = GemmChecker(node_name, settings.gemm_size, settings.gemm_interval_s,
                                    submit=self._submit_check, idle=lambda: self._mailboxes.alive() == 0)
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
            _NodeAgentServicer(self._uplink, self._mailboxes, self._keeper), self._server
        )
        if self._keeper is not None:
            # a pull's submit may block under backpressure: never on the uplink's command callback
            self._pulls = futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"fleet-agent-pull-{self.node_name}")
        address = f"{self._bind_host}:{self._local_port}"
        detail = "bind failed"
        try:
            port = self._server.add_insecure_port(address)
        except RuntimeError as exc:   # grpcio >= 1.59 raises, older ones return 0
            detail, port = str(exc), 0
        if port == 0:
            self._server = None
            self._executor.shutdown(wait=False)
            if self._pulls is not None:
                self._pulls.shutdown(wait=False)
                self._pulls = None
            self._uplink.close()   # releases its spill folder
            raise OSError(f"{self.agent_id} cannot serve workers on {address} (is another agent "
                          f"of this node still running there?): {detail}")
        self._server.start()
        self.local_address = f"{self._bind_host}:{port}"
        self._hello.local_address = self.local_address
        self._uplink.start()
        self._checker.start()
        if not self._uplink.wait_welcomed(connect_timeout_s):
            self.close()
            raise TimeoutError(f"{self.agent_id}: controller did not accept the connection")
        return self.local_address

    def _on_command(self, cmd: events_pb2.Command) -> None:
        """A command from the controller: a fault for the agent itself is applied now, a
        trace pull answered on the pull thread, anything else waits for its rank's next report."""
        which = cmd.WhichOneof("kind")
        kind = cmd.fault.kind if which == "fault" else 0
        if which == "health_check":
            self._checker.request(cmd)
        elif which == "pull":
            self._pull_later(cmd)
        elif kind == FaultKind.SDC_GEMM.wire:
            log.warning("%s: sdc-gemm fault (command %s): this node's matrix products now come out "
                        "wrong in one element until the agent restarts", self.agent_id, cmd.command_id)
            self._checker.make_defective()
        elif kind == FaultKind.AGENT_DOWN.wire:
            log.warning("%s: agent-down fault (command %s): killing this agent", self.agent_id, cmd.command_id)
            self._die()
        elif kind == FaultKind.PARTITION.wire:
            self._uplink.partition(cmd.fault.duration_s if cmd.fault.duration_s > 0 else DEFAULT_PARTITION_S)
        else:
            self._mailboxes.post(cmd)

    def _pull_later(self, cmd: events_pb2.Command) -> None:
        pulls = self._pulls
        if pulls is None:
            log.debug("%s: trace pull (command %s) ignored: this agent sends every collective (or is closing)",
                      self.agent_id, cmd.command_id)
            return
        try:
            pulls.submit(self._answer_pull, cmd)
        except RuntimeError:   # closed meanwhile
            log.debug("%s: trace pull (command %s) ignored: the agent is closing", self.agent_id, cmd.command_id)

    def _answer_pull(self, cmd: events_pb2.Command) -> None:
        """Submit the raw collectives ``cmd.pull`` asks for (on the pull thread)."""
        try:
            block = self._keeper.pull(cmd.pull)
            if not block.seq:
                log.debug("%s: trace pull (command %s): nothing kept of job %s attempt %d for ranks %s",
                          self.agent_id, cmd.command_id, cmd.pull.job_id, cmd.pull.attempt, list(cmd.pull.ranks))
                return
            # the controller's diagnosis waits for it: not for the next batch interval
            self._uplink.submit([events_pb2.Event(collectives=block)], timeout_s=30.0, urgent=True)
        except TimeoutError as exc:
            log.warning("%s: trace pull (command %s) not sent: %s", self.agent_id, cmd.command_id, exc)
        except Exception:  # the pull thread must never die silently
            log.exception("%s: answering trace pull (command %s) failed", self.agent_id, cmd.command_id)

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

    def _submit_check(self, event: events_pb2.Event, urgent: bool) -> None:
        # a command's answer leaves at once, not after batch_interval_s
        self._uplink.submit([event], timeout_s=30.0, urgent=urgent)

    def check_now(self, timeout_s: float = 60.0) -> events_pb2.SdcCheckEvent:
        """Run the known-answer GEMM test now (as a ``health_check`` command would), report
        it, and return its event; ``TimeoutError`` after ``timeout_s``."""
        return self._checker.run_now(timeout_s)

    @property
    def defective(self) -> bool:
        """True once an sdc-gemm fault made this node's products wrong."""
        return self._checker.defective

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
        """Stop serving workers and checking the node, flush what is buffered (bounded),
        close the stream."""
        self._checker.close()
        if self._server is not None:
            self._server.stop(grace=1.0).wait(timeout=5)
            self._server = None
            self._executor.shutdown(wait=False, cancel_futures=True)
        pulls, self._pulls = self._pulls, None
        if pulls is not None:
            pulls.shutdown(wait=False, cancel_futures=True)
        self._uplink.close()   # wakes a pull blocked in submit
        if pulls is not None:
            pulls.shutdown(wait=True)

    def __enter__(self) -> NodeAgent:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
