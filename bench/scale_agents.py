"""Synthetic node agents for ``bench/scale.py``: one OS process driving many agent streams
on one asyncio loop, each a real ``AgentService.Connect`` call over ``grpc.aio``.

    python -m bench.scale_agents --address HOST:PORT --token T --ranks R --first N0 --count N
                                 [--per-step 100] [--step-s 1.0] [--batch-interval-s 0.5]

Each stream is one node of 8 ranks (``bench.scale_schedule``): a Hello (agent_id, node name,
epoch, token, as ``agent.uplink`` sends it, the token also as metadata), then every
``--batch-interval-s`` one ``EventBatch`` (consecutive seq per (agent, epoch)) holding the
node's ProcessGroupInfo events (once per attempt), the StepEvents of the steps its ranks
finished, and one ``Event(fronts=CollectiveFronts)`` with a row per (rank, group) whose
front moved; a heartbeat when a stream fell quiet and every ``QUIET_HEALTH_INTERVAL_S``
(a large job's agents' policy). A ``TracePull`` is answered at once with the raw
entries (``CollectiveColumns``) of the newest ``last`` sequence numbers of each asked
(rank, group), consistent with the fronts sent. ``--streams-per-connection N`` streams share
one channel (TCP connection); 1 gives each its own, as each real agent has. Sharing costs the
simulated agents less CPU (0.43 against 0.54 CPU s/s at 16,384 ranks), but streams parked by
the controller may then hold back the others of their connection (HTTP/2 flow control is per
connection too).

Delivery: batches stay until acked; after a reconnect (``fleet.agent.backoff``'s jittered
delays, the real agents' policy) those above the Welcome's committed_seq are sent again in order, so
the controller stores each exactly once. All nodes' fronts come from one vectorised
computation per tick (every rank follows the same schedule; only a fault's culprit
differs).

Control on stdin, one JSON object a line; replies on stdout, one JSON object a line:
  {"cmd": "attempt", "job": J, "attempt": A, "t0_ns": T}   start emitting attempt A from T
  {"cmd": "fault", "kind": "hang"|"desync", "rank": r, "op_index": N}
  {"cmd": "freeze"}       stop making batches (heartbeats go on): for exact counts
  {"cmd": "stats"}        -> counters (see ``Agents.stats``)
  {"cmd": "reset"}        restart the ack-gap, ack-latency and welcome-time measurements
  {"cmd": "quit"}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter, deque

import grpc
import numpy as np

from bench.scale_schedule import (
    DESYNC_OP, DTYPES, KINDS, RANKS_PER_NODE, Fault, Layout, Schedule, agent_id, node_name, steps_done,
)
from fleet.agent import backoff
from fleet.agent.uplink import QUIET_HEALTH_INTERVAL_S
from fleet.proto import agent_pb2, events_pb2
from fleet.proto.columns import pack as pack_columns
from fleet.proto.contract import (
    AGENT_MESSAGE_BATCH_TAG, CONNECT_METHOD_PATH, EVENT_BATCH_EVENTS_TAG, TOKEN_METADATA_KEY, encode_varint,
    length_delimited_tag,
)
from fleet.proto.fronts import PACKED_COLUMNS, signature

#: Default streams per channel (TCP connection): sharing is cheaper for the simulated agents.
STREAMS_PER_CONNECTION = 16
HEARTBEAT_INTERVAL_S = 1.0
RECONNECT_MAX_S = 2.0
DEFAULT_PULL_LAST = 64
OP_NAMES = ["all_gather", "reduce_scatter", "broadcast", "all_reduce", DESYNC_OP[0]]
_RNG = random.Random()  # seeded from the OS: processes do not draw alike
_DESYNC_SIG = signature(DESYNC_OP[0], DESYNC_OP[1], DTYPES, DESYNC_OP[1], DTYPES)


def reconnect_delay(attempt: int) -> float:
    """Seconds before reconnect number ``attempt`` (1-based): the agents' own policy,
    ``fleet.agent.backoff`` (full jitter, capped exponential), with this process's draws."""
    return backoff.delay(attempt - 1, _RNG.random(), max_s=RECONNECT_MAX_S)


