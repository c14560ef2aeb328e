"""LogTee: real files appended by writer threads while the tee tails them; every complete
line once, prefixed with its rank, in file order per rank; partial lines held until
their newline, and written by stop()."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fleet.controlplane.logtee import LogTee, rank_logs

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 20.0


class Lines:
    """What the tee wrote, safe to read from the test thread."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._cond = threading.Condition()

    def write(self, line: str) -> None:
        with self._cond:
            self._lines.append(line)
            self._cond.notify_all()

    def wait_for(self, done: Callable[[list[str]], bool]) -> list[str]:
        with self._cond:
            assert self._cond.wait_for(lambda: done(self._lines), timeout=DEADLINE_S), self._lines
            return list(self._lines)

    @property
    def lines(self) -> list[str]:
        with self._cond:
            return list(self._lines)


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)
        f.flush()


def test_lines_of_files_that_appear_after_start_are_prefixed_and_in_order(tmp_path: Path) -> None:
    out = Lines()
    n = 200
    with LogTee(tmp_path, out.write, poll_s=0.01) as tee:
        assert tee.log_dir == tmp_path

        def writer(rank: int) -> None:
            path = tmp_path / f"rank-{rank}.log"
            for i in range(n):
                _append(path, f"step {i}\n".encode())
                if i % 50 == 0:
                    time.sleep(0.01)

        threads = [threading.Thread(target=writer, args=(r,), name=f"writer-{r}") for r in (0, 1, 10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=DEADLINE_S)
        got = out.wait_for(lambda lines: len(lines) == 3 * n)
    for rank in (0, 1, 10):
        assert [line for line in got if line.startswith(f"[rank {rank}] ")] == \
            [f"[rank {rank}] step {i}" for i in range(n)]
    assert len(out.lines) == 3 * n  # stop() wrote nothing twice


def test_a_partial_line_is_held_until_its_newline(tmp_path: Path) -> None:
    out = Lines()
    path = tmp_path / "rank-3.log"
    path.write_bytes(b"")
    tee = LogTee(tmp_path, out.write, poll_s=0.01).start()
    try:
        _append(path, b"loss 0.")
        _append(path, b"5\r\nnext")  # CRLF ends a line without its \r
        assert out.wait_for(lambda lines: len(lines) >= 1) == ["[rank 3] loss 0.5"]
        # the tee polls on: the held "next" must not come out before its newline
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            assert out.lines == ["[rank 3] loss 0.5"]
            time.sleep(0.02)
        _append(path, b" line\nlast words")
        out.wait_for(lambda lines: len(lines) >= 2)
    finally:
        tee.stop()
    assert out.lines == ["[rank 3] loss 0.5", "[rank 3] next line", "[rank 3] last words"]
    tee.stop()  # idempotent: nothing more
    assert len(out.lines) == 3


def test_stop_writes_what_is_left_and_ends_the_thread(tmp_path: Path) -> None:
    out = Lines()
    tee = LogTee(tmp_path, out.write, poll_s=30.0).start()  # never polls on its own in this test
    (tmp_path / "rank-0.log").write_bytes(b"\xce\xb1 ok\n\xff bad\ntail")  # UTF-8, then a bad byte
    (tmp_path / "rank-0.error.json").write_text("{}")  # not a rank log
    (tmp_path / "rank-x.log").write_text("not a rank\n")
    tee.stop()
    assert out.lines == ["[rank 0] α ok", "[rank 0] \ufffd bad", "[rank 0] tail"]
    assert not [t for t in threading.enumerate() if t.name.startswith("fleet-log-tee")]


def test_ranks_and_prefix_options(tmp_path: Path) -> None:
    for rank in range(3):
        (tmp_path / f"rank-{rank}.log").write_text(f"hello from {rank}\n")
    out = Lines()
    with LogTee(tmp_path, out.write, poll_s=0.01, ranks={1}, prefix=False):
        out.wait_for(lambda lines: len(lines) >= 1)
    assert out.lines == ["hello from 1"]


def test_a_failing_write_does_not_end_the_tee(tmp_path: Path, caplog) -> None:
    out = Lines()

    def flaky(line: str) -> None:
        if "boom" in line:
            raise OSError("terminal gone")
        out.write(line)

    path = tmp_path / "rank-0.log"
    with LogTee(tmp_path, flaky, poll_s=0.01):
        _append(path, b"boom\n")
        _append(path, b"after\n")
        out.wait_for(lambda lines: lines == ["[rank 0] after"])
    assert "writing a line of rank 0 failed" in caplog.text


def test_a_missing_folder_is_waited_for(tmp_path: Path) -> None:
    folder = tmp_path / "attempt-1"
    out = Lines()
    with LogTee(folder, out.write, poll_s=0.01):
        time.sleep(0.05)
        folder.mkdir()
        _append(folder / "rank-0.log", b"late\n")
        out.wait_for(lambda lines: lines == ["[rank 0] late"])


def test_rank_logs_lists_rank_files_by_number(tmp_path: Path) -> None:
    for name in ("rank-10.log", "rank-2.log", "rank-2.error.json", "rank-.log", "other.log"):
        (tmp_path / name).write_text("")
    assert list(rank_logs(tmp_path)) == [2, 10]
    assert rank_logs(tmp_path / "absent") == {}


def test_start_twice_is_an_error(tmp_path: Path) -> None:
    tee = LogTee(tmp_path, lambda line: None).start()
    try:
        with pytest.raises(RuntimeError):
            tee.start()
    finally:
        tee.stop()
    with pytest.raises(ValueError):
        LogTee(tmp_path, lambda line: None, poll_s=0)
