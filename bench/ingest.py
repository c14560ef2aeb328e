"""Sustained ingest of collective events: agents -> gRPC -> controller -> SQL store.

    python bench/ingest.py [--agents 4] [--events 1200000] [--runs 3] [--block 500]
                           [--latency-s 10] [--postgres-url URL | --no-postgres] [--metrics]

Every part is the real one, each in its own process, all on 127.0.0.1:

  * **controller**: ``ControllerServer`` with the real ``AgentServicer`` (validation, the
    single ``IngestWriter`` with group commits, acks after commit) over a ``Store`` on a
    fresh SQLite file (WAL, ``synchronous=NORMAL``), or on a fresh database of a
    PostgreSQL server (a throwaway server started from the Debian binaries as the tests
    do, but with fsync on and ``synchronous_commit=off``, the same durability as that
    SQLite setting; or ``--postgres-url``);
  * **K synthetic agents**: each a real ``agent.uplink.Uplink`` streaming
    ``CollectiveColumns`` blocks of ``--block`` rows, which is what a node agent forwards
    from its workers' reports (``fleet.proto.columns.pack``), with distinct keys per agent.

Throughput: the agents submit ``--events`` in all as fast as the stream takes them
(``Uplink.submit`` blocks when the controller falls behind: gRPC flow control, nothing is
dropped); the rate is events / (last ack - first submit). Each run then checks that the
store holds exactly one row per event. ``--runs`` runs per backend; the median is shown.

The limit, in the same run: plain ``sqlite3.executemany`` of the very same rows (plain
``INSERT``, prebuilt tuples) into a fresh file with the same table and indexes and the
same pragmas (WAL, synchronous=NORMAL), one transaction per chunk; the best of chunk
sizes 2,000 and 20,000 rows per run, median over runs. ``ratio_to_raw`` = SQLite ingest
rate / that limit.

The agents' write-ahead log, in the same runs: each SQLite run is repeated with the
agents writing every submission to their log first, as a real node agent does
(``agent.wal``: one append per submit, one file per batch). ``agent_wal_ratio`` = that
rate / the rate without (median of per-run ratios).

``--metrics``: every controller runs with the batch-fed Prometheus metrics on, as ``fleet
up`` does (``collective_metrics``: every batch is queued for the metrics refresher, which
folds its rows into histograms, arrival-lag matches and gauges); compare a run with and
without it for what the metrics cost ingest.

Latency: agents pace their submits to half the measured SQLite maximum for
``--latency-s`` seconds; a block's latency is from its submit to the agent to the ack of
the batch holding it, which the controller sends after the commit (so an upper bound on
event-to-commit). p50/p99 over blocks.

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKEN = "bench-ingest-token-0123456789"
JOB = "j-20261130-000000-bnch"
GROUPS_PER_RANK = 2
RANKS_PER_AGENT = 8
OPS = ["all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast"]
SHAPES = [[[4096, 1024]], [[1024, 1024]], [[2, 8, 512]], [[1]], [[64, 4096], [64, 4096]]]


def _block(agent: int, first: int, n: int, now_ns: int):
    """Rows ``first .. first+n-1`` of agent ``fleet.agent`` as one CollectiveColumns block.

    Row i is rank agent*8 + i%8, group i//8 % 2, seq i//16: distinct keys everywhere."""
    from fleet.proto import events_pb2
    from fleet.proto.columns import dtypes_json, shapes_json

    strings = [JOB, "0", "1", *OPS, *(shapes_json(s) for s in SHAPES), dtypes_json(["bfloat16"]),
               "completed"]
    op0, shape0 = 3, 3 + len(OPS)
    dtype, state = shape0 + len(SHAPES), shape0 + len(SHAPES) + 1
    idx = range(first, first + n)
    ops = [op0 + (i // 16) % len(OPS) for i in idx]
    shapes = [shape0 + (i // 16) % len(SHAPES) for i in idx]
    return events_pb2.CollectiveColumns(
        strings=strings, job_id=[0] * n, attempt=[1] * n,
        rank=[agent * RANKS_PER_AGENT + i % RANKS_PER_AGENT for i in idx],
        group=[1 + (i // RANKS_PER_AGENT) % GROUPS_PER_RANK for i in idx],
        group_size=[RANKS_PER_AGENT] * n, seq=[i // (RANKS_PER_AGENT * GROUPS_PER_RANK) + 1 for i in idx],
        op=ops, input_sizes=shapes, input_dtypes=[dtype] * n, output_sizes=shapes,
        output_dtypes=[dtype] * n, enter_ns=[now_ns] * n, exit_ns=[now_ns + 1_000_000] * n,
        state=[state] * n, step=[i // 400 for i in idx], exit_estimated=[False] * n)


# -- child processes ------------------------------------------------------------------------

def serve_controller(url: str, metrics: bool = False) -> int:
    """Run a controller on ``url`` until stdin closes; print its address, then its counts.
    ``metrics``: with the controller's batch-fed metrics, as ``fleet up`` runs it (the
    ``CollectiveMetrics`` observer and the refresher thread folding every batch in)."""
    from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
    from fleet.controlplane.collective_metrics import CollectiveMetrics
    from fleet.controlplane.control_server import ControlServicer
    from fleet.controlplane.grpc_server import ControllerServer
    from fleet.controlplane.job_metrics import MetricsRefresher
    from fleet.controlplane.metrics import ControllerMetrics
    from fleet.controlplane.store import Store

    class NoJobs:  # ControlService is not exercised here
        pass

    with Store(url) as store:
        observed = None
        if metrics:
            observed = ControllerMetrics()
            feed = CollectiveMetrics(observed.registry, JOB)
            observed.on_close(MetricsRefresher(observed, None, feed, 1.0).start().close)
        servicer = AgentServicer(store, AgentRegistry(), TOKEN, controller_id="ctl-bench", metrics=observed,
                                 observer=feed.observe if metrics else None)
        server = ControllerServer(servicer, ControlServicer(NoJobs(), TOKEN)).start()
        print(json.dumps({"address": server.address}), flush=True)
        sys.stdin.read()
        cpu = time.process_time()
        server.close()
        m = servicer.metrics
        print(json.dumps({"events": m.value("fleet_ingest_events_total"),
                          "errors": sum(m.value("fleet_ingest_errors_total", reason=r)
                                        for r in ("malformed", "oversized", "invalid", "store")),
                          "cpu_s": cpu}), flush=True)
    return 0


def serve_agent(address: str, index: int, events: int, block: int, rate: float, spill_dir: str) -> int:
    """One synthetic agent: connect, wait for "go" on stdin, submit, wait for every ack.
    ``spill_dir``: with it, the agent writes every submission to its write-ahead log
    first, as a real node agent does (``agent.wal``); without, memory only."""
    from fleet.agent.settings import AgentSettings
    from fleet.agent.uplink import Uplink
    from fleet.proto import agent_pb2, events_pb2

    submitted: list[float] = []     # monotonic submit time per block
    acked_at: list[float] = []      # monotonic ack time per block, in order
    lock = threading.Lock()

    def on_ack(_seq: int, n_events: int) -> None:
        now = time.monotonic()
        with lock:
            acked_at.extend([now] * n_events)

    hello = agent_pb2.Hello(agent_id=f"bench-agent-{index}", node_name=f"bench-node-{index}",
                            token=TOKEN, epoch=time.time_ns(), pid=os.getpid())
    uplink = Uplink(controller_address=address, token=TOKEN, hello=hello,
                    on_command=lambda _c: None,
                    heartbeat=lambda: agent_pb2.Heartbeat(agent_id=hello.agent_id, time_ns=time.time_ns()),
                    settings=AgentSettings(heartbeat_interval_s=1.0, spill_dir=spill_dir), on_ack=on_ack).start()
    if not uplink.wait_welcomed(30):
        print(json.dumps({"error": "not welcomed"}), flush=True)
        return 1
    blocks = [events_pb2.Event(collectives=_block(index, first, min(block, events - first), 0))
              for first in range(0, events, block)]
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    interval = block / rate if rate > 0 else 0.0
    for i, ev in enumerate(blocks):
        if interval:
            due = start + i * interval
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        now_ns = time.time_ns()
        ev.collectives.enter_ns[:] = [now_ns] * len(ev.collectives.job_id)
        submitted.append(time.monotonic())
        uplink.submit([ev], timeout_s=120)
    ok = uplink.flush(timeout_s=300)
    uplink.close()
    with lock:
        lat = [a - s for s, a in zip(submitted, acked_at)]
        end = max(acked_at) if acked_at else time.monotonic()
    print(json.dumps({"ok": ok and len(acked_at) == len(blocks), "start": start, "end": end,
                      "events": events, "latencies": lat}), flush=True)
    return 0


# -- the driver -----------------------------------------------------------------------------

#: Flags every controller child gets (``--metrics``).
_CONTROLLER_FLAGS: list[str] = []


def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO)


def _line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"child {proc.args[2:]} exited ({proc.wait()})")
    return json.loads(line)


def run_ingest(url: str, agents: int, events: int, block: int, rate_per_agent: float,
               spill_dir: str = "") -> dict:
    """One run: a fresh controller on ``url`` and ``agents`` agents (writing a write-ahead
    log under ``spill_dir``, if given); returns rate, latencies."""
    ctl = _child("--serve-controller", url, *_CONTROLLER_FLAGS)
    procs: list[subprocess.Popen] = []
    try:
        address = _line(ctl)["address"]
        per_agent = events // agents
        procs = [_child("--serve-agent", address, "--index", str(i), "--events", str(per_agent),
                        "--block", str(block), "--rate", str(rate_per_agent), "--spill-dir", spill_dir)
                 for i in range(agents)]
        for p in procs:
            if not _line(p).get("ready"):
                raise RuntimeError("an agent did not connect")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [_line(p) for p in procs]
        for p in procs:
            p.stdin.close()
            p.wait(30)
        ctl.stdin.close()
        counts = _line(ctl)
        ctl.wait(30)
    finally:
        for p in [ctl, *procs]:
            if p.poll() is None:
                p.kill()
                p.wait()
    if not all(r["ok"] for r in results):
        raise RuntimeError("an agent did not get every batch acked")
    total = per_agent * agents
    elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
    lat = sorted(x for r in results for x in r["latencies"])
    return {"events": total, "committed": counts["events"], "errors": counts["errors"],
            "seconds": elapsed, "events_per_s": total / elapsed, "controller_cpu_s": counts["cpu_s"],
            "p50_s": lat[len(lat) // 2], "p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))]}


def count_rows(url: str) -> tuple[int, int]:
    """(rows, distinct keys) in the collectives table."""
    from sqlalchemy import create_engine, text
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            n = c.execute(text("SELECT count(*) FROM collectives")).scalar()
            keys = c.execute(text("SELECT count(*) FROM (SELECT DISTINCT job_id, attempt, rank, "
                                  "group_name, seq FROM collectives) k")).scalar()
    finally:
        engine.dispose()
    return int(n), int(keys)


def raw_sqlite(folder: Path, agents: int, events: int, block: int, chunk: int) -> float:
    """Rows/s of plain sqlite3.executemany of the benchmark's rows into a fresh file."""
    from fleet.controlplane.store import Store
    from fleet.controlplane.store.ingest import COLLECTIVE_COLUMNS, _column_rows

    path = folder / f"raw-{chunk}-{time.monotonic_ns()}.db"
    Store(f"sqlite:///{path}").close()  # the same tables and indexes as the real store
    per_agent = events // agents
    rows = [r for i in range(agents) for first in range(0, per_agent, block)
            for r in _column_rows(_block(i, first, min(block, per_agent - first), time.time_ns()))]
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    sql = (f"INSERT INTO collectives ({', '.join(COLLECTIVE_COLUMNS)}) "
           f"VALUES ({', '.join('?' * len(COLLECTIVE_COLUMNS))})")
    start = time.perf_counter()
    for at in range(0, len(rows), chunk):
        con.execute("BEGIN")
        con.executemany(sql, rows[at:at + chunk])
        con.execute("COMMIT")
    rate = len(rows) / (time.perf_counter() - start)
    con.close()
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4, help="synthetic agent processes (default 4)")
    parser.add_argument("--events", type=int, default=1_200_000, help="events per throughput run")
    parser.add_argument("--pg-events", type=int, default=0, help="events per PostgreSQL run (default --events)")
    parser.add_argument("--runs", type=int, default=3, help="throughput runs per backend (median)")
    parser.add_argument("--block", type=int, default=500, help="rows per CollectiveColumns block")
    parser.add_argument("--latency-s", type=float, default=10.0, help="length of the paced latency run")
    parser.add_argument("--postgres-url", help="an existing server's database URL (default: start one)")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    parser.add_argument("--metrics", action="store_true",
                        help="controllers with the batch-fed Prometheus metrics on, as fleet up runs them")
    parser.add_argument("--serve-controller", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--serve-agent", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--spill-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_controller:
        return serve_controller(args.serve_controller, args.metrics)
    if args.metrics:
        _CONTROLLER_FLAGS.append("--metrics")
    if args.serve_agent:
        return serve_agent(args.serve_agent, args.index, args.events, args.block, args.rate, args.spill_dir)

    folder = Path(tempfile.mkdtemp(prefix="fleet-bench-ingest-"))
    out: dict[str, float | int | str] = {"agents": args.agents, "block": args.block}
    print(f"{args.agents} agents, blocks of {args.block} rows, {args.events:,} events per run, "
          f"{args.runs} runs per backend; files in {folder}", flush=True)

    sqlite_rates, raw_rates, wal_rates = [], [], []
    for run in range(args.runs):
        url = f"sqlite:///{folder}/ingest-{run}.db"
        r = run_ingest(url, args.agents, args.events, args.block, 0.0)
        rows, keys = count_rows(url)
        if rows != r["events"] or keys != rows:
            raise SystemExit(f"SQLite run {run}: {rows} rows ({keys} keys) for {r['events']} events")
        raw = max(raw_sqlite(folder, args.agents, args.events, args.block, c) for c in (2000, 20000))
        sqlite_rates.append(r["events_per_s"])
        raw_rates.append(raw)
        print(f"  sqlite run {run}: {r['events_per_s']:,.0f} events/s ({r['seconds']:.2f} s, "
              f"controller CPU {r['controller_cpu_s']:.1f} s, {rows:,} rows, none lost or doubled); "
              f"raw executemany {raw:,.0f} rows/s; ratio {r['events_per_s'] / raw:.2f}", flush=True)
        # the same run with the agents' write-ahead log on (a real node agent's default)
        wal_url = f"sqlite:///{folder}/ingest-wal-{run}.db"
        w = run_ingest(wal_url, args.agents, args.events, args.block, 0.0, spill_dir=str(folder / f"wal-{run}"))
        rows, keys = count_rows(wal_url)
        if rows != w["events"] or keys != rows:
            raise SystemExit(f"SQLite WAL run {run}: {rows} rows ({keys} keys) for {w['events']} events")
        wal_rates.append(w["events_per_s"])
        print(f"  sqlite run {run}, agents with a write-ahead log: {w['events_per_s']:,.0f} events/s "
              f"({w['events_per_s'] / r['events_per_s']:.2f} x without)", flush=True)
    ev_sqlite, raw_rate = statistics.median(sqlite_rates), statistics.median(raw_rates)
    out.update(events_per_s_sqlite=round(ev_sqlite), raw_sqlite_rows_per_s=round(raw_rate),
               ratio_to_raw=round(ev_sqlite / raw_rate, 3),
               ratio_to_raw_per_run=[round(a / b, 3) for a, b in zip(sqlite_rates, raw_rates)],
               events_per_s_sqlite_agent_wal=round(statistics.median(wal_rates)),
               agent_wal_ratio=round(statistics.median(a / b for a, b in zip(wal_rates, sqlite_rates)), 3))

    half = ev_sqlite / 2
    events = int(half * args.latency_s) // args.agents * args.agents
    lat = run_ingest(f"sqlite:///{folder}/latency.db", args.agents, events, args.block,
                     half / args.agents)
    print(f"  sqlite latency at {half:,.0f} events/s (half the maximum) for {lat['seconds']:.1f} s: "
          f"p50 {lat['p50_s'] * 1e3:.1f} ms, p99 {lat['p99_s'] * 1e3:.1f} ms", flush=True)
    out.update(latency_rate_events_per_s=round(half), p50_latency_s=round(lat["p50_s"], 4),
               p99_latency_s=round(lat["p99_s"], 4))

    if not args.no_postgres:
        server = None
        if args.postgres_url:
            urls = iter([args.postgres_url] * args.runs)
        else:
            from tests.pg import PostgresServer
            server = PostgresServer(crash_safe=True)
            server.start()
            urls = iter([server.create_database() for _ in range(args.runs)])
        try:
            pg_rates = []
            pg_events = args.pg_events or args.events
            for run in range(args.runs):
                url = next(urls)
                if args.postgres_url:
                    _truncate(url)
                r = run_ingest(url, args.agents, pg_events, args.block, 0.0)
                rows, keys = count_rows(url)
                if rows != r["events"] or keys != rows:
                    raise SystemExit(f"PostgreSQL run {run}: {rows} rows ({keys} keys) for {r['events']} events")
                pg_rates.append(r["events_per_s"])
                print(f"  postgresql run {run}: {r['events_per_s']:,.0f} events/s ({r['seconds']:.2f} s, "
                      f"controller CPU {r['controller_cpu_s']:.1f} s, {rows:,} rows, none lost or doubled)",
                      flush=True)
            out["events_per_s_postgres"] = round(statistics.median(pg_rates))
        finally:
            if server is not None:
                server.stop()

    print(f"SQLite {out['events_per_s_sqlite']:,} events/s = {out['ratio_to_raw']:.2f} x raw executemany "
          f"({out['raw_sqlite_rows_per_s']:,} rows/s); p99 {out['p99_latency_s'] * 1e3:.0f} ms at half rate"
          + (f"; PostgreSQL {out['events_per_s_postgres']:,} events/s" if "events_per_s_postgres" in out else ""))
    print(json.dumps(out))
    return 0


def _truncate(url: str) -> None:
    from sqlalchemy import create_engine, text

    from fleet.controlplane.store import Store
    Store(url).close()
    engine = create_engine(url)
    with engine.begin() as c:
        c.execute(text("TRUNCATE collectives, ingest_batches"))
    engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
