"""Ctrl-C delivered where the code can take it.

Python raises ``KeyboardInterrupt`` in the main thread wherever it happens to be: inside a
store read that holds a connection pool's lock, inside a gRPC or Ray call. What runs next
(the controller's teardown, a CLI's close) may then wait on that lock for ever: `fleet up`
once kept running for more than 90 s after a Ctrl-C in a test. ``DeferredInterrupt``
takes SIGINT for the block it guards: the first one is noted, and raised as
``KeyboardInterrupt`` where the block asks (``check``, ``pause``) or when it ends; a
second one is raised at once, wherever that is (a user who presses Ctrl-C twice wants out).

Outside the main thread (a controller run by a test's thread) it changes nothing: signals
are delivered to the main thread only.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType, TracebackType
from typing import Any

#: How often ``pause`` looks for a Ctrl-C, seconds.
PAUSE_SLICE_S = 0.1


class DeferredInterrupt:
    """A context manager; see the module docstring."""

    def __init__(self) -> None:
        self.asked = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
        if kind is None:
            self.check()   # noted while the block was ending: not lost

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if Ctrl-C was pressed."""
        if self.asked:
            raise KeyboardInterrupt

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, raising ``KeyboardInterrupt`` within ``PAUSE_SLICE_S`` of a Ctrl-C."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.check()
            time.sleep(min(left, PAUSE_SLICE_S))
        self.check()
