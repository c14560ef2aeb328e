"""The node agent as a Ray actor (the controller wraps this class with ``ray.remote``).

Kept free of Ray imports so the agent also runs as a plain process next to torchrun.
"""

from __future__ import annotations

import logging
import os

from fleet.agent.node_agent import NodeAgent


class AgentActor:
    """Holds one NodeAgent for the lifetime of the actor process.

    The constructor takes ``NodeAgent``'s keyword arguments. To restart a node's agent
    after it died (the agent-down fault, a crash), start a new actor on that node with
    ``local_port`` set to the port of the address the old one's ``start`` returned: its
    workers keep reporting to that address and reach the new agent unchanged."""

    def __init__(self, **agent_kwargs: object) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self._agent = NodeAgent(**agent_kwargs)  # type: ignore[arg-type]

    def start(self, connect_timeout_s: float = 30.0) -> str:
        """Start serving and connect; returns the local address workers report to."""
        return self._agent.start(connect_timeout_s)

    def pid(self) -> int:
        return os.getpid()

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self._agent.flush(timeout_s)

    def stats(self) -> dict[str, int]:
        return self._agent.stats()

    def partitioned(self) -> bool:
        return self._agent.partitioned()

    def end_partition(self) -> None:
        """Lift a partition fault early (the controller reaches the actor through Ray)."""
        self._agent.end_partition()

    def close(self) -> None:
        self._agent.close()
