"""Distributed checkpoints with a commit marker: save, validate, find the newest good one, load.

A checkpoint of step ``S`` lives in ``{checkpoint_dir}/step_{S:08d}/`` and is written
by every rank with ``torch.distributed.checkpoint`` (synchronous). It holds the model
and AdamW state (via ``get_state_dict``/``set_state_dict``, so it round-trips exactly),
the step, and each rank's CPU RNG state.

Commit protocol: every rank's ``dcp.save`` returns -> a recorded barrier -> rank 0
writes ``MANIFEST.json`` (every file with its size and sha256, and the step) atomically
(tmp file, fsync, ``os.replace``). A checkpoint is *valid* only when its manifest exists,
names its own step, and every listed file matches its checksum; anything else (a crash
mid-save, a truncated or corrupted file) is ignored by ``latest_valid``.

Invariants:
  * Only rank 0 writes the manifest, clears a stale directory and deletes old
    checkpoints, so ranks never race on them.
  * All ranks call ``save``/``load`` together (they run collectives).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from workers.recorder import FlightRecorder

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_HASH_CHUNK = 1 << 20


def step_path(checkpoint_dir: str | os.PathLike[str], step: int) -> Path:
    """Directory of the checkpoint of ``step``."""
    return Path(checkpoint_dir) / f"step_{step:08d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _rng_key(rank: int) -> str:
    # Each rank's generator may differ (spawned processes seed themselves), so each rank
    # keeps its own; a distinct key per rank stops DCP deduplicating them into one copy.
    return f"rng_rank{rank}"


def _app_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
               with_rng: bool = True) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": step}
    if with_rng:
        state[_rng_key(_rank())] = torch.get_rng_state()
    return state


def save(checkpoint_dir: str | os.PathLike[str], step: int, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer, recorder: FlightRecorder | None = None,
         keep: int = 3) -> tuple[str, str, float]:
    """Save and commit the checkpoint of ``step`` from every rank.

    ``recorder`` records the commit barriers (required when a process group is up).
    Rank 0 then deletes committed checkpoints older than the newest ``keep`` (0 keeps
    all). Returns ``(path, manifest_sha256, seconds)``; ``manifest_sha256`` is ``""`` on
    ranks other than 0, which do not wait for the manifest.
    """
    t0 = time.perf_counter()
    path = step_path(checkpoint_dir, step)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and recorder is None:
        raise ValueError("checkpoint.save needs a FlightRecorder when a process group is up")
    rank = _rank()
    if rank == 0:
        # A directory left by an earlier attempt (crashed mid-save, or from a run that
        # went past this step) must not mix its files, or its manifest, with ours.
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
    if distributed:
        recorder.barrier()  # nobody writes until rank 0 has cleared the directory
    dcp.save(_app_state(model, optimizer, step), checkpoint_id=str(path))
    if distributed:
        recorder.barrier()  # every rank's shards are on disk before the commit
    manifest_sha = ""
    if rank == 0:
        manifest_sha = _write_manifest(path, step)
        _prune(Path(checkpoint_dir), keep)
    seconds = time.perf_counter() - t0
    log.info("checkpoint step %d saved to %s in %.3fs", step, path, seconds)
    return str(path), manifest_sha, seconds


def load(path: str | os.PathLike[str], model: torch.nn.Module,
         optimizer: torch.optim.Optimizer) -> int:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (all ranks together).

    Restores this rank's CPU RNG state too, when the checkpoint has one for this rank
    (it does not after the world grew). Returns the checkpoint's step. Does not re-verify
    the manifest: pick ``path`` with ``latest_valid``.
    """
    saved_keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    rng_key = _rng_key(_rank())
    has_rng = rng_key in saved_keys
    state = _app_state(model, optimizer, 0, with_rng=has_rng)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if has_rng:
        torch.set_rng_state(state[rng_key])
    else:
        log.warning("checkpoint %s has no RNG state for rank %d; keeping the current one", path, _rank())
    return int(state["step"])


def verify(path: str | os.PathLike[str], *, checksums: bool = True) -> bool:
    """True if the checkpoint at ``path`` is committed and (with ``checksums``) intact."""
    path = Path(path)
    m = _STEP_DIR.match(path.name)
    if m is None:
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("step") != int(m.group(1)):
            return False
        files = manifest["files"]
        if ".metadata" not in files:
            return False
        for name, entry in files.items():
            f = path / name
            if f.stat().st_size != entry["bytes"]:
                return False
            if checksums and _sha256_file(f) != entry["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.debug("checkpoint %s invalid: %r", path, exc)
        return False
    return True


def latest_valid(checkpoint_dir: str | os.PathLike[str]) -> tuple[int, str] | None:
    """The newest valid checkpoint under ``checkpoint_dir`` as ``(step, path)``, or None.

    Checksums every file of each candidate, newest first, until one passes.
    """
    for step, path in _step_dirs(Path(checkpoint_dir)):
        if verify(path):
            return step, str(path)
        log.warning("skipping invalid checkpoint %s", path)
    return None


def _step_dirs(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """Step directories, newest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = []
    for entry in checkpoint_dir.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return sorted(found, reverse=True)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(path: Path, step: int) -> str:
    files = {}
    for f in sorted(path.rglob("*")):
        if f.is_file() and f.name != MANIFEST and not f.name.endswith(".tmp"):
            files[f.relative_to(path).as_posix()] = {"bytes": f.stat().st_size, "sha256": _sha256_file(f)}
    body = json.dumps({"format": MANIFEST_FORMAT, "step": step, "time_ns": time.time_ns(),
                       "files": files}, indent=1, sort_keys=True).encode()
    tmp = path / (MANIFEST + ".tmp")
    with tmp.open("wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)
    # The rename itself must survive a power cut, or the commit may vanish.
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return hashlib.sha256(body).hexdigest()


def _prune(checkpoint_dir: Path, keep: int) -> None:
    """Delete checkpoints older than the newest ``keep`` committed ones (rank 0 only)."""
    if keep <= 0:
        return
    committed = [(s, p) for s, p in _step_dirs(checkpoint_dir) if verify(p, checksums=False)]
    if len(committed) <= keep:
        return
    cutoff = committed[keep - 1][0]
    for step, p in _step_dirs(checkpoint_dir):
        if step < cutoff:
            shutil.rmtree(p, ignore_errors=True)
            log.info("deleted old checkpoint %s", p)
