"""End to end, as a user meets it: a plain torchrun script that records its collectives
(``record_collectives(dump_dir=...)``) hangs on one rank; nobody reaches ``close()``, the
ranks' stall watchers write the dumps, and ``fleet replay DIR`` names the hung rank with
its Python stack and says so in its exit status."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "tests" / "programs" / "fr_hang.py"
WORLD = 3
WAIT_S = 90.0

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """End torchrun and its ranks, by PID (torchrun starts each rank in a session of its
    own, so killing torchrun's group would leave them), and check nothing is left."""
    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    for p in [*ranks, psutil.Process(proc.pid)] if proc.poll() is None else ranks:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    _gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"ranks still running: {[p.pid for p in alive]}"


def _dumps_with_markers(folder: Path) -> dict[int, dict]:
    out = {}
    for r in range(WORLD):
        path = folder / f"fr_dump_{r}"
        if path.exists():
            out[r] = pickle.loads(path.read_bytes()).get("fleet_dump", {})
    return out


def test_a_hung_torchrun_job_leaves_dumps_and_replay_names_the_hung_rank(tmp_path):
    folder = tmp_path / "fr"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", f"--nproc-per-node={WORLD}",
           "--master-addr", "127.0.0.1", f"--master-port={_free_port()}", str(PROGRAM), str(folder)]
    log = (tmp_path / "torchrun.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while len(_dumps_with_markers(folder)) < WORLD:
            assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"dumps after {WAIT_S}s: {sorted(_dumps_with_markers(folder))}"
            time.sleep(0.2)
        assert proc.poll() is None  # still hung: every dump came from a stall watcher
    finally:
        _stop(proc)
        log.close()
    markers = _dumps_with_markers(folder)
    assert all(m.get("reason", "").startswith("no progress") for m in markers.values()), markers

    out = subprocess.run([sys.executable, "-m", "fleet.controlplane.cli.main", "replay", str(folder), "--json",
                          "--exit-code"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 11, out.stderr  # --exit-code: hang
    d = json.loads(out.stdout)
    assert (d["verdict"], d["culprit_ranks"]) == ("hang", [WORLD - 1]), out.stdout[:3000]
    cause = d["findings"][0]
    assert cause["role"] == "cause" and cause["kind"] == "missing" and cause["ranks"] == [WORLD - 1]
    assert sorted(cause["waiting_ranks"]) == list(range(WORLD - 1))
    frames = [f["name"] for s in cause["stacks"] for f in s["frames"]]
    assert "train_step" in frames, cause["stacks"]  # where the hung rank stands: its last collective

    text = subprocess.run([sys.executable, "-m", "fleet.controlplane.cli.main", "replay", str(folder)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "HANG" in text.stdout and "train_step" in text.stdout, text.stdout[-2000:]
