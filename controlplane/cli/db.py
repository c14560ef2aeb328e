"""`fleet db`: the store's schema. `upgrade` migrates it to this fleet's newest revision
(opening a store does the same on first use); `current` only looks."""

from __future__ import annotations

from typing import Annotated

import typer

from fleet.controlplane.cli.common import STORE_ENV, ClusterOpt, JsonOpt, store_url_of
from fleet.controlplane.cli.render import console, print_json, progress

app = typer.Typer(name="db", help="The store's schema: migrations.", no_args_is_help=True)

#: The shared --store option, also spelt --url here (its first name).
UrlOpt = Annotated[
    str | None,
    typer.Option("--url", "--store", envvar=STORE_ENV, show_envvar=True,
                 help="SQLAlchemy URL of the store \\[default: the --cluster file's store.url]"),
]


@app.command("upgrade")
def upgrade(url: UrlOpt = None, cluster: ClusterOpt = None, json_out: JsonOpt = False) -> None:
    """Migrate the store's schema to this fleet's newest revision, keeping every row."""
    from fleet.controlplane.store import migrate
    from fleet.controlplane.store.engine import redact

    store_url, _ = store_url_of(url, cluster)
    shown = redact(store_url)
    with progress(f"upgrading store {shown}"):
        before, after = migrate.upgrade_url(store_url)
    if json_out:
        print_json({"url": shown, "before": before, "after": after, "changed": before != after})
    elif before == after:
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

    s = migrate.inspect_url(store_url_of(url, cluster)[0])
    if json_out:
        print_json({"url": s.url, "current": s.current, "head": s.head, "state": s.state})
        return
    console.print(f"store {s.url} " + _DESCRIBE[s.state].format(current=s.current, head=s.head),
                  highlight=False, soft_wrap=True)
