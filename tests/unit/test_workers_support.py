"""Shared helpers for the workers/ tests (no tests here): a real NodeAgent gRPC server
that collects worker events, and a launcher for real multi-rank gloo process groups."""

from __future__ import annotations

import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto import columns
from fleet.workers.ray_actor import WorkerActor


def free_port() -> int:
    return WorkerActor().free_port()


class AgentServer(agent_pb2_grpc.NodeAgentServicer):
    """A real NodeAgent on 127.0.0.1 that records every report and hands out queued commands."""

    def __init__(self, port: int = 0) -> None:
        self.events: list[tuple[int, events_pb2.Event]] = []
        self.reports = 0
        self._pending: dict[int, list[events_pb2.Command]] = {}
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="test-agent"))
        agent_pb2_grpc.add_NodeAgentServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        assert self.port, "could not bind the test agent"
        self.address = f"127.0.0.1:{self.port}"
        self._server.start()

    def Report(self, request, context):  # noqa: N802 - gRPC method name
        with self._cond:
            self.reports += 1
            for e in request.events:
                if e.WhichOneof("kind") == "collectives":  # the reporter packs collectives
                    self.events.extend((request.rank, events_pb2.Event(collective=c))
                                       for c in columns.unpack(e.collectives))
                else:
                    self.events.append((request.rank, e))
            cmds = self._pending.pop(request.rank, [])
            self._cond.notify_all()
        return agent_pb2.WorkerReply(commands=cmds)

    def send(self, rank: int, cmd: events_pb2.Command) -> None:
        """Queue ``cmd`` for the next report of ``rank``."""
        with self._cond:
            self._pending.setdefault(rank, []).append(cmd)

    def wait_for(self, predicate: Callable[[AgentServer], bool], timeout_s: float = 20.0) -> None:
        """Block until ``predicate(self)`` holds (checked on every report) or fail."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                assert left > 0, "timed out waiting for the agent to receive the expected events"
                self._cond.wait(left)

    def of_kind(self, kind: str, rank: int | None = None) -> list:
        with self._cond:
            return [getattr(e, kind) for r, e in self.events
                    if e.WhichOneof("kind") == kind and (rank is None or r == rank)]

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)


REPO_ROOT = Path(__file__).resolve().parents[2]


def _child_main() -> None:
    """Entry of one rank's process: ``python -c ... _child_main() IN OUT``."""
    with open(sys.argv[1], "rb") as f:
        target, rank, world_size, port, args = pickle.load(f)
    try:
        result = {"ok": target(rank, world_size, port, *args)}
    except BaseException:  # report any failure to the parent instead of hanging it
        result = {"error": traceback.format_exc()}
    with open(sys.argv[2] + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])


def wait_for_gate(timeout_s: float = 30.0) -> None:
    """In a rank: block until the parent calls ``Ranks.open_gate`` (or fail after ``timeout_s``)."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    assert ready and sys.stdin.read(1) == "g", "gate never opened"


class Ranks:
    """``world_size`` subprocesses each running ``target(rank, world_size, port, *args)``;
    they share a free rendezvous port on 127.0.0.1, so they can form one gloo group.

    Plain subprocesses, not multiprocessing: nothing (like a resource tracker) outlives
    the test. ``wait`` joins every process, killing (by PID) any still alive at the end.
    """

    def __init__(self, target: Callable, world_size: int, args: tuple = ()) -> None:
        self.world_size = world_size
        self._dir = Path(tempfile.mkdtemp(prefix="fleet-ranks-"))
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        for rank in range(world_size):
            inp = self._dir / f"in{rank}.pkl"
            inp.write_bytes(pickle.dumps((target, rank, world_size, port, args)))
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", "from tests.unit.test_workers_support import _child_main; _child_main()",
                 str(inp), str(self._dir / f"out{rank}.pkl")],
                cwd=REPO_ROOT, stdin=subprocess.PIPE, text=True))

    def open_gate(self) -> None:
        """Release every rank waiting in ``wait_for_gate``."""
        for p in self.procs:
            if p.poll() is None:
                p.stdin.write("g")
                p.stdin.flush()

    def wait(self, timeout_s: float = 60.0, expect_exit: dict[int, int] | None = None) -> dict[int, object]:
        """Join all ranks; return each surviving rank's return value. ``expect_exit``
        maps ranks expected to die to their exit status."""
        expect_exit = expect_exit or {}
        deadline = time.monotonic() + timeout_s
        try:
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"ranks still running after {timeout_s}s") from None
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
                p.stdin.close()
        out, errors = {}, []
        for rank, p in enumerate(self.procs):
            if rank in expect_exit:
                assert p.returncode == expect_exit[rank], f"rank {rank} exited {p.returncode}"
                continue
            result_file = self._dir / f"out{rank}.pkl"
            if not result_file.exists():
                errors.append(f"rank {rank} exited {p.returncode} without a result")
                continue
            result = pickle.loads(result_file.read_bytes())
            if "error" in result:
                errors.append(f"rank {rank}:\n{result['error']}")
            else:
                out[rank] = result["ok"]
                assert p.returncode == 0, f"rank {rank} exited {p.returncode}"
        shutil.rmtree(self._dir, ignore_errors=True)
        assert not errors, "\n".join(errors)
        return out


def run_ranks(target: Callable, world_size: int, args: tuple = (), timeout_s: float = 60.0,
              expect_exit: dict[int, int] | None = None) -> dict[int, object]:
    """Start ``Ranks(target, world_size, args)`` and wait for them; see ``Ranks.wait``."""
    return Ranks(target, world_size, args).wait(timeout_s, expect_exit)
