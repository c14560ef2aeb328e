"""The ingest path on both store backends: column blocks, validation, rejections, the
writer's group commits, drops, refusals; and zero loss / zero duplicates across a
controller killed with SIGKILL and restarted, and across repeated connection drops."""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from sqlalchemy import create_engine, text

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.agent.uplink import Uplink
from fleet.controlplane.agent_server import AgentRegistry
from fleet.controlplane.cli.main import main
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.store import Store
from fleet.controlplane.store.ingest import COLLECTIVE_COLUMNS, InvalidBatch, prepare
from fleet.controlplane.store.schema import Collective
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.contract import CONNECT_METHOD_PATH, TOKEN_METADATA_KEY
from tests import ingest_controller
from tests.component.conftest import TOKEN, start_server
from fleet.workers.reporter import Reporter
from fleet.workers.spec import WorkerSpec
from fleet.proto import columns

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(store_url: str):
    with Store(store_url) as s:
        yield s


def _job(store: Store) -> tuple[str, int]:
    job_id = store.create_job("ingest-test", total_steps=10, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING)
    return job_id, store.create_attempt(job_id)


def _coll(job_id: str, rank: int, seq: int, state: str = "completed", group: str = "0",
          op: str = "all_gather") -> events_pb2.CollectiveEvent:
    c = events_pb2.CollectiveEvent(
        job_id=job_id, attempt=1, rank=rank, group=group, group_size=4, seq=seq, op=op,
        enter_ns=seq * 1_000, exit_ns=seq * 1_000 + 7 if state != "started" else 0, state=state,
        step=seq // 3, input_dtypes=["bfloat16"], output_dtypes=["bfloat16", "float32"])
    c.input_sizes.add().dims.extend([4, seq % 5 + 1])
    c.output_sizes.add().dims.extend([16, 2])
    c.output_sizes.add()  # a 0-d tensor
    return c


def _block(events: list[events_pb2.CollectiveEvent]) -> events_pb2.Event:
    return events_pb2.Event(collectives=columns.pack(events))


def _steps(job_id: str, rank: int, first: int, n: int) -> list[events_pb2.Event]:
    return [events_pb2.Event(step=events_pb2.StepEvent(
        job_id=job_id, attempt=1, rank=rank, step=s, loss=1.0, end_ns=s)) for s in range(first, first + n)]


def _wait(cond, timeout_s: float = 20.0, what: str = "condition") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _uplink(address: str, name: str, **kw) -> Uplink:  # noqa: ANN003
    hello = agent_pb2.Hello(agent_id=f"agent-{name}", node_name=name, token=kw.pop("token", TOKEN),
                            epoch=time.time_ns())
    return Uplink(controller_address=address, token=hello.token, hello=hello,
                  on_command=lambda _c: None,
                  heartbeat=lambda: agent_pb2.Heartbeat(agent_id=hello.agent_id, time_ns=time.time_ns()),
                  settings=AgentSettings(batch_interval_s=0.02, **kw), reconnect_max_s=0.3).start()


# -- rows ---------------------------------------------------------------------------------

def test_column_blocks_and_single_events_store_the_same_rows(store: Store) -> None:
    # the rows are built positionally, in the table's column order
    assert COLLECTIVE_COLUMNS == tuple(c.name for c in Collective.__table__.columns)
    job_id, _ = _job(store)
    evs = [_coll(job_id, 0, s) for s in range(1, 40)]
    assert columns.unpack(columns.pack(evs)) == evs
    store.record_batch("a", 1, 1, [_block(evs)])
    store.record_batch("b", 1, 1, [events_pb2.Event(collective=e) for e in
                                   [_coll(job_id, 1, s) for s in range(1, 40)]])
    rows = store.collectives(job_id)
    by_rank = {r: [(c.seq, c.op, c.input_sizes, c.output_sizes, c.input_dtypes, c.output_dtypes,
                    c.enter_ns, c.exit_ns, c.state, c.step) for c in rows if c.rank == r] for r in (0, 1)}
    assert len(by_rank[0]) == 39 and by_rank[0] == by_rank[1]
    assert by_rank[0][0][3] == ((16, 2), ())


def test_op_names_become_canonical_at_the_ingest_and_the_typed_view_names_every_column(store: Store) -> None:
    from fleet.controlplane.store import CollectiveRow

    # the watchdog's view of a prepared row is the table's columns, in order
    assert CollectiveRow._fields == tuple("group" if c == "group_name" else c for c in COLLECTIVE_COLUMNS)
    job_id, _ = _job(store)
    names = ["allreduce", "gloo:_allgather_base", "_reduce_scatter_base", "reduce_scatter_tensor",
             "alltoall_base", "nccl:send 0->1", "broadcast"]
    evs = [_coll(job_id, 0, seq, op=op) for seq, op in enumerate(names, 1)]
    batch = prepare([_block(evs[:4]), *(events_pb2.Event(collective=e) for e in evs[4:])])
    canonical = ["all_reduce", "all_gather", "reduce_scatter", "reduce_scatter", "all_to_all", "send 0->1",
                 "broadcast"]
    view = list(batch.collective_rows())
    assert [(r.job_id, r.rank, r.group, r.seq, r.op) for r in view] == [
        (job_id, 0, "0", seq, op) for seq, op in enumerate(canonical, 1)]
    assert (view[0].state, view[0].enter_ns, view[0].exit_ns, view[0].step) == ("completed", 1000, 1007, 0)
    store.record_batch("a", 1, 1, [_block(evs)])
    assert [c.op for c in store.collectives(job_id)] == canonical
    (step,) = prepare(_steps(job_id, 2, 5, 1)).step_rows()
    assert (step.job_id, step.attempt, step.rank, step.step, step.end_ns, step.loss) == (job_id, 1, 2, 5, 5, 1.0)


def test_completion_wins_over_start_in_any_order_within_and_across_blocks(store: Store) -> None:
    job_id, _ = _job(store)
    store.record_batch("a", 1, 1, [_block([_coll(job_id, 0, 1, "started"), _coll(job_id, 0, 1),
                                           _coll(job_id, 0, 2)])])
    store.record_batch("a", 1, 2, [_block([_coll(job_id, 0, 2, "started"),
                                           _coll(job_id, 0, 3, "started")])])
    store.record_batch("a", 1, 3, [_block([_coll(job_id, 0, 3, "failed")])])
    got = {c.seq: (c.state, c.exit_ns) for c in store.collectives(job_id)}
    assert got == {1: ("completed", 1007), 2: ("completed", 2007), 3: ("failed", 3007)}


def test_an_invalid_single_collective_is_named_by_its_event_index(store: Store) -> None:
    job_id, _ = _job(store)
    bad = _coll(job_id, 0, 2, state="exploded")
    events = [*_steps(job_id, 0, 1, 2), events_pb2.Event(collective=_coll(job_id, 0, 1)),
              events_pb2.Event(collective=bad)]
    with pytest.raises(InvalidBatch, match=r"events 2\.\.3 \(single collectives\): collective\.state"):
        store.record_batch("a", 1, 1, events)
    assert store.steps(job_id) == [] and store.collectives(job_id) == []


def test_a_group_commit_applies_batches_in_order_and_skips_repeats(store: Store) -> None:
    job_id, _ = _job(store)
    started = prepare([_block([_coll(job_id, 0, 6, "started"), _coll(job_id, 0, 7, "started")])])
    done = prepare([_block([_coll(job_id, 0, 6)]), *_steps(job_id, 0, 1, 2)])
    assert store.record_batches([("a", 1, 1, started), ("a", 1, 2, done), ("a", 1, 1, started)]) \
        == [True, True, False]
    assert {c.seq: c.state for c in store.collectives(job_id)} == {6: "completed", 7: "started"}
    assert [s.step for s in store.steps(job_id)] == [1, 2]
    assert store.record_batches([("a", 1, 2, done), ("b", 1, 1, started)]) == [False, True]
    assert {c.seq: c.state for c in store.collectives(job_id)} == {6: "completed", 7: "started"}
    assert store.committed_seq("a", 1) == 2


def test_sdc_checks_arrive_in_batches_and_bad_ones_are_refused(store: Store) -> None:
    job_id, _ = _job(store)
    sdc = events_pb2.SdcCheckEvent(job_id=job_id, attempt=1, rank=-1, node="node-3", step=40,
                                   kind="gemm", value="1.5", expected="1.0", ok=False,
                                   detail="known-answer GEMM differs", time_ns=9)
    store.record_batch("a", 1, 1, [events_pb2.Event(sdc=sdc)])
    (got,) = store.sdc_checks(job_id)
    assert (got.rank, got.node, got.step, got.kind, got.ok, got.detail) == \
        (None, "node-3", 40, "gemm", False, "known-answer GEMM differs")
    sdc.kind = "vibes"
    with pytest.raises(InvalidBatch, match="event 0: sdc: kind"):
        store.record_batch("a", 1, 2, [events_pb2.Event(sdc=sdc)])
    assert len(store.sdc_checks(job_id)) == 1


@pytest.mark.parametrize("damage, message", [
    (lambda b: b.rank.append(3), "collectives.rank has 3 values"),
    (lambda b: b.op.__setitem__(0, 99), "collectives.op: index 99 outside strings"),
    (lambda b: b.strings.__setitem__(b.state[0], "exploded"), "collectives.state"),
    (lambda b: b.strings.__setitem__(b.input_sizes[0], "[[1,"), "collectives.input_sizes"),
    (lambda b: b.strings.__setitem__(b.input_dtypes[0], "[1]"), "collectives.input_dtypes"),
    (lambda b: b.strings.__setitem__(b.job_id[0], "j" * 65), "collectives.job_id"),
], ids=["length", "index", "state", "json", "dtypes", "too-long"])
def test_invalid_blocks_are_refused_whole_and_write_nothing(store: Store, damage, message) -> None:  # noqa: ANN001
    job_id, _ = _job(store)
    ev = _block([_coll(job_id, 0, 1), _coll(job_id, 0, 2)])
    damage(ev.collectives)
    with pytest.raises(InvalidBatch, match=message):
        store.record_batch("a", 1, 1, [*_steps(job_id, 0, 1, 3), ev])
    assert store.collectives(job_id) == [] and store.steps(job_id) == []
    assert store.committed_seq("a", 1) == 0


# -- the stream ---------------------------------------------------------------------------

def test_a_refused_batch_is_recorded_as_dropped_and_the_stream_goes_on(
        store: Store, store_url: str, capsys: pytest.CaptureFixture) -> None:
    job_id, _ = _job(store)
    store.record_rank(job_id, 1, 0, "node-r", 1234)
    server, _ = start_server(store, AgentRegistry())
    servicer = server.agent_servicer
    try:
        up = _uplink(server.address, "node-r", batch_max_events=1)
        bad = _block([_coll(job_id, 0, 5)])
        bad.collectives.strings[bad.collectives.state[0]] = "exploded"
        up.submit(_steps(job_id, 0, 1, 1))
        up.submit([bad])
        up.submit(_steps(job_id, 0, 2, 1))
        assert up.flush(20), up.stats()
        up.close()
    finally:
        server.close()
    assert [s.step for s in store.steps(job_id)] == [1, 2]
    assert store.collectives(job_id) == []
    drops = store.ingest_drops()
    assert [(d.node, d.events, d.source, d.first_seq) for d in drops] == [("node-r", 1, "controller", 2)]
    assert "collectives.state" in drops[0].reason
    assert servicer.metrics.value("fleet_ingest_errors_total", reason="invalid") == 1
    assert servicer.metrics.value("fleet_ingest_dropped_events_total", source="controller") == 1
    # visible to the operator: `fleet nodes` and `fleet replay`
    capsys.readouterr()
    assert main(["nodes", "--store", store_url, "--json"]) == 0
    nodes = {n["name"]: n for n in json.loads(capsys.readouterr().out)}
    assert nodes["node-r"]["events_lost"] == 1 and "collectives.state" in nodes["node-r"]["last_loss"]
    assert main(["replay", job_id, "--store", store_url, "--json"]) == 0
    lost = json.loads(capsys.readouterr().out)["events_lost"]
    assert [(d["node"], d["events"], d["source"]) for d in lost] == [("node-r", 1, "controller")]
    assert main(["replay", job_id, "--store", store_url]) == 0
    assert "1 events from nodes ['node-r'] never reached the store" in capsys.readouterr().out


def test_events_a_worker_had_to_drop_are_recorded_with_the_controller(store: Store) -> None:
    job_id, _ = _job(store)
    server, _ = start_server(store, AgentRegistry())
    agent = NodeAgent(node_name="node-w", controller_address=server.address, token=TOKEN,
                      settings=AgentSettings(batch_interval_s=0.02))
    try:
        agent.start(connect_timeout_s=10)
        spec = WorkerSpec(job_id=job_id, attempt=1, rank=3, world_size=4, node_name="node-w",
                          master_addr="127.0.0.1", master_port=0, agent_address=agent.local_address,
                          checkpoint_dir="/nonexistent", report_interval_s=30.0)
        reporter = Reporter(spec, max_buffered=10)
        for ev in _steps(job_id, 3, 1, 50):  # the buffer holds 10: the oldest are dropped
            reporter.emit(ev)
        reporter.close()
        assert reporter.dropped >= 1 and reporter.sent + reporter.dropped == 50
        assert agent.flush(20)
        _wait(lambda: store.ingest_drops("node-w"), what="the loss to be recorded")
    finally:
        agent.close()
        server.close()
    (drop,) = store.ingest_drops("node-w")
    assert (drop.events, drop.source) == (reporter.dropped, "agent")
    assert "rank 3" in drop.reason and "buffer was full" in drop.reason
    assert len(store.steps(job_id)) == reporter.sent


def test_a_controller_serves_many_agents_at_once(store: Store) -> None:
    job_id, _ = _job(store)
    registry = AgentRegistry()
    server, _ = start_server(store, registry)
    uplinks = []
    try:
        uplinks = [_uplink(server.address, f"node-{i:03d}") for i in range(150)]
        assert all(up.wait_welcomed(30) for up in uplinks)
        assert len(registry.connected_nodes()) == 150
        for i, up in enumerate(uplinks):
            up.submit(_steps(job_id, i, 1, 4))
        assert all(up.flush(60) for up in uplinks)
    finally:
        for up in uplinks:
            up.close()
        server.close()
    assert len(store.steps(job_id)) == 600


def test_large_batches_are_stored_and_oversized_messages_refused_and_counted(store: Store) -> None:
    job_id, _ = _job(store)
    registry = AgentRegistry()
    server, _ = start_server(store, registry)
    servicer = server.agent_servicer
    try:
        big = [_coll(job_id, r, s) for r in range(8) for s in range(1, 2_501)]  # 20k rows
        up = _uplink(server.address, "node-big")
        up.submit([_block(big[:10_000]), _block(big[10_000:])])
        assert up.flush(60), up.stats()
        up.close()
        assert len(store.collectives(job_id)) == 20_000
        with grpc.insecure_channel(server.address) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            hello = agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id="x", node_name="n-x", token=TOKEN, epoch=1))
            huge = agent_pb2.AgentMessage(batch=agent_pb2.EventBatch(
                agent_id="x", epoch=1, seq=1, events=[_block(big)] * 48))
            assert huge.ByteSize() > 16 << 20
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Connect(iter([hello, huge]), metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            garbage = channel.stream_stream(CONNECT_METHOD_PATH,
                                            request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as err:
                list(garbage(iter([b"\xff\x00\xfe not a protobuf"]), metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=5))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Connect(iter([hello]), metadata=((TOKEN_METADATA_KEY, "nope"),), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.close()
    m = servicer.metrics
    assert (m.value("fleet_ingest_errors_total", reason="oversized"),
            m.value("fleet_ingest_errors_total", reason="malformed"),
            m.value("fleet_ingest_errors_total", reason="unauthenticated")) == (1, 1, 1)
    assert m.value("fleet_ingest_events_total") == 20_000
    assert len(store.collectives(job_id)) == 20_000  # the refused messages wrote nothing


def test_metrics_are_served_over_http_on_loopback(store: Store) -> None:
    server, _ = start_server(store, AgentRegistry())
    metrics = server.agent_servicer.metrics
    try:
        port = metrics.serve("127.0.0.1", 0)
        up = _uplink(server.address, "node-m")
        up.submit(_steps("j-none", 0, 1, 5))
        assert up.flush(20)
        up.close()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            body = b""
            while chunk := s.recv(65536):
                body += chunk
    finally:
        metrics.close()
        server.close()
    assert b"fleet_ingest_events_total 5.0" in body


# -- durability -----------------------------------------------------------------------------

class _Controller:
    """tests/ingest_controller.py in its own process, so that it can be SIGKILLed."""

    def __init__(self, url: str, port: int = 0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.ingest_controller", url, str(port)],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        assert line.startswith("ready "), f"controller did not start: {line!r}"
        self.address = line.split()[1]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc.stdout.close()


def _count(url: str) -> dict[str, tuple[int, int]]:
    """rows and distinct keys per table."""
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return {
                "collectives": tuple(c.execute(text(
                    "SELECT count(*), (SELECT count(*) FROM (SELECT DISTINCT rank, group_name, seq "
                    "FROM collectives) k) FROM collectives")).one()),
                "steps": tuple(c.execute(text(
                    "SELECT count(*), (SELECT count(*) FROM (SELECT DISTINCT rank, step FROM steps) k) "
                    "FROM steps")).one()),
            }
    finally:
        engine.dispose()


def _stream(uplinks: list[Uplink], job_id: str, rounds: int, per_round: int,
            between: callable) -> int:  # noqa: ANN001
    """Each uplink sends ``rounds`` x (a block of ``per_round`` collectives + as many steps)."""
    for r in range(rounds):
        for i, up in enumerate(uplinks):
            first = r * per_round + 1
            up.submit([_block([_coll(job_id, i, s) for s in range(first, first + per_round)]),
                       *_steps(job_id, i, first, per_round)], timeout_s=60)
        between(r)
    return rounds * per_round * len(uplinks)


def test_controller_killed_and_restarted_mid_stream_loses_and_duplicates_nothing(store_url: str) -> None:
    with Store(store_url) as store:
        job_id, _ = _job(store)
    ctl = _Controller(store_url)
    port = int(ctl.address.rsplit(":", 1)[1])
    uplinks = [_uplink(ctl.address, f"node-{i}", token=ingest_controller.TOKEN) for i in range(3)]
    try:
        def restart(r: int) -> None:
            nonlocal ctl
            if r in (2, 5, 8):
                ctl.kill()
                ctl = _Controller(store_url, port)
        sent = _stream(uplinks, job_id, 10, 300, restart)
        for up in uplinks:
            assert up.flush(60), up.stats()
        assert all(up.stats()["reconnects"] >= 3 for up in uplinks)
    finally:
        for up in uplinks:
            up.close()
        ctl.stop()
    assert _count(store_url) == {"collectives": (sent, sent), "steps": (sent, sent)}


class _FlakyProxy:
    """A TCP proxy on 127.0.0.1 that cuts every connection through it on ``cut()``."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._accept = threading.Thread(target=self._run, name="test-proxy", daemon=True)
        self._accept.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                t = threading.Thread(target=self._pump, args=(a, b), name="test-proxy-pump", daemon=True)
                t.start()
                self._threads.append(t)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def connections(self) -> int:
        with self._lock:
            return len(self._socks) // 2

    def cut(self) -> int:
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        return len(socks) // 2

    def close(self) -> None:
        self._closed = True
        try:  # wakes the accept: closing alone leaves a thread blocked in accept(2)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self.cut()
        for t in [self._accept, *self._threads]:
            t.join(5)
        assert not self._accept.is_alive(), "the proxy's accept thread did not end"


def test_repeated_connection_drops_lose_and_duplicate_nothing(store: Store, store_url: str) -> None:
    job_id, _ = _job(store)
    server, _ = start_server(store, AgentRegistry())
    proxy = _FlakyProxy(server.address)
    uplinks = [_uplink(proxy.address, f"node-{i}") for i in range(2)]
    cuts = 0
    try:
        def drop(_r: int) -> None:
            nonlocal cuts
            # in one process, gRPC shares one connection between channels to one address
            _wait(lambda: proxy.connections() >= 1, what="the agents to reconnect")
            cuts += proxy.cut()
        sent = _stream(uplinks, job_id, 12, 200, drop)
        for up in uplinks:
            assert up.flush(60), up.stats()
        reconnects = sum(up.stats()["reconnects"] for up in uplinks)
    finally:
        for up in uplinks:
            up.close()
        proxy.close()
        server.close()
    assert cuts >= 6 and reconnects >= 6, (cuts, reconnects)
    assert _count(store_url) == {"collectives": (sent, sent), "steps": (sent, sent)}
