"""Client SDK for a running controller's ControlService (what the CLI and tests call).

Finds the controller through ``<state_dir>/controller.json`` unless given an address
and token (and, for a controller with mutual TLS, the client's ``TlsFiles``, which
controller.json also names); gRPC errors become ``FleetError``s with the server's message.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from fleet.controlplane import auth
from fleet.controlplane.errors import ConfigError
from fleet.controlplane.grpc_errors import error_class
from fleet.proto import control_pb2, control_pb2_grpc, events_pb2
from fleet.proto.contract import TOKEN_METADATA_KEY
from fleet.proto.kinds import FaultKind
from fleet.proto.tls import TlsFileError, TlsFiles, channel_credentials


class ControlClient:
    """A connection to one controller; a context manager."""

    def __init__(self, address: str, token: str, timeout_s: float = 10.0, tls: TlsFiles | None = None) -> None:
        self.address = address
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._timeout_s = timeout_s
        if tls is None:
            self._channel = grpc.insecure_channel(address)
        else:
            try:
                credentials = channel_credentials(tls)
            except TlsFileError as exc:
                raise ConfigError(str(exc)) from None
            self._channel = grpc.secure_channel(address, credentials)
        self._stub = control_pb2_grpc.ControlServiceStub(self._channel)

    @classmethod
    def from_state_dir(cls, state_dir: str | Path, address: str | None = None,
                       timeout_s: float = 10.0) -> ControlClient:
        """The controller whose controller.json is in ``state_dir`` (``UnavailableError``
        when there is none); ``timeout_s``: how long each call may take."""
        info = auth.read_controller_info(Path(state_dir))
        return cls(address or info.address, info.token, timeout_s=timeout_s, tls=info.tls_files())

    def _call(self, method, request, wait_s: float = 0.0):  # noqa: ANN001
        """``wait_s``: how long the call itself may take on the server, on top of the
        client's timeout."""
        try:
            return method(request, metadata=self._metadata, timeout=self._timeout_s + wait_s)
        except grpc.RpcError as exc:
            err = error_class(exc.code())
            detail = exc.details() or exc.code().name
            # a transport failure (no controller there) reads differently from a refusal
            # that the controller itself answered with UNAVAILABLE
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED or "connect" in detail.lower():
                detail = f"controller at {self.address} is not reachable ({detail})"
            raise err(detail) from None

    def reachable(self, timeout_s: float) -> bool:
        """Whether the controller's address accepts a connection (TLS handshake included)
        within ``timeout_s`` seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return False
        return True

    def list_jobs(self) -> list[control_pb2.JobSummary]:
        return list(self._call(self._stub.ListJobs, control_pb2.ListJobsRequest()).jobs)

    def job_status(self, job_id: str = "") -> control_pb2.JobStatus:
        return self._call(self._stub.GetJob, control_pb2.GetJobRequest(job_id=job_id))

    def inject_fault(
        self, job_id: str, kind: str, *, rank: int = -1, node: str = "", at_step: int = 0,
        duration_s: float = 0.0, after_s: float = 0.0, delay_s: float = 0.0, target: str = "",
        bit: int | None = None, value_error: float = 0.0, persistent: bool = False,
    ) -> control_pb2.InjectFaultReply:
        """Ask the controller to inject a fault (see ``controlplane.chaos`` for the kinds;
        ``target``, ``bit``, ``value_error`` and ``persistent`` are an sdc fault's)."""
        fault = events_pb2.FaultSpec(kind=_fault_kind(kind).wire, at_step=at_step, duration_s=duration_s,
                                     after_s=after_s, delay_s=delay_s, target=target, value_error=value_error,
                                     persistent=persistent)
        if bit is not None:
            fault.bit = bit
        req = control_pb2.InjectFaultRequest(job_id=job_id, rank=rank, node=node, fault=fault)
        return self._call(self._stub.InjectFault, req)

    def check_node(self, node: str, timeout_s: float = 30.0) -> control_pb2.NodeCheckReply:
        """Have the controller run the known-answer GEMM test on ``node`` now and wait up
        to ``timeout_s`` seconds for the verdict (``NodeCheckReply.verdict``)."""
        return self._call(self._stub.CheckNode, control_pb2.CheckNodeRequest(node=node, timeout_s=timeout_s),
                          wait_s=timeout_s)

    def stop_job(self, job_id: str, reason: str = "", requested_by: str = "") -> control_pb2.StopJobReply:
        """Ask the controller to stop ``job_id`` (it checkpoints, then tears down); returns
        at once with ``state`` "STOPPING", the attempt and job.stop_timeout_s."""
        return self._call(self._stub.StopJob, control_pb2.StopJobRequest(
            job_id=job_id, reason=reason, requested_by=requested_by))

    def get_status(self, job_id: str = "") -> control_pb2.StatusReply:
        """`fleet status` of ``job_id`` ("" = the job the controller runs)."""
        return self._call(self._stub.GetStatus, control_pb2.GetStatusRequest(job_id=job_id))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fault_kind(kind: str) -> FaultKind:
    """``kind`` as the contract's enum; ConfigError naming ``--kind`` when unknown."""
    try:
        return FaultKind(kind)
    except ValueError:
        known = ", ".join(FaultKind)
        raise ConfigError(f"--kind: unknown fault kind {kind!r} (choose from {known})") from None
