"""`fleet db`: the store's schema. `upgrade` migrates it to this fleet's newest revision
(opening a store does the same on first use); `current` only looks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fleet.controlplane.cli.common import DEFAULT_STORE_URL, JsonOpt
from fleet.controlplane.cli.render import console, print_json

app = typer.Typer(name="db", help="The store's schema: migrations.", no_args_is_help=True)

UrlOpt = Annotated[
    str | None,
    typer.Option("--url", "--store",
                 help="SQLAlchemy URL of the store [default: the --cluster file's store.url]"),
]
ClusterOpt = Annotated[
    Path | None,
    typer.Option("--cluster", "-c", help="cluster.yaml whose store to use [default: examples/local.yaml]"),
]


def _store_url(url: str | None, cluster: Path | None) -> str:
    """--url, else the cluster file's store.url (the file `fleet up` runs by default)."""
    from fleet.controlplane.config import DEFAULT_CLUSTER_FILE, load_cluster_config

    if url:
        return url
    if cluster is not None:
        return load_cluster_config(cluster).store.url
    if DEFAULT_CLUSTER_FILE.exists():
        return load_cluster_config(DEFAULT_CLUSTER_FILE).store.url
    return DEFAULT_STORE_URL


@app.command("upgrade")
def upgrade(url: UrlOpt = None, cluster: ClusterOpt = None) -> None:
    """Migrate the store's schema to this fleet's newest revision, keeping every row."""
    from fleet.controlplane.store import migrate
    from fleet.controlplane.store.engine import redact

    store_url = _store_url(url, cluster)
    before, after = migrate.upgrade_url(store_url)
    shown = redact(store_url)
    if before == after:
        console.print(f"store {shown} already at {after} (head)", highlight=False, soft_wrap=True)
    else:
        console.print(f"store {shown} upgraded {before or '(empty)'} -> {after}",
                      highlight=False, soft_wrap=True)


_DESCRIBE = {
    "head": "at {current} (head)",
    "behind": "at {current}; head is {head}: run `fleet db upgrade`",
    "empty": "empty (no schema yet); head is {head}",
    "unversioned": "made before migrations (no revision); `fleet db upgrade` stamps it and "
                   "brings it to {head}",
    "unknown": "at {current}, unknown to this fleet (head {head}): upgrade fleet",
}


@app.command("current")
def current(url: UrlOpt = None, cluster: ClusterOpt = None, json_out: JsonOpt = False) -> None:
    """Show the store's schema revision; changes nothing."""
    from fleet.controlplane.store import migrate

    s = migrate.inspect_url(_store_url(url, cluster))
    if json_out:
        print_json({"url": s.url, "current": s.current, "head": s.head, "state": s.state})
        return
    console.print(f"store {s.url} " + _DESCRIBE[s.state].format(current=s.current, head=s.head),
                  highlight=False, soft_wrap=True)
