"""`fleet stop` on a program of yours: the stop command travels controller -> agent -> the
rank's session over real gRPC, and the session sends its process SIGTERM, as torchrun
does. A program that handles SIGTERM saves and exits 0; one that does not ends by it."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.controlplane.agent_server import AgentRegistry
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.store import Store
from fleet.proto import events_pb2
from tests.component.conftest import TOKEN, start_server

pytestmark = pytest.mark.timeout(120)

#: A rank of a program under fleet's session: reports a step every 20 ms until stopped;
#: with "handle", SIGTERM saves a file and exits 0 (what a program that checkpoints on
#: SIGTERM does).
PROGRAM = r"""
import signal, sys, time
from fleet.workers.session import Session, step
from fleet.workers.spec import WorkerSpec

agent, job, rank, mode, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
if mode == "handle":
    def on_term(signum, frame):
        with open(out, "w") as f:
            f.write(f"saved at step {n}")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
Session(WorkerSpec(job_id=job, attempt=1, rank=rank, world_size=2, node_name="node-0", master_addr="127.0.0.1",
                   master_port=0, agent_address=agent, checkpoint_dir="", report_interval_s=0.05,
                   fr_buffer_entries=0)).install()
for n in range(1, 3000):  # a minute at most
    step(n, loss=1.0)
    time.sleep(0.02)
sys.exit(3)
"""


@pytest.fixture
def agent_and_job(tmp_path: Path) -> Iterator[tuple[AgentRegistry, NodeAgent, str]]:
    with Store(f"sqlite:///{tmp_path}/fleet.db") as store:
        job = store.create_job("program-stop", total_steps=0, config_json="{}")
        store.set_job_state(job, JobState.PLACING)
        store.create_attempt(job)
        registry = AgentRegistry()
        server, _ = start_server(store, registry)
        agent = NodeAgent(node_name="node-0", controller_address=server.address, token=TOKEN,
                          settings=AgentSettings(batch_interval_s=0.05, heartbeat_interval_s=0.2))
        try:
            agent.start(connect_timeout_s=10)
            yield registry, agent, job
        finally:
            agent.close()
            server.close()


def test_a_stop_command_sends_the_program_sigterm(agent_and_job, tmp_path: Path) -> None:  # noqa: ANN001
    registry, agent, job = agent_and_job
    saved = tmp_path / "saved.txt"
    ranks = [subprocess.Popen([sys.executable, "-c", PROGRAM, agent.local_address, job, str(rank), mode, str(saved)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, mode in ((0, "handle"), (1, "default"))]
    try:
        for rank in (0, 1):  # what the controller's Stopper sends, rank by rank
            registry.send("node-0", events_pb2.Command(command_id=f"c{rank}", job_id=job, attempt=1, rank=rank,
                                                       stop=True))
        results = [p.communicate(timeout=60) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    (_, err0), (_, err1) = results
    assert ranks[0].returncode == 0, err0       # it handled SIGTERM: saved, then exit 0
    assert saved.read_text().startswith("saved at step ")
    assert ranks[1].returncode == -signal.SIGTERM, err1  # the default action: ended by it
    for rank, err in enumerate((err0, err1)):
        assert f"fleet: rank {rank}: stop requested (fleet stop): sending SIGTERM" in err
