"""Silent data corruption through the real Controller's attempt loop (the in-memory runtime
of test_controller.py, real node agents over gRPC, a real SQLite store): every rank raises
SdcError after the same triage; the suspect's node is quarantined at once, the restart
says where it rolls back to, and the next attempts restore at most that step until one
has trained past the corrupted attempt."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleet.controlplane.config import ClusterConfig
from fleet.controlplane.controller import Controller
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.runtime import RankFailure, Runtime
from fleet.controlplane.sdc import SdcFailure
from fleet.controlplane.store import NODE_QUARANTINED, Store
from fleet.proto.kinds import IncidentKind
from tests.unit.test_controller import (
    REPO,
    STEPS,
    InMemoryCluster,
    InMemoryPool,
    InProcessAgents,
    Outcome,
    Script,
    ScriptedWorkers,
    store,  # noqa: F401 -- the fixture
)

pytestmark = pytest.mark.timeout(120)

#: attempt 1 ends in persistent SDC: first bad step 3 on rank 1, verified step 2
SDC = SdcFailure(step=3, rank=1, verdict="persistent", rollback_step=2,
                 evidence="rank 1's weights differ from rank 0's again after replay 1 of step 3")


class SdcWorkers(ScriptedWorkers):
    """Attempt 1: after its steps every rank raises SdcError (they all ran the triage)."""

    def run(self, specs) -> None:  # noqa: ANN001
        first = not self._script.attempts
        super().run(specs)
        if first:
            self._pending = [RankFailure(s.rank, s.node_name, False, "SdcError: ...", sdc=SDC) for s in specs]
            for s in specs:
                self.results[s.rank] = "raised"


def _config(tmp: Path) -> ClusterConfig:
    raw = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    raw["state_dir"] = str(tmp / ".fleet")
    raw["store"]["url"] = f"sqlite:///{tmp}/.fleet/fleet.db"
    raw["ray"]["nodes"] = 3
    raw["controller"].update(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0)
    raw["job"].update(steps=STEPS, checkpoint_dir=str(tmp / "ckpt"), ranks_per_node=1, ep_size=1, nodes=2,
                      restart_backoff_s=0.0, max_restarts=3, data_parallel="ddp")
    raw["sdc"] = {"check_interval": 5}
    raw["policy"] = {"quarantine_after_incidents": 2}
    return ClusterConfig.model_validate(raw)


def test_persistent_sdc_quarantines_the_node_and_holds_restores_to_the_verified_step(
        tmp_path: Path, store: Store) -> None:  # noqa: F811
    # 1: SDC after 4 steps; 2: a crash at step 2 (not past step 4: still held); 3: a crash
    # after step 6 (past it: the hold ends); 4: succeeds
    script = Script([Outcome(4), Outcome(2, die=1), Outcome(STEPS, die=0), Outcome(STEPS)])
    runtime = Runtime(cluster=InMemoryCluster, agents=InProcessAgents, pool=InMemoryPool,
                      workers=lambda placement, actors: SdcWorkers(script, placement, actors))
    result = Controller(_config(tmp_path), store, runtime=runtime).run()
    assert result.state is JobState.SUCCEEDED, result.reason
    first = store.incidents(result.job_id)[0]
    assert (first.kind, first.detector, first.rank, first.node, first.attempt) == (
        IncidentKind.SDC, "sdc_persistent", 1, "node-1", 1)
    assert "first seen at step 3" in first.evidence and "roll back to step 2" in first.evidence
    node = next(n for n in store.list_nodes() if n.name == "node-1")
    assert node.state == NODE_QUARANTINED
    assert node.quarantine_reason.startswith("persistent silent data corruption on node-1: rank 1")
    restarts = [a.cause for a in store.actions(result.job_id) if a.kind == "restart"]
    assert restarts[0].endswith("restart 1 of 3, rolling back to step 2 (verified before the corruption)")
    assert "rolling back" not in restarts[1]
    specs = script.attempts
    assert [{s.node_name for s in a} for a in specs[1:]] == [{"node-0", "node-2"}] * 3
    assert [{s.restore_at_most for s in a} for a in specs] == [{0}, {2}, {2}, {0}]
    assert {s.sdc_check_interval for a in specs for s in a} == {5}
