"""The environment of a fleet worker process: every variable fleet sets, derived in one place.

``worker_env(spec, user_env)`` is the only function that decides a fleet worker's
environment variables, from its ``WorkerSpec`` (which the controller derives from
cluster.yaml in ``controlplane/launch.py``, and ``workers.train.spec_from_torchrun``
from its flags). ``apply_worker_env`` puts them into ``os.environ`` at the top of
``workers.train.run``, before the process group exists; it is the only place fleet's
own workers set ``TORCH_FR_BUFFER_SIZE``. (``workers/flight.py``'s
``record_collectives`` is the library edge for plain torchrun scripts that never
start a fleet worker: it sets the ring size only when the user has not.)

What is derived:
  * the native flight recorder's ring: ``TORCH_FR_BUFFER_SIZE`` from
    ``job.flight_recorder_entries`` (0 turns it off; unset, torch records 2000 entries
    anyway), and its legacy name ``TORCH_NCCL_TRACE_BUFFER_SIZE``, which torch 2.13
    still reads when the new one is unset, so that the two can never disagree. fleet
    reads the ring itself, so it sets neither ``TORCH_NCCL_DUMP_ON_TIMEOUT`` (needs a
    dump file path, and the controller asks for dumps itself) nor
    ``TORCH_NCCL_ENABLE_TIMING`` (a CUDA event pair per collective; durations come
    from the step timings): those stay as the user sets them;
  * rendezvous: ``MASTER_ADDR``/``MASTER_PORT`` (what ``init_method="env://"`` code
    in the user's entrypoint reads), and ``GLOO_SOCKET_IFNAME=lo`` when the
    rendezvous host is loopback (a local cluster: gloo must not pick a real NIC);
  * thread caps ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` = 1: ranks share the host's
    cores, more threads per rank only contend;
  * last, ``spec.env``: variables the launcher adds explicitly (they win).

A variable the user had set to another value is overridden with a warning naming it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping, MutableMapping

from fleet.workers.spec import WorkerSpec

log = logging.getLogger(__name__)

#: Names torch reads the native flight-recorder ring size from (new name first).
FR_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")

#: Values this process's earlier ``apply_worker_env`` calls set: a later attempt in the
#: same process (in-process restart) must not mistake them for the user's.
_applied: dict[str, str] = {}


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def worker_env(spec: WorkerSpec, user_env: Mapping[str, str]) -> dict[str, str]:
    """Every environment variable fleet sets for ``spec``'s process; logs a warning for each
    one ``user_env`` (the environment the process would otherwise have) sets differently."""
    env = {name: str(spec.fr_buffer_entries) for name in FR_BUFFER_VARS}
    if spec.master_addr:
        env["MASTER_ADDR"] = spec.master_addr
        env["MASTER_PORT"] = str(spec.master_port)
        if is_loopback(spec.master_addr):
            env["GLOO_SOCKET_IFNAME"] = "lo"
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env.update(spec.env)
    for name, value in env.items():
        before = user_env.get(name)
        if before is not None and before != value:
            log.warning("rank %d: overriding %s=%r from the environment with %r (derived from the "
                        "job's configuration)", spec.rank, name, before, value)
    return env


def apply_worker_env(spec: WorkerSpec, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set ``worker_env(spec, ...)`` in ``environ`` (default ``os.environ``); returns it."""
    environ = os.environ if environ is None else environ
    user_env = {k: v for k, v in environ.items() if _applied.get(k) != v}
    env = worker_env(spec, user_env)
    environ.update(env)
    _applied.update(env)
    return env


#: What torchrun tells every process it starts, plus fleet's own identity: set by the
#: launcher for each rank of a user entrypoint, never by ``job.entrypoint.env``.
TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
)
FLEET_VARS = ("FLEET_JOB_ID", "FLEET_ATTEMPT", "FLEET_AGENT_ADDRESS")
LAUNCH_VARS = frozenset(TORCHRUN_VARS + FLEET_VARS)


def launch_env(spec: WorkerSpec) -> dict[str, str]:
    """The per-rank variables of a user entrypoint's process (``spec.launch``), added at
    launch to its base environment (``spec.launch.env``).

    They are torchrun's, so an unmodified torchrun script runs as it is:
    ``TORCHELASTIC_RESTART_COUNT`` is the attempt - 1, ``TORCHELASTIC_RUN_ID`` the job id,
    and ``TORCHELASTIC_USE_AGENT_STORE=True``: rank 0's launcher serves the rendezvous
    TCPStore on ``MASTER_ADDR`` only, and every rank's ``env://`` init joins it as a
    client (torch's own rank-0 store would listen on every interface). The flight
    recorder's ring comes from ``job.flight_recorder_entries`` unless the program's
    environment sizes it; ``OMP_NUM_THREADS=1`` is set when the environment leaves it
    unset, as torchrun does for several processes per node."""
    launch = spec.launch
    assert launch is not None
    env = {
        "RANK": str(spec.rank), "LOCAL_RANK": str(spec.local_rank), "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(spec.local_world_size), "GROUP_RANK": str(spec.group_rank),
        "GROUP_WORLD_SIZE": str(spec.group_world_size), "ROLE_RANK": str(spec.rank),
        "ROLE_WORLD_SIZE": str(spec.world_size), "ROLE_NAME": "default",
        "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(max(spec.attempt - 1, 0)),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.job_id,
        "TORCHELASTIC_ERROR_FILE": launch.error_file(spec.rank),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "FLEET_JOB_ID": spec.job_id, "FLEET_ATTEMPT": str(spec.attempt),
        "FLEET_AGENT_ADDRESS": spec.agent_address,
    }
    if spec.master_addr and is_loopback(spec.master_addr) and "GLOO_SOCKET_IFNAME" not in launch.env:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if not any(launch.env.get(name) for name in FR_BUFFER_VARS):
        # the new name only: torch 2.13 warns in every rank's log when the legacy one is set
        env[FR_BUFFER_VARS[0]] = str(spec.fr_buffer_entries)
    if "OMP_NUM_THREADS" not in launch.env:
        env["OMP_NUM_THREADS"] = "1"
    return env
