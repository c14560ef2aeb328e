"""Entry point of the `fleet` command: wires the noun modules and owns error handling.

Only this function catches broadly: a ``FleetError`` prints two lines on stderr,
``error: <message>`` and ``hint: <what to do>``, and exits with its class's code;
``--traceback`` prints the full traceback before them. Usage errors are typer's own (exit
code 2 with the usage line).
"""

from __future__ import annotations

import sys
import traceback

import typer

from fleet.controlplane.cli import config_cmd, db, faults, jobs, logs, model, nodes, replay, report, run, up
from fleet.controlplane.cli import status
from fleet.controlplane.cli.render import print_error
from fleet.controlplane.errors import FleetError

app = typer.Typer(
    name="fleet",
    help="fleet: cluster-reliability control plane for large PyTorch training. "
    "Add --traceback to any command to see the full traceback of an error.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("up")(up.up)
app.command("run", context_settings=run.CONTEXT_SETTINGS)(run.run)
app.command("logs")(logs.logs)
app.command("jobs")(jobs.jobs)
app.command("status")(status.status)
app.command("stop")(jobs.stop)
app.command("nodes")(nodes.nodes)
app.command("quarantine")(nodes.quarantine)
app.command("release")(nodes.release)
app.command("replay")(replay.replay)
app.command("report")(report.report)
app.command("inject-fault")(faults.inject_fault)
app.command("model-info")(model.model_info)
app.add_typer(db.app, name="db")
app.add_typer(config_cmd.app, name="config")

def _fleet_args_end(args: list[str]) -> int:
    """Where fleet's own arguments end: `fleet run`'s program gets the rest untouched, a
    --traceback of its own included."""
    command = next((i for i, a in enumerate(args) if a != "--traceback"), len(args))
    if args[command:command + 1] != ["run"]:
        return len(args)
    return command + 1 + run.program_start(args[command + 1:], typer.main.get_command(app).commands["run"])


def _hint(exc: FleetError, args: list[str]) -> str:
    """The error's hint, ``fleet <command>`` in it made the command the user ran."""
    hint = exc.hint or ""
    if "fleet <command>" not in hint:
        return hint
    words = [a for a in args if not a.startswith("-")]
    command = words[:1]
    subcommands = getattr(typer.main.get_command(app).commands.get(words[0]), "commands", None) if words else None
    if subcommands:  # a group (`fleet db upgrade`): its command is the first of its words after it
        command += next(([w] for w in words[1:] if w in subcommands), [])
    return hint.replace("fleet <command>", " ".join(["fleet", *command]))


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and exits with) the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    own = _fleet_args_end(args)
    show_traceback = "--traceback" in args[:own]
    args = [a for a in args[:own] if a != "--traceback"] + args[own:]
    code = 0
    try:
        app(args=args, prog_name="fleet", standalone_mode=True)
    except SystemExit as exc:  # typer ends every command, usage errors included, this way
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except FleetError as exc:
        if show_traceback:
            traceback.print_exc()
        print_error(str(exc), _hint(exc, args[:own]))
        code = exc.exit_code
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
