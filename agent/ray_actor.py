"""The node agent as a Ray actor (the controller wraps this class with ``ray.remote``).

Kept free of Ray imports so the agent also runs as a plain process next to torchrun.
"""

from __future__ import annotations

import logging
import os

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.proto.tls import TlsFiles


class AgentActor:
    """Holds one NodeAgent for the lifetime of the actor process.

    The agent's tuning arrives as one ``AgentSettings`` object and goes to ``NodeAgent``
    unchanged. To restart a node's agent after it died (the agent-down fault, a crash),
    start a new actor on that node with ``local_port`` set to the port of the address the
    old one's ``start`` returned: its workers keep reporting to that address and reach
    the new agent unchanged."""

    def __init__(self, *, node_name: str, ray_node_id: str, controller_address: str, token: str,
                 settings: AgentSettings, local_port: int, tls: TlsFiles | None,
                 bind_host: str = "127.0.0.1") -> None:
        """``bind_host``: where the worker channel listens (cluster.yaml's ``agent.host``)."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self._agent = NodeAgent(node_name=node_name, ray_node_id=ray_node_id, controller_address=controller_address,
                                token=token, settings=settings, bind_host=bind_host, local_port=local_port, tls=tls)

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