class _Kinds:
    """Per kind of group, what a rank whose counts are (entered, completed) shows."""

    def __init__(self, schedule: Schedule, t0_ns: int, entered: int, completed: int,
                 desync: Fault | None, culprit: bool) -> None:
        s = schedule
        n = len(KINDS)
        self.e = np.array([s.seqs(np.int64(entered), k) for k in range(n)], dtype=np.int64)
        self.c = np.array([s.seqs(np.int64(completed), k) for k in range(n)], dtype=np.int64)
        self.entered_ns = np.zeros(n, dtype=np.int64)
        self.completed_ns = np.zeros(n, dtype=np.int64)
        self.op = np.zeros(n, dtype=np.int64)
        self.sig = np.zeros(n, dtype=np.int64)
        self.step = np.zeros(n, dtype=np.int64)
        for k in range(n):
            index, p = s.seq_op(self.e[k:k + 1], k)
            i, p = int(index[0]), int(p[0])
            if i >= 0:
                op, _sizes, sig = s.ops[k][p]
                if culprit and desync is not None and i == desync.op_index:
                    op, sig = DESYNC_OP[0], _DESYNC_SIG
                self.entered_ns[k] = s.op_enter_ns(t0_ns, i)
                self.op[k] = 1 + OP_NAMES.index(op)
                self.sig[k] = sig
                self.step[k] = i // s.per_step + 1
            ci, _ = s.seq_op(self.c[k:k + 1], k)
            if int(ci[0]) >= 0:
                self.completed_ns[k] = s.op_enter_ns(t0_ns, int(ci[0])) + s.dt_ns // 2


def _length_delimited(tag: bytes, data: bytes) -> bytes:
    return tag + encode_varint(len(data)) + data


_FRONTS_TAG = length_delimited_tag(events_pb2.Event.DESCRIPTOR.fields_by_name["fronts"])


def _fronts_event(block: bytes) -> bytes:
    """An encoded ``Event(fronts=block)`` as an element of EventBatch.events."""
    return _length_delimited(EVENT_BATCH_EVENTS_TAG, _length_delimited(_FRONTS_TAG, block))


_STRINGS_TAG = length_delimited_tag(events_pb2.CollectiveFronts.DESCRIPTOR.fields_by_name["strings"])
_PACKED_TAG = length_delimited_tag(events_pb2.CollectiveFronts.DESCRIPTOR.fields_by_name["packed"])
# Node._static keeps PACKED_COLUMNS[:4] (job_id, rank, group, group_size: fixed per (rank,
# group)); the rest are a tick's values, in this order:
assert PACKED_COLUMNS[4:] == ("attempt", "entered_seq", "completed_seq", "entered_ns", "completed_ns", "op",
                              "signature", "step", "entered")


def _packed_values(*columns: np.ndarray) -> bytes:
    """The value columns of ``CollectiveFronts.packed`` (``PACKED_COLUMNS[4:]``, in order)."""
    return np.concatenate(columns).astype("<i8").tobytes()


def _fronts_block(strings: bytes, static: bytes, values: bytes) -> bytes:
    """An encoded ``CollectiveFronts``: its encoded ``strings`` fields, then ``packed``."""
    return strings + _length_delimited(_PACKED_TAG, static + values)


class _Template:
    """One tick's fronts of a node whose ranks all follow the schedule (every node but a
    fault's culprit's): computed once per tick, shared by all such nodes. ``last_e`` is the
    array those nodes sent last (identity marks a node as in step); ``values`` the encoded
    value columns of the rows that changed (None: none did), ``idx`` those rows."""

    def __init__(self, agents: Agents, view: _Kinds, last_e: np.ndarray, last_c: np.ndarray) -> None:
        self.last_e = last_e
        self.e = np.tile(view.e, (RANKS_PER_NODE, 1))
        self.c = np.tile(view.c, (RANKS_PER_NODE, 1))
        changed = ((self.e != last_e) | (self.c != last_c)).ravel()
        self.idx = np.flatnonzero(changed)
        self.values = None
        if len(self.idx):
            idx, n = self.idx, len(self.idx)

            def col(a: np.ndarray) -> np.ndarray:
                return np.tile(a, RANKS_PER_NODE)[idx]

            self.values = _packed_values(
                np.full(n, agents.attempt), self.e.ravel()[idx], self.c.ravel()[idx], col(view.entered_ns),
                col(view.completed_ns), col(view.op), col(view.sig), col(view.step), (self.e - last_e).ravel()[idx])


