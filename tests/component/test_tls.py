"""Mutual TLS between agents (and the CLI) and the controller, over real gRPC servers.

A throwaway PKI is made with the ``openssl`` CLI: a CA, a server certificate for
127.0.0.1/localhost, a client certificate, and a second CA with its own client
certificate (a stranger).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.controlplane import auth
from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
from fleet.controlplane.client import ControlClient
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.errors import ConfigError, UnavailableError
from fleet.controlplane.grpc_server import ControllerServer
from fleet.controlplane.lifecycle import JobState
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.contract import TOKEN_METADATA_KEY
from fleet.proto.tls import TlsFileError, TlsFiles, channel_credentials
from tests.component.conftest import TOKEN, StoreJobControl, start_server

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Pki:
    server: TlsFiles
    client: TlsFiles
    stranger: TlsFiles   # trusts our CA, but its certificate is signed by another CA


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=fleet-test-{name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=fleet-test-{name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "stranger", "other-ca", "extendedKeyUsage=clientAuth\n")
    return Pki(
        server=TlsFiles(ca_cert=d / "ca.pem", cert=d / "server.pem", key=d / "server.key"),
        client=TlsFiles(ca_cert=d / "ca.pem", cert=d / "client.pem", key=d / "client.key"),
        stranger=TlsFiles(ca_cert=d / "ca.pem", cert=d / "stranger.pem", key=d / "stranger.key"),
    )


@dataclass
class TlsController:
    store: object
    registry: AgentRegistry
    server: ControllerServer

    @property
    def address(self) -> str:
        return self.server.address


@pytest.fixture
def tls_controller(store, pki: Pki) -> Iterator[TlsController]:  # noqa: ANN001
    registry = AgentRegistry()
    server, _ = start_server(store, registry, tls=pki.server)
    try:
        yield TlsController(store, registry, server)
    finally:
        server.close()


def _steps(job_id: str, attempt: int, n: int) -> list[events_pb2.Event]:
    return [events_pb2.Event(step=events_pb2.StepEvent(
        job_id=job_id, attempt=attempt, rank=0, step=s, loss=1.0, step_time_s=0.01, tokens_per_s=1.0,
        end_ns=s)) for s in range(1, n + 1)]


def _serving(address: str, credentials: grpc.ChannelCredentials) -> bool:
    with grpc.secure_channel(address, credentials) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="fleet.v1.AgentService"), timeout=5)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def test_agent_with_the_right_client_certificate_connects_and_delivers(tls_controller, pki: Pki, tmp_path) -> None:  # noqa: ANN001
    store = tls_controller.store
    job_id = store.create_job("tls", total_steps=100, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING)
    attempt = store.create_attempt(job_id)
    agent = NodeAgent(node_name="node-tls", controller_address=tls_controller.address, token=TOKEN,
                      tls=pki.client, settings=AgentSettings(batch_interval_s=0.02, spill_dir=str(tmp_path / "spill")))
    agent.start(connect_timeout_s=10)
    try:
        with grpc.insecure_channel(agent.local_address) as channel:   # the worker hop stays local
            agent_pb2_grpc.NodeAgentStub(channel).Report(agent_pb2.WorkerReport(
                job_id=job_id, attempt=attempt, rank=0, events=_steps(job_id, attempt, 50)), timeout=10)
        assert agent.flush(10), agent.stats()
        assert "node-tls" in tls_controller.registry.connected_nodes()
    finally:
        agent.close()
    assert sorted(s.step for s in store.steps(job_id)) == list(range(1, 51))


@pytest.mark.parametrize("who", ["plaintext", "stranger"])
def test_agents_without_a_trusted_client_certificate_are_refused(tls_controller, pki: Pki, tmp_path, who: str) -> None:  # noqa: ANN001
    tls = None if who == "plaintext" else pki.stranger
    agent = NodeAgent(node_name=f"node-{who}", controller_address=tls_controller.address, token=TOKEN,
                      tls=tls, settings=AgentSettings(spill_dir=str(tmp_path / "spill")))
    with pytest.raises(TimeoutError):
        agent.start(connect_timeout_s=1.5)   # never welcomed
    assert f"node-{who}" not in tls_controller.registry.connected_nodes()
    assert all(n.name != f"node-{who}" for n in tls_controller.store.list_nodes())
    # the server keeps serving trusted clients
    assert _serving(tls_controller.address, channel_credentials(pki.client))


def test_a_client_presenting_no_certificate_is_refused(tls_controller, pki: Pki) -> None:  # noqa: ANN001
    no_cert = grpc.ssl_channel_credentials(root_certificates=pki.client.ca_cert.read_bytes())
    hello = agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id="a", node_name="node-nocert", token=TOKEN))
    with grpc.secure_channel(tls_controller.address, no_cert) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(agent_pb2_grpc.AgentServiceStub(channel).Connect(
                iter([hello]), metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=5))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "node-nocert" not in tls_controller.registry.connected_nodes()
    assert _serving(tls_controller.address, channel_credentials(pki.client))


def test_cli_client_connects_with_tls_from_controller_json(tls_controller, pki: Pki, tmp_path: Path) -> None:  # noqa: ANN001
    info = auth.ControllerInfo(tls_controller.address, TOKEN, "job-x", 1, ca_cert=str(pki.client.ca_cert),
                               client_cert=str(pki.client.cert), client_key=str(pki.client.key))
    auth.write_controller_info(tmp_path, info)
    assert auth.read_controller_info(tmp_path).tls_files() == pki.client
    with ControlClient.from_state_dir(tmp_path) as client:
        assert client.list_jobs() == []
    # the same controller, dialled in plaintext: a transport failure, not an answer
    with ControlClient(tls_controller.address, TOKEN, timeout_s=2) as client, pytest.raises(UnavailableError):
        client.list_jobs()


def test_unreadable_tls_files_are_named(pki: Pki, tmp_path: Path) -> None:
    missing = TlsFiles(ca_cert=tmp_path / "absent-ca.pem", cert=pki.client.cert, key=pki.client.key)
    with pytest.raises(TlsFileError, match=r"TLS ca_cert .*absent-ca\.pem: cannot read"):
        channel_credentials(missing)
    not_pem = tmp_path / "key.txt"
    not_pem.write_text("hello")
    with pytest.raises(TlsFileError, match=r"TLS key .*key\.txt: not a PEM file"):
        channel_credentials(TlsFiles(ca_cert=pki.client.ca_cert, cert=pki.client.cert, key=not_pem))
    with pytest.raises(ConfigError, match="cannot read"):
        ControlClient("127.0.0.1:1", TOKEN, tls=missing)


def test_controller_server_with_a_missing_tls_file_is_a_config_error(store, pki: Pki, tmp_path: Path) -> None:  # noqa: ANN001
    files = TlsFiles(ca_cert=pki.server.ca_cert, cert=pki.server.cert, key=tmp_path / "gone.key")
    servicer = AgentServicer(store, AgentRegistry(), TOKEN, controller_id="ctl-bad")
    try:
        with pytest.raises(ConfigError, match=r"TLS key .*gone\.key"):
            ControllerServer(servicer, ControlServicer(StoreJobControl(store), TOKEN), tls=files)
    finally:
        servicer.close()
