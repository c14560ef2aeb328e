"""The controller's side of AgentService: one bidi stream per node agent, on asyncio.

Every stream is a coroutine on the controller's one gRPC event loop (the
``fleet-ctl-aio`` thread that ``grpc_server.ControllerServer`` owns): no thread per
stream, so the number of agents is bounded by memory and CPU, not by a thread pool.
Per stream, a reader task takes the agent's messages and the handler writes the
Welcome, the acks and any commands posted for the node.

An event batch is validated and turned into rows (``ingest.prepare``), then queued for
the store's single writer (``IngestWriter``), which commits it idempotently, keyed by
(agent_id, epoch, seq), and acks it after the commit (a restarted agent first resends what
its predecessor left unacknowledged, under that process's epoch). A batch that fails validation is
recorded as dropped and acked as rejected, in its place in the stream's order. Each
stream handles its messages one at a time, so its batches reach the writer, and its
acks come back, in the order they were sent.

What never runs on the loop, because it would stall every other stream:
- ``prepare`` of a batch of more than ``INLINE_PREPARE_EVENTS`` events runs in a pool of
  ``PREPARE_THREADS`` threads (``fleet-ctl-prepare``): a full 2,000-event batch takes
  ~10-20 ms on this machine, which on the loop would delay every other stream's reads and
  acks by as much; a small one (~0.1 ms) costs less than the hop to a thread.
- Store calls (the Hello's node row and committed seq, DropReports, node checks, which
  store verdicts and may quarantine) run in a pool of ``STORE_THREADS`` (``fleet-ctl-store``).
- ``IngestWriter.put`` blocks when the queue is full; the loop only tries it without
  waiting and, when full, parks the stream in a first-come-first-served line
  (``ParkedStreams``): each ack the writer sends wakes the first in line, and each that
  gets its batch in wakes the next, so about as many try as there is room for. (Waking
  every parked stream on every ack cost O(acks x parked) wake-ups: with a 16,384-rank
  job's 2,048 streams behind a backlog, more CPU than the ingest itself, so the backlog
  never drained.) A parked stream does not read: gRPC flow control pushes back on its
  agent. Nothing is dropped for being slow.

An optional observer (the controller's watchdog and its metrics, chained with
``fan_out``) sees every valid batch's rows before they are queued; it runs ON THE LOOP
THREAD, so it must be cheap (O(1)), and its errors are logged, never allowed to break
ingest. Node checks (``on_node_check``, the
controller's ``node_checks.NodeChecks.observe``) are handed each known-answer GEMM result
of a valid batch, with the stream's node, once the batch is queued, in the store pool;
their errors are logged too. Heartbeats update the node's liveness and health samples;
DropReports (events an agent lost) are stored in ``ingest_drops``.

Refusals never crash anything and are counted in ``fleet_ingest_errors_total``: a
missing or wrong token (UNAUTHENTICATED), bytes that are not an AgentMessage
(INVALID_ARGUMENT), a message over the size limit (RESOURCE_EXHAUSTED), a stream that
breaks the protocol (INVALID_ARGUMENT), an invalid batch (rejected ack).

``AgentRegistry`` is what the rest of the controller sees, from any thread: which nodes
have a live agent, when each was last heard from, and a way to send a command to a node.
``AgentSession.ack``/``post``/``fail`` may be called from any thread: they hand the
message to the loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from fleet.controlplane.auth import tokens_equal
from fleet.controlplane.errors import UnavailableError
from fleet.controlplane.metrics import ControllerMetrics
from fleet.controlplane.store import HealthRecord, Store
from fleet.controlplane.store.ingest import InvalidBatch, PreparedBatch, count_events, prepare
from fleet.controlplane.store.writer import IngestWriter, Item
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.contract import TOKEN_METADATA_KEY

#: What the AgentService deserializer returns for bytes that are not an AgentMessage,
#: and for a message over the size limit.
MALFORMED = object()
OVERSIZED = object()

log = logging.getLogger(__name__)

#: Sees each valid batch's rows: (node name of the agent, rows). Called on the loop thread.
BatchObserver = Callable[[str, PreparedBatch], None]


def fan_out(*observers: BatchObserver | None) -> BatchObserver | None:
    """One observer that shows each batch to every one of ``observers`` (Nones left out),
    in order; one that raises does not keep the batch from the others (the first error is
    raised after all were called). None when there is none."""
    chain = [o for o in observers if o is not None]
    if len(chain) <= 1:
        return chain[0] if chain else None

    def observe(node_name: str, batch: PreparedBatch) -> None:
        failed: Exception | None = None
        for o in chain:
            try:
                o(node_name, batch)
            except Exception as exc:  # noqa: BLE001 - re-raised below, once the others saw it
                failed = failed or exc
        if failed is not None:
            raise failed

    return observe


#: Takes one node check result: (node name of the agent, its "gemm" SdcCheckEvent).
NodeCheckSink = Callable[[str, events_pb2.SdcCheckEvent], None]

#: Batches of at most this many events are prepared on the loop; larger ones in the pool.
INLINE_PREPARE_EVENTS = 64
PREPARE_THREADS = 2
STORE_THREADS = 2
#: Hellos served by one round of store work at most (the node rows in one transaction,
#: the committed seqs in one query): after a controller restart thousands of agents say
#: Hello at once, and one round each would queue them for tens of seconds.
HELLO_ROUND_MAX = 512
#: Longest the first stream parked on a full writer queue waits before trying again,
#: seconds (it is woken sooner by any ack; this covers a store outage, when nothing is acked).
FULL_QUEUE_RETRY_S = 0.25
#: A parked stream further back in line wakes this often only to stay counted as heard
#: from (``agent_timeout_s`` is 10 s), seconds.
PARKED_HEARD_S = 1.0

T = TypeVar("T")


class ParkedStreams:
    """Streams waiting for room in the writer's queue, in arrival order (loop thread only).

    ``wake`` (called on each ack) wakes the first in line; a stream that then gets its
    batch in calls ``wake`` again for the next; one refused again goes back to the front.
    So a commit that frees room for N batches wakes about N streams, whatever the number
    parked."""

    def __init__(self) -> None:
        self._line: collections.deque[asyncio.Future[None]] = collections.deque()
        self.woken = 0  # turns given, in all

    def __len__(self) -> int:
        """Streams in line."""
        return sum(not f.done() for f in self._line)

    def park(self, first: bool = False) -> asyncio.Future[None]:
        """A place in line (at its front with ``first``): done when it is this one's turn."""
        fut = asyncio.get_running_loop().create_future()
        if first:
            self._line.appendleft(fut)
        else:
            self._line.append(fut)
        return fut

    def first_is(self, fut: asyncio.Future[None]) -> bool:
        """Whether ``fut`` is first in line."""
        line = self._line
        while line and line[0].done():
            line.popleft()
        return bool(line) and line[0] is fut

    def wake(self) -> None:
        while self._line:
            fut = self._line.popleft()
            if not fut.done():  # a stream that left cancelled its place
                fut.set_result(None)
                self.woken += 1
                return


