"""Component tier: a real controller gRPC server on 127.0.0.1:0 over a real store, on
both backends (a SQLite file and a database on a real PostgreSQL server)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.errors import NotFoundError
from fleet.controlplane.grpc_server import ControllerServer
from fleet.controlplane.store import Store
from fleet.proto import control_pb2, events_pb2
from fleet.proto.kinds import FaultKind
from fleet.proto.tls import TlsFiles

TOKEN = "test-token-0123456789"


class StoreJobControl:
    """A JobControl answering from the store (no Ray): enough for the service contract."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.faults: list[tuple[str, int, str, str]] = []

    def list_jobs(self) -> list[control_pb2.JobSummary]:
        return [control_pb2.JobSummary(job_id=j.id, state=j.state.value) for j in self.store.list_jobs()]

    def job_status(self, job_id: str) -> control_pb2.JobStatus:
        j = self.store.get_job(job_id)
        return control_pb2.JobStatus(job=control_pb2.JobSummary(job_id=j.id, state=j.state.value))

    def inject_fault(self, job_id, rank, node, fault: events_pb2.FaultSpec):  # noqa: ANN001
        self.store.get_job(job_id)
        if rank > 3:
            raise NotFoundError(f"rank {rank} does not exist")
        self.faults.append((job_id, rank, node, FaultKind.from_wire(fault.kind).value))
        return control_pb2.InjectFaultReply(command_id="c1", attempt=1, ranks=[rank], node=node or "node-0")

    def stop_job(self, job_id: str, reason: str, by: str = "") -> control_pb2.StopJobReply:
        self.store.get_job(job_id)
        return control_pb2.StopJobReply(state="STOPPING")


@dataclass
class Controller:
    store: Store
    registry: AgentRegistry
    server: ControllerServer
    control: StoreJobControl

    @property
    def address(self) -> str:
        return self.server.address


def start_server(store: Store, registry: AgentRegistry, port: int = 0,
                 tls: TlsFiles | None = None) -> tuple[ControllerServer, StoreJobControl]:
    control = StoreJobControl(store)
    server = ControllerServer(
        AgentServicer(store, registry, TOKEN, controller_id="ctl-test"),
        ControlServicer(control, TOKEN),
        port=port,
        tls=tls,
    ).start()
    return server, control


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    """A fresh store, once per backend (SQLite file, real PostgreSQL)."""
    with Store(store_url) as s:
        yield s


@pytest.fixture
def controller(store: Store) -> Iterator[Controller]:
    registry = AgentRegistry()
    server, control = start_server(store, registry)
    try:
        yield Controller(store, registry, server, control)
    finally:
        server.close()
