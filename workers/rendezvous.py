"""Rendezvous for the process group: the TCPStore, served on master_addr only.

Kept free of a module-level torch import so the controller can reference the worker
actor class without loading torch.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING

from fleet.workers.spec import WorkerSpec

if TYPE_CHECKING:
    import torch.distributed as dist


def listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket listening on exactly host:port (port 0 = any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def rendezvous_store(spec: WorkerSpec, listen_socket: socket.socket | None) -> dist.TCPStore:
    """The process group's TCPStore.

    Rank 0 serves it on a socket bound to master_addr only: torch's own TCPStore server
    listens on every interface, which a loopback-only deployment must not do.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=spec.pg_timeout_s)
    if spec.rank != 0 or spec.external_store:
        return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False, timeout)
    sock = listen_socket or listen_on(spec.master_addr, spec.master_port)
    return _serve(sock, spec.master_addr, spec.world_size, timeout)


def _serve(sock: socket.socket, host: str, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The master TCPStore, served from an already listening socket."""
    import torch.distributed as dist

    store = dist.TCPStore(host, sock.getsockname()[1], world_size, True, timeout,
                          wait_for_workers=False, master_listen_fd=sock.fileno())
    sock.detach()  # the store now owns (and eventually closes) the descriptor
    return store


def loopback_store(rank: int, world_size: int, port: int, timeout_s: float = 60.0) -> dist.TCPStore:
    """A TCPStore on 127.0.0.1:port for a group of local processes (tests, benchmarks):
    like ``init_method="tcp://127.0.0.1:port"``, but rank 0 listens on loopback only."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    return _serve(listen_on("127.0.0.1", port), "127.0.0.1", world_size, timeout)
