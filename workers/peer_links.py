"""Cutting this rank's gloo connections when its attempt fails, so that no peer stays
blocked in a collective.

When one rank dies, gloo fails the collectives of the ranks connected to it at once, but
a rank waiting in another collective (an expert-parallel all-to-all with a rank that is
alive and has just failed, say) stays blocked until that peer's *process* exits or the
process-group timeout fires: neither ``destroy_process_group`` nor the gloo backend's
``abort`` closes the sockets while Python still holds the group. fleet keeps failed
ranks' processes for the next attempt (in-process restart), so a failing rank shuts its
connections to its peers down itself: every peer's pending collective then fails within
milliseconds, and the failure travels through the whole job.

The peers' connections are found by process: each rank publishes its pid in the
rendezvous store; a connection whose remote end belongs to a peer's process, other than
the rendezvous store's, is one of gloo's. Sockets are shut down (``shutdown(2)``), not
closed: gloo still owns the descriptors.
"""

from __future__ import annotations

import logging
import os
import socket

import psutil
import torch.distributed as dist

log = logging.getLogger(__name__)

_KEY = "fleet/pid/{rank}"


class PeerLinks:
    """Knows the peer ranks' processes; ``sever()`` shuts this process's connections to
    them down."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, store_port: int) -> None:
        """Publish this rank's pid and read every peer's (blocks until all published)."""
        store.set(_KEY.format(rank=rank), str(os.getpid()))
        self.peer_pids = {int(store.get(_KEY.format(rank=r))) for r in range(world_size) if r != rank}
        self.store_port = store_port

    def sever(self) -> int:
        """Shut down every TCP connection from this process to a peer rank's process
        (the rendezvous store's excepted); returns how many. Never raises."""
        try:
            me, conns = os.getpid(), psutil.net_connections("tcp")
        except psutil.Error as exc:
            log.warning("cannot list connections to cut them: %s", exc)
            return 0
        peer_ends = {tuple(c.laddr) for c in conns if c.pid in self.peer_pids and c.laddr}
        cut = 0
        for c in conns:
            if (c.pid != me or c.status != psutil.CONN_ESTABLISHED or not c.raddr
                    or tuple(c.raddr) not in peer_ends or self.store_port in (c.laddr[1], c.raddr[1])):
                continue
            try:
                with socket.socket(fileno=os.dup(c.fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                continue  # already closed by gloo
        return cut
