"""The Ray-facing shell around one training rank.

``WorkerActor`` is a plain class; the controller makes it an actor with
``ray.remote(...)(WorkerActor)`` and its own resource options, so this module does not
import Ray. One actor runs one rank of an attempt, and may run a rank of the next attempt too (fleet
restarts in-process: the process keeps torch loaded and its in-memory snapshots).
"""

from __future__ import annotations

import gc
import os
import socket

from fleet.workers.rendezvous import listen_on
from fleet.workers.spec import Launch, WorkerSpec


class WorkerActor:
    """One rank's process: reports its pid, finds a rendezvous port, runs training.

    For fleet's built-in trainer the actor's own process trains (and keeps torch and its
    in-memory snapshots across attempts). For a user program (``WorkerSpec.launch``) the
    actor is the rank's launcher: the program runs in a child interpreter
    (``workers/launcher.py``) started warm, and after each attempt a fresh one is started
    at once for the next, so every restart finds torch already imported."""

    def __init__(self) -> None:
        self._listen: socket.socket | None = None
        self._process = None  # the warm RankProcess of a user program

    def warm(self, launch: Launch | None = None, background: bool = False) -> bool:
        """Get ready to take a rank at once (a warm spare): import the built-in trainer
        (torch with it) and what torch loads lazily on first use (``shim.WARM_MODULES``:
        DDP's and FSDP2's first wrap import ``torch._dynamo``, 0.4-0.6 s on the restart's
        critical path otherwise), or start the interpreter ``launch``'s program will run in.

        ``background`` (a spare replacing one a restart used, started while the job trains):
        all of it at the idle scheduling class (``shim.import_warm_modules``), yielding the
        CPU to busy ranks: on the 4-rank example two spares importing torch at full priority
        slowed the first 40 steps by up to a third. Otherwise (the processes an attempt
        waits for, and the first attempt's spares, which an early failure needs ready) the
        trainer is imported at this process's own priority.

        Then everything imported so far is moved out of the garbage collector's sight
        (``gc.freeze``): modules live as long as the process, and a failing rank's
        ``gc.collect`` (``workers.train.run``) scanned them all, 0.1-0.2 s between a peer's
        death and this rank's return, on every restart's critical path."""
        if launch is None:
            from fleet.workers.shim import import_warm_modules

            if not background:
                from fleet.workers import train  # noqa: F401
            import_warm_modules(("fleet.workers.train",) if background else ())
            gc.freeze()
        else:
            self._start_process(launch)
        return True

    def _start_process(self, launch: Launch) -> None:
        from fleet.workers.launcher import RankProcess

        if self._process is not None:
            self._process.kill()
        self._process = RankProcess(launch)

    def pid(self) -> int:
        """Process id of this rank: the program's interpreter, or this process for the
        built-in trainer (the agent watches it and kills it on orders)."""
        return self._process.pid if self._process is not None else os.getpid()

    def free_port(self, host: str = "127.0.0.1") -> int:
        """Open rank 0's rendezvous socket on host (any free port) and return the port.

        The socket stays open and listening until ``run`` hands it to the TCPStore, so no
        other process can take the port in between.
        """
        if self._listen is None:
            self._listen = listen_on(host, 0)
        return self._listen.getsockname()[1]

    def run(self, spec: WorkerSpec) -> dict:
        """Run this rank: train it (``workers.train.run``) or run its program
        (``workers.launcher.run_rank``); returns its result dict."""
        sock, self._listen = self._listen, None
        try:
            if spec.launch is not None:
                return self._run_program(spec, sock)
            from fleet.workers import train  # torch loads here, in the worker process only

            return train.run(spec, listen_socket=sock)
        finally:
            if sock is not None:
                sock.close()

    def _run_program(self, spec: WorkerSpec, sock: socket.socket | None) -> dict:
        from fleet.workers.launcher import run_rank

        assert spec.launch is not None
        if self._process is None or not self._process.matches(spec.launch):
            self._start_process(spec.launch)  # cold: not warmed with this program's environment
        process = self._process
        try:
            return run_rank(spec, process, sock)
        finally:
            self._start_process(spec.launch)  # the next attempt's interpreter warms up now
