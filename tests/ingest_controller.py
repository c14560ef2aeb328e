"""A controller process for the ingest tests: ``python -m tests.ingest_controller URL PORT``.

Serves AgentService (and health) over a real Store on ``URL`` at 127.0.0.1:``PORT``,
prints ``ready <address>`` once serving, and runs until stdin closes or it is killed.
Tests kill it with SIGKILL mid-stream to prove that nothing is lost or duplicated.
"""

from __future__ import annotations

import sys

from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.grpc_server import ControllerServer
from fleet.controlplane.store import Store

TOKEN = "test-ingest-token-0123456789"


def main(url: str, port: int) -> None:
    with Store(url) as store:
        servicer = AgentServicer(store, AgentRegistry(), TOKEN, controller_id="ctl-ingest-test")
        with ControllerServer(servicer, ControlServicer(None, TOKEN), port=port) as server:
            print(f"ready {server.address}", flush=True)
            sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
