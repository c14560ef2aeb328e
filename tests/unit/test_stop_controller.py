"""A stop while no attempt runs ends the job at once: the real Controller over the in-memory
runtime of test_controller (real agents in this process, real gRPC, a real SQLite file)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fleet.controlplane.controller import Controller
from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.store import Store
from tests.unit.test_controller import Outcome, Script, cluster_config, in_memory_runtime, store  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def test_a_stop_during_the_restart_backoff_ends_the_job_at_once(tmp_path: Path, store: Store) -> None:  # noqa: F811
    # attempt 1 dies before its first step: the restart waits restart_backoff_s (60 s) first
    script = Script([Outcome(0, die=0), Outcome(3)])
    cfg = cluster_config(tmp_path)
    cfg = cfg.model_copy(update={"job": cfg.job.model_copy(update={"restart_backoff_s": 60.0})})
    ctl = Controller(cfg, store, runtime=in_memory_runtime(script))
    asked: dict[str, float] = {}

    def operator() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if ctl.job_id and store.get_job(ctl.job_id).state is JobState.RESTARTING:
                asked["at"] = time.monotonic()
                ctl.control.stop_job(ctl.job_id, "not now", by="ops@host")
                return
            time.sleep(0.05)

    thread = threading.Thread(target=operator, name="test-operator")
    thread.start()
    try:
        result = ctl.run()
    finally:
        thread.join(60)
    ended_after_s = time.monotonic() - asked["at"]
    assert result.state is JobState.STOPPED
    assert result.reason == "stopped by operator ops@host: not now; no attempt was running; no valid checkpoint"
    assert ended_after_s < 30, ended_after_s  # not after the 60 s backoff
    assert len(script.attempts) == 1  # no second attempt was placed
    [attempt] = store.get_attempts(result.job_id)
    assert attempt.state is AttemptState.FAILED
    assert [a.cause for a in store.actions(result.job_id) if a.kind == "stop"] == ["stopped by operator ops@host: "
                                                                                    "not now"]
