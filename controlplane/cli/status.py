"""`fleet status [JOB] [--watch]`: one job and its nodes, from the running controller, or
from the store when no controller runs (or none accepts a connection within
``CONNECT_TIMEOUT_S``, or one does not answer within ``ANSWER_TIMEOUT_S``).

The job: state, attempt, step/total, loss, tokens/s, ETTR so far, restarts, the newest
valid checkpoint, the last incident and a stop in progress; per node: state, health,
quarantine reason, the current attempt's ranks on it, events lost on the way to the
store, and (live) its agent: connected, seconds since last heard from. Without JOB: the
running controller's job, else the newest job in the store. ``--watch`` redraws it every
``--interval`` seconds until the job ends or Ctrl-C (exit 0); on a pipe each view is
printed after the last; with ``--json`` it prints one JSON object per line per refresh.
``StatusSource`` is what `fleet stop` polls too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Group
from rich.text import Text

from fleet.controlplane.cli.common import ClusterOpt, StateDirOpt, StoreOpt, open_store, state_dir_of
from fleet.controlplane.cli.render import console, fmt_time, print_json, table
from fleet.controlplane.errors import ConfigError, FleetError, NotFoundError, UnavailableError
from fleet.controlplane.interrupts import DeferredInterrupt

if TYPE_CHECKING:
    from fleet.controlplane.client import ControlClient
    from fleet.controlplane.status import EttrCache, Status
    from fleet.controlplane.store import Store

#: How long a controller's address gets to accept a connection before the store answers
#: instead, seconds ...
CONNECT_TIMEOUT_S = 2.0
#: ... and how long a controller that accepted it gets to answer (one under load is still
#: the one to ask: the store lacks its live facts).
ANSWER_TIMEOUT_S = 10.0
#: The longest --interval, seconds.
MAX_INTERVAL_S = 3600.0
#: Evidence longer than this is cut in the text view (--json has all of it).
EVIDENCE_CHARS = 160


class StatusSource:
    """Where a status comes from: the controller of ``state_dir`` while it answers, else
    the store (``--store`` / ``--cluster``). Keeps its connections between calls (a
    `--watch`); a controller that stopped answering is asked again only once its
    controller.json changes. A context manager."""

    def __init__(self, state_dir: Path, store: str | None, cluster: Path | None) -> None:
        from fleet.controlplane.status import EttrCache

        self.state_dir = state_dir
        self._store_opts = (store, cluster)
        self._store: Store | None = None
        self._client: ControlClient | None = None
        self._given_up: str | None = None  # controller.json's text when the controller last failed to answer
        self._ettr: EttrCache = EttrCache()
        self.address = ""

    def client(self) -> ControlClient | None:
        """A client of the running controller; None when controller.json is missing (or
        unchanged since its controller stopped answering)."""
        from fleet.controlplane.client import ControlClient

        path = self.state_dir / "controller.json"
        try:
            text = path.read_text()
        except OSError:
            self._drop()
            return None
        if text == self._given_up:
            return None
        if self._client is None:
            try:
                client = ControlClient.from_state_dir(self.state_dir, timeout_s=ANSWER_TIMEOUT_S)
            except FleetError:
                self._given_up = text
                return None
            if not client.reachable(CONNECT_TIMEOUT_S):
                client.close()
                self._given_up = text
                return None
            self._client, self.address = client, client.address
        return self._client

    def gave_up(self) -> None:
        """The controller did not answer: use the store until controller.json changes."""
        try:
            self._given_up = (self.state_dir / "controller.json").read_text()
        except OSError:
            self._given_up = None
        self._drop()

    def _drop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(*self._store_opts)
        return self._store

    def get(self, job_id: str) -> Status:
        """The status of ``job_id`` ("" = the running controller's job, else the store's
        newest); ``NotFoundError`` when there is no such job."""
        from fleet.controlplane.status import from_proto, load_status

        client = self.client()
        if client is not None:
            try:
                return from_proto(client.get_status(job_id))
            except UnavailableError:
                self.gave_up()
        store = self.store()
        if not job_id:
            newest = store.list_jobs(limit=1)
            if not newest:
                raise NotFoundError("the store holds no job yet", hint="`fleet up` runs one")
            job_id = newest[0].id
        return load_status(store, job_id, time.time(), None, self._ettr)

    def close(self) -> None:
        self._drop()
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> StatusSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def status(
    job: Annotated[str, typer.Argument(
        help="Job id \\[default: the running controller's job, else the newest in the store].")] = "",
    watch: Annotated[bool, typer.Option(
        "--watch", "-w", help="Redraw every --interval until the job ends or Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between redraws with --watch.")] = 1.0,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print JSON (with --watch: one object per line per refresh).")] = False,
    state_dir: StateDirOpt = None,
    store: StoreOpt = None, cluster: ClusterOpt = None,
) -> None:
    """Show a job and its nodes: from the running controller, or from the store when none runs."""
    if not 0 < interval <= MAX_INTERVAL_S:
        raise ConfigError(f"--interval: must be in (0, {MAX_INTERVAL_S:g}] seconds (got {interval:g})")
    with StatusSource(state_dir_of(state_dir, cluster), store, cluster) as source:
        if not watch:
            s = source.get(job)
            if json_out:
                print_json(_as_json(s, source))
            else:
                console.print(render(s, source_text(s, source)))
            return
        try:
            _watch(source, job, interval, json_out)
        except KeyboardInterrupt:
            pass  # Ctrl-C ends a watch: exit 0


def _watch(source: StatusSource, job: str, interval: float, json_out: bool) -> None:
    """Redraw until the job ends or Ctrl-C, which ends the watch after the refresh in
    progress (``interrupts``: an interrupt inside a store read or a gRPC call can leave a
    lock held that closing the source then waits on for ever)."""
    with DeferredInterrupt() as ctrl_c:
        _redraw(source, job, interval, json_out, ctrl_c)


def _redraw(source: StatusSource, job: str, interval: float, json_out: bool, ctrl_c: DeferredInterrupt) -> None:
    from rich.live import Live

    s = source.get(job)
    job = s.job.job_id  # keep watching this job, even once its controller is gone
    if json_out:
        while True:
            sys.stdout.write(json.dumps(_as_json(s, source), default=str) + "\n")
            sys.stdout.flush()
            if _ended(s):
                return
            ctrl_c.pause(interval)
            s = source.get(job)
    if not console.is_terminal:  # a pipe or a log: one view after another
        while True:
            console.print(render(s, source_text(s, source)))
            console.file.flush()
            if _ended(s):
                return
            ctrl_c.pause(interval)
            s = source.get(job)
    with Live(render(s, source_text(s, source)), console=console, auto_refresh=False) as live:
        while not _ended(s):
            ctrl_c.pause(interval)
            s = source.get(job)
            live.update(render(s, source_text(s, source)), refresh=True)


def _ended(s: Status) -> bool:
    return s.job.state in ("SUCCEEDED", "FAILED", "STOPPED")


def _as_json(s: Status, source: StatusSource) -> dict:
    from fleet.controlplane.status import to_dict

    out = to_dict(s)
    out["controller"] = source.address if s.live else None
    return out


def source_text(s: Status, source: StatusSource) -> str:
    if s.live:
        return f"from the running controller at {source.address}"
    return "from the store (no controller running)"


# -- the text view ---------------------------------------------------------------------------


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.1f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def render(s: Status, where: str) -> Group:
    """The Rich view: a header line, the job's figures, the last incident, a node table."""
    j = s.job
    colour = {"SUCCEEDED": "green", "FAILED": "red", "STOPPED": "yellow", "RUNNING": "green"}.get(j.state, "cyan")
    head = Text.assemble((j.job_id, "bold"), f" {j.name}  ", (j.state, f"bold {colour}"))
    if j.attempt:
        head.append(f"  attempt {j.attempt} {j.attempt_state}")
    if j.stopping and not _ended(s):
        head.append(f"  stopping: {j.stopping}", style="yellow")
    head.append(f"  {where}", style="dim")
    steps = f"step {j.step}/{j.total_steps}" if j.total_steps else f"step {j.step}"
    figures = [steps,
               f"loss {j.loss:.4f}" if j.loss is not None else "loss -",
               f"tokens/s {j.tokens_per_s:,.0f}",
               f"ETTR {j.ettr:.1%}" if j.ettr is not None else "ETTR -",
               f"restarts {j.restarts}",
               f"checkpoint step {j.checkpoint_step}" if j.checkpoint_step is not None else "no checkpoint"]
    lines: list[Text | object] = [head, Text("  ".join(figures))]
    if j.reason:
        lines.append(Text(f"reason: {j.reason}", overflow="fold"))
    i = j.last_incident
    if i is not None:
        evidence = i.evidence if len(i.evidence) <= EVIDENCE_CHARS else i.evidence[:EVIDENCE_CHARS - 3] + "..."
        where_i = f"rank {i.rank} on {i.node}" if i.rank >= 0 else (i.node or "no node named")
        lines.append(Text(f"last incident: {i.kind}{' (observed)' if i.observed else ''}, {where_i}, "
                          f"{fmt_time(i.detected_at)} ({_ago(s.at - i.detected_at)}): {evidence}", overflow="fold"))
    else:
        lines.append(Text("last incident: none"))
    rows = []
    for n in s.nodes:
        if s.live:
            agent = "connected" + (f", heard {_ago(n.silent_s)}" if n.silent_s is not None else "") \
                if n.agent_connected else "not connected"
        else:
            agent = f"last seen {fmt_time(n.last_seen)}"
        rows.append([n.name, n.state, n.health, ",".join(map(str, n.ranks)) or "-", agent, n.events_lost,
                     n.quarantine_reason])
    lines.append(table(None, ["node", "state", "health", "ranks", "agent", "events lost", "quarantine reason"], rows))
    return Group(*lines)
