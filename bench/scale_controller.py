"""A headless controller for ``bench/scale.py``: the real ingest, watchdog and store,
without Ray or a launcher.

    python -m bench.scale_controller --store URL --port P --job JOB --ranks R [--attempt N]
                                     [--hang-factor F] [--interval-s S]

Assembles what the real controller does for one job: a ``Store(URL)``, an
``AgentRegistry``, a ``Watchdog`` (its ``send`` is ``registry.send``, so a large job's
diagnosis pulls raw entries from the agents), an ``AgentServicer`` whose observer is the
watchdog, a ``ControllerServer`` on 127.0.0.1:P. Every incident the watchdog fires is
stored (``Store.record_incident``, as the attempt runner stores one), so the bench reads
it back from the store. Node names are the simulated layout's (``bench.scale_schedule``).

Prints ``{"address": ...}`` once serving. Control on stdin, one JSON object a line:
``{"cmd": "attempt"}`` creates the job's next attempt (RUNNING) and watches it, replying
``{"attempt": N}``; ``{"cmd": "watch", "attempt": N}`` watches an existing one (what a
restarted controller does). ``--ingest-processes N``: the agents' streams are served by N
ingest processes on port P (``controller.ingest_processes``), the controller's own
AgentService on a free port. Runs until SIGTERM or stdin closes; restartable on the same
port and store (``--attempt N``: watch attempt N from the start).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
import time

from bench.scale_schedule import Layout
from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
from fleet.controlplane.config import DetectConfig
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.detectors import Incident
from fleet.controlplane.grpc_server import MAX_MESSAGE_BYTES, ControllerServer
from fleet.controlplane.ingest_shards import IngestShards
from fleet.controlplane.lifecycle import AttemptState
from fleet.controlplane.store import Store
from fleet.controlplane.watchdog import Watchdog

TOKEN = "bench-scale-token-0123456789"


class _NoJobs:  # ControlService is not exercised here
    pass


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(url: str, port: int, job: str, ranks: int, attempt: int | None, cfg: DetectConfig,
          ingest_processes: int = 0) -> int:
    layout = Layout(ranks)
    nodes = [layout.node_of(r) for r in range(ranks)]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Store(url) as store:
        registry = AgentRegistry()
        current = {"attempt": attempt or 0}

        def on_incident(incident: Incident) -> None:
            store.record_incident(job, current["attempt"], incident.kind, incident.detector, incident.evidence,
                                  rank=incident.rank, node=incident.node)

        watchdog = Watchdog(store, job, cfg, on_incident, lambda: registry.silent_for(time.monotonic()),
                            send=registry.send)
        servicer = AgentServicer(store, registry, TOKEN, controller_id="ctl-bench-scale",
                                 observer=watchdog.observe)
        own_port = 0 if ingest_processes else port
        with contextlib.ExitStack() as stack:
            stack.enter_context(watchdog)
            server = stack.enter_context(ControllerServer(servicer, ControlServicer(_NoJobs(), TOKEN), port=own_port))
            address = server.address
            if ingest_processes:
                shards = stack.enter_context(IngestShards(
                    ingest_processes, store_url=url, host="127.0.0.1", port=port, token=TOKEN,
                    controller_id="ctl-bench-scale", registry=registry, observer=watchdog.observe,
                    max_message_bytes=MAX_MESSAGE_BYTES))
                address = shards.address
            if attempt:
                watchdog.watch(attempt, nodes)
            _reply({"address": address})

            def control() -> None:
                for line in sys.stdin:
                    cmd = json.loads(line)
                    if cmd["cmd"] == "attempt":
                        n = store.create_attempt(job)
                        store.set_attempt_state(job, n, AttemptState.RUNNING, "bench")
                        # placed as the controller places them: every rank on its node
                        store.record_ranks(job, n, [(r, node, 0) for r, node in enumerate(nodes)])
                        current["attempt"] = n
                        watchdog.watch(n, nodes)
                        _reply({"attempt": n})
                    elif cmd["cmd"] == "watch":
                        current["attempt"] = cmd["attempt"]
                        watchdog.watch(cmd["attempt"], nodes)
                        _reply({"attempt": cmd["attempt"]})
                stop.set()

            threading.Thread(target=control, name="fleet-bench-control", daemon=True).start()
            stop.wait()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store URL")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--attempt", type=int, default=None, help="watch this attempt from the start")
    parser.add_argument("--hang-factor", type=float, default=None)
    parser.add_argument("--interval-s", type=float, default=None)
    parser.add_argument("--ingest-processes", type=int, default=0,
                        help="controller.ingest_processes: agents' streams served by N processes on --port")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s controller %(levelname)s %(name)s: %(message)s")
    overrides = {k: v for k, v in (("hang_factor", args.hang_factor), ("interval_s", args.interval_s))
                 if v is not None}
    try:
        cfg = DetectConfig(**overrides)
        Layout(args.ranks)
    except ValueError as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    return serve(args.store, args.port, args.job, args.ranks, args.attempt, cfg, args.ingest_processes)


if __name__ == "__main__":
    sys.exit(main())
