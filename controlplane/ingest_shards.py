"""Ingest processes: a large job's agent streams served by several processes on one port.

One Python process does at most one core's work (the GIL). At 16,384 ranks (2,048 agents
sending a batch and a heartbeat a second) the ingest path alone needs about that: the
controller saturates, ingest lags grow without bound, and detection waits behind them.
With ``controller.ingest_processes: N`` the controller starts N ingest processes
(``python -m fleet.controlplane.ingest_shards``) that listen together on one port,
``controller.ingest_port`` (SO_REUSEPORT: the kernel hands each new connection to one of
them), and agents dial that port. Each process runs what the controller's own
AgentService runs — the token check, validation (``ingest.prepare``), an ``IngestWriter``
committing to the store and acking after commit — so ingest, the store's exactly-once
keys and the write-ahead resend all work as in one process. PostgreSQL only: SQLite has
one write lock.

The controller keeps the rest: the watchdog, the metrics, the agent registry, the node
checks. Each process forwards to it over a socket pair (pickled lists, a few ms apart):
  * every valid batch's rows, as the in-process observer chain would see them;
  * each stream that opens and closes (agent, node, epoch, local address), and every open
    stream's last-heard time each ``HEARD_EVERY_S`` (the registry's liveness);
  * node check results (``SdcCheckEvent`` of kind gemm);
  * its ingest counters (deltas applied to the controller's) and commit durations.
and takes from it: messages for a stream (commands, trace pulls; ``RemoteSession.post``),
a stream to end (``fail``), and stop.

A process whose controller is gone (its socket closed: the controller ended, even by
SIGKILL) exits at once; what it had not acked its agents resend to whoever serves next. A
process that dies is started again on the same port (at most ``RESTARTS_PER_MINUTE``);
meanwhile its agents reconnect to the others.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import grpc

from fleet.controlplane.addresses import join_host_port
from fleet.controlplane.agent_server import AgentRegistry, AgentServicer, AgentSession, BatchObserver, NodeCheckSink
from fleet.controlplane.errors import ConfigError, UnavailableError
from fleet.controlplane.metrics import ERROR_REASONS, ControllerMetrics
from fleet.controlplane.store.ingest import PreparedBatch
from fleet.proto import agent_pb2, events_pb2
from fleet.proto.tls import TlsFiles

log = logging.getLogger(__name__)

#: How often a process tells the controller when each of its streams was last heard from.
HEARD_EVERY_S = 0.2
#: How often a process sends its ingest counters.
METRICS_EVERY_S = 1.0
#: A process gathers what it forwards for this long after the first item, then sends it
#: in one message (one syscall and one pickle for many batches).
FORWARD_GATHER_S = 0.005
#: Longest to wait for a process to bind its port, seconds (it imports the store and gRPC).
START_TIMEOUT_S = 60.0
#: Longest a process may take to commit what it holds and exit when stopped, seconds.
STOP_TIMEOUT_S = 30.0
RESTARTS_PER_MINUTE = 3
_PICKLE = pickle.HIGHEST_PROTOCOL


@dataclass(frozen=True)
class ShardSpec:
    """What an ingest process needs (sent over its socket, never on its command line:
    the token is a secret)."""

    index: int
    store_url: str
    host: str
    port: int
    token: str
    controller_id: str
    max_message_bytes: int
    tls: TlsFiles | None = None
    log_level: int = logging.WARNING


# -- the ingest process ---------------------------------------------------------------------

class _Forward:
    """The process's side of the socket: what goes to the controller, gathered by one
    thread. ``put`` is O(1) and safe from any thread (the observer runs on the gRPC loop)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._items: collections.deque[tuple] = collections.deque()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self.heard: Callable[[], dict[int, float]] = dict
        self.metrics: Callable[[], dict[str, Any]] = dict
        self._thread = threading.Thread(target=self._run, name="fleet-ingest-forward", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, item: tuple) -> None:
        self._items.append(item)
        self._wake.set()

    def close(self) -> None:
        """Send what is left, with the last counters, and stop the thread."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(10.0)

    def _run(self) -> None:
        next_heard = next_metrics = time.monotonic()
        while True:
            woke = self._wake.wait(HEARD_EVERY_S)
            if woke and not self._stopped.is_set():
                time.sleep(FORWARD_GATHER_S)
            self._wake.clear()
            out = []
            while self._items:
                out.append(self._items.popleft())
            now = time.monotonic()
            last = self._stopped.is_set()
            if now >= next_heard or last:
                out.append(("heard", self.heard()))
                next_heard = now + HEARD_EVERY_S
            if now >= next_metrics or last:
                out.append(("metrics", self.metrics()))
                next_metrics = now + METRICS_EVERY_S
            if out:
                try:
                    self._conn.send_bytes(pickle.dumps(out, _PICKLE))
                except OSError:  # the controller is gone; the main thread exits
                    return
            if last:
                return


class _ForwardingRegistry(AgentRegistry):
    """The process's registry: streams are numbered (``sid``) and their opening and
    closing forwarded."""

    def __init__(self, forward: _Forward) -> None:
        super().__init__()
        self._forward = forward
        self._sids = itertools.count(1)
        self._by_sid: dict[int, AgentSession] = {}
        self._sid_of: dict[int, int] = {}  # id(session) -> sid
        self._open_lock = threading.Lock()

    def attach(self, session: AgentSession) -> None:
        super().attach(session)
        with self._open_lock:
            sid = next(self._sids)
            self._by_sid[sid] = session
            self._sid_of[id(session)] = sid
        self._forward.put(("attach", sid, session.agent_id, session.node_name, session.epoch,
                           session.local_address, session.last_heard))

    def detach(self, session: AgentSession) -> None:
        super().detach(session)
        with self._open_lock:
            sid = self._sid_of.pop(id(session), None)
            if sid is not None:
                self._by_sid.pop(sid, None)
        if sid is not None:
            self._forward.put(("detach", sid))

    def by_sid(self, sid: int) -> AgentSession | None:
        with self._open_lock:
            return self._by_sid.get(sid)

    def heard(self) -> dict[int, float]:
        with self._open_lock:
            return {sid: s.last_heard for sid, s in self._by_sid.items()}


class _RecordedHistogram:
    """Stands in for ``ControllerMetrics.commit_s``: keeps the observations to forward."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: list[float] = []

    def observe(self, value: float) -> None:
        with self._lock:
            self._values.append(value)

    def take(self) -> list[float]:
        with self._lock:
            out, self._values = self._values, []
            return out


