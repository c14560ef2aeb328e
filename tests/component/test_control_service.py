"""ControlService over a real gRPC server: token checks, validation, errors as FleetErrors."""

from __future__ import annotations

import pytest

from fleet.controlplane.client import ControlClient
from fleet.controlplane.errors import AuthError, ConfigError, NotFoundError, UnavailableError
from fleet.controlplane.lifecycle import JobState
from tests.component.conftest import TOKEN

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def job_id(controller) -> str:  # noqa: ANN001
    job = controller.store.create_job("ctl-test", total_steps=10, config_json="{}")
    controller.store.set_job_state(job, JobState.PLACING)
    return job


def test_calls_with_the_token_reach_the_controller(controller, job_id) -> None:  # noqa: ANN001
    with ControlClient(controller.address, TOKEN) as client:
        assert [j.job_id for j in client.list_jobs()] == [job_id]
        assert client.job_status(job_id).job.state == "PLACING"
        reply = client.inject_fault(job_id, "crash", rank=2, at_step=5)
        assert list(reply.ranks) == [2]
        assert client.stop_job(job_id, "test").state == "STOPPING"
    assert controller.control.faults == [(job_id, 2, "", "crash")]


def test_wrong_token_is_refused_and_changes_nothing(controller, job_id) -> None:  # noqa: ANN001
    with ControlClient(controller.address, "not-the-token") as client:
        with pytest.raises(AuthError):
            client.inject_fault(job_id, "crash", rank=0)
        with pytest.raises(AuthError):
            client.list_jobs()
    assert controller.control.faults == []


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"kind": "meteor", "rank": 0}, ConfigError, "unknown fault kind 'meteor'"),
        ({"kind": "crash"}, ConfigError, "needs a rank or a node"),
        ({"kind": "crash", "rank": 0, "at_step": -3}, ConfigError, "--at-step: must be >= 0"),
        ({"kind": "crash", "rank": 99}, NotFoundError, "rank 99"),
    ],
)
def test_bad_requests_get_a_clear_error(controller, job_id, kwargs, error, text) -> None:  # noqa: ANN001
    with ControlClient(controller.address, TOKEN) as client, pytest.raises(error, match=text):
        client.inject_fault(job_id, **kwargs)
    assert controller.control.faults == []


def test_unknown_job_is_not_found(controller) -> None:  # noqa: ANN001
    with ControlClient(controller.address, TOKEN) as client, pytest.raises(NotFoundError):
        client.job_status("j-nope")


def test_no_controller_is_unavailable() -> None:
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with ControlClient(f"127.0.0.1:{port}", TOKEN, timeout_s=2) as client:
        with pytest.raises(UnavailableError, match="not reachable"):
            client.list_jobs()


# -- the controller's own JobService: sdc faults need a copy to compare ------------------------

@pytest.fixture
def live_service(store, tmp_path):  # noqa: ANN001, ANN201
    """A real JobService over a real gRPC server, its job running attempt 1 on 4 ranks, and
    a state dir whose controller.json points the CLI at it."""
    import os

    from fleet.controlplane import auth
    from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
    from fleet.controlplane.control_server import ControlServicer
    from fleet.controlplane.grpc_server import ControllerServer
    from fleet.controlplane.job_control import JobService, LiveJob

    job = LiveJob(job_id=store.create_job("sdc-refusal", total_steps=10, config_json="{}"))
    store.set_job_state(job.job_id, JobState.PLACING)
    store.create_attempt(job.job_id)
    submitted = []
    service = JobService(store, job)
    service.take_faults(submitted.append)
    server = ControllerServer(AgentServicer(store, AgentRegistry(), TOKEN, controller_id="ctl-test"),
                              ControlServicer(service, TOKEN), port=0).start()
    auth.write_controller_info(tmp_path, auth.ControllerInfo(server.address, TOKEN, job.job_id, os.getpid()))
    try:
        yield job, submitted, tmp_path
    finally:
        server.close()


def test_an_sdc_fault_on_a_layout_without_copies_is_refused(live_service, capsys) -> None:  # noqa: ANN001
    from fleet.controlplane.cli.main import main
    from fleet.controlplane.sdc import copies_problem

    job, submitted, state_dir = live_service
    nodes = ["node-0", "node-0", "node-1", "node-1"]
    job.move_to(1, nodes, no_copies=copies_problem("fsdp", 4, 2))
    argv = ["inject-fault", "--job", job.job_id, "--kind", "sdc", "--rank", "1", "--bit", "30",
            "--state-dir", str(state_dir)]
    assert main(argv) == ConfigError.exit_code
    out, err = capsys.readouterr()
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    # the error, then what to do about it
    assert len(lines) == 2 and lines[1].startswith("hint:") and "Traceback" not in out + err, out + err
    assert f"--kind sdc: job {job.job_id} has no copy of the corrupted state to compare" in lines[0]
    assert "fsdp shards" in lines[0]
    assert submitted == []
    # other kinds still go; and on a layout with copies, sdc does, whole
    assert main([*argv[:3], "--kind", "crash", "--rank", "1", "--state-dir", str(state_dir)]) == 0
    job.move_to(1, nodes, no_copies="")
    assert main([*argv, "--target", "optimizer", "--persistent", "--at-step", "12"]) == 0
    assert [(o.kind, o.rank) for o in submitted] == [("crash", 1), ("sdc", 1)]
    assert (submitted[1].bit, submitted[1].target, submitted[1].persistent, submitted[1].at_step) == (
        30, "optimizer", True, 12)
