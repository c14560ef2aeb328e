"""fleet: a cluster-reliability control plane for large PyTorch training.

Everything fleet installs lives under this one namespace:

- ``fleet.controlplane`` -- the controller, store, detectors, diagnosis and CLI
  (repository folder ``controlplane/``);
- ``fleet.agent`` -- the per-node agent (``agent/``);
- ``fleet.workers`` -- one rank's training process and its reliability hooks (``workers/``);
- ``fleet.proto`` -- the wire contract and its generated stubs (``proto/fleet/proto/``).

The public API for a training script of your own:

- :func:`step` (``fleet.workers.session.step``): ``fleet.step(step, loss=..., tokens=...)``
  after each training step of a program fleet launched (``job.entrypoint``, ``fleet
  run``) feeds the step-based detectors and ``fleet report``; a no-op anywhere else;
- :func:`phase` (``fleet.workers.session.phase``): ``with fleet.phase("eval"):`` tells
  the controller the rank is in a named phase, whose hang threshold is
  ``detect.phase_timeouts_s.eval``; a no-op anywhere else;
- :func:`record_collectives` (``fleet.workers.flight.record_collectives``): fleet's flight
  recorder around a plain torchrun script fleet did not launch.

Both load on first use, so ``import fleet`` costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleet.workers.flight import FlightHandle, record_collectives
    from fleet.workers.session import phase, step

__all__ = ["FlightHandle", "phase", "record_collectives", "step"]


def __getattr__(name: str) -> Any:
    if name in ("step", "phase"):
        from fleet.workers import session

        return getattr(session, name)
    if name in __all__:
        from fleet.workers import flight

        return getattr(flight, name)
    raise AttributeError(f"module 'fleet' has no attribute {name!r}")