class Node:
    """One simulated node and its agent stream."""

    def __init__(self, agents: Agents, node: int) -> None:
        self.agents = agents
        self.node = node
        self.name = node_name(node)
        self.agent_id = agent_id(node)
        self.epoch = agents.epoch + node
        layout = agents.layout
        self.ranks = list(range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE))
        self.groups = [layout.groups(r) for r in self.ranks]       # [rank][kind] = (name, members)
        names: dict[str, int] = {}
        for gs in self.groups:
            for g, _ in gs:
                names.setdefault(g, len(names))
        self.group_names = list(names)
        base = 1 + len(OP_NAMES)  # strings: job, ops, groups
        self.row_rank = np.repeat(np.asarray(self.ranks, dtype=np.int64), len(KINDS))
        self.row_group = np.asarray([base + names[g] for gs in self.groups for g, _ in gs], dtype=np.int64)
        self.row_size = np.asarray([len(m) for gs in self.groups for _, m in gs], dtype=np.int64)
        self.last_e = np.zeros((RANKS_PER_NODE, len(KINDS)), dtype=np.int64)
        self.last_c = np.zeros_like(self.last_e)
        self.steps_sent = 0
        self.groups_sent = False
        self._static_cache: dict[bytes, bytes] = {}
        # the stream
        self.unacked: deque[tuple[int, bytes]] = deque()
        self.next_seq = 1
        self.sent = 0
        self.wake = asyncio.Event()
        self.broken = False
        self.heartbeat_due = False
        self.last_write = 0.0                  # monotonic time of the last batch written
        self.last_heartbeat = 0.0
        self.connected = False
        self.stage = "new"                     # "hello" (awaiting the Welcome), "up", "backoff"
        self.stage_since = 0.0                 # monotonic, when the stage began
        self.errors = 0                        # unexpected exceptions of the stream (a bench bug)
        self.last_error = ""
        self.welcomes = 0
        self.welcomed_at = 0.0                 # time.time() of the newest Welcome
        self.acks = 0
        self.rejected = 0
        self.last_ack = 0.0
        self.max_ack_gap = 0.0
        self.written: deque[tuple[int, float]] = deque()  # (seq, monotonic time written), unacked
        self.max_ack_latency = 0.0             # longest from writing a batch to its ack
        self.reconnects = 0
        self.pulls = 0
        self.pulls_asked = 0
        self.steps_total = 0
        self.hello = agent_pb2.AgentMessage(hello=agent_pb2.Hello(
            agent_id=self.agent_id, node_name=self.name, hostname=self.name, pid=os.getpid(),
            token=agents.token, epoch=self.epoch)).SerializeToString()

    def reset_attempt(self, last_e: np.ndarray, last_c: np.ndarray) -> None:
        self.last_e, self.last_c = last_e, last_c
        self.steps_sent = 0
        self.groups_sent = False
        self._static_cache.clear()

    # -- batches ------------------------------------------------------------------------

    def add_batch(self, events: list[events_pb2.Event], extra: bytes = b"") -> None:
        """Queue a batch of ``events`` plus ``extra`` (already encoded Events, each under
        its EventBatch.events key)."""
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        batch = agent_pb2.EventBatch(agent_id=self.agent_id, epoch=self.epoch, seq=seq,
                                     events=events).SerializeToString() + extra
        self.unacked.append((seq, _length_delimited(AGENT_MESSAGE_BATCH_TAG, batch)))
        self.wake.set()

    def emit(self, now_ns: int, views: dict, template: _Template) -> None:
        """Queue this tick's batch, if there is anything to send."""
        events, fronts = self.tick(now_ns, views, template)
        if events or fronts:
            self.add_batch(events, fronts)

    def tick(self, now_ns: int, views: dict, template: _Template) -> tuple[list[events_pb2.Event], bytes]:
        """This node's events of the attempt as of ``now_ns``: (events, its encoded fronts
        event or b"")."""
        a = self.agents
        job, attempt = a.job, a.attempt
        events: list[events_pb2.Event] = []
        if not self.groups_sent:
            self.groups_sent = True
            for r, gs in zip(self.ranks, self.groups):
                for g, members in gs:
                    events.append(events_pb2.Event(group=events_pb2.ProcessGroupInfo(
                        job_id=job, attempt=attempt, rank=r, group=g, desc=g.rstrip("0123456789."),
                        ranks=members)))
        done = steps_done(a.schedule, a.t0_ns, now_ns, a.fault)
        if done > self.steps_sent:
            s = a.schedule
            for step in range(self.steps_sent + 1, done + 1):
                end_ns = a.t0_ns + step * s.step_ns
                loss = 10.0 / (1.0 + 0.01 * step)
                for r in self.ranks:
                    events.append(events_pb2.Event(step=events_pb2.StepEvent(
                        job_id=job, attempt=attempt, rank=r, step=step, loss=loss, step_time_s=s.step_s,
                        tokens_per_s=4096 / s.step_s, end_ns=end_ns)))
            self.steps_total += (done - self.steps_sent) * len(self.ranks)
            self.steps_sent = done
        culprit = a.fault.rank if a.fault is not None else -1
        if self.last_e is template.last_e and not self.ranks[0] <= culprit < self.ranks[0] + RANKS_PER_NODE:
            # in step with every other node: the tick's shared values, this node's own keys
            self.last_e, self.last_c = template.e, template.c
            if template.values is None:
                return events, b""
            return events, _fronts_event(_fronts_block(*self._static(template.idx), template.values))
        block = self._fronts(views)
        return events, b"" if block is None else _fronts_event(block)

    def _static(self, idx: np.ndarray) -> tuple[bytes, bytes]:
        """(the encoded strings fields, the packed job_id, rank, group and group_size
        columns) of rows ``idx``."""
        key = idx.tobytes()
        data = self._static_cache.get(key)
        if data is None:
            strings = b"".join(_length_delimited(_STRINGS_TAG, t.encode())
                               for t in [self.agents.job, *OP_NAMES, *self.group_names])
            static = np.concatenate([np.zeros(len(idx), dtype=np.int64), self.row_rank[idx], self.row_group[idx],
                                     self.row_size[idx]]).astype("<i8").tobytes()
            data = self._static_cache[key] = (strings, static)
        return data

    def _fronts(self, views: dict) -> bytes | None:
        """The general path (the fault's culprit's node): the encoded block of rows computed
        for this node."""
        base = views["all"]
        culprit = self.agents.fault.rank if self.agents.fault is not None else -1
        local = culprit - self.ranks[0]
        rows_of = [base] * RANKS_PER_NODE
        if 0 <= local < RANKS_PER_NODE:
            rows_of[local] = views["culprit"]
        e = np.stack([v.e for v in rows_of])
        c = np.stack([v.c for v in rows_of])
        changed = ((e != self.last_e) | (c != self.last_c)).ravel()
        if not changed.any():
            return None
        idx = np.flatnonzero(changed)
        entered = (e - self.last_e).ravel()[idx]
        self.last_e, self.last_c = e, c

        def col(name: str) -> np.ndarray:
            return np.stack([getattr(v, name) for v in rows_of]).ravel()[idx]

        values = _packed_values(np.full(len(idx), self.agents.attempt), e.ravel()[idx], c.ravel()[idx],
                                col("entered_ns"), col("completed_ns"), col("op"), col("sig"), col("step"), entered)
        return _fronts_block(*self._static(idx), values)

    def pull(self, cmd: events_pb2.Command) -> None:
        """Answer a TracePull with the newest raw entries of the asked (rank, group)s."""
        a = self.agents
        p = cmd.pull
        if p.job_id != a.job or p.attempt != a.attempt:
            return
        last = p.last or DEFAULT_PULL_LAST
        want = set(p.groups)
        s, t0 = a.schedule, a.t0_ns
        out = []
        for i, r in enumerate(self.ranks):
            if p.ranks and r not in p.ranks:
                continue
            for k, (g, members) in enumerate(self.groups[i]):
                if want and g not in want:
                    continue
                top, done = int(self.last_e[i, k]), int(self.last_c[i, k])
                seqs = np.arange(max(1, top - last + 1), top + 1, dtype=np.int64)
                index, pos = s.seq_op(seqs, k)
                for seq, gi, pi in zip(seqs.tolist(), index.tolist(), pos.tolist()):
                    op, sizes, _sig = s.ops[k][pi]
                    if a.fault is not None and a.fault.kind == "desync" and r == a.fault.rank \
                            and gi == a.fault.op_index:
                        op, sizes = DESYNC_OP
                    enter = s.op_enter_ns(t0, gi)
                    finished = seq <= done
                    shape = [events_pb2.Shape(dims=d) for d in json.loads(sizes)]
                    out.append(events_pb2.CollectiveEvent(
                        job_id=a.job, attempt=a.attempt, rank=r, group=g, group_size=len(members), seq=seq,
                        op=op, input_sizes=shape, input_dtypes=["bfloat16"], output_sizes=shape,
                        output_dtypes=["bfloat16"], enter_ns=enter,
                        exit_ns=enter + s.dt_ns // 2 if finished else 0,
                        state="completed" if finished else "started", step=gi // s.per_step + 1))
        if out:
            self.pulls += 1
            self.add_batch([events_pb2.Event(collectives=pack_columns(out))])

    # -- the stream ---------------------------------------------------------------------

    async def run(self) -> None:
        a = self.agents
        failures = 0
        while not a.stopping:
            call = a.connect_for(self.node)(metadata=((TOKEN_METADATA_KEY, a.token),))
            reader = None
            try:
                self.stage, self.stage_since = "hello", time.monotonic()
                await call.write(self.hello)
                first = await call.read()
                if first is grpc.aio.EOF or first.WhichOneof("msg") != "welcome":
                    raise ConnectionError("no Welcome")
                self._welcome(first.welcome.committed_seq)
                self.stage = "up"
                failures = 0
                self.broken = False
                reader = asyncio.ensure_future(self._read(call))
                await self._write(call)
            except (grpc.aio.AioRpcError, ConnectionError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass  # the call ended (a write after its end raises InvalidStateError): reconnect
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - a stream never dies: counted, shown in stats
                self.errors += 1
                self.last_error = repr(exc)
            finally:
                self.connected = False
                if reader is not None:
                    reader.cancel()
                call.cancel()
            if a.stopping:
                break
            failures += 1
            self.reconnects += 1
            self.stage = "backoff"
            await asyncio.sleep(reconnect_delay(failures))

    def _welcome(self, committed: int) -> None:
        self.written.clear()  # what is resent after a reconnect is timed from its new write
        while self.unacked and self.unacked[0][0] <= committed:
            self.unacked.popleft()
        self.sent = committed
        self.connected = True
        self.welcomes += 1
        self.welcomed_at = time.time()
        self.last_ack = time.monotonic()

    async def _read(self, call) -> None:  # noqa: ANN001 - grpc.aio.StreamStreamCall
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                kind = msg.WhichOneof("msg")
                if kind == "ack":
                    now = time.monotonic()
                    self.max_ack_gap = max(self.max_ack_gap, now - self.last_ack)
                    self.last_ack = now
                    self.acks += 1
                    if msg.ack.rejected:
                        self.rejected += 1
                    while self.unacked and self.unacked[0][0] <= msg.ack.seq:
                        self.unacked.popleft()
                    if self.written and self.written[0][0] <= msg.ack.seq:
                        self.max_ack_latency = max(self.max_ack_latency, now - self.written[0][1])
                    while self.written and self.written[0][0] <= msg.ack.seq:
                        self.written.popleft()
                elif kind == "command" and msg.command.WhichOneof("kind") == "pull":
                    self.pulls_asked += 1
                    if self.agents.answer_pulls:
                        self.pull(msg.command)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            pass
        finally:
            self.broken = True
            self.wake.set()

    async def _write(self, call) -> None:  # noqa: ANN001
        self.wake.set()
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.broken or self.agents.stopping:
                return
            for seq, data in list(self.unacked):
                if seq > self.sent:
                    await call.write(data)
                    self.sent = seq
                    self.last_write = time.monotonic()
                    self.written.append((seq, self.last_write))
            if self.heartbeat_due:
                self.heartbeat_due = False
                self.last_heartbeat = time.monotonic()
                await call.write(agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat(
                    agent_id=self.agent_id, time_ns=time.time_ns(),
                    host=agent_pb2.HostMetrics(workers_alive=RANKS_PER_NODE))).SerializeToString())


class Agents:
    """The streams of one process and their shared clock-driven state."""

    def __init__(self, address: str, token: str, layout: Layout, schedule: Schedule, first: int, count: int,
                 batch_interval_s: float, answer_pulls: bool = True,
                 streams_per_connection: int = STREAMS_PER_CONNECTION) -> None:
        self.address = address
        self.streams_per_connection = streams_per_connection
        self.token = token
        self.layout = layout
        self.schedule = schedule
        self.batch_interval_s = batch_interval_s
        self.answer_pulls = answer_pulls
        self.epoch = time.time_ns()
        self.stopping = False
        self.frozen = False
        self.job = ""
        self.attempt = 0
        self.t0_ns = 0
        self.fault: Fault | None = None
        self.channels: list[grpc.aio.Channel] = []
        self.connects: list = []
        self.nodes = [Node(self, n) for n in range(first, first + count)]
        self.tick_s: deque[float] = deque(maxlen=64)
        self._last_e = np.zeros((RANKS_PER_NODE, len(KINDS)), dtype=np.int64)
        self._last_c = np.zeros_like(self._last_e)

    def connect_for(self, node: int):  # noqa: ANN201
        return self.connects[node % len(self.connects)]

    async def run(self) -> None:
        n_channels = max(1, -(-len(self.nodes) // self.streams_per_connection))
        for i in range(n_channels):
            # a distinct argument per channel: each its own TCP connection
            # its own reconnect backoff short: the streams' jittered backoff is the policy measured
            ch = grpc.aio.insecure_channel(self.address, options=[("fleet.bench.channel", i),
                                                                  ("grpc.initial_reconnect_backoff_ms", 100),
                                                                  ("grpc.min_reconnect_backoff_ms", 100),
                                                                  ("grpc.max_reconnect_backoff_ms", 500),
                                                                  ("grpc.max_send_message_length", 64 << 20),
                                                                  ("grpc.max_receive_message_length", 64 << 20)])
            self.channels.append(ch)
            self.connects.append(ch.stream_stream(CONNECT_METHOD_PATH, request_serializer=None,
                                                  response_deserializer=agent_pb2.ControllerMessage.FromString))
        tasks = [asyncio.ensure_future(n.run()) for n in self.nodes]
        tasks.append(asyncio.ensure_future(self._ticks()))
        tasks.append(asyncio.ensure_future(self._heartbeats()))
        try:
            await self._control()
        finally:
            self.stopping = True
            for n in self.nodes:
                n.wake.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for ch in self.channels:
                await ch.close()

    async def _ticks(self) -> None:
        # fixed rate, as a real agent cuts a batch ``batch_interval_s`` after its first
        # pending event: sleeping the interval after each tick's work would stretch the
        # cadence by the tick's cost (a quarter second at 16,384 ranks) and show up as ack gaps
        due = time.monotonic()
        while True:
            due += self.batch_interval_s
            now = time.monotonic()
            if due < now:  # a tick ran over a whole interval: the next goes now, none are doubled
                due = now
            await asyncio.sleep(due - now)
            if not self.job or self.frozen:
                continue
            started = time.process_time()
            now_ns = time.time_ns()
            views, template = self.prepare(now_ns)
            for i, n in enumerate(self.nodes):
                n.emit(now_ns, views, template)
                if i % 64 == 63:
                    await asyncio.sleep(0)
            self.tick_s.append(time.process_time() - started)

    def prepare(self, now_ns: int) -> tuple[dict, _Template]:
        """One tick's shared values: per kind of group, what a rank following the schedule
        shows ("all") and what the fault's culprit shows ("culprit"), and the template of
        every node in step."""
        s, t0, f = self.schedule, self.t0_ns, self.fault
        g, gc = s.entered(t0, now_ns), s.completed(t0, now_ns)
        if f is None:
            views = {"all": _Kinds(s, t0, g, gc, None, False)}
            views["culprit"] = views["all"]
        else:
            ce, cc = f.caps(-1)
            he, hc = f.caps(f.rank)
            desync = f if f.kind == "desync" else None
            views = {"all": _Kinds(s, t0, min(g, ce), min(gc, cc), None, False),
                     "culprit": _Kinds(s, t0, min(g, he), min(gc, hc), desync, True)}
        template = _Template(self, views["all"], self._last_e, self._last_c)
        self._last_e, self._last_c = template.e, template.c
        return views, template

    def start_attempt(self, job: str, attempt: int, t0_ns: int) -> None:
        """Emit ``attempt`` of ``job`` from ``t0_ns`` on (the fault cleared)."""
        self.job, self.attempt, self.t0_ns, self.fault = job, attempt, t0_ns, None
        self.frozen = False
        self._last_e = np.zeros((RANKS_PER_NODE, len(KINDS)), dtype=np.int64)
        self._last_c = np.zeros_like(self._last_e)
        for n in self.nodes:
            n.reset_attempt(self._last_e, self._last_c)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            now = time.monotonic()
            for n in self.nodes:
                # as a large job's agent does (``fleet.agent.uplink``): a heartbeat when the
                # stream fell quiet, and for the host's health every QUIET_HEALTH_INTERVAL_S
                quiet = now - n.last_write >= HEARTBEAT_INTERVAL_S + self.batch_interval_s
                if n.connected and (quiet or now - n.last_heartbeat >= QUIET_HEALTH_INTERVAL_S):
                    n.heartbeat_due = True
                    n.wake.set()

    async def _control(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = await reader.readline()
            if not line:
                return
            cmd = json.loads(line)
            what = cmd["cmd"]
            if what == "attempt":
                self.start_attempt(cmd["job"], cmd["attempt"], cmd["t0_ns"])
            elif what == "fault":
                self.fault = Fault(cmd["kind"], cmd["rank"], cmd["op_index"])
            elif what == "freeze":
                self.frozen = True
            elif what == "reset":
                now = time.monotonic()
                for n in self.nodes:
                    n.max_ack_gap, n.last_ack, n.max_ack_latency = 0.0, now, 0.0
            elif what == "stats":
                _reply(self.stats())
            elif what == "quit":
                return

    def _stuck_in_hello(self, after_s: float = 10.0) -> dict:
        """Streams awaiting their Welcome for over ``after_s``: how many, the longest wait,
        and the states of their channels."""
        now = time.monotonic()
        stuck = [n for n in self.nodes if n.stage == "hello" and now - n.stage_since > after_s]
        states = Counter(str(self.channels[n.node % len(self.channels)].get_state()) for n in stuck)
        return {"streams": len(stuck), "longest_s": round(max((now - n.stage_since for n in stuck), default=0), 1),
                "channels": dict(states)}

    def stats(self) -> dict:
        """Counters of this process's streams."""
        nodes = self.nodes
        cpu = os.times()
        return {
            "streams": len(nodes), "connected": sum(n.connected for n in nodes),
            "stages": dict(Counter(n.stage for n in nodes)),
            "stuck_in_hello": self._stuck_in_hello(),
            "stream_errors": sum(n.errors for n in nodes),
            "last_stream_error": next((n.last_error for n in nodes if n.last_error), ""),
            "welcomed": sum(n.welcomes > 0 for n in nodes), "min_welcomes": min(n.welcomes for n in nodes),
            "newest_welcome": max(n.welcomed_at for n in nodes), "acks": sum(n.acks for n in nodes),
            "min_acks": min(n.acks for n in nodes), "rejected": sum(n.rejected for n in nodes),
            "max_ack_gap_s": max(n.max_ack_gap for n in nodes),
            "max_ack_latency_s": max(n.max_ack_latency for n in nodes), "unacked": sum(len(n.unacked) for n in nodes),
            "reconnects": sum(n.reconnects for n in nodes), "pulls": sum(n.pulls for n in nodes),
            "pulls_asked": sum(n.pulls_asked for n in nodes),
            "steps": sum(n.steps_total for n in nodes),
            "batches": {n.agent_id: n.next_seq - 1 for n in nodes},
            "epochs": {n.agent_id: n.epoch for n in nodes},
            "cpu_s": cpu.user + cpu.system, "tick_cpu_s": max(self.tick_s, default=0.0),
        }


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--first", type=int, required=True, help="first node of this process")
    parser.add_argument("--count", type=int, required=True, help="nodes (streams) of this process")
    parser.add_argument("--per-step", type=int, default=100)
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--batch-interval-s", type=float, default=0.5)
    parser.add_argument("--no-pull", action="store_true", help="ignore TracePulls (the fronts-only figure)")
    parser.add_argument("--streams-per-connection", type=int, default=STREAMS_PER_CONNECTION)
    args = parser.parse_args()
    try:
        layout, schedule = Layout(args.ranks), Schedule(args.per_step, args.step_s)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.streams_per_connection < 1:
        print("error: --streams-per-connection must be at least 1", file=sys.stderr)
        return 2
    agents = Agents(args.address, args.token, layout, schedule, args.first, args.count, args.batch_interval_s,
                    not args.no_pull, args.streams_per_connection)
    _reply({"ready": True, "pid": os.getpid()})
    asyncio.run(agents.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
