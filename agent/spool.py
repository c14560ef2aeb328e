"""The uplink's spill to disk: unacknowledged batches that do not fit in memory.

Layout: ``<root>/<agent_id>/<epoch>/<seq:020d>.<n_events>.batch``, one file per batch
holding the serialized ``EventBatch``. A file is written under a temporary name and
renamed, so a file with the final name is always complete; it is deleted once the
controller acknowledged (or rejected) its batch. Folders are created with mode 0700.

Spilled batches do not survive the agent process: a restarted agent has a new epoch,
and the controller only takes batches of a stream's own epoch. What an earlier process
of the same agent left behind is found by ``Spool.take_stale`` (the folder of a live
process is skipped: each open spool holds an exclusive ``flock`` on its folder's lock
file), summarised so the caller can report the loss, and deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_SUFFIX = ".batch"
_LOCK = ".lock"


@dataclass(frozen=True)
class StaleSpill:
    """Batches an earlier process of this agent spilled and never got acknowledged."""

    epoch: int
    first_seq: int
    last_seq: int
    batches: int
    events: int


def _private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) or check that an existing one is ours and not a link."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"spill folder {path} is not a folder owned by this user")


class Spool:
    """One agent process's spill folder. Not thread-safe: the uplink calls it under its lock."""

    def __init__(self, root: str | Path, agent_id: str, epoch: int) -> None:
        self._agent_dir = Path(root) / agent_id
        self.dir = self._agent_dir / str(epoch)
        self._epoch = epoch
        _private_dir(Path(root))
        _private_dir(self._agent_dir)
        _private_dir(self.dir)
        self._lock_fd = os.open(self.dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _path(self, seq: int, n_events: int) -> Path:
        return self.dir / f"{seq:020d}.{n_events}{_SUFFIX}"

    def write(self, seq: int, n_events: int, data: bytes) -> Path:
        """Write one batch; OSError (ENOSPC, EFBIG, EIO...) leaves no file behind."""
        path = self._path(seq, n_events)
        tmp = path.with_name(path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return path

    @staticmethod
    def read(path: Path) -> bytes:
        return path.read_bytes()

    @staticmethod
    def remove(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def take_stale(self) -> list[StaleSpill]:
        """Summarise and delete what earlier processes of this agent left; live ones are kept."""
        found: list[StaleSpill] = []
        for old in sorted(self._agent_dir.iterdir()):
            if old == self.dir or not old.is_dir() or old.is_symlink():
                continue
            try:
                fd = os.open(old / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # another process of this agent still runs
                summary = _summarise(old)
                if summary is not None:
                    found.append(summary)
                shutil.rmtree(old, ignore_errors=True)
            finally:
                os.close(fd)
        return found

    def close(self) -> None:
        """Delete this process's folder (its batches can never be resent) and unlock it."""
        if self._lock_fd < 0:
            return
        shutil.rmtree(self.dir, ignore_errors=True)
        fd, self._lock_fd = self._lock_fd, -1
        with contextlib.suppress(OSError):
            os.close(fd)


def _summarise(folder: Path) -> StaleSpill | None:
    try:
        epoch = int(folder.name)
    except ValueError:
        return None
    seqs: list[int] = []
    events = 0
    for f in folder.iterdir():
        parts = f.name.split(".")
        if len(parts) != 3 or "." + parts[2] != _SUFFIX:
            continue  # the lock file, or a temporary name of a write that never finished
        try:
            seqs.append(int(parts[0]))
            events += int(parts[1])
        except ValueError:
            continue
    if not seqs:
        return None
    return StaleSpill(epoch=epoch, first_seq=min(seqs), last_seq=max(seqs), batches=len(seqs), events=events)