@dataclass
class AgentSession:
    """One connected agent stream. ``ack``, ``post`` and ``fail`` are thread-safe."""

    agent_id: str
    node_name: str
    epoch: int
    local_address: str
    #: Messages for the agent not yet written to the stream (appended from any thread).
    outbox: collections.deque[agent_pb2.ControllerMessage] = field(default_factory=collections.deque)
    last_heard: float = field(default_factory=time.monotonic)
    connected: bool = True
    failed: bool = False
    #: Set when the stream must end: the agent went away, or ``fail`` was called.
    done: threading.Event = field(default_factory=threading.Event)
    status: tuple[grpc.StatusCode, str] | None = None
    #: The loop serving this stream (None: not served, e.g. a session built by a test).
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    #: Called on the loop after messages were posted (the servicer's "the writer acked").
    on_wake: Callable[[], None] | None = field(default=None, repr=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _wake_pending: bool = field(default=False, repr=False)

    def ack(self, msg: agent_pb2.ControllerMessage) -> None:
        """Queue an ack for the stream (the writer thread calls this after a commit)."""
        self.post(msg)

    def post(self, msg: agent_pb2.ControllerMessage) -> None:
        """Queue ``msg`` for the agent, from any thread."""
        self.outbox.append(msg)
        self._notify()

    def fail(self, reason: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        """End this stream with ``code`` (the agent reconnects and resends what is unacked)."""
        if not self.failed:
            self.failed = True
            self.status = (code, reason)
            log.warning("agent %s: closing its stream (%s): %s", self.agent_id, code.name, reason)
        self.done.set()
        self._notify()

    def _notify(self) -> None:
        # one wake-up per loop turn however many acks a commit produced
        if self.loop is None or self._wake_pending:
            return
        self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._woken)
        except RuntimeError:  # the loop is closed: the stream is gone, nobody reads this
            self._wake_pending = False

    def _woken(self) -> None:
        self._wake_pending = False
        self._wake.set()
        if self.on_wake is not None:
            self.on_wake()

    async def wait_for_work(self) -> None:
        """On the loop: return once the outbox has a message or the stream is done."""
        while not self.outbox and not self.done.is_set():
            self._wake.clear()
            if self.outbox or self.done.is_set():
                return
            await self._wake.wait()


def _next_message(outbox: collections.deque[agent_pb2.ControllerMessage]) -> agent_pb2.ControllerMessage:
    """Pop the next message to write; a run of plain acks becomes its last one (an ack
    covers every batch up to its seq), so a busy stream writes one ack per wakeup, not one
    per batch. A rejection is never merged away."""
    msg = outbox.popleft()
    if not _plain_ack(msg):
        return msg
    while outbox and _plain_ack(outbox[0]) and outbox[0].ack.epoch == msg.ack.epoch:
        nxt = outbox.popleft()
        if nxt.ack.seq >= msg.ack.seq:
            msg = nxt
    return msg


def _plain_ack(msg: agent_pb2.ControllerMessage) -> bool:
    return msg.WhichOneof("msg") == "ack" and not msg.ack.rejected


class AgentRegistry:
    """Live agent sessions by node name (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._sessions: dict[str, AgentSession] = {}

    def attach(self, session: AgentSession) -> None:
        with self._lock:
            old = self._sessions.get(session.node_name)
            if old is not None:
                old.connected = False
            self._sessions[session.node_name] = session
            self._lock.notify_all()

    def detach(self, session: AgentSession) -> None:
        with self._lock:
            session.connected = False
            self._lock.notify_all()

    def connected_nodes(self) -> set[str]:
        with self._lock:
            return {n for n, s in self._sessions.items() if s.connected}

    def session(self, node_name: str) -> AgentSession | None:
        with self._lock:
            return self._sessions.get(node_name)

    def wait_for(self, nodes: set[str], timeout_s: float) -> set[str]:
        """Wait until every node in ``nodes`` has a connected agent; return the missing ones."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                missing = nodes - {n for n, s in self._sessions.items() if s.connected}
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self._lock.wait(min(left, 0.5))

    def send(self, node_name: str, command: events_pb2.Command) -> None:
        """Hand ``command`` to the node's stream (any thread; returns at once)."""
        session = self.session(node_name)
        if session is None or not session.connected:
            raise UnavailableError(f"node {node_name} has no connected agent")
        session.post(agent_pb2.ControllerMessage(command=command))

    def silent_for(self, now: float) -> dict[str, float]:
        """Seconds since each connected agent was last heard from (monotonic clock)."""
        with self._lock:
            return {n: now - s.last_heard for n, s in self._sessions.items() if s.connected}


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    """Accepts agent streams, queues their batches for the writer, relays commands.

    ``Connect`` is a coroutine: serve it on a ``grpc.aio`` server (``ControllerServer``).
    Owns the ``IngestWriter`` and two small thread pools; ``close()`` commits what is
    queued and stops them. ``observer`` (optional) is shown every batch that passed
    validation, before the writer gets it, on the loop thread; ``on_node_check``
    (optional) every node check result in one, in the store pool."""

    def __init__(self, store: Store, registry: AgentRegistry, token: str, controller_id: str,
                 metrics: ControllerMetrics | None = None, observer: BatchObserver | None = None,
                 on_node_check: NodeCheckSink | None = None) -> None:
        self._store = store
        self._registry = registry
        self._token = token
        self._controller_id = controller_id
        self.metrics = metrics or ControllerMetrics()
        self.writer = IngestWriter(store, self.metrics)
        self._observer = observer
        self._observer_failed = False
        self._on_node_check = on_node_check
        # threads start on first use: a servicer that never serves starts none
        self._prepare_pool = futures.ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="fleet-ctl-prepare")
        self._store_pool = futures.ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="fleet-ctl-store")
        self._parked = ParkedStreams()   # loop only: streams waiting for room in the writer
        # Hellos waiting for the next round of store work, and whether a round is going (loop only)
        self._hellos: list[tuple[agent_pb2.Hello, AgentSession, asyncio.Future[int]]] = []
        self._hello_rounds = False

    def close(self) -> None:
        """Commit what is queued, stop the writer, the pools and the metrics endpoint."""
        self.writer.close()
        self._prepare_pool.shutdown(wait=True, cancel_futures=True)
        self._store_pool.shutdown(wait=True, cancel_futures=True)
        self.metrics.close()

    async def _in(self, pool: futures.Executor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _refuse(self, context: grpc.aio.ServicerContext, reason: str, code: grpc.StatusCode,
                      detail: str) -> None:
        self.metrics.errors.labels(reason).inc()
        await context.abort(code, detail)

    async def Connect(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        metadata = dict(context.invocation_metadata() or ())
        if not tokens_equal(metadata.get(TOKEN_METADATA_KEY), self._token):
            await self._refuse(context, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED,
                               f"missing or wrong {TOKEN_METADATA_KEY}")
        messages = request_iterator.__aiter__()
        try:
            first = await messages.__anext__()
        except StopAsyncIteration:
            return
        if first is MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message is not an AgentMessage")
        if first is OVERSIZED:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the first message is over the size limit")
        if first.WhichOneof("msg") != "hello" or not first.hello.node_name:
            await self._refuse(context, "protocol", grpc.StatusCode.INVALID_ARGUMENT,
                               "the first message must be a Hello with node_name")
        hello = first.hello
        if not tokens_equal(hello.token, self._token):
            await self._refuse(context, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED,
                               "wrong token in Hello")

        loop = asyncio.get_running_loop()
        session = AgentSession(
            agent_id=hello.agent_id or f"agent-{hello.node_name}",
            node_name=hello.node_name,
            epoch=hello.epoch,
            local_address=hello.local_address,
            loop=loop,
            on_wake=self._parked.wake,   # an ack: the first parked stream's turn
        )
        try:
            committed = await self._committed(hello, session)
        except UnavailableError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the controller's store is unavailable: {exc}")
        self._registry.attach(session)
        self.metrics.agents.inc()
        log.info("agent %s connected (epoch %d, committed seq %d)", session.agent_id, session.epoch, committed)
        reader: asyncio.Task[None] | None = None
        try:
            await context.write(agent_pb2.ControllerMessage(
                welcome=agent_pb2.Welcome(controller_id=self._controller_id, committed_seq=committed)))
            reader = loop.create_task(self._receive(messages, session), name=f"fleet-agent-rx-{session.node_name}")
            while True:
                await session.wait_for_work()
                # drain first: acks produced just before the stream ended still go out
                while session.outbox:
                    await context.write(_next_message(session.outbox))
                if session.done.is_set():
                    break
            if session.status is not None:
                await context.abort(*session.status)
        finally:
            session.done.set()
            if reader is not None and not reader.done():
                reader.cancel()
            self._registry.detach(session)
            self.metrics.agents.dec()
            log.info("agent %s disconnected", session.agent_id)

    async def _committed(self, hello: agent_pb2.Hello, session: AgentSession) -> int:
        """The highest seq committed for the session's (agent, epoch), its node's row stored
        first. Hellos that arrive while a round of this store work runs wait for the next
        round, which serves all of them (``HELLO_ROUND_MAX`` at a time)."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._hellos.append((hello, session, done))
        if not self._hello_rounds:
            self._hello_rounds = True
            asyncio.get_running_loop().create_task(self._serve_hellos(), name="fleet-agent-hellos")
        return await done

    async def _serve_hellos(self) -> None:
        try:
            while self._hellos:
                round_, self._hellos = self._hellos[:HELLO_ROUND_MAX], self._hellos[HELLO_ROUND_MAX:]
                try:
                    seqs = await self._in(self._store_pool, self._hello_rows, [(h, s) for h, s, _ in round_])
                except Exception as exc:  # noqa: BLE001 - each Hello's stream is told
                    for _, _, done in round_:
                        if not done.done():
                            done.set_exception(exc)
                    continue
                for _, session, done in round_:
                    if not done.done():
                        done.set_result(seqs[(session.agent_id, session.epoch)])
        finally:
            self._hello_rounds = False

    def _hello_rows(self, hellos: list[tuple[agent_pb2.Hello, AgentSession]]) -> dict[tuple[str, int], int]:
        """In the store pool: the Hellos' node rows, and the highest seq committed for each
        (agent, epoch)."""
        self._store.upsert_nodes([(h.node_name, h.ray_node_id, h.hostname) for h, _ in hellos])
        return self._store.committed_seqs([(s.agent_id, s.epoch) for _, s in hellos])

    async def _receive(self, messages: AsyncIterator[Any], session: AgentSession) -> None:
        try:
            async for msg in messages:
                session.last_heard = time.monotonic()
                if msg is MALFORMED:
                    session.fail("a message is not an AgentMessage", grpc.StatusCode.INVALID_ARGUMENT)
                    return
                if msg is OVERSIZED:
                    session.fail("a message is over the size limit", grpc.StatusCode.RESOURCE_EXHAUSTED)
                    return
                kind = msg.WhichOneof("msg")
                if kind == "batch":
                    if not await self._queue_batch(session, msg.batch):
                        return
                elif kind == "heartbeat":
                    h = msg.heartbeat.host
                    self.writer.put_health(HealthRecord(   # never blocks
                        session.node_name, msg.heartbeat.time_ns, h.cpu_percent, h.load1,
                        h.mem_used_bytes, h.mem_total_bytes, h.workers_alive))
                elif kind == "drop":
                    await self._in(self._store_pool, self._record_agent_drop, session, msg.drop)
                else:
                    self.metrics.errors.labels("protocol").inc()
                    session.fail(f"unexpected {kind or 'empty'} message after the Hello",
                                 grpc.StatusCode.INVALID_ARGUMENT)
                    return
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, grpc.aio.BaseError):
            pass  # the agent went away; it resends unacked batches on reconnect
        except Exception:
            log.exception("agent %s: receiving failed; closing its stream", session.agent_id)
            session.fail("the controller failed to read the stream")
        finally:
            session.done.set()
            session._notify()

    async def _queue_batch(self, session: AgentSession, batch: agent_pb2.EventBatch) -> bool:
        # a batch of an earlier epoch is a predecessor's, resent from its write-ahead log:
        # committed at most once like any other (its key is its own), acked under its epoch
        if batch.agent_id != session.agent_id or not 0 < batch.epoch <= session.epoch:
            self.metrics.errors.labels("protocol").inc()
            session.fail(f"batch for {batch.agent_id}/{batch.epoch} on the stream of "
                         f"{session.agent_id}/{session.epoch}", grpc.StatusCode.INVALID_ARGUMENT)
            return False
        events = count_events(batch.events)
        try:
            if events <= INLINE_PREPARE_EVENTS:
                rows, rejected = prepare(batch.events, events), ""
            else:
                rows, rejected = await self._in(self._prepare_pool, prepare, batch.events, events), ""
        except InvalidBatch as exc:
            rows, rejected = None, str(exc)
        if rows is not None and self._observer is not None:
            self._observe(session, rows)
        item = Item(session, batch.epoch, batch.seq, rows, events, rejected)
        if not self.writer.put(item, timeout_s=0) and not await self._park(session, item):
            return False
        if rows is not None and rows.sdc and self._on_node_check is not None:
            await self._in(self._store_pool, self._node_checks, session, batch.events)
        return True

    async def _park(self, session: AgentSession, item: Item) -> bool:
        """Wait in line until the writer takes ``item``; False if the stream ended first.
        A parked stream reads nothing more; the agent is not silent, the controller is
        slow, so it still counts as heard from."""
        turn = self._parked.park()
        try:
            while True:
                session.last_heard = time.monotonic()
                # the first in line tries again now and then (a store outage acks nothing);
                # the rest only wake to be counted as heard from
                first = self._parked.first_is(turn)
                done, _ = await asyncio.wait((turn,), timeout=FULL_QUEUE_RETRY_S if first else PARKED_HEARD_S)
                if session.done.is_set():
                    return False
                if not done and not first:
                    continue
                if self.writer.put(item, timeout_s=0):
                    turn.cancel()  # out of line (when it timed out, it is still in it) ...
                    self._parked.wake()  # ... and there may be room for the next one too
                    return True
                if done:
                    turn = self._parked.park(first=True)
        finally:
            turn.cancel()

    def _node_checks(self, session: AgentSession, events: Iterable[events_pb2.Event]) -> None:
        for event in events:
            if event.WhichOneof("kind") != "sdc" or event.sdc.kind != "gemm":
                continue
            try:
                self._on_node_check(session.node_name, event.sdc)  # type: ignore[misc]
            except Exception:
                log.exception("agent %s: handling a node check failed (ingest goes on)", session.agent_id)

    def _observe(self, session: AgentSession, rows: PreparedBatch) -> None:
        try:
            self._observer(session.node_name, rows)  # type: ignore[misc]
        except Exception:
            # the first failure with its traceback; a broken observer must not flood the log
            if not self._observer_failed:
                self._observer_failed = True
                log.exception("agent %s: the batch observer failed (ingest goes on)", session.agent_id)
            else:
                log.debug("agent %s: the batch observer failed again", session.agent_id, exc_info=True)

    def _record_agent_drop(self, session: AgentSession, drop: agent_pb2.DropReport) -> None:
        self.metrics.dropped.labels("agent").inc(drop.events)
        log.error("agent %s lost %d events (batches %d-%d): %s", session.agent_id, drop.events,
                  drop.first_seq, drop.last_seq, drop.reason)
        self._store.record_drop(session.agent_id, session.node_name, drop.epoch, drop.first_seq,
                                drop.last_seq, drop.events, drop.reason, "agent")
