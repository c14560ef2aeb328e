"""ControlService: what operators and the CLI ask of a running controller.

Thin: validates the token and the request, calls the controller's ``JobControl``
methods (``GetStatus``: ``controlplane.status`` over the store and the live job) (``CheckNode``: its ``NodeCheckRunner``, ``node_checks.NodeChecks``), and turns
``FleetError``s into gRPC status codes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import grpc

from fleet.controlplane.auth import tokens_equal
from fleet.controlplane.chaos import validate_order
from fleet.controlplane.chaos_fire import order_of
from fleet.controlplane.errors import ConfigError, FleetError, UnavailableError
from fleet.controlplane.grpc_errors import status_code
from fleet.proto import control_pb2, control_pb2_grpc, events_pb2
from fleet.proto.contract import TOKEN_METADATA_KEY

log = logging.getLogger(__name__)


class JobControl(Protocol):
    """The controller operations ControlService exposes."""

    def list_jobs(self) -> list[control_pb2.JobSummary]: ...

    def job_status(self, job_id: str) -> control_pb2.JobStatus: ...

    def inject_fault(
        self, job_id: str, rank: int, node: str, fault: events_pb2.FaultSpec
    ) -> control_pb2.InjectFaultReply: ...

    def stop_job(self, job_id: str, reason: str, by: str = "") -> control_pb2.StopJobReply: ...

    def get_status(self, job_id: str) -> control_pb2.StatusReply: ...


class NodeCheckRunner(Protocol):
    """Runs known-answer GEMM tests on nodes (``node_checks.NodeChecks``)."""

    def check(self, nodes: list[str], timeout_s: float, *, job_id: str = "", attempt: int = 0,
              purpose: str = "on demand") -> dict[str, Any]: ...


#: The longest a CheckNode call may wait for its result, seconds.
CHECK_NODE_MAX_TIMEOUT_S = 600.0


Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _guarded(method: Callable[..., Resp]) -> Callable[..., Resp]:
    @functools.wraps(method)
    def wrapper(self: ControlServicer, request: Req, context: grpc.ServicerContext) -> Resp:
        metadata = dict(context.invocation_metadata())
        if not tokens_equal(metadata.get(TOKEN_METADATA_KEY), self._token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {TOKEN_METADATA_KEY}")
        try:
            return method(self, request, context)
        except FleetError as exc:
            context.abort(status_code(exc), str(exc))
        raise AssertionError("unreachable")

    return wrapper


class ControlServicer(control_pb2_grpc.ControlServiceServicer):
    """``node_checks``: what CheckNode runs (None: this controller answers it UNAVAILABLE)."""

    def __init__(self, control: JobControl, token: str, node_checks: NodeCheckRunner | None = None) -> None:
        self._control = control
        self._token = token
        self._node_checks = node_checks

    @_guarded
    def ListJobs(self, request: control_pb2.ListJobsRequest, context: grpc.ServicerContext) -> control_pb2.ListJobsReply:
        return control_pb2.ListJobsReply(jobs=self._control.list_jobs())

    @_guarded
    def GetJob(self, request: control_pb2.GetJobRequest, context: grpc.ServicerContext) -> control_pb2.JobStatus:
        return self._control.job_status(request.job_id)

    @_guarded
    def InjectFault(
        self, request: control_pb2.InjectFaultRequest, context: grpc.ServicerContext
    ) -> control_pb2.InjectFaultReply:
        # the same rules as the CLI's (a ConfigError becomes INVALID_ARGUMENT)
        validate_order(order_of(request.fault, request.rank, request.node))
        return self._control.inject_fault(request.job_id, request.rank, request.node, request.fault)

    @_guarded
    def StopJob(self, request: control_pb2.StopJobRequest, context: grpc.ServicerContext) -> control_pb2.StopJobReply:
        return self._control.stop_job(request.job_id, request.reason, request.requested_by)

    @_guarded
    def GetStatus(self, request: control_pb2.GetStatusRequest,
                  context: grpc.ServicerContext) -> control_pb2.StatusReply:
        return self._control.get_status(request.job_id)

    @_guarded
    def CheckNode(self, request: control_pb2.CheckNodeRequest,
                  context: grpc.ServicerContext) -> control_pb2.NodeCheckReply:
        if not request.node:
            raise ConfigError("node: must name a node")
        if not 0 < request.timeout_s <= CHECK_NODE_MAX_TIMEOUT_S:
            raise ConfigError(f"timeout_s: must be in (0, {CHECK_NODE_MAX_TIMEOUT_S:g}] (got {request.timeout_s:g})")
        if self._node_checks is None:
            raise UnavailableError("this controller runs no node checks")
        c = self._node_checks.check([request.node], request.timeout_s, purpose="release")[request.node]
        return control_pb2.NodeCheckReply(
            node=c.node, verdict=c.verdict, reason=c.reason, quarantined=c.quarantined, error=c.error,
            bound=c.bound, row=c.row, col=c.col, dtype=c.dtype, size=c.size, device=c.device,
            duration_s=c.duration_s, at=c.at)
