"""The controller's gRPC server: AgentService, ControlService and standard health checking.

Binds 127.0.0.1 by default; ``close()`` stops it and then the agent servicer's store
writer. AgentService is registered with its own deserializer, so that refused messages
are counted (``fleet_ingest_errors_total``): bytes that are not an AgentMessage end the
stream with INVALID_ARGUMENT, a message over ``max_message_bytes`` with
RESOURCE_EXHAUSTED. gRPC's own receive limit is set ``GRPC_LIMIT_FACTOR`` times higher,
as a backstop against memory exhaustion: past it gRPC refuses the message itself
(RESOURCE_EXHAUSTED too, but not counted).
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fleet.controlplane.agent_server import MALFORMED, OVERSIZED, AgentServicer
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.errors import ConfigError, UnavailableError
from fleet.proto import agent_pb2, control_pb2_grpc
from fleet.proto.contract import AGENT_SERVICE, CONNECT_METHOD, CONTROL_SERVICE
from fleet.proto.tls import TlsFileError, TlsFiles, server_credentials

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
GRPC_LIMIT_FACTOR = 4
#: Size of the gRPC thread pool. Every open agent stream holds one thread for its whole
#: life (plus its own receiver thread), so this bounds the agents one controller serves;
#: threads are started on demand, so an unused bound costs nothing.
MAX_STREAMS = 1024


def _agent_service(servicer: AgentServicer, max_message_bytes: int) -> grpc.GenericRpcHandler:
    """AgentService.Connect, whose deserializer counts messages it refuses."""

    def parse(data: bytes) -> object:
        if len(data) > max_message_bytes:
            servicer.metrics.errors.labels("oversized").inc()
            return OVERSIZED
        try:
            return agent_pb2.AgentMessage.FromString(data)
        except Exception:  # noqa: BLE001 - any parse failure is the sender's fault
            servicer.metrics.errors.labels("malformed").inc()
            return MALFORMED

    connect = grpc.stream_stream_rpc_method_handler(
        servicer.Connect, request_deserializer=parse,
        response_serializer=agent_pb2.ControllerMessage.SerializeToString)
    return grpc.method_handlers_generic_handler(AGENT_SERVICE, {CONNECT_METHOD: connect})


class ControllerServer:
    """Owns the grpc.Server; a context manager."""

    def __init__(
        self,
        agent_servicer: AgentServicer,
        control_servicer: ControlServicer,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = MAX_STREAMS,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        tls: TlsFiles | None = None,
    ) -> None:
        self.agent_servicer = agent_servicer
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fleet-ctl-grpc")
        self._server = grpc.server(
            self._executor,
            options=[
                ("grpc.max_receive_message_length", GRPC_LIMIT_FACTOR * max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._server.add_generic_rpc_handlers((_agent_service(agent_servicer, max_message_bytes),))
        control_pb2_grpc.add_ControlServiceServicer_to_server(control_servicer, self._server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        try:
            if tls is None:
                bound = self._server.add_insecure_port(f"{host}:{port}")
            else:  # mutual TLS: clients must present a certificate signed by tls.ca_cert
                bound = self._server.add_secure_port(f"{host}:{port}", server_credentials(tls))
        except TlsFileError as exc:
            raise ConfigError(str(exc)) from None
        except RuntimeError as exc:
            raise UnavailableError(f"cannot bind the controller to {host}:{port}: {exc}") from None
        if bound == 0:
            raise UnavailableError(f"cannot bind the controller to {host}:{port}")
        self.address = f"{host}:{bound}"

    def start(self) -> ControllerServer:
        self._server.start()
        for service in ("", AGENT_SERVICE, CONTROL_SERVICE):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self

    def close(self, grace_s: float = 2.0) -> None:
        self._health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait(timeout=grace_s + 3)
        # grpc.Server.stop leaves the executor's threads parked; end them too
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.agent_servicer.close()

    def __enter__(self) -> ControllerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
