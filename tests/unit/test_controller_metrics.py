"""The controller serves its metrics by default and publishes where (controller.json's
``metrics_port``, the Prometheus target file), not at all with ``controller.metrics:
false``, fails a job whose fixed metrics port is taken in one line naming the key, and
takes everything down at the end: the real Controller over the in-memory
runtime of ``test_controller`` (real agents over gRPC, a real SQLite store)."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest

from fleet.controlplane.controller import Controller, Progress, RunResult
from fleet.controlplane.errors import UnavailableError
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.store import Store
from tests.unit.test_controller import STEPS, Outcome, Script, cluster_config, in_memory_runtime

pytestmark = pytest.mark.timeout(120)


def _run(tmp: Path, store: Store, **controller: object) -> tuple[RunResult, list[dict]]:
    """Run a job that succeeds; at every progress line, what controller.json, the target
    file and (when it names a port) /metrics showed."""
    cfg = cluster_config(tmp)
    cfg = cfg.model_copy(update={"controller": cfg.controller.model_copy(update=controller)})
    state_dir = tmp / ".fleet"
    seen: list[dict] = []

    def look(p: Progress) -> None:
        try:
            info = json.loads((state_dir / "controller.json").read_text())
        except OSError:
            return
        targets = state_dir / "prometheus" / "targets.json"
        view = {"port": info.get("metrics_port"), "targets": json.loads(targets.read_text()) if targets.exists()
                else None, "body": ""}
        if view["port"]:
            with urllib.request.urlopen(f"http://127.0.0.1:{view['port']}/metrics", timeout=10) as reply:
                view["body"] = reply.read().decode()
        seen.append(view)

    result = Controller(cfg, store, on_progress=look, runtime=in_memory_runtime(Script([Outcome(STEPS)]))).run()
    return result, seen


@pytest.fixture
def store(tmp_path: Path):
    (tmp_path / ".fleet").mkdir()
    with Store(f"sqlite:///{tmp_path}/.fleet/fleet.db") as s:
        yield s


def test_metrics_are_served_by_default_and_gone_after(tmp_path: Path, store: Store) -> None:
    result, seen = _run(tmp_path, store, metrics_refresh_interval_s=0.05)
    assert result.state is JobState.SUCCEEDED
    assert seen, "controller.json was never seen while the job ran"
    port = seen[0]["port"]
    assert port > 0 and all(v["port"] == port for v in seen)
    assert all(v["targets"] == [{"targets": [f"127.0.0.1:{port}"], "labels": {"fleet_job_id": result.job_id}}]
               for v in seen)
    assert all("fleet_ingest_events_total" in v["body"] for v in seen)
    # the store-derived ones once the refresher has run (every 0.05 s here)
    assert any(f'fleet_job_total_steps{{job_id="{result.job_id}"}} {float(STEPS)}' in v["body"] for v in seen)
    assert not (tmp_path / ".fleet" / "prometheus" / "targets.json").exists()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_metrics_false_serves_nothing(tmp_path: Path, store: Store) -> None:
    result, seen = _run(tmp_path, store, metrics=False)
    assert result.state is JobState.SUCCEEDED
    assert seen and all(v["port"] == 0 and v["targets"] is None for v in seen)


def test_a_taken_metrics_port_fails_the_job_naming_the_key(tmp_path: Path, store: Store) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UnavailableError) as info:
            _run(tmp_path, store, metrics_port=port)
    assert str(info.value).startswith(f"controller.metrics_port: cannot serve metrics on 127.0.0.1:{port}: ")
    assert "in use" in str(info.value)
    [job] = store.list_jobs()
    assert job.state is JobState.FAILED and job.reason == str(info.value)
    assert not (tmp_path / ".fleet" / "prometheus" / "targets.json").exists()
