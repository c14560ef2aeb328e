"""A rank's non-finite loss reaches the controller as fields, not text: the exception
keeps them through pickling (Ray's path), the orchestrator reads them off Ray's task
error, and the FAILED WorkerStatus carries them on the wire."""

from __future__ import annotations

import pickle

import pytest
import ray.exceptions

from fleet.proto import events_pb2
from fleet.workers.failures import NonFiniteLossError, status_fields

pytestmark = pytest.mark.timeout(60)


def test_nonfinite_loss_error_survives_pickling_with_its_fields() -> None:
    err = pickle.loads(pickle.dumps(NonFiniteLossError(12, [3, 5])))
    assert isinstance(err, NonFiniteLossError)
    assert (err.step, err.ranks) == (12, [3, 5])
    assert str(err) == "non-finite loss at step 12 on rank(s) [3, 5]"


def test_failed_status_carries_the_fields() -> None:
    status = events_pb2.WorkerStatus(state=events_pb2.WorkerStatus.FAILED,
                                     **status_fields(NonFiniteLossError(7, [1])))
    wire = events_pb2.WorkerStatus.FromString(status.SerializeToString())
    assert (wire.nonfinite_step, list(wire.nonfinite_ranks)) == (7, [1])
    assert status_fields(RuntimeError("boom")) == {}


def test_orchestrator_reads_the_fields_off_a_ray_task_error() -> None:
    from fleet.controlplane.orchestrator import nonfinite_loss

    def as_driver_sees(cause: BaseException) -> BaseException:
        # what ray.get raises on the driver: the worker's task error, pickled across
        # processes, as an instance of the cause's class too
        err = ray.exceptions.RayTaskError("WorkerActor.run", "Traceback (most recent call last): ...", cause)
        return pickle.loads(pickle.dumps(err)).as_instanceof_cause()

    assert nonfinite_loss(as_driver_sees(NonFiniteLossError(12, [3]))) == (12, (3,))
    assert nonfinite_loss(as_driver_sees(NonFiniteLossError(4, []))) == (4, ())
    assert nonfinite_loss(as_driver_sees(RuntimeError("non-finite loss at step 1 on rank(s) [0]"))) == (0, ())
    assert nonfinite_loss(RuntimeError("boom")) == (0, ())
