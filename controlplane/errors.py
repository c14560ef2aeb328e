"""The one error hierarchy of fleet.

Every error a user can cause or meet is a ``FleetError``; each subclass has a CLI exit
code, and ``fleet.controlplane.grpc_errors`` maps each to a gRPC status code (for the
servers and the client). Only the CLI entry point catches broadly and prints one line.

Imports nothing, gRPC included: the decision logic and the diagnosis engine raise these
errors and must run where gRPC is absent.
"""

from __future__ import annotations


class FleetError(Exception):
    """Base class. ``str(err)`` is the one line shown to the user."""

    exit_code = 1


class ConfigError(FleetError):
    """cluster.yaml or a CLI flag is invalid; the message names the file, key and line."""

    exit_code = 2


class DumpError(FleetError):
    """A flight-recorder dump file that cannot be read; the message names the file."""

    exit_code = 2


class NotFoundError(FleetError):
    """A job, attempt, node or rank that does not exist."""

    exit_code = 3


class StateError(FleetError):
    """An operation that the current lifecycle state does not allow (illegal transition)."""

    exit_code = 4


class AuthError(FleetError):
    """A caller without the job's token."""

    exit_code = 5


class UnavailableError(FleetError):
    """A controller, agent or cluster that cannot be reached in time."""

    exit_code = 6


class JobFailedError(FleetError):
    """The job ended FAILED: restarts exhausted or an unrecoverable error."""

    exit_code = 7


class JobStoppedError(FleetError):
    """The job ended STOPPED: an operator stopped it (`fleet stop`), after its checkpoint."""

    exit_code = 8


class Interrupted(FleetError):
    """The user interrupted a command (Ctrl-C); what it started has been torn down."""

    exit_code = 130
