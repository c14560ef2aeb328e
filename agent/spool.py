"""The uplink's write-ahead log: every event a worker reported, on disk until committed.

An agent answers a worker's report only once the report's events are written here, so
an agent killed at any moment loses nothing a worker let go of: its successor (the next
process of the same agent, a new epoch) finishes what it left and resends it.
Durability is against the agent *process* dying (SIGKILL, OOM, a crash): files are
written to the kernel, not fsynced; a machine that loses power loses its workers too.

Layout under ``<root>/<agent_id>/<epoch>/`` (folders mode 0700, files 0600):

- ``pending.<gen:020d>.log``: the events taken since the last cut, which become batch
  ``gen`` and later ones. Appended one worker report at a time, in one write: the
  report's events (``EventBatch.events`` fields) and then its ``ReportMark`` (an
  ``EventBatch.marks`` field). The log is a valid ``EventBatch`` body.
- ``<seq:020d>.<n_events>.batch``: one batch, its serialized ``EventBatch`` (header,
  events, marks), written under a temporary name and renamed, so a file with the final
  name is complete. Deleted once the controller acknowledged (or rejected) it.

A cut of batch ``k`` (the first ``n`` events of ``pending.k``) writes ``k.batch``, then,
if events remain, ``pending.(k+1)`` with them (temporary name, rename), then deletes
``pending.k``; batch ``k`` is sent only after that. So wherever a process dies, the
folder says what is where: the newest ``pending.g`` is the only live log, and when
``g.batch`` exists, its first ``n_g`` events already are in that batch.

``Spool.take_stale`` adopts what earlier processes of this agent left (the folder of a
live process is skipped: each open spool holds an exclusive ``flock`` on its folder's
lock file): it finishes a cut the predecessor had begun, cuts its live log into one last
batch of the predecessor's epoch (its seq was never used, so the controller cannot
already have it), and returns every batch to resend under its original
``(agent_id, epoch, seq)``, which the controller's ingest commits at most once; plus the
newest report number per reporter that the predecessor made durable, so a worker's
retry of such a report is not taken twice. A log's tail without its mark (a write the
process died in) is dropped: that report was never answered, and its worker sends it
again. ``release`` deletes an adopted folder once all its batches are acknowledged.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from fleet.proto import agent_pb2
from fleet.proto.contract import EVENT_BATCH_EVENTS_TAG, EVENT_BATCH_MARKS_TAG

log = logging.getLogger(__name__)

_SUFFIX = ".batch"
_LOCK = ".lock"
_LOG_PREFIX = "pending."
_LOG_SUFFIX = ".log"


@dataclass(frozen=True)
class StaleBatch:
    """One batch an earlier process of this agent left unacknowledged."""

    epoch: int
    seq: int
    n_events: int
    path: Path
    size: int


@dataclass
class Predecessor:
    """What one earlier process of this agent left: batches to resend, in seq order."""

    epoch: int
    folder: Path
    batches: list[StaleBatch]
    #: reporter -> the newest report_id this process had made durable
    reports: dict[str, int] = field(default_factory=dict)
    #: events of a log tail that was never answered (dropped; its worker resends them)
    torn_events: int = 0
    lock_fd: int = -1


def _private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) or check that an existing one is ours and not a link."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"spill folder {path} is not a folder owned by this user")


def _write_file(path: Path, data: bytes) -> None:
    """``data`` at ``path``, complete or not at all (temporary name, rename)."""
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


def _varint(data: bytes | memoryview, i: int) -> tuple[int, int]:
    """The varint at ``data[i:]`` and the index after it; IndexError when cut short."""
    shift = value = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def fields(data: bytes) -> Iterator[tuple[bytes, int, int]]:
    """The length-delimited fields of ``data``: ``(key, start, end)``, ``data[start:end]``
    being the whole field (key and length included). Stops at a field cut short (a torn
    tail), and at the first field that is not length-delimited."""
    i, n = 0, len(data)
    while i < n:
        start = i
        try:
            key, i = _varint(data, i)
            if key & 0x7 != 2:
                return
            key_end = i
            length, i = _varint(data, i)
        except (IndexError, ValueError):
            return
        end = i + length
        if end > n:
            return
        yield data[start:key_end], start, end
        i = end


def _mark_of(data: bytes, start: int, end: int) -> agent_pb2.ReportMark:
    body = data[start + len(EVENT_BATCH_MARKS_TAG):end]
    _, i = _varint(body, 0)
    return agent_pb2.ReportMark.FromString(body[i:])


class Spool:
    """One agent process's write-ahead log. Not thread-safe: the uplink calls it under its lock."""

    def __init__(self, root: str | Path, agent_id: str, epoch: int) -> None:
        self._agent_dir = Path(root) / agent_id
        self.dir = self._agent_dir / str(epoch)
        self._agent_id = agent_id
        self._epoch = epoch
        _private_dir(Path(root))
        _private_dir(self._agent_dir)
        _private_dir(self.dir)
        self._lock_fd = os.open(self.dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._log_fd = -1
        self._log_gen = 0
        self._adopted: dict[int, Predecessor] = {}

    # -- this process's log and batches -------------------------------------------------

    def _path(self, seq: int, n_events: int) -> Path:
        return self.dir / f"{seq:020d}.{n_events}{_SUFFIX}"

    def _log_path(self, gen: int) -> Path:
        return self.dir / f"{_LOG_PREFIX}{gen:020d}{_LOG_SUFFIX}"

    def append(self, gen: int, data: bytes) -> None:
        """Append one report's fields to the log that feeds batch ``gen``. OSError (ENOSPC,
        EIO...) may leave a torn tail, which a successor drops; the caller stops appending
        to this log until the next cut starts another."""
        if self._log_gen != gen:
            self._close_log()
            self._log_fd = os.open(self._log_path(gen), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._log_gen = gen
        view = memoryview(data)
        while view:
            written = os.write(self._log_fd, view)
            view = view[written:]

    def write(self, seq: int, n_events: int, data: bytes) -> Path:
        """Spill one batch (no log: memory was full); OSError leaves no file behind."""
        path = self._path(seq, n_events)
        _write_file(path, data)
        return path

    def cut(self, seq: int, n_events: int, data: bytes, rest: bytes) -> tuple[Path, bool]:
        """Batch ``seq`` (its ``EventBatch`` bytes ``data``) is cut from log ``seq``, whose
        remaining fields are ``rest``: write the batch, carry ``rest`` to log ``seq + 1``,
        delete log ``seq``, in that order (the module docstring says why). Returns the
        batch's path and whether ``rest`` is on disk (when not, the caller must not append
        to log ``seq + 1`` before its next cut). OSError: the batch file is not there."""
        path = self._path(seq, n_events)
        _write_file(path, data)
        if self._log_gen == seq:
            self._close_log()
        rest_durable = True
        if rest:
            try:
                _write_file(self._log_path(seq + 1), rest)
            except OSError as exc:
                log.warning("write-ahead log: %d bytes after batch %d are only in memory until the next "
                            "batch (%s)", len(rest), seq, exc)
                rest_durable = False
        self._log_path(seq).unlink(missing_ok=True)
        return path, rest_durable

    def _close_log(self) -> None:
        if self._log_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._log_fd)
        self._log_fd, self._log_gen = -1, 0

    @staticmethod
    def read(path: Path) -> bytes:
        return path.read_bytes()

    @staticmethod
    def remove(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    # -- what earlier processes left --------------------------------------------------

    def take_stale(self) -> list[Predecessor]:
        """Adopt what earlier processes of this agent left (oldest first); a live
        process's folder is skipped. Each adopted folder stays locked until ``release``."""
        found: list[Predecessor] = []
        for old in sorted(self._agent_dir.iterdir(), key=lambda p: (len(p.name), p.name)):
            if old == self.dir or not old.is_dir() or old.is_symlink():
                continue
            try:
                epoch = int(old.name)
            except ValueError:
                continue
            try:
                fd = os.open(old / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # another process of this agent still runs
            try:
                pred = self._adopt(old, epoch)
            except OSError as exc:
                log.error("cannot read what an earlier run of %s left in %s (%s); it is left there",
                          self._agent_id, old, exc)
                os.close(fd)
                continue
            pred.lock_fd = fd
            if pred.batches:
                self._adopted[epoch] = pred
                found.append(pred)
            else:
                found.append(pred)
                self._delete(pred)
        return found

    def _adopt(self, folder: Path, epoch: int) -> Predecessor:
        batches: dict[int, StaleBatch] = {}
        logs: dict[int, Path] = {}
        for f in folder.iterdir():
            name = f.name
            if name.startswith(_LOG_PREFIX) and name.endswith(_LOG_SUFFIX):
                with contextlib.suppress(ValueError):
                    logs[int(name[len(_LOG_PREFIX):-len(_LOG_SUFFIX)])] = f
                continue
            parts = name.split(".")
            if len(parts) != 3 or "." + parts[2] != _SUFFIX:
                continue  # the lock file, or a temporary name of a write that never finished
            try:
                seq, n = int(parts[0]), int(parts[1])
            except ValueError:
                continue
            batches[seq] = StaleBatch(epoch, seq, n, f, f.stat().st_size)
        pred = Predecessor(epoch, folder, [])
        for b in batches.values():
            self._note_marks(pred, Spool.read(b.path))
        if logs:
            gen = max(logs)
            data = logs[gen].read_bytes()
            for other in logs.values():  # older logs were cut already; they still hold marks
                if other != logs[gen]:
                    self._note_marks(pred, other.read_bytes())
            live = self._live_fields(pred, data, skip_events=batches[gen].n_events if gen in batches else 0)
            if live:
                seq = gen + 1 if gen in batches else gen
                events = sum(1 for key, _, _ in fields(live) if key == EVENT_BATCH_EVENTS_TAG)
                header = agent_pb2.EventBatch(agent_id=self._agent_id, epoch=epoch, seq=seq).SerializeToString()
                path = folder / f"{seq:020d}.{events}{_SUFFIX}"
                _write_file(path, header + live)
                batches[seq] = StaleBatch(epoch, seq, events, path, len(header) + len(live))
            for f in logs.values():
                f.unlink(missing_ok=True)
        pred.batches = [batches[s] for s in sorted(batches)]
        return pred

    @staticmethod
    def _note_marks(pred: Predecessor, data: bytes) -> None:
        for key, start, end in fields(data):
            if key == EVENT_BATCH_MARKS_TAG:
                try:
                    mark = _mark_of(data, start, end)
                except (DecodeError, IndexError, ValueError):
                    continue  # not a mark this agent wrote: it cannot vouch for any report
                if mark.reporter and mark.report_id > pred.reports.get(mark.reporter, 0):
                    pred.reports[mark.reporter] = mark.report_id

    def _live_fields(self, pred: Predecessor, data: bytes, skip_events: int) -> bytes:
        """The fields of a live log after its first ``skip_events`` events (already cut),
        up to its last mark; notes every complete report's mark."""
        self._note_marks(pred, data)
        begin = 0
        last_mark_end = 0
        seen = 0
        for key, start, end in fields(data):
            if key == EVENT_BATCH_EVENTS_TAG:
                seen += 1
                if seen == skip_events:
                    begin = end
            elif key == EVENT_BATCH_MARKS_TAG:
                last_mark_end = end
        if skip_events and seen < skip_events:
            return b""  # everything in it was cut
        if last_mark_end <= begin:
            torn = data[begin:]
        else:
            torn = data[last_mark_end:]
        pred.torn_events += sum(1 for key, _, _ in fields(torn) if key == EVENT_BATCH_EVENTS_TAG)
        return data[begin:last_mark_end] if last_mark_end > begin else b""

    def release(self, epoch: int) -> None:
        """Delete an adopted folder (every batch of it was acknowledged or rejected)."""
        pred = self._adopted.pop(epoch, None)
        if pred is not None:
            self._delete(pred)

    @staticmethod
    def _delete(pred: Predecessor) -> None:
        shutil.rmtree(pred.folder, ignore_errors=True)
        if pred.lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(pred.lock_fd)
            pred.lock_fd = -1

    def close(self) -> None:
        """A clean stop: delete this process's folder and the adopted ones (nothing in them
        is resent; the uplink logs what was still unacknowledged) and unlock them."""
        if self._lock_fd < 0:
            return
        self._close_log()
        for pred in self._adopted.values():
            self._delete(pred)
        self._adopted.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        fd, self._lock_fd = self._lock_fd, -1
        with contextlib.suppress(OSError):
            os.close(fd)
