"""Options and helpers shared by the CLI modules, and where each command finds its store,
state folder and cluster file.

Every setting is taken from, in order: its flag, its environment variable, the cluster
file's value, the built-in default:

- the cluster file: ``--cluster``, ``FLEET_CLUSTER``, ``examples/local.yaml``;
- the store: ``--store``, ``FLEET_STORE``, the cluster file's ``store.url``,
  ``sqlite:///.fleet/fleet.db``;
- the state folder (controller.json, logs): ``--state-dir``, ``FLEET_STATE_DIR``, the
  cluster file's ``state_dir``, ``.fleet``.

`fleet up` and `fleet run` honour ``FLEET_STORE`` and ``FLEET_STATE_DIR`` as overrides of
``store.url`` and ``state_dir`` (``--set`` beats them), so what they write is where the
reading commands look. This module is the CLI's edge: only it reads ``os.environ``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fleet.controlplane.errors import ConfigError, NotFoundError

if TYPE_CHECKING:
    from fleet.controlplane.config import ClusterConfig
    from fleet.controlplane.config_overrides import Override
    from fleet.controlplane.store import Store

DEFAULT_STORE_URL = "sqlite:///.fleet/fleet.db"
DEFAULT_STATE_DIR = Path(".fleet")
#: The environment variables that stand in for a flag.
STORE_ENV, STATE_DIR_ENV, CLUSTER_ENV = "FLEET_STORE", "FLEET_STATE_DIR", "FLEET_CLUSTER"

# typer reads the variable when the flag is absent (and shows it in --help); the
# resolution functions below then take a value without knowing which of the two it was
StoreOpt = Annotated[
    str | None,
    typer.Option("--store", envvar=STORE_ENV, show_envvar=True,
                 help="SQLAlchemy URL of the store \\[default: the --cluster file's store.url]"),
]
ClusterOpt = Annotated[
    Path | None,
    typer.Option("--cluster", "-c", envvar=CLUSTER_ENV, show_envvar=True,
                 help="cluster.yaml to read settings from \\[default: examples/local.yaml]"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
StateDirOpt = Annotated[
    Path | None,
    typer.Option("--state-dir", envvar=STATE_DIR_ENV, show_envvar=True,
                 help="Folder of the running controller's controller.json and the logs "
                      "\\[default: the --cluster file's state_dir, else .fleet]"),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", metavar="KEY=VALUE",
                 help="Set a cluster.yaml key, validated as in the file (repeatable): "
                      "--set job.steps=1000 --set 'job.entrypoint.args=[--lr, \"0.1\"]'"),
]


def _env(name: str) -> str | None:
    """The variable's value; None when unset or empty (as typer treats it)."""
    return os.environ.get(name) or None


def _named(flag: str, env: str, value: object) -> str:
    """How an error names where ``value`` came from: the variable when it holds that
    value (typer filled it in, or the flag repeats it), else the flag."""
    return env if _env(env) is not None and _env(env) == str(value) else flag


def cluster_file(cluster: Path | None) -> Path | None:
    """The cluster file a command reads settings from: --cluster or FLEET_CLUSTER, else
    the embedded default when it exists; None when there is none."""
    from fleet.controlplane.config import DEFAULT_CLUSTER_FILE

    if cluster is not None:
        return cluster
    env = _env(CLUSTER_ENV)
    if env is not None:
        return Path(env)
    return DEFAULT_CLUSTER_FILE if DEFAULT_CLUSTER_FILE.exists() else None


def env_overrides() -> list[Override]:
    """FLEET_STORE and FLEET_STATE_DIR as overrides of ``store.url`` and ``state_dir``
    (for `fleet up`, `fleet run`, `fleet config show`)."""
    from fleet.controlplane.config_overrides import Override

    out = []
    for env, key in ((STORE_ENV, ("store", "url")), (STATE_DIR_ENV, ("state_dir",))):
        value = _env(env)
        if value is not None:
            out.append(Override(key, value, f"{env}={value}"))
    return out


def load_cluster(cluster: Path | None, sets: list[str] | None = None) -> tuple[ClusterConfig, Path]:
    """(the validated config, its file) as `fleet up` runs it: the cluster file
    (``cluster_file``), then FLEET_STORE / FLEET_STATE_DIR, then every ``--set`` in order."""
    from fleet.controlplane.config import DEFAULT_CLUSTER_FILE, load_cluster_config
    from fleet.controlplane.config_overrides import parse_overrides

    overrides = [*env_overrides(), *parse_overrides(sets)]  # parsed first: a bad --set fails fast
    path = cluster_file(cluster) or DEFAULT_CLUSTER_FILE
    try:
        return load_cluster_config(path, overrides), path
    except ConfigError as exc:
        env = _env(CLUSTER_ENV)
        if env is not None and Path(env) == path and not path.exists():
            raise ConfigError(f"{CLUSTER_ENV}: {exc}",
                              hint=f"{CLUSTER_ENV} names a file that is not there: set it right, "
                                   "unset it, or give --cluster") from None
        raise


def state_dir_of(state_dir: Path | None, cluster: Path | None) -> Path:
    """The state folder: --state-dir or FLEET_STATE_DIR, else the cluster file's
    state_dir, else .fleet."""
    if state_dir is not None:
        return state_dir
    env = _env(STATE_DIR_ENV)
    if env is not None:
        return Path(env)
    path = cluster_file(cluster)
    if path is None:
        return DEFAULT_STATE_DIR
    from fleet.controlplane.config import load_cluster_config

    return Path(load_cluster_config(path).state_dir)


def store_url_of(store: str | None, cluster: Path | None) -> tuple[str, str]:
    """(the store's URL, what named it, for errors): --store or FLEET_STORE, else the
    cluster file's store.url, else the default SQLite file."""
    if store:
        return store, _named("--store", STORE_ENV, store)
    env = _env(STORE_ENV)
    if env is not None:
        return env, STORE_ENV
    path = cluster_file(cluster)
    if path is None:
        return DEFAULT_STORE_URL, "the default store"
    from fleet.controlplane.config import load_cluster_config

    return load_cluster_config(path).store.url, f"{path}: store.url"


def open_store(store: str | None, cluster: Path | None) -> Store:
    """The store (``store_url_of``), for reading: a SQLite file that does not exist is an
    error (a typo must not create an empty store)."""
    # imported here: commands that need no store (replay --dumps) start faster
    from fleet.controlplane.store import Store
    from fleet.controlplane.store.engine import sqlite_file

    url, source = store_url_of(store, cluster)
    path = sqlite_file(url)
    if path is not None and not path.exists():
        raise NotFoundError(
            f"{source}: no store at {path} (nothing has run with it yet?)",
            hint="run the command in the folder `fleet up` ran in, or name its store: --store URL, "
                 f"{STORE_ENV}, or --cluster FILE (its store.url)")
    return Store(url)
