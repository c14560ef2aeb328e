"""The bytes a real Uplink writes are what the generated classes and the contract say.

A real gRPC server on 127.0.0.1 registers Connect at the contract's method path without
a deserializer, so it sees the uplink's hand-framed messages byte for byte; each one must
start with the descriptor-derived key and parse with the generated ``AgentMessage``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from fleet.agent.uplink import Uplink
from fleet.proto import agent_pb2, contract, events_pb2

pytestmark = pytest.mark.timeout(60)

TOKEN = "framing-token"


class RawConnect:
    """Connect with no deserializer: keeps every message's raw bytes, acks every batch."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.raw: list[bytes] = []
        self.tokens: list[str | None] = []

    def __call__(self, request_iterator, context):  # noqa: ANN001
        self.tokens.append(dict(context.invocation_metadata()).get(contract.TOKEN_METADATA_KEY))
        for data in request_iterator:
            with self.cond:
                self.raw.append(data)
                self.cond.notify_all()
            msg = agent_pb2.AgentMessage.FromString(data)
            if msg.WhichOneof("msg") == "hello":
                yield agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(controller_id="raw"))
            elif msg.WhichOneof("msg") == "batch":
                yield agent_pb2.ControllerMessage(ack=agent_pb2.Ack(epoch=msg.batch.epoch, seq=msg.batch.seq))


@contextlib.contextmanager
def _raw_server() -> Iterator[tuple[RawConnect, int]]:
    """A gRPC server on 127.0.0.1 whose Connect is a ``RawConnect``: (it, the port)."""
    handler = RawConnect()
    method = grpc.stream_stream_rpc_method_handler(
        handler, request_deserializer=None, response_serializer=agent_pb2.ControllerMessage.SerializeToString)
    executor = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="fleet-test-raw-connect")
    server = grpc.server(executor)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        contract.AGENT_SERVICE, {contract.CONNECT_METHOD: method}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield handler, port
    finally:
        server.stop(0).wait(5)
        executor.shutdown(wait=True)


def test_uplink_frames_batches_with_the_contract_tags() -> None:
    with _raw_server() as (handler, port):
        _frame_batches(handler, port)


def _frame_batches(handler: RawConnect, port: int) -> None:
    events = [events_pb2.Event(step=events_pb2.StepEvent(job_id="j", attempt=1, rank=0, step=s, loss=1.0 / s))
              for s in range(1, 301)]
    hello = agent_pb2.Hello(agent_id="agent-n0", node_name="n0", token=TOKEN, epoch=11)
    up = Uplink(controller_address=f"127.0.0.1:{port}", token=TOKEN, hello=hello, on_command=lambda c: None,
                heartbeat=lambda: agent_pb2.Heartbeat(agent_id="agent-n0", time_ns=time.time_ns()),
                reconnect_max_s=0.2)
    try:
        up.start()
        for first in range(0, len(events), 100):   # several batches, each cut by a flush
            up.submit(events[first:first + 100])
            assert up.flush(20), up.stats()
    finally:
        up.close()
    assert handler.tokens and set(handler.tokens) == {TOKEN}
    batches = [data for data in handler.raw
               if agent_pb2.AgentMessage.FromString(data).WhichOneof("msg") == "batch"]
    assert len(batches) == 3
    received = []
    for data in batches:
        assert data.startswith(contract.AGENT_MESSAGE_BATCH_TAG)
        batch = agent_pb2.AgentMessage.FromString(data).batch
        assert (batch.agent_id, batch.epoch) == ("agent-n0", 11)
        # the events field of the batch, as sent, is the concatenation the contract's tag
        # frames, followed by the (unnamed, one submit each) write-ahead log mark
        body = data[len(contract.AGENT_MESSAGE_BATCH_TAG):]
        header = agent_pb2.EventBatch(agent_id="agent-n0", epoch=11, seq=batch.seq).SerializeToString()
        assert body.endswith(header + b"".join(
            contract.EVENT_BATCH_EVENTS_TAG + contract.encode_varint(e.ByteSize()) + e.SerializeToString()
            for e in batch.events) + contract.EVENT_BATCH_MARKS_TAG + b"\x00")
        assert list(batch.marks) == [agent_pb2.ReportMark()]
        received += batch.events
    assert received == events


def _heartbeats_while_busy(collective_fronts: bool) -> tuple[int, int]:
    """(heartbeats while a report arrives every 20 ms for 1.2 s, heartbeats in the 0.6 s
    after the reports stop), heartbeat interval 0.1 s, batches every 0.05 s."""
    with _raw_server() as (handler, port):
        return _count_heartbeats(handler, port, collective_fronts)


def _count_heartbeats(handler: RawConnect, port: int, collective_fronts: bool) -> tuple[int, int]:
    from fleet.agent.settings import AgentSettings

    settings = AgentSettings(batch_interval_s=0.05, heartbeat_interval_s=0.1, collective_fronts=collective_fronts)
    up = Uplink(controller_address=f"127.0.0.1:{port}", token=TOKEN,
                hello=agent_pb2.Hello(agent_id="agent-n0", node_name="n0", token=TOKEN, epoch=1),
                on_command=lambda c: None, settings=settings,
                heartbeat=lambda: agent_pb2.Heartbeat(agent_id="agent-n0", time_ns=time.time_ns()),
                reconnect_max_s=0.2)

    def heartbeats() -> int:
        with handler.cond:
            return sum(agent_pb2.AgentMessage.FromString(d).WhichOneof("msg") == "heartbeat" for d in handler.raw)

    try:
        up.start()
        with handler.cond:   # the first heartbeat goes out with the stream: count from there
            assert handler.cond.wait_for(lambda: len(handler.raw) >= 2, 10)
        before = heartbeats()
        end = time.monotonic() + 1.2
        step = 0
        while time.monotonic() < end:
            step += 1
            up.submit([events_pb2.Event(step=events_pb2.StepEvent(job_id="j", attempt=1, rank=0, step=step))])
            time.sleep(0.02)
        busy = heartbeats() - before
        before = heartbeats()
        time.sleep(0.6)
        quiet = heartbeats() - before
    finally:
        up.close()
    return busy, quiet


def test_a_large_jobs_agent_sends_heartbeats_only_when_its_stream_falls_quiet() -> None:
    busy, quiet = _heartbeats_while_busy(collective_fronts=True)
    # batches every 0.05 s say "alive": no heartbeat while they flow (health is due only
    # every QUIET_HEALTH_INTERVAL_S, 10 s); once they stop, heartbeats resume
    assert busy <= 1, busy
    assert quiet >= 2, quiet
    # a small job's agent keeps its heartbeat every interval, busy or not
    busy_small, _ = _heartbeats_while_busy(collective_fronts=False)
    assert busy_small >= 6, busy_small
