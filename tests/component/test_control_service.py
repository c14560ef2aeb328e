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
        assert client.stop_job(job_id, "test") == "STOPPING"
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
