"""Worker -> agent -> controller -> store, over real gRPC servers and a real SQLite file."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.controlplane.agent_server import AgentRegistry
from fleet.controlplane.lifecycle import JobState
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.contract import TOKEN_METADATA_KEY
from fleet.proto.kinds import FaultKind
from tests.component.conftest import TOKEN, start_server

pytestmark = pytest.mark.timeout(120)


def _job(store) -> tuple[str, int]:  # noqa: ANN001
    job_id = store.create_job("stream-test", total_steps=10_000, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING)
    return job_id, store.create_attempt(job_id)


def _steps(job_id: str, attempt: int, rank: int, first: int, n: int) -> list[events_pb2.Event]:
    return [
        events_pb2.Event(step=events_pb2.StepEvent(
            job_id=job_id, attempt=attempt, rank=rank, step=s, loss=1.0 / s, step_time_s=0.01,
            tokens_per_s=100.0, end_ns=time.time_ns(),
        ))
        for s in range(first, first + n)
    ]


def _collectives(job_id: str, attempt: int, rank: int, n: int) -> list[events_pb2.Event]:
    out = []
    for seq in range(1, n + 1):
        for state in ("started", "completed"):
            c = events_pb2.CollectiveEvent(
                job_id=job_id, attempt=attempt, rank=rank, group="0", group_size=2, seq=seq,
                op="all_reduce", enter_ns=seq * 1000, exit_ns=seq * 1000 + 500 if state == "completed" else 0,
                state=state, step=seq,
            )
            c.input_sizes.add().dims.extend([128])
            c.input_dtypes.append("float32")
            out.append(events_pb2.Event(collective=c))
    return out


def _wait(cond, timeout_s: float = 10.0, what: str = "condition") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def agent(controller):  # noqa: ANN001
    a = NodeAgent(node_name="node-0", controller_address=controller.address, token=TOKEN,
                  settings=AgentSettings(batch_interval_s=0.05, heartbeat_interval_s=0.2))
    a.start(connect_timeout_s=10)
    try:
        yield a
    finally:
        a.close()


def _worker(agent: NodeAgent) -> tuple[grpc.Channel, agent_pb2_grpc.NodeAgentStub]:
    channel = grpc.insecure_channel(agent.local_address)
    return channel, agent_pb2_grpc.NodeAgentStub(channel)


def test_events_reach_the_store_exactly_once(controller, agent) -> None:  # noqa: ANN001
    job_id, attempt = _job(controller.store)
    channel, stub = _worker(agent)
    with channel:
        for rank in (0, 1):
            for first in range(1, 301, 100):
                stub.Report(agent_pb2.WorkerReport(
                    job_id=job_id, attempt=attempt, rank=rank,
                    events=_steps(job_id, attempt, rank, first, 100)), timeout=5)
            stub.Report(agent_pb2.WorkerReport(
                job_id=job_id, attempt=attempt, rank=rank,
                events=_collectives(job_id, attempt, rank, 50)), timeout=5)
    assert agent.flush(10)
    steps = controller.store.steps(job_id)
    assert len(steps) == 600
    assert sorted(s.step for s in steps if s.rank == 1) == list(range(1, 301))
    colls = controller.store.collectives(job_id, rank=0)
    assert [c.seq for c in colls] == list(range(1, 51))
    assert all(c.state == "completed" and c.exit_ns for c in colls)
    # heartbeats became health samples for the node
    _wait(lambda: controller.store.health_samples("node-0"), what="a health sample")
    assert controller.registry.connected_nodes() == {"node-0"}


def test_commands_reach_only_the_addressed_rank_of_the_current_attempt(controller, agent) -> None:  # noqa: ANN001
    job_id, attempt = _job(controller.store)
    channel, stub = _worker(agent)
    with channel:
        def report(rank: int, att: int = attempt) -> list[events_pb2.Command]:
            return list(stub.Report(agent_pb2.WorkerReport(job_id=job_id, attempt=att, rank=rank), timeout=5).commands)

        report(0), report(1)
        crash = events_pb2.FaultSpec(kind=FaultKind("crash").wire, at_step=7)
        controller.registry.send("node-0", events_pb2.Command(
            command_id="c-1", job_id=job_id, attempt=attempt, rank=1, fault=crash))
        got: list[events_pb2.Command] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = report(1)
        assert [(c.command_id, FaultKind.from_wire(c.fault.kind), c.fault.at_step) for c in got] == [("c-1", "crash", 7)]
        assert report(0) == []
        assert report(1) == []  # delivered once

        # a command for an old attempt is dropped, not delivered to the new attempt's rank
        controller.registry.send("node-0", events_pb2.Command(
            command_id="c-old", job_id=job_id, attempt=attempt, rank=0, fault=crash))
        _wait(lambda: agent._mailboxes._boxes.get((job_id, 0)), what="the command to arrive")
        assert report(0, att=attempt + 1) == []


def test_controller_restart_mid_stream_loses_and_duplicates_nothing(store) -> None:  # noqa: ANN001
    registry = AgentRegistry()
    server, _ = start_server(store, registry)
    port = int(server.address.rsplit(":", 1)[1])
    job_id, attempt = _job(store)
    a = NodeAgent(node_name="node-0", controller_address=server.address, token=TOKEN,
                  settings=AgentSettings(batch_interval_s=0.02, batch_max_events=50))
    a.start(connect_timeout_s=10)
    try:
        channel = grpc.insecure_channel(a.local_address)
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        sent = 0
        for round_ in range(6):
            stub.Report(agent_pb2.WorkerReport(
                job_id=job_id, attempt=attempt, rank=0,
                events=_steps(job_id, attempt, 0, sent + 1, 400)), timeout=10)
            sent += 400
            if round_ in (1, 3):
                server.close(grace_s=0)       # controller dies mid-stream ...
                registry = AgentRegistry()
                server, _ = start_server(store, registry, port=port)   # ... and comes back
                _wait(lambda: "node-0" in registry.connected_nodes(), what="the agent to reconnect")
        assert a.flush(30), f"backlog left: {a.stats()}"
        assert a.stats()["reconnects"] >= 2
        channel.close()
    finally:
        a.close()
        server.close()
    steps = [s.step for s in store.steps(job_id)]
    assert len(steps) == sent, "events lost or duplicated"
    assert sorted(steps) == list(range(1, sent + 1))


def test_unauthenticated_agents_are_refused(controller) -> None:  # noqa: ANN001
    with grpc.insecure_channel(controller.address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        hello = agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id="x", node_name="evil", token="nope"))
        for metadata in (((TOKEN_METADATA_KEY, "wrong"),), ()):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Connect(iter([hello]), metadata=metadata, timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # right metadata, wrong token inside the Hello
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Connect(iter([hello]), metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert controller.registry.connected_nodes() == set()
    assert all(n.name != "evil" for n in controller.store.list_nodes())


def test_agent_with_wrong_token_never_connects(controller) -> None:  # noqa: ANN001
    a = NodeAgent(node_name="node-9", controller_address=controller.address, token="wrong")
    with pytest.raises(TimeoutError):
        a.start(connect_timeout_s=1.0)
    assert "node-9" not in controller.registry.connected_nodes()


def test_first_message_must_be_hello(controller) -> None:  # noqa: ANN001
    with grpc.insecure_channel(controller.address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        batch = agent_pb2.AgentMessage(batch=agent_pb2.EventBatch(agent_id="a", epoch=1, seq=1))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Connect(iter([batch]), metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=5))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_predecessors_batch_is_acked_under_its_epoch_and_a_later_epochs_is_refused(controller) -> None:  # noqa: ANN001
    job_id, attempt = _job(controller.store)
    hello = agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id="agent-node-7", node_name="node-7",
                                                         token=TOKEN, epoch=200))

    def batch(epoch: int, seq: int, first: int) -> agent_pb2.AgentMessage:
        return agent_pb2.AgentMessage(batch=agent_pb2.EventBatch(
            agent_id="agent-node-7", epoch=epoch, seq=seq, events=_steps(job_id, attempt, 0, first, 3)))

    with grpc.insecure_channel(controller.address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        # epoch 100's batch 4 (resent by its successor, twice), then the stream's own batch 1
        done = threading.Event()

        def outbound():  # noqa: ANN202 - the stream stays open until the last ack came back
            yield from (hello, batch(100, 4, 1), batch(100, 4, 1), batch(200, 1, 4))
            done.wait(10)

        replies = []
        call = stub.Connect(outbound(), metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=10)
        for reply in call:
            replies.append(reply)
            if reply.WhichOneof("msg") == "ack" and reply.ack.epoch == 200:
                done.set()
                call.cancel()
                break
        acks = [(r.ack.epoch, r.ack.seq, r.ack.rejected) for r in replies if r.WhichOneof("msg") == "ack"]
        assert acks[-1] == (200, 1, "") and set(acks[:-1]) == {(100, 4, "")}, acks
        with pytest.raises(grpc.RpcError) as err:   # a batch of a later epoch is no predecessor's
            list(stub.Connect(iter([hello, batch(300, 1, 7)]), metadata=((TOKEN_METADATA_KEY, TOKEN),),
                              timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sorted(s.step for s in controller.store.steps(job_id)) == list(range(1, 7))   # epoch 100's once


def test_many_agents_saying_hello_at_once_are_each_welcomed_where_they_left_off(controller) -> None:  # noqa: ANN001
    # a controller restart: every agent says Hello at once; they are served by rounds of
    # store work, and each Welcome still carries its own (agent, epoch)'s committed seq
    job_id, attempt = _job(controller.store)
    metadata = ((TOKEN_METADATA_KEY, TOKEN),)

    def hello(i: int) -> agent_pb2.AgentMessage:
        return agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id=f"agent-{i}", node_name=f"node-{i}",
                                                            token=TOKEN, epoch=7))

    with grpc.insecure_channel(controller.address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        for i in range(5):   # agents 0..4 had i + 1 batches committed before the restart
            done = threading.Event()

            def outbound(i: int = i, done: threading.Event = done):  # noqa: ANN202
                yield hello(i)
                for seq in range(1, i + 2):
                    yield agent_pb2.AgentMessage(batch=agent_pb2.EventBatch(
                        agent_id=f"agent-{i}", epoch=7, seq=seq, events=_steps(job_id, attempt, i, seq, 1)))
                done.wait(10)

            call = stub.Connect(outbound(), metadata=metadata, timeout=10)
            for reply in call:
                if reply.WhichOneof("msg") == "ack" and reply.ack.seq == i + 1:
                    done.set()
                    call.cancel()
                    break
        welcomed: dict[int, int] = {}
        errors: list[BaseException] = []

        def say_hello(i: int) -> None:
            try:
                reply = next(iter(stub.Connect(iter([hello(i)]), metadata=metadata, timeout=20)))
                welcomed[i] = reply.welcome.committed_seq
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=say_hello, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert not errors
    assert welcomed == {i: (i + 1 if i < 5 else 0) for i in range(40)}
    assert {n.name for n in controller.store.list_nodes()} == {f"node-{i}" for i in range(40)}


def test_random_bytes_on_the_port_do_not_hurt_the_server(controller) -> None:  # noqa: ANN001
    host, port = controller.address.rsplit(":", 1)
    for payload in (b"\x00" * 64, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 8):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
    with grpc.insecure_channel(controller.address) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="fleet.v1.AgentService"), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