def _counters(metrics: ControllerMetrics, commits: _RecordedHistogram) -> dict[str, Any]:
    """The process's ingest counters, cumulative (the controller applies the deltas)."""
    return {
        "batches": metrics.value("fleet_ingest_batches_total"),
        "events": metrics.value("fleet_ingest_events_total"),
        "duplicates": metrics.value("fleet_ingest_duplicate_batches_total"),
        "errors": {r: metrics.value("fleet_ingest_errors_total", reason=r) for r in ERROR_REASONS},
        "dropped": {s: metrics.value("fleet_ingest_dropped_events_total", source=s) for s in ("agent", "controller")},
        "queued": metrics.value("fleet_ingest_queued_events"),
        "agents": metrics.value("fleet_agents_connected"),
        "commits": commits.take(),
    }


def serve_shard(conn: Connection) -> int:
    """An ingest process: read its spec, serve until told to stop or the controller goes."""
    from fleet.controlplane.grpc_server import ControllerServer
    from fleet.controlplane.store import Store

    spec: ShardSpec = pickle.loads(conn.recv_bytes())
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s ingest-{spec.index} %(levelname)s %(name)s: %(message)s")
    forward = _Forward(conn)
    registry = _ForwardingRegistry(forward)
    metrics = ControllerMetrics()
    commits = _RecordedHistogram()
    metrics.commit_s = commits  # type: ignore[assignment]
    forward.heard = registry.heard
    forward.metrics = lambda: _counters(metrics, commits)

    def observe(node: str, batch: PreparedBatch) -> None:
        forward.put(("batch", node, batch))

    def node_check(node: str, event: events_pb2.SdcCheckEvent) -> None:
        forward.put(("node_check", node, event.SerializeToString()))

    try:
        store = Store(spec.store_url)
    except Exception as exc:  # noqa: BLE001 - told to the controller, which raises it
        conn.send_bytes(pickle.dumps([("failed", f"{type(exc).__name__}: {exc}")], _PICKLE))
        return 1
    # bind only when told: every process binds (and listens) within a few ms of the others,
    # else a lone early listener takes every agent that connects meanwhile
    conn.send_bytes(pickle.dumps([("loaded",)], _PICKLE))
    try:
        if pickle.loads(conn.recv_bytes()) != ("bind",):
            raise EOFError
    except (EOFError, OSError):
        os._exit(0)  # the controller gave up on starting, or is gone
    try:
        server = ControllerServer(
            AgentServicer(store, registry, spec.token, spec.controller_id, metrics=metrics,
                          observer=observe, on_node_check=node_check),
            None, host=spec.host, port=spec.port, max_message_bytes=spec.max_message_bytes, tls=spec.tls,
            reuse_port=True).start()
    except Exception as exc:  # noqa: BLE001 - told to the controller, which raises it
        conn.send_bytes(pickle.dumps([("failed", f"{type(exc).__name__}: {exc}")], _PICKLE))
        store.close()
        return 1
    conn.send_bytes(pickle.dumps([("ready",)], _PICKLE))
    forward.start()
    try:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                # the controller is gone: nobody reads what this process would commit and
                # ack; exit now, so the port is free for the next controller's processes
                os._exit(0)
            if msg[0] == "post":
                session = registry.by_sid(msg[1])
                if session is not None:
                    session.post(agent_pb2.ControllerMessage.FromString(msg[2]))
            elif msg[0] == "fail":
                session = registry.by_sid(msg[1])
                if session is not None:
                    session.fail(msg[2], grpc.StatusCode[msg[3]])
            elif msg[0] == "stop":
                break
    finally:
        server.close()   # streams end, the writer commits and acks what it holds
        forward.close()
        store.close()
    return 0


