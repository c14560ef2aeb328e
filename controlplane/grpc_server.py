"""The controller's gRPC server: AgentService, ControlService and standard health checking.

Binds 127.0.0.1 by default; message size is bounded; ``close()`` stops it.
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from controlplane.agent_server import AgentServicer
from controlplane.control_server import ControlServicer
from controlplane.errors import UnavailableError
from fleet_proto import agent_pb2_grpc, control_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ControllerServer:
    """Owns the grpc.Server; a context manager."""

    def __init__(
        self,
        agent_servicer: AgentServicer,
        control_servicer: ControlServicer,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 64,
    ) -> None:
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fleet-ctl-grpc")
        self._server = grpc.server(
            self._executor,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        agent_pb2_grpc.add_AgentServiceServicer_to_server(agent_servicer, self._server)
        control_pb2_grpc.add_ControlServiceServicer_to_server(control_servicer, self._server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        try:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:
            raise UnavailableError(f"cannot bind the controller to {host}:{port}: {exc}") from None
        if bound == 0:
            raise UnavailableError(f"cannot bind the controller to {host}:{port}")
        self.address = f"{host}:{bound}"

    def start(self) -> ControllerServer:
        self._server.start()
        for service in ("", "fleet.v1.AgentService", "fleet.v1.ControlService"):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self

    def close(self, grace_s: float = 2.0) -> None:
        self._health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait(timeout=grace_s + 3)
        # grpc.Server.stop leaves the executor's threads parked; end them too
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ControllerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
