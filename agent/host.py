"""Host health of the agent's node, read with psutil (NVML would join here on GPU nodes)."""

from __future__ import annotations

import os

import psutil

from fleet.proto import agent_pb2


def host_metrics(workers_alive: int) -> agent_pb2.HostMetrics:
    """A snapshot of this host's CPU, load and memory."""
    mem = psutil.virtual_memory()
    return agent_pb2.HostMetrics(
        cpu_percent=psutil.cpu_percent(interval=None),
        load1=os.getloadavg()[0],
        mem_used_bytes=int(mem.total - mem.available),
        mem_total_bytes=int(mem.total),
        workers_alive=workers_alive,
    )
