"""The one error hierarchy of fleet.

Every error a user can cause or meet is a ``FleetError``; each subclass maps to a gRPC
status code (for servers) and a CLI exit code. Only the CLI entry point catches broadly
and prints one line.
"""

from __future__ import annotations

import grpc


class FleetError(Exception):
    """Base class. ``str(err)`` is the one line shown to the user."""

    exit_code = 1
    grpc_code = grpc.StatusCode.INTERNAL


class ConfigError(FleetError):
    """cluster.yaml or a CLI flag is invalid; the message names the file, key and line."""

    exit_code = 2
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class DumpError(FleetError):
    """A flight-recorder dump file that cannot be read; the message names the file."""

    exit_code = 2
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(FleetError):
    """A job, attempt, node or rank that does not exist."""

    exit_code = 3
    grpc_code = grpc.StatusCode.NOT_FOUND


class StateError(FleetError):
    """An operation that the current lifecycle state does not allow (illegal transition)."""

    exit_code = 4
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class AuthError(FleetError):
    """A caller without the job's token."""

    exit_code = 5
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class UnavailableError(FleetError):
    """A controller, agent or cluster that cannot be reached in time."""

    exit_code = 6
    grpc_code = grpc.StatusCode.UNAVAILABLE


class JobFailedError(FleetError):
    """The job ended FAILED: restarts exhausted or an unrecoverable error."""

    exit_code = 7
    grpc_code = grpc.StatusCode.ABORTED


class Interrupted(FleetError):
    """The user interrupted a command (Ctrl-C); what it started has been torn down."""

    exit_code = 130
    grpc_code = grpc.StatusCode.CANCELLED
