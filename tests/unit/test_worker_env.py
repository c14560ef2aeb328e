"""workers/env.py: every worker environment variable derived from the spec in one place,
with a warning for each user setting it overrides; controlplane/launch.py builds the specs."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from fleet.controlplane.config import parse_cluster_yaml
from fleet.controlplane.launch import worker_specs
from fleet.workers import env as worker_env_module
from fleet.workers.env import apply_worker_env, is_loopback, worker_env
from fleet.workers.spec import WorkerSpec

pytestmark = pytest.mark.timeout(30)


def _spec(**kw: object) -> WorkerSpec:
    fields: dict = dict(job_id="j", attempt=1, rank=3, world_size=4, node_name="node-1",
                        master_addr="127.0.0.1", master_port=29511, agent_address="127.0.0.1:1",
                        checkpoint_dir="/tmp/c", fr_buffer_entries=512)
    fields.update(kw)
    return WorkerSpec(**fields)


def test_every_variable_is_derived_from_the_spec() -> None:
    assert worker_env(_spec(), {}) == {
        "TORCH_FR_BUFFER_SIZE": "512",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "512",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def test_a_recorder_of_zero_entries_is_off_and_a_real_host_keeps_gloo_on_its_nic() -> None:
    env = worker_env(_spec(fr_buffer_entries=0, master_addr="10.1.2.3"), {})
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"
    assert env["MASTER_ADDR"] == "10.1.2.3"
    assert "GLOO_SOCKET_IFNAME" not in env


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
    ("10.0.0.1", False), ("node-1.cluster", False), ("", False)])
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_the_launchers_extras_win() -> None:
    assert worker_env(_spec(env={"OMP_NUM_THREADS": "4", "EXTRA": "x"}), {})["OMP_NUM_THREADS"] == "4"


def test_each_user_setting_overridden_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    user = {"TORCH_FR_BUFFER_SIZE": "2000", "OMP_NUM_THREADS": "1", "MASTER_PORT": "1", "HOME": "/h"}
    with caplog.at_level(logging.WARNING, logger="fleet.workers.env"):
        worker_env(_spec(), user)
    warned = sorted(name for name in ("TORCH_FR_BUFFER_SIZE", "OMP_NUM_THREADS", "MASTER_PORT", "HOME")
                    if any(name in r.getMessage() for r in caplog.records))
    assert warned == ["MASTER_PORT", "TORCH_FR_BUFFER_SIZE"]   # same value or not ours: no warning
    assert len(caplog.records) == 2


def test_apply_sets_the_environment_and_a_later_attempt_is_not_warned_about_fleets_own_values(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_env_module, "_applied", {})
    environ = {"TORCH_FR_BUFFER_SIZE": "7"}
    with caplog.at_level(logging.WARNING, logger="fleet.workers.env"):
        apply_worker_env(_spec(), environ)
        assert environ["TORCH_FR_BUFFER_SIZE"] == "512" and environ["MASTER_PORT"] == "29511"
        assert [r for r in caplog.records if "TORCH_FR_BUFFER_SIZE" in r.getMessage()]
        caplog.clear()
        apply_worker_env(_spec(master_port=29600), environ)   # in-process restart, new port
    assert environ["MASTER_PORT"] == "29600"
    assert not caplog.records


def test_worker_specs_carry_the_config_to_every_rank() -> None:
    cfg = parse_cluster_yaml("job: {nodes: 2, ranks_per_node: 2, flight_recorder_entries: 64, seq_len: 32,"
                             " model: {dim: 128}}\nagent: {report_interval_s: 0.25, fr_poll_interval_s: 0.3}")
    placement = [SimpleNamespace(name=n) for n in ("node-0", "node-0", "node-1", "node-1")]
    specs = worker_specs(cfg, job_id="job-1", attempt=2, placement=placement, port=29400,
                         checkpoint_dir="/ckpt", local_addresses={"node-0": "127.0.0.1:1", "node-1": "127.0.0.1:2"},
                         master_addr="127.0.0.1")
    assert [(s.rank, s.node_name, s.agent_address) for s in specs] == [
        (0, "node-0", "127.0.0.1:1"), (1, "node-0", "127.0.0.1:1"),
        (2, "node-1", "127.0.0.1:2"), (3, "node-1", "127.0.0.1:2")]
    s = specs[3]
    assert (s.job_id, s.attempt, s.world_size, s.master_addr, s.master_port, s.checkpoint_dir) == (
        "job-1", 2, 4, "127.0.0.1", 29400, "/ckpt")
    assert s.train == cfg.job.train_args() and s.train.seq_len == 32 and s.model.dim == 128
    assert (s.fr_buffer_entries, s.report_interval_s, s.fr_poll_interval_s, s.pg_timeout_s) == (
        64, 0.25, 0.3, cfg.job.pg_timeout_s)
    assert worker_env(s, {})["TORCH_FR_BUFFER_SIZE"] == "64"
