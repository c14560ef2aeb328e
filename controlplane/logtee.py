"""Rank-prefixed tee of an attempt's log files, like torchrun's ``--tee``.

The launcher writes each rank's stdout and stderr to
``<state_dir>/logs/<job>/attempt-<n>/rank-<r>.log``. ``LogTee(log_dir, write)`` tails
every ``rank-<r>.log`` in that folder from a daemon thread (files may appear after it
starts) and calls ``write(f"[rank {r}] {line}")`` once per complete line, ``line``
without its newline. A partial line is held until its newline arrives; ``stop()``
prints what is left (a last line without a newline included) and ends the thread.

Invariants: a line is written once, whole, in file order per rank; ranks interleave by
arrival (each poll reads every file in rank order). Bytes that are not UTF-8 are shown
as replacement characters, never an error. ``write`` raising is logged and the tee goes
on: it must not die silently while a job runs. `fleet logs --follow` reuses this class.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

#: A rank's log file in an attempt's folder (``rank-<r>.error.json`` is not one).
RANK_LOG = re.compile(r"^rank-(\d+)\.log$")
_READ_CHUNK = 1 << 20


def rank_logs(log_dir: Path) -> dict[int, Path]:
    """The rank log files in ``log_dir`` by rank (none if the folder does not exist)."""
    try:
        entries = list(log_dir.iterdir())
    except OSError:
        return {}
    found = {int(m.group(1)): p for p in entries if (m := RANK_LOG.match(p.name)) and p.is_file()}
    return dict(sorted(found.items()))


class FileTail:
    """One file read incrementally: complete lines out, the partial last line held."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115 - held open across polls, closed by close()
        self._partial = b""

    def lines(self) -> list[str]:
        """The complete lines appended since the last call, without their newlines."""
        data = self._partial
        while chunk := self._file.read(_READ_CHUNK):
            data += chunk
        *complete, self._partial = data.split(b"\n")
        return [_text(line) for line in complete]

    def rest(self) -> list[str]:
        """Every line still unread, the held partial line included (for the end)."""
        out = self.lines()
        if self._partial:
            out.append(_text(self._partial))
            self._partial = b""
        return out

    def close(self) -> None:
        self._file.close()


def _text(line: bytes) -> str:
    return line.removesuffix(b"\r").decode("utf-8", errors="replace")


class LogTee:
    """Tail every ``rank-<r>.log`` in ``log_dir`` and ``write`` each complete line,
    prefixed ``[rank r] `` (``prefix=False``: as it is), every ``poll_s`` seconds.

    ``ranks``: only these ranks (None: every rank). ``start()`` starts the thread;
    ``stop()`` (idempotent) ends it and writes what is left. A context manager."""

    def __init__(self, log_dir: Path, write: Callable[[str], None], poll_s: float = 0.1, *,
                 ranks: Collection[int] | None = None, prefix: bool = True) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, not {poll_s}")
        self.log_dir = Path(log_dir)
        self._write = write
        self._poll_s = poll_s
        self._ranks = None if ranks is None else frozenset(ranks)
        self._prefix = prefix
        self._tails: dict[int, FileTail] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._lock = threading.Lock()  # one poll at a time: the thread's, or stop()'s last one

    def start(self) -> LogTee:
        if self._thread is not None or self._stopped:
            raise RuntimeError("a LogTee starts once")
        self._thread = threading.Thread(target=self._run, name=f"fleet-log-tee-{self.log_dir.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread, then write every line still unread (partial ones too)."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 10 * self._poll_s))
            if self._thread.is_alive():
                log.warning("log tee of %s did not end in time (a write blocked?)", self.log_dir)
        with self._lock:
            self._poll(final=True)
            for tail in self._tails.values():
                tail.close()
            self._tails.clear()

    def __enter__(self) -> LogTee:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                with self._lock:
                    self._poll(final=False)
            except Exception:  # the tee must outlive a bad file or a failing write
                log.exception("log tee of %s: a poll failed", self.log_dir)

    def _poll(self, *, final: bool) -> None:
        for rank, path in rank_logs(self.log_dir).items():
            if rank not in self._tails and (self._ranks is None or rank in self._ranks):
                try:
                    self._tails[rank] = FileTail(path)
                except OSError as exc:
                    log.warning("log tee: cannot open %s: %s", path, exc)
        for rank, tail in self._tails.items():
            for line in tail.rest() if final else tail.lines():
                self._emit(rank, line)

    def _emit(self, rank: int, line: str) -> None:
        try:
            self._write(f"[rank {rank}] {line}" if self._prefix else line)
        except Exception:
            log.exception("log tee of %s: writing a line of rank %d failed", self.log_dir, rank)
