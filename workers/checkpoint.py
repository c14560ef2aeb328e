"""Distributed checkpoints with a commit marker: save (blocking or asynchronous), validate,
find the newest good one, load.

A checkpoint of step ``S`` lives in ``{checkpoint_dir}/step_{S:08d}/`` and is written by
every rank with ``torch.distributed.checkpoint`` (DCP). It holds the model and AdamW
state (via ``get_state_dict``/``set_state_dict``: FSDP2 DTensor shards and DDP both
round-trip exactly), the step, per rank its RNG states and data position, and one
replicated ``extra`` dict of the caller's (e.g. MoE router biases), pickled.

Expert parallelism: EP rank ``j`` holds different experts under the same parameter
names as the other EP ranks, which DCP would take for one replicated tensor. Their keys
get the suffix ``@ep{j}of{ep}`` in the files, so a checkpoint loads only with the same
``ep_size`` (and any data-parallel size: DCP reshards the FSDP dimension).

Commit protocol: every rank's shards are on disk -> rank 0 writes ``MANIFEST.json``
(every file with its size and sha256, and the step) atomically (tmp file, fsync,
``os.replace``, directory fsync). A checkpoint is *valid* only when its manifest exists,
names its own step and format, and every listed file matches its checksum; anything else
(a crash mid-save, a rank killed before the commit, a corrupted file) is ignored by
``latest_valid``.

  * ``save``: blocking; two recorded barriers (directory cleared, shards written).
  * ``AsyncCheckpointer``: ``start`` blocks only while the state is copied to CPU
    memory; a background thread writes it. The loop folds ``poll_local_done()`` into a
    collective it makes anyway and calls ``commit`` on every rank once all ranks
    reported done; rank 0 then writes the manifest. No extra blocking collective.

Invariants:
  * Only rank 0 writes manifests, clears stale directories and deletes old checkpoints.
  * All ranks call ``save``/``load``/``AsyncCheckpointer(...)``/``start``/``commit``
    together and in the same order.
  * An ``AsyncCheckpointer`` writes each step directory at most once; stale ones
    (uncommitted, or newer than the step the run resumed from) are removed when it
    is built, before any rank can write.
"""

from __future__ import annotations

import enum
import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fleet.workers.recorder import FlightRecorder

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 2  # 2: per-rank state and extra as pickled bytes, EP key suffixes
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_HASH_CHUNK = 1 << 20
DATA_POSITION = "data_position"  # key load() adds to the returned extra dict


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or committed."""


def step_path(checkpoint_dir: str | os.PathLike[str], step: int) -> Path:
    """Directory of the checkpoint of ``step``."""
    return Path(checkpoint_dir) / f"step_{step:08d}"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The step of checkpoint directory ``path`` (``step_path``'s inverse); None when
    ``path`` is not a step directory."""
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _rank_key(rank: int) -> str:
    # Each rank's RNG and data position differ; a distinct key per rank stops DCP
    # deduplicating them into one copy.
    return f"rank{rank}"


def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(raw: bytes) -> Any:
    return torch.load(io.BytesIO(raw), weights_only=False)


def _rank_state(data_position: int | None) -> dict:
    state = {"cpu_rng": torch.get_rng_state(), "data_position": data_position}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    return state


