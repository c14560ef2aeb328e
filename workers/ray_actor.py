"""The Ray-facing shell around one training rank.

``WorkerActor`` is a plain class; the controller makes it an actor with
``ray.remote(...)(WorkerActor)`` and its own resource options, so this module does not
import Ray. One actor runs one rank of an attempt, and may run a rank of the next attempt too (fleet
restarts in-process: the process keeps torch loaded and its in-memory snapshots).
"""

from __future__ import annotations

import os
import socket

from fleet.workers.rendezvous import listen_on
from fleet.workers.spec import WorkerSpec


class WorkerActor:
    """One rank's process: reports its pid, finds a rendezvous port, runs training."""

    def __init__(self) -> None:
        self._listen: socket.socket | None = None

    def warm(self) -> bool:
        """Import torch and the training code now, so that this process can take a rank
        at once (a warm spare)."""
        from fleet.workers import train  # noqa: F401

        return True

    def pid(self) -> int:
        """Process id of this worker (the agent watches it and kills it on orders)."""
        return os.getpid()

    def free_port(self, host: str = "127.0.0.1") -> int:
        """Open rank 0's rendezvous socket on host (any free port) and return the port.

        The socket stays open and listening until ``run`` hands it to the TCPStore, so no
        other process can take the port in between.
        """
        if self._listen is None:
            self._listen = listen_on(host, 0)
        return self._listen.getsockname()[1]

    def run(self, spec: WorkerSpec) -> dict:
        """Train this rank (see ``workers.train.run``); returns its result dict."""
        from fleet.workers import train  # torch loads here, in the worker process only

        sock, self._listen = self._listen, None
        try:
            return train.run(spec, listen_socket=sock)
        finally:
            if sock is not None:
                sock.close()
