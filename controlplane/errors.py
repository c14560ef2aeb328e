"""The one error hierarchy of fleet.

Every error a user can cause or meet is a ``FleetError``; each subclass has a CLI exit
code, and ``fleet.controlplane.grpc_errors`` maps each to a gRPC status code (for the
servers and the client). Only the CLI entry point catches broadly and prints two lines:
``error: <message>`` and ``hint: <what to do>``.

Every class has a default ``hint``; a raise site that knows better passes its own
(``NotFoundError(..., hint="...")``). A hint may say ``fleet <command>``: the CLI puts the
command the user ran there.

Imports nothing, gRPC included: the decision logic and the diagnosis engine raise these
errors and must run where gRPC is absent.
"""

from __future__ import annotations


class FleetError(Exception):
    """Base class. ``str(err)`` is the one line shown to the user; ``hint`` the one line
    after it, saying what to do."""

    exit_code = 1
    hint = "run the command again with --traceback for the full traceback; report it if it looks like a bug"

    def __init__(self, *args: object, hint: str | None = None) -> None:
        super().__init__(*args)
        if hint is not None:
            # an instance attribute: pickling (Ray, the agent's error reports) keeps it
            self.hint = hint


class ConfigError(FleetError):
    """cluster.yaml or a CLI flag is invalid; the message names the file, key and line."""

    exit_code = 2
    hint = "`fleet <command> --help` lists its flags; `fleet config schema` the cluster.yaml keys"


class DumpError(FleetError):
    """A flight-recorder dump file that cannot be read; the message names the file."""

    exit_code = 2
    hint = ("a dump is a PyTorch flight-recorder file (pickle or JSON, format 2.x); "
            "--prefix picks which files of the folder are read")


class NotFoundError(FleetError):
    """A job, attempt, node or rank that does not exist."""

    exit_code = 3
    hint = "`fleet jobs` and `fleet nodes` list what the store holds (--store, FLEET_STORE or --cluster pick the store)"


class StateError(FleetError):
    """An operation that the current lifecycle state does not allow (illegal transition)."""

    exit_code = 4
    hint = "`fleet jobs` and `fleet nodes` show the current states"


class AuthError(FleetError):
    """A caller without the job's token."""

    exit_code = 5
    hint = ("run it as the user who ran `fleet up`, with its --state-dir (or FLEET_STATE_DIR): "
            "the token is in that folder's controller.json")


class UnavailableError(FleetError):
    """A controller, agent or cluster that cannot be reached in time."""

    exit_code = 6
    hint = "is `fleet up` running? (--state-dir or FLEET_STATE_DIR names its folder)"


class JobFailedError(FleetError):
    """The job ended FAILED: restarts exhausted or an unrecoverable error."""

    exit_code = 7
    hint = "`fleet report JOB` and `fleet replay JOB` show why"


class JobStoppedError(FleetError):
    """The job ended STOPPED: an operator stopped it (`fleet stop`), after its checkpoint."""

    exit_code = 8
    hint = "stopped on purpose (exit code 8, not a failure); `fleet report JOB` shows its attempts"


class Interrupted(FleetError):
    """The user interrupted a command (Ctrl-C); what it started has been torn down."""

    exit_code = 130
    hint = "everything it started was torn down; run the command again to start over"