def _set_rank_state(state: dict) -> int | None:
    torch.set_rng_state(state["cpu_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])
    return state["data_position"]


# ---- expert-parallel key renaming --------------------------------------------------------

def _expert_prefixes(model: nn.Module) -> tuple[str, ...]:
    from fleet.workers.parallel import expert_modules  # parallel imports FSDP; keep it lazy

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return tuple(name + "." for name, _ in expert_modules(inner))


def _ep_renamer(model: nn.Module, ep_rank: int, ep_size: int):
    """``(to_file, from_file)`` key maps: expert keys get the EP suffix (identity if ep_size 1)."""
    prefixes = _expert_prefixes(model) if ep_size > 1 else ()
    suffix = f"@ep{ep_rank}of{ep_size}"

    def to_file(key: str) -> str:
        return key + suffix if key.startswith(prefixes) else key

    def from_file(key: str) -> str:
        return key[: -len(suffix)] if prefixes and key.endswith(suffix) else key

    return to_file, from_file


def _rename(model_sd: dict, optim_sd: dict, fn) -> tuple[dict, dict]:
    model_sd = {fn(k): v for k, v in model_sd.items()}
    optim_sd = dict(optim_sd)
    if "state" in optim_sd:
        optim_sd["state"] = {fn(k): v for k, v in optim_sd["state"].items()}
    if "param_groups" in optim_sd:
        optim_sd["param_groups"] = [
            {**g, "params": [fn(k) for k in g["params"]]} for g in optim_sd["param_groups"]]
    return model_sd, optim_sd


def _app_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, *,
               extra: dict | None, data_position: int | None, ep_rank: int, ep_size: int) -> dict:
    if extra and DATA_POSITION in extra:
        raise ValueError(f"extra must not hold {DATA_POSITION!r}: pass data_position instead")
    to_file, _ = _ep_renamer(model, ep_rank, ep_size)
    model_sd, optim_sd = _rename(*get_state_dict(model, optimizer), to_file)
    return {"model": model_sd, "optim": optim_sd, "step": step, "extra": _pack(dict(extra or {})),
            _rank_key(_rank()): _pack(_rank_state(data_position))}


# ---- blocking save ------------------------------------------------------------------------

def save(checkpoint_dir: str | os.PathLike[str], step: int, model: nn.Module,
         optimizer: torch.optim.Optimizer, recorder: FlightRecorder | None = None,
         keep: int = 3, *, extra: dict | None = None, data_position: int | None = None,
         ep_rank: int = 0, ep_size: int = 1) -> tuple[str, str, float]:
    """Save and commit the checkpoint of ``step`` from every rank, blocking.

    ``recorder`` records the commit barriers (required when a process group is up).
    Rank 0 then deletes committed checkpoints older than the newest ``keep`` (0 keeps
    all). Returns ``(path, manifest_sha256, seconds)``; ``manifest_sha256`` is ``""`` on
    ranks other than 0, which do not wait for the manifest.
    """
    t0 = time.perf_counter()
    path = step_path(checkpoint_dir, step)
    distributed = _distributed()
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
    dcp.save(_app_state(model, optimizer, step, extra=extra, data_position=data_position,
                        ep_rank=ep_rank, ep_size=ep_size), checkpoint_id=str(path))
    if distributed:
        recorder.barrier()  # every rank's shards are on disk before the commit
    manifest_sha = ""
    if rank == 0:
        manifest_sha = _write_manifest(path, step)
        _prune(Path(checkpoint_dir), keep)
    seconds = time.perf_counter() - t0
    log.info("checkpoint step %d saved to %s in %.3fs", step, path, seconds)
    return str(path), manifest_sha, seconds


# ---- asynchronous save ----------------------------------------------------------------------

class SaveState(enum.Enum):
    IDLE = "idle"          # nothing in flight: start() allowed
    WRITING = "writing"    # staged; the background thread is writing this rank's shards
    WRITTEN = "written"    # this rank's part is on disk: waiting for commit()
    FAILED = "failed"      # the background save raised; the checkpointer is unusable


_TRANSITIONS = {
    SaveState.IDLE: {SaveState.WRITING},
    SaveState.WRITING: {SaveState.WRITTEN, SaveState.FAILED},
    SaveState.WRITTEN: {SaveState.IDLE},
    SaveState.FAILED: set(),
}


class AsyncCheckpointer:
    """Asynchronous DCP saves committed by the training loop; one save in flight at a time.

    Building it is collective: every rank creates the gloo group DCP's background thread
    coordinates on (so its collectives never interleave with training ones), and rank 0
    removes stale step directories (uncommitted, or newer than ``resume_step``) before a
    barrier on that group. ``timeout`` bounds each background collective: a save whose
    peer died fails after it instead of hanging.

    Per checkpoint, on every rank::

        ckpt.start(step, model, optimizer, extra=..., data_position=...)   # staging only
        ... each later step: done = ckpt.poll_local_done(), folded into a collective ...
        if every rank reported done: path, sha = ckpt.commit(step)          # rank 0 writes
    """

    def __init__(self, checkpoint_dir: str | os.PathLike[str], *, keep: int = 3,
                 resume_step: int = 0, timeout: timedelta = timedelta(minutes=10),
                 ep_rank: int = 0, ep_size: int = 1) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.keep = keep
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.state = SaveState.IDLE
        self.step: int | None = None       # step of the save in flight / awaiting commit
        self.history: list[tuple[SaveState, SaveState]] = []
        self._future: Future | None = None
        self._last_started = resume_step
        self._group = dist.new_group(backend="gloo", timeout=timeout) if _distributed() else None
        # One stager for all saves: it keeps its CPU buffers, so staging after the first
        # save copies into memory already mapped instead of allocating it again. Safe
        # because only one save is in flight at a time.
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))
        if _rank() == 0:
            _remove_stale(self.checkpoint_dir, resume_step)
        if self._group is not None:
            dist.barrier(group=self._group)

    def _move(self, new: SaveState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise CheckpointError(f"checkpoint save cannot go from {self.state.value} to {new.value}")
        self.history.append((self.state, new))
        self.state = new

    def start(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *,
              extra: dict | None = None, data_position: int | None = None) -> float:
        """Stage this rank's state in CPU memory and start writing it in the background.

        Returns the seconds the caller was blocked (the staging copy). Training may
        change the model right after: the save holds its own copy.
        """
        if step <= self._last_started:
            raise CheckpointError(f"checkpoint step {step} is not after step {self._last_started}, "
                                  "already saved or resumed from")
        if self.state is not SaveState.IDLE:
            raise CheckpointError(f"cannot start step {step}: step {self.step} is {self.state.value}")
        t0 = time.perf_counter()
        state = _app_state(model, optimizer, step, extra=extra, data_position=data_position,
                           ep_rank=self.ep_rank, ep_size=self.ep_size)
        self._future = dcp.async_save(state, checkpoint_id=str(step_path(self.checkpoint_dir, step)),
                                      process_group=self._group, async_stager=self._stager)
        self._move(SaveState.WRITING)
        self.step, self._last_started = step, step
        return time.perf_counter() - t0

    def poll_local_done(self) -> bool:
        """True once this rank's part of the save in flight is on disk (never blocks).

        False when idle. Raises CheckpointError if the background save failed.
        """
        if self.state == SaveState.WRITING and self._future is not None and self._future.done():
            exc = self._future.exception()
            if exc is not None:
                self._move(SaveState.FAILED)
                raise CheckpointError(f"checkpoint step {self.step} failed on rank {_rank()}: {exc!r}") from exc
            self._move(SaveState.WRITTEN)
        return self.state == SaveState.WRITTEN

    def wait_local(self, timeout_s: float) -> None:
        """Block until this rank's save in flight is on disk (end of training), or raise."""
        if self.state == SaveState.WRITING:
            try:
                self._future.result(timeout=timeout_s)
            except Exception:
                pass  # poll_local_done reports it
            if not self.poll_local_done():
                raise CheckpointError(f"checkpoint step {self.step} not written after {timeout_s}s")

    def commit(self, step: int) -> tuple[str, str]:
        """Commit ``step`` once every rank reported its part done; call on every rank.

        Rank 0 writes the manifest and prunes old checkpoints; the others only forget the
        save. Returns ``(path, manifest_sha256)`` (``""`` on ranks other than 0).
        """
        if self.step != step or not self.poll_local_done():
            raise CheckpointError(f"cannot commit step {step}: this rank's save is "
                                  f"{self.state.value} (step {self.step})")
        path = step_path(self.checkpoint_dir, step)
        sha = ""
        if _rank() == 0:
            sha = _write_manifest(path, step)
            _prune(self.checkpoint_dir, self.keep)
            log.info("checkpoint step %d committed to %s", step, path)
        self._move(SaveState.IDLE)
        self._future, self.step = None, None
        return str(path), sha

    def close(self, timeout_s: float = 60.0) -> None:
        """Let a save in flight finish (uncommitted), so no writer thread outlives us."""
        if self._future is not None and not self._future.done():
            try:
                self._future.result(timeout=timeout_s)
            except Exception as exc:  # closing on the way out of a failure: log, do not mask it
                log.warning("checkpoint step %s failed while closing: %r", self.step, exc)
        self._stager.close()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remove_stale(checkpoint_dir: Path, resume_step: int) -> None:
    for step, path in _step_dirs(checkpoint_dir):
        if step > resume_step or not verify(path, checksums=False):
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed stale checkpoint directory %s", path)


# ---- load -----------------------------------------------------------------------------------

def load(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer, *,
         ep_rank: int = 0, ep_size: int = 1) -> tuple[int, dict]:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (all ranks together).

    Restores this rank's RNG states too, when the checkpoint has them for this rank (it
    does not after the world grew). Returns ``(step, extra)``: the caller's ``extra``
    plus ``extra["data_position"]``, the position this rank saved (None if none, or
    no state for this rank). Does not re-verify the manifest: pick ``path`` with
    ``latest_valid``.
    """
    saved_keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    to_file, from_file = _ep_renamer(model, ep_rank, ep_size)
    model_sd, optim_sd = _rename(*get_state_dict(model, optimizer), to_file)
    key = _rank_key(_rank())
    state: dict = {"model": model_sd, "optim": optim_sd, "step": 0, "extra": b""}
    if key in saved_keys:
        state[key] = b""
    dcp.load(state, checkpoint_id=str(path))
    model_sd, optim_sd = _rename(state["model"], state["optim"], from_file)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    extra = _unpack(state["extra"])
    extra[DATA_POSITION] = None
    if key in state:
        extra[DATA_POSITION] = _set_rank_state(_unpack(state[key]))
    else:
        log.warning("checkpoint %s has no RNG state for rank %d; keeping the current one", path, _rank())
    return int(state["step"]), extra


@dataclass(frozen=True)
class InvalidCheckpoint:
    """A step directory that failed verification: which, and why (shown to the user)."""

    step: int
    path: str
    reason: str


def problem(path: str | os.PathLike[str], *, checksums: bool = True) -> str:
    """Why the checkpoint at ``path`` is not valid (not committed, or, with
    ``checksums``, not intact); "" when it is valid."""
    path = Path(path)
    m = _STEP_DIR.match(path.name)
    if m is None:
        return f"{path.name} is not a step directory"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("step") != int(m.group(1)):
            return f"{MANIFEST} names another format or step"
        files = manifest["files"]
        if ".metadata" not in files:
            return f"{MANIFEST} lists no .metadata"
        for name, entry in files.items():
            f = path / name
            if f.stat().st_size != entry["bytes"]:
                return f"{name} has {f.stat().st_size} bytes, {MANIFEST} says {entry['bytes']}"
            if checksums and _sha256_file(f) != entry["sha256"]:
                return f"{name} does not match its sha256 in {MANIFEST}"
    except FileNotFoundError as exc:
        return f"{Path(exc.filename or MANIFEST).name} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.debug("checkpoint %s invalid: %r", path, exc)
        return f"unreadable {MANIFEST} or file ({type(exc).__name__})"
    return ""


def verify(path: str | os.PathLike[str], *, checksums: bool = True) -> bool:
    """True if the checkpoint at ``path`` is committed and (with ``checksums``) intact."""
    return not problem(path, checksums=checksums)


def latest_valid(checkpoint_dir: str | os.PathLike[str],
                 skipped: list[InvalidCheckpoint] | None = None, *,
                 at_most: int = 0) -> tuple[int, str] | None:
    """The newest valid checkpoint under ``checkpoint_dir`` as ``(step, path)``, or None.

    Checksums every file of each candidate, newest first, until one passes; each one
    that fails is appended to ``skipped`` (the caller reports them: the manifest is the
    truth of a checkpoint's validity, and the store's flag follows it). ``at_most`` > 0:
    checkpoints of later steps are passed over, unchecked (a restore ceiling after
    silent data corruption).
    """
    for step, path in _step_dirs(Path(checkpoint_dir)):
        if at_most > 0 and step > at_most:
            continue
        why = problem(path)
        if not why:
            return step, str(path)
        log.warning("skipping invalid checkpoint %s: %s", path, why)
        if skipped is not None:
            skipped.append(InvalidCheckpoint(step, str(path), why))
    return None


#: Bytes ``corrupt_newest`` flips.
_FLIP_BYTES = 64


def corrupt_newest(checkpoint_dir: str | os.PathLike[str]) -> Path:
    """Chaos: flip bytes in place in the largest data file of the newest valid checkpoint
    (the size stays, the checksum breaks), so that ``latest_valid`` skips it; returns the
    file. ``FileNotFoundError`` when there is no valid checkpoint or nothing to flip."""
    latest = latest_valid(checkpoint_dir)
    if latest is None:
        raise FileNotFoundError(f"no valid checkpoint under {checkpoint_dir} to corrupt")
    step, path = latest
    files = json.loads((Path(path) / MANIFEST).read_text())["files"]
    # data files first (.distcp); .metadata only if there is nothing else
    name = max(files, key=lambda f: (f != ".metadata", files[f]["bytes"], f))
    target, size = Path(path) / name, files[name]["bytes"]
    if size == 0:
        raise FileNotFoundError(f"checkpoint {path}: its largest file {name} is empty; nothing to corrupt")
    offset = max(0, size // 2 - _FLIP_BYTES // 2)
    with target.open("r+b") as f:
        f.seek(offset)
        raw = f.read(_FLIP_BYTES)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in raw))
        f.flush()
        os.fsync(f.fileno())
    log.warning("corrupted checkpoint step %d: %d bytes of %s at offset %d", step, len(raw), target, offset)
    return target


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
