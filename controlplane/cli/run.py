"""`fleet run`: torchrun's shape for your own script, under the whole control plane.

``fleet run [--nodes N] [--nproc-per-node R] [--max-restarts K] [--set KEY=VALUE]...
script.py [args...]`` (or ``-m module [args...]``) builds a ``ClusterConfig`` in memory
(``run_config``): the embedded default's settings (``examples/local.yaml``) without its
built-in-trainer recipe, a local Ray cluster of N simulated nodes, R ranks per node, and
``job.entrypoint`` = the program, its arguments, the current directory as workdir, the
caller's environment, and tee on. The store is SQLite under ``--state-dir``. The job
then takes the same path as `fleet up` (``up.run_job``), and the exit code is 0 only
when it SUCCEEDED. ``--set`` (and ``FLEET_STORE``) override keys of that config last,
validated as cluster.yaml's are.

Everything after the script or module goes to the program untouched, options included
(click stops parsing options at the first positional argument); ``program_start``
tells the entry point where that is, so it strips ``--traceback`` only before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fleet.controlplane.cli.common import DEFAULT_STATE_DIR, STATE_DIR_ENV, SetOpt, env_overrides
from fleet.controlplane.errors import ConfigError

if TYPE_CHECKING:  # the config imports pydantic and gRPC: only `fleet run` itself pays for them
    from fleet.controlplane.config import ClusterConfig
    from fleet.controlplane.config_overrides import Override

#: What `fleet run` names itself in errors (where `fleet up` names the cluster file).
SOURCE = "fleet run"
#: click settings of the command: options end at the script (or module) name.
CONTEXT_SETTINGS = {"allow_interspersed_args": False}
#: torchrun's --max-restarts defaults to 0; fleet's to job.max_restarts' default, 3:
#: restarting on healthy nodes is what fleet is for.
DEFAULT_MAX_RESTARTS = 3


def run(
    program: Annotated[
        list[str] | None,
        typer.Argument(metavar="SCRIPT|MODULE [ARGS]...", show_default=False,
                       help="The script (or, with -m, the module) and its arguments, passed on untouched."),
    ] = None,
    module: Annotated[
        bool, typer.Option("-m", "--module", help="Run a module (`python -m MODULE`) instead of a script.")
    ] = False,
    nodes: Annotated[int, typer.Option("--nodes", min=1, max=16, help="Simulated nodes (local Ray).")] = 1,
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", min=1, max=64, help="Ranks per node.")
    ] = 1,
    max_restarts: Annotated[
        int, typer.Option("--max-restarts", min=0, max=1000,
                          help="Attempts after the first before giving up (torchrun's default is 0).")
    ] = DEFAULT_MAX_RESTARTS,
    tee: Annotated[
        bool, typer.Option("--tee/--no-tee", help="Also print every rank's output here, prefixed \\[rank r].")
    ] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print the final summary as JSON.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show controller logs.")] = False,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", envvar=STATE_DIR_ENV, show_envvar=True,
                           help="Folder for the store, logs and checkpoints.")
    ] = DEFAULT_STATE_DIR,
    sets: SetOpt = None,
) -> None:
    """Run your own torch.distributed script (or -m module) on every rank, torchrun-style,
    with fleet's tracing, diagnosis and restarts. Prints the job id first; exits 0 only
    when every rank finished. --set overrides a key of the config it builds (job.*,
    detect.*, ...); FLEET_STORE overrides its store."""
    from fleet.controlplane.cli.up import run_job
    from fleet.controlplane.config_overrides import parse_overrides
    from fleet.controlplane.entrypoint import check_entrypoint

    if not program:
        raise ConfigError(f"{SOURCE}: give a script to run, or -m and a module")
    if program[0].startswith("-") and program[0] != "-":
        raise ConfigError(f"{SOURCE}: no such option: {program[0]} (a script's own options come after it)")
    # FLEET_STATE_DIR is --state-dir's variable already: only the store's is an override here
    overrides = [o for o in env_overrides() if o.key != ("state_dir",)] + parse_overrides(sets)
    config = run_config(program[0], program[1:], module=module, nodes=nodes, nproc_per_node=nproc_per_node,
                        max_restarts=max_restarts, tee=tee, state_dir=state_dir, workdir=Path.cwd(),
                        overrides=overrides)
    check_entrypoint(config, SOURCE)
    run_job(config, json_out=json_out, verbose=verbose, announce=not json_out)


def run_config(target: str, args: Sequence[str], *, module: bool = False, nodes: int = 1,
               nproc_per_node: int = 1, max_restarts: int = DEFAULT_MAX_RESTARTS, tee: bool = True,
               state_dir: Path = DEFAULT_STATE_DIR, workdir: Path | None = None,
               overrides: Sequence[Override] = ()) -> ClusterConfig:
    """The cluster config `fleet run` runs ``target`` (a script path relative to
    ``workdir``, or a module with ``module``) with, ``overrides`` (``--set``) set on it
    last; ``ConfigError`` names a bad value (or the override that set it)."""
    import yaml

    from fleet.controlplane.config import DEFAULT_CLUSTER_FILE, validate_cluster_data
    from fleet.workers.spec import TrainArgs, documented_fields

    data: dict[str, Any] = yaml.safe_load(DEFAULT_CLUSTER_FILE.read_text(encoding="utf-8")) or {}
    recipe = {*documented_fields(TrainArgs), "model"}
    job = {k: v for k, v in (data.get("job") or {}).items() if k not in recipe}
    entrypoint: dict[str, Any] = {
        "module" if module else "script": target, "args": list(args),
        "workdir": str(workdir or Path.cwd()), "inherit_env": True, "tee": tee,
    }
    job.update(nodes=nodes, ranks_per_node=nproc_per_node, max_restarts=max_restarts, entrypoint=entrypoint,
               checkpoint_dir=str(state_dir / "checkpoints"))
    data.update(
        name=_job_name(target, module), state_dir=str(state_dir), job=job,
        ray={**(data.get("ray") or {}), "address": None, "nodes": nodes},
        store={"url": f"sqlite:///{state_dir / 'fleet.db'}"},
    )
    return validate_cluster_data(data, SOURCE, overrides=overrides)


def _job_name(target: str, module: bool) -> str:
    """The job's name: the module, or the script's file name without its suffix."""
    name = target if module else Path(target).stem
    return (name or "fleet-run")[:128]


def program_start(args: Sequence[str], command: Any) -> int:
    """Index in ``args`` (what follows ``run``) of the script or module name: the first
    token that is neither one of ``command``'s options nor an option's value. ``len(args)``
    when there is none. ``command``: the click command of `fleet run` (typer's own copy
    of click, hence read by attribute)."""
    takes_value: set[str] = set()
    flags: set[str] = set()
    for param in command.params:
        if param.param_type_name == "option":
            names = [*param.opts, *param.secondary_opts]
            (flags if param.is_flag or param.count else takes_value).update(names)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return i + 1
        name = arg.split("=", 1)[0]
        if name in takes_value:
            i += 1 if "=" in arg else 2
        elif name in flags or name in ("--traceback", "--help"):
            i += 1
        else:
            return i
    return len(args)
