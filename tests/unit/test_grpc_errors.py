"""FleetError <-> gRPC status code lives beside the servers; the hierarchy itself and the
diagnosis engine that raises it never import gRPC."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import grpc
import pytest

from fleet.controlplane import errors
from fleet.controlplane.grpc_errors import error_class, status_code

pytestmark = pytest.mark.timeout(60)


def test_every_error_has_a_status_code_and_the_client_maps_it_back() -> None:
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.FleetError)]
    assert len(classes) >= 9
    for cls in classes:
        assert isinstance(status_code(cls("x")), grpc.StatusCode), cls
    for cls in (errors.ConfigError, errors.NotFoundError, errors.StateError, errors.AuthError,
                errors.UnavailableError):
        assert error_class(status_code(cls("x"))) is cls
    assert status_code(errors.DumpError("x")) is grpc.StatusCode.INVALID_ARGUMENT
    assert error_class(grpc.StatusCode.DEADLINE_EXCEEDED) is errors.UnavailableError
    assert error_class(grpc.StatusCode.INTERNAL) is errors.FleetError

    class Subclass(errors.NotFoundError):
        pass

    assert status_code(Subclass("x")) is grpc.StatusCode.NOT_FOUND   # nearest named class


def test_errors_and_diagnosis_import_no_grpc() -> None:
    probe = ("import json, sys\n"
             "import fleet.controlplane.errors, fleet.controlplane.detectors\n"
             "import fleet.controlplane.diagnosis.engine, fleet.controlplane.diagnosis.dumps\n"
             "print(json.dumps(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.'))))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(out.stdout) == []