# -- the controller's side ------------------------------------------------------------------

@dataclass(eq=False)
class RemoteSession:
    """An agent stream served by an ingest process, as the controller's ``AgentRegistry``
    sees it: ``post``/``ack``/``fail`` go over the process's socket."""

    agent_id: str
    node_name: str
    epoch: int
    local_address: str
    shard: _Shard = field(repr=False)
    sid: int = 0
    last_heard: float = field(default_factory=time.monotonic)
    connected: bool = True

    def post(self, msg: agent_pb2.ControllerMessage) -> None:
        self.shard.send(("post", self.sid, msg.SerializeToString()))

    def ack(self, msg: agent_pb2.ControllerMessage) -> None:
        self.post(msg)

    def fail(self, reason: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.shard.send(("fail", self.sid, reason, code.name))


class _Shard:
    """One ingest process, seen from the controller: its socket and its streams."""

    def __init__(self, spec: ShardSpec) -> None:
        self.spec = spec
        self._send_lock = threading.Lock()
        self.sessions: dict[int, RemoteSession] = {}
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet.controlplane.ingest_shards", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(pickle.dumps(spec, _PICKLE))
        self.thread: threading.Thread | None = None

    def expect(self, what: str, timeout_s: float) -> None:
        """Wait for the process to say ``what`` ("loaded", "ready"); raise why not."""
        if not self.conn.poll(timeout_s):
            raise UnavailableError(f"ingest process {self.spec.index} did not start within {timeout_s:.0f} s")
        try:
            (said,) = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise UnavailableError(f"ingest process {self.spec.index} exited while starting "
                                   f"(exit code {self.proc.wait(5)})") from None
        if said[0] == "failed":
            raise UnavailableError(f"ingest process {self.spec.index} could not start: {said[1]}")
        if said[0] != what:
            raise UnavailableError(f"ingest process {self.spec.index} said {said[0]!r} before {what!r}")

    def send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send_bytes(pickle.dumps(msg, _PICKLE))
        except OSError:
            pass  # the process is gone: its streams are detached, their agents reconnect


class IngestShards:
    """The controller's ingest processes: starts them, relays what they forward into the
    controller's registry, observer, node checks and metrics, and stops them.

    A context manager; ``address`` is what agents dial (``host:port`` of the shared port)."""

    def __init__(self, processes: int, *, store_url: str, host: str, port: int, token: str,
                 controller_id: str, registry: AgentRegistry, observer: BatchObserver | None = None,
                 on_node_check: NodeCheckSink | None = None, metrics: ControllerMetrics | None = None,
                 max_message_bytes: int, tls: TlsFiles | None = None) -> None:
        if processes < 1:
            raise ConfigError("controller.ingest_processes: must be at least 1 to start ingest processes")
        if store_url.startswith("sqlite"):
            raise ConfigError("controller.ingest_processes: needs a PostgreSQL store (SQLite has one write lock)")
        self._registry = registry
        self._observer = observer
        self._observer_failed = False
        self._on_node_check = on_node_check
        self._metrics = metrics
        self._stopping = False
        self._restarts: collections.deque[float] = collections.deque()
        self._checks = futures.ThreadPoolExecutor(1, thread_name_prefix="fleet-ingest-checks")
        self._seen: dict[int, dict[str, Any]] = {}  # shard index -> its last counters
        self._base = ShardSpec(0, store_url, host, port, token, controller_id, max_message_bytes, tls,
                               logging.getLogger("fleet").getEffectiveLevel())
        self.shards: list[_Shard] = []
        try:
            with _reserved_port(host, port) as self.port:
                # every process binds first and starts listening only when all have bound:
                # a lone early listener would take every agent that connects meanwhile
                for i in range(processes):
                    self.shards.append(_Shard(dataclasses.replace(self._base, index=i, port=self.port)))
                self._bind(self.shards)
        except BaseException:
            self.close()
            raise
        self.address = join_host_port(host, self.port)
        log.info("%d ingest processes serving agents on %s", processes, self.address)

    def _bind(self, shards: list[_Shard]) -> None:
        """Once every one of ``shards`` has loaded, let all bind at once; relay from them."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for shard in shards:
            shard.expect("loaded", max(0.1, deadline - time.monotonic()))
        for shard in shards:
            shard.send(("bind",))
        for shard in shards:
            shard.expect("ready", max(0.1, deadline - time.monotonic()))
            shard.thread = threading.Thread(target=self._relay, args=(shard,),
                                            name=f"fleet-ingest-relay-{shard.spec.index}", daemon=True)
            shard.thread.start()

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.shards if s.proc.poll() is None]

    # -- what the processes forward -------------------------------------------------------

    def _relay(self, shard: _Shard) -> None:
        while True:
            try:
                items = pickle.loads(shard.conn.recv_bytes())
            except (EOFError, OSError):
                break
            for item in items:
                try:
                    self._handle(shard, item)
                except Exception:  # noqa: BLE001 - one bad item must not end the relay
                    log.exception("ingest process %d: handling %s failed", shard.spec.index, item[0])
        for session in list(shard.sessions.values()):
            self._registry.detach(session)
        shard.sessions.clear()
        if self._stopping:
            return
        code = shard.proc.wait(10)
        log.error("ingest process %d exited (code %s); its agents reconnect to the others",
                  shard.spec.index, code)
        self._restart(shard)

    def _handle(self, shard: _Shard, item: tuple) -> None:
        kind = item[0]
        if kind == "batch":
            if self._observer is not None:
                self._observe(item[1], item[2])
        elif kind == "heard":
            for sid, heard in item[1].items():
                session = shard.sessions.get(sid)
                if session is not None:
                    session.last_heard = max(session.last_heard, heard)
        elif kind == "attach":
            _, sid, agent_id, node, epoch, local_address, heard = item
            session = RemoteSession(agent_id, node, epoch, local_address, shard, sid, heard)
            shard.sessions[sid] = session
            self._registry.attach(session)  # type: ignore[arg-type]
        elif kind == "detach":
            session = shard.sessions.pop(item[1], None)
            if session is not None:
                self._registry.detach(session)  # type: ignore[arg-type]
        elif kind == "node_check":
            if self._on_node_check is not None:
                self._checks.submit(self._node_check, item[1], events_pb2.SdcCheckEvent.FromString(item[2]))
        elif kind == "metrics":
            self._count(shard.spec.index, item[1])

    def _observe(self, node: str, batch: PreparedBatch) -> None:
        try:
            self._observer(node, batch)  # type: ignore[misc]
        except Exception:
            if not self._observer_failed:
                self._observer_failed = True
                log.exception("the batch observer failed on a forwarded batch (ingest goes on)")

    def _node_check(self, node: str, event: events_pb2.SdcCheckEvent) -> None:
        try:
            self._on_node_check(node, event)  # type: ignore[misc]
        except Exception:
            log.exception("node %s: handling a forwarded node check failed", node)

    def _count(self, index: int, now: dict[str, Any]) -> None:
        m = self._metrics
        if m is None:
            return
        before = self._seen.get(index) or {"batches": 0, "events": 0, "duplicates": 0, "queued": 0, "agents": 0,
                                           "errors": {}, "dropped": {}}
        self._seen[index] = now
        for name, counter in (("batches", m.batches), ("events", m.events), ("duplicates", m.duplicates)):
            if now[name] > before[name]:
                counter.inc(now[name] - before[name])
        for reason, v in now["errors"].items():
            if v > before["errors"].get(reason, 0):
                m.errors.labels(reason).inc(v - before["errors"].get(reason, 0))
        for source, v in now["dropped"].items():
            if v > before["dropped"].get(source, 0):
                m.dropped.labels(source).inc(v - before["dropped"].get(source, 0))
        m.queued.inc(now["queued"] - before["queued"])
        m.agents.inc(now["agents"] - before["agents"])
        for took in now["commits"]:
            m.commit_s.observe(took)

    def _restart(self, dead: _Shard) -> None:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > 60:
            self._restarts.popleft()
        if len(self._restarts) >= RESTARTS_PER_MINUTE:
            log.error("ingest process %d: not restarted (%d restarts in the last minute); "
                      "the other processes serve its agents", dead.spec.index, len(self._restarts))
            return
        self._restarts.append(now)
        if self._metrics is not None and dead.spec.index in self._seen:
            last = self._seen.pop(dead.spec.index)
            self._metrics.queued.dec(last["queued"])
            self._metrics.agents.dec(last["agents"])
        try:
            self.shards.remove(dead)
            shard = _Shard(dead.spec)
            self.shards.append(shard)
            self._bind([shard])
            log.warning("ingest process %d started again on port %d", dead.spec.index, self.port)
        except Exception:  # noqa: BLE001 - the others still serve
            log.exception("ingest process %d could not be started again", dead.spec.index)

    # -- stopping -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process: each ends its streams and commits and acks what it holds
        first. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        for shard in self.shards:
            shard.send(("stop",))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for shard in self.shards:
            try:
                shard.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("ingest process %d did not stop in %.0f s; killing it", shard.spec.index, STOP_TIMEOUT_S)
                shard.proc.kill()
                shard.proc.wait(10)
            if shard.thread is not None:
                shard.thread.join(10)
            shard.conn.close()
        self._checks.shutdown(wait=True)

    def __enter__(self) -> IngestShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _reserved_port(host: str, port: int) -> Iterator[int]:
    """``port``, or a free one, held by a bound (not listening) SO_REUSEPORT socket while
    the processes bind it too: nobody else can take it meanwhile."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise UnavailableError(f"controller.ingest_port: cannot bind {join_host_port(host, port)}: "
                                   f"{exc.strerror or exc}") from None
        yield sock.getsockname()[1]


def main(argv: list[str]) -> int:
    """``python -m fleet.controlplane.ingest_shards FD``: serve on the socket at FD."""
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m fleet.controlplane.ingest_shards FD (started by the controller)", file=sys.stderr)
        return 2
    return serve_shard(Connection(int(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
