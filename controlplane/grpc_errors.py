"""FleetError <-> gRPC status code, for the controller's gRPC servers and its client.

A server answers a ``FleetError`` with the status code of its class (the nearest class
in its MRO that the table names); the client turns a status code back into the
``FleetError`` class a caller catches, with the server's message. The error hierarchy
itself (``fleet.controlplane.errors``) knows nothing of gRPC, so that code raising it
(detectors, diagnosis) never imports gRPC.
"""

from __future__ import annotations

import grpc

from fleet.controlplane.errors import (
    AuthError,
    ConfigError,
    DumpError,
    FleetError,
    Interrupted,
    JobFailedError,
    JobStoppedError,
    NotFoundError,
    StateError,
    UnavailableError,
)

_STATUS_OF: dict[type[FleetError], grpc.StatusCode] = {
    FleetError: grpc.StatusCode.INTERNAL,
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    DumpError: grpc.StatusCode.INVALID_ARGUMENT,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    StateError: grpc.StatusCode.FAILED_PRECONDITION,
    AuthError: grpc.StatusCode.UNAUTHENTICATED,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,
    JobFailedError: grpc.StatusCode.ABORTED,
    JobStoppedError: grpc.StatusCode.ABORTED,
    Interrupted: grpc.StatusCode.CANCELLED,
}

#: What a client raises for a status code; any other code is a plain FleetError.
_ERROR_OF: dict[grpc.StatusCode, type[FleetError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: ConfigError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: StateError,
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
}


def status_code(err: FleetError) -> grpc.StatusCode:
    """The status code a server answers ``err`` with."""
    return next(_STATUS_OF[cls] for cls in type(err).__mro__ if cls in _STATUS_OF)


def error_class(code: grpc.StatusCode) -> type[FleetError]:
    """The FleetError class a client raises for a call that ended with ``code``."""
    return _ERROR_OF.get(code, FleetError)
