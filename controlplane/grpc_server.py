"""The controller's gRPC server: AgentService, ControlService and standard health checking.

One ``grpc.aio`` server on one asyncio event loop, run by one named thread
(``fleet-ctl-aio``) that ``ControllerServer`` owns. AgentService streams are coroutines
on that loop (``agent_server``): an open agent stream costs memory, not a thread, so the
number of agents one controller serves is not bounded by a thread pool. The health
service is the asyncio one (``grpc_health.v1.health.aio``). ControlService is a sync
servicer: grpc.aio runs it in a small thread pool (``fleet-ctl-control``, at most
``control_threads``, started on demand), so a slow ``CheckNode`` never holds the loop.

Binds 127.0.0.1 by default; ``close()`` stops the server, then the loop and its thread,
then the agent servicer's store writer and pools: no thread is left behind. AgentService
is registered with its own deserializer, so that refused messages are counted
(``fleet_ingest_errors_total``): bytes that are not an AgentMessage end the stream with
INVALID_ARGUMENT, a message over ``max_message_bytes`` with RESOURCE_EXHAUSTED. gRPC's own
receive limit is set ``GRPC_LIMIT_FACTOR`` times higher, as a backstop against memory
exhaustion: past it gRPC refuses the message itself (RESOURCE_EXHAUSTED too, but not
counted).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from fleet.controlplane.agent_server import MALFORMED, OVERSIZED, AgentServicer
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.errors import ConfigError, UnavailableError
from fleet.proto import agent_pb2, control_pb2_grpc
from fleet.proto.contract import AGENT_SERVICE, CONNECT_METHOD, CONTROL_SERVICE
from fleet.proto.tls import TlsFileError, TlsFiles, server_credentials

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
GRPC_LIMIT_FACTOR = 4
#: Threads for ControlService calls (operators and the CLI: few at a time; CheckNode
#: may hold one for its whole timeout). Agent streams use none of them.
CONTROL_THREADS = 16
#: Calls the server holds before the loop has taken them up. gRPC's default (1,000, and
#: random early refusal up to 3,000) refuses streams (CANCELLED) when more than a
#: thousand agents connect at once, as after a controller restart; a held call costs a
#: few KiB, and the loop takes them up in a few seconds.
MAX_PENDING_CALLS = 32_768
#: After the server stopped: longest to wait for its streams' tasks to end, and how long
#: the loop then keeps running for gRPC's last completions, seconds (see ``_stop``).
STOP_WAIT_S = 5.0
STOP_DRAIN_S = 0.2
#: Longest the loop thread may take to start the server or to stop it, seconds.
LOOP_CALL_TIMEOUT_S = 30.0

T = TypeVar("T")


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
    """Owns the grpc.aio server and the event loop thread it runs on; a context manager."""

    def __init__(
        self,
        agent_servicer: AgentServicer,
        control_servicer: ControlServicer | None,
        host: str = "127.0.0.1",
        port: int = 0,
        control_threads: int = CONTROL_THREADS,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        tls: TlsFiles | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.agent_servicer = agent_servicer
        self._serves_control = control_servicer is not None
        try:
            credentials = server_credentials(tls) if tls is not None else None
        except TlsFileError as exc:
            raise ConfigError(str(exc)) from None
        self._control_pool = futures.ThreadPoolExecutor(control_threads, thread_name_prefix="fleet-ctl-control")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="fleet-ctl-aio", daemon=True)
        self._thread.start()
        self._closed = False
        options = [
            ("grpc.max_receive_message_length", GRPC_LIMIT_FACTOR * max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # an ingest process shares its port with the others (the kernel spreads the
            # agents' connections over them); anything else owns its port alone
            ("grpc.so_reuseport", int(reuse_port)),
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
        ]
        try:
            bound = self._on_loop(self._build(control_servicer, options, max_message_bytes,
                                              f"{host}:{port}", credentials))
        except RuntimeError as exc:
            self._stop_loop()
            raise UnavailableError(f"cannot bind the controller to {host}:{port}: {exc}") from None
        except BaseException:
            self._stop_loop()
            raise
        if bound == 0:
            self._stop_loop()
            raise UnavailableError(f"cannot bind the controller to {host}:{port}")
        self.address = f"{host}:{bound}"

    # -- the loop thread ------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            try:
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()

    def _on_loop(self, coro: Coroutine[Any, Any, T], timeout_s: float = LOOP_CALL_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _stop_loop(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:  # already closed
            pass
        self._thread.join(LOOP_CALL_TIMEOUT_S)
        # a sync ControlService call may still wait (CheckNode): its thread ends after it
        self._control_pool.shutdown(wait=False, cancel_futures=True)

    async def _build(self, control_servicer: ControlServicer | None, options: list[tuple[str, Any]],
                     max_message_bytes: int, address: str,
                     credentials: grpc.ServerCredentials | None) -> int:
        # made on the loop: a grpc.aio server belongs to the loop it was created on
        self._server = grpc.aio.server(migration_thread_pool=self._control_pool, options=options)
        self._server.add_generic_rpc_handlers((_agent_service(self.agent_servicer, max_message_bytes),))
        if control_servicer is not None:
            control_pb2_grpc.add_ControlServiceServicer_to_server(control_servicer, self._server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        if credentials is None:
            return self._server.add_insecure_port(address)
        # mutual TLS: clients must present a certificate signed by tls.ca_cert
        return self._server.add_secure_port(address, credentials)

    async def _start(self) -> None:
        await self._server.start()
        for service in ("", AGENT_SERVICE, CONTROL_SERVICE)[:3 if self._serves_control else 2]:
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def _stop(self, grace_s: float) -> None:
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
        # the streams' handlers unwind (each cancels its reader task) and gRPC sends their
        # last operations; wait for that, bounded, but cancel nothing of gRPC's own. Closing
        # the loop before gRPC completed them makes it log an error per stream ("Event loop
        # is closed") on whatever loop it uses next.
        here = asyncio.current_task()
        deadline = time.monotonic() + STOP_WAIT_S
        while (left := [t for t in asyncio.all_tasks() if t is not here]) and time.monotonic() < deadline:
            await asyncio.wait(left, timeout=deadline - time.monotonic())
        await asyncio.sleep(STOP_DRAIN_S)

    # -- the public face ------------------------------------------------------------------

    def start(self) -> ControllerServer:
        self._on_loop(self._start())
        return self

    def close(self, grace_s: float = 2.0) -> None:
        """Stop serving (streams get ``grace_s`` to end), stop the loop thread, then commit
        what the writer holds and stop it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._on_loop(self._stop(grace_s), timeout_s=grace_s + LOOP_CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the loop, its thread and the writer must still stop
            log.exception("stopping the gRPC server failed; stopping its loop anyway")
        self._stop_loop()
        self.agent_servicer.close()

    def __enter__(self) -> ControllerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
