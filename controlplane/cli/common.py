"""Options and helpers shared by the CLI modules."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fleet.controlplane.errors import NotFoundError

if TYPE_CHECKING:
    from fleet.controlplane.store import Store

DEFAULT_STORE_URL = "sqlite:///.fleet/fleet.db"

StoreOpt = Annotated[
    str | None,
    typer.Option("--store", help="SQLAlchemy URL of the store [default: the --cluster file's store.url]"),
]
ClusterOpt = Annotated[
    Path | None,
    typer.Option("--cluster", "-c", help="cluster.yaml whose store to read [default: examples/local.yaml]"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
StateDirOpt = Annotated[
    Path, typer.Option("--state-dir", help="Folder holding the running controller's controller.json.")
]


def open_store(store: str | None, cluster: Path | None) -> Store:
    """The store named by --store, else by the cluster file's store.url, for reading: a
    SQLite file that does not exist is an error (a typo must not create an empty store)."""
    # imported here: commands that need no store (replay --dumps) start faster
    from fleet.controlplane.config import DEFAULT_CLUSTER_FILE, load_cluster_config
    from fleet.controlplane.store import Store
    from fleet.controlplane.store.engine import sqlite_file

    if store:
        url, source = store, "--store"
    elif cluster is not None:
        url, source = load_cluster_config(cluster).store.url, f"{cluster}: store.url"
    elif DEFAULT_CLUSTER_FILE.exists():
        url, source = load_cluster_config(DEFAULT_CLUSTER_FILE).store.url, f"{DEFAULT_CLUSTER_FILE}: store.url"
    else:
        url, source = DEFAULT_STORE_URL, "the default store"
    path = sqlite_file(url)
    if path is not None and not path.exists():
        raise NotFoundError(f"{source}: no store at {path} (nothing has run with it yet?)")
    return Store(url)
