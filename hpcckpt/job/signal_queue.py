"""The wrapper's signal plumbing: handlers that only queue, and a wakeup pipe.

Handlers run between two bytecodes of the main loop; they only record ``(signal,
when)`` and the wakeup fd wakes the loop's ``select``, which then handles the queue in
order. SIGCHLD wakes it too (the step ended). Signals that arrived while Python was
still importing (:mod:`hpcckpt.job.early_signals`) come first, with an unknown time.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from hpcckpt.job import early_signals


class SignalQueue:
    """``install()``, then ``wait(timeout)`` and ``pop()`` in the main loop; ``restore()``."""

    def __init__(self) -> None:
        self._queue: deque[tuple[int, float | None]] = deque()
        self._wake_r = self._wake_w = -1
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup = -1

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._queue.append((signum, time.monotonic()))

    def _on_child(self, _signum: int, _frame: object) -> None:
        pass  # the wakeup fd already woke the main loop

    def install(self, signals: Iterable[int]) -> None:
        """Take over from early_signals: our handlers first, then adopt what it recorded."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in signals:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        self._old_handlers[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, self._on_child)
        for sig in early_signals.take():  # arrived while Python was importing
            self._queue.append((sig, None))

    def restore(self) -> None:
        """Give the signals back to the handlers they had before ``install``."""
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
            except (TypeError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
        self._old_handlers.clear()
        signal.set_wakeup_fd(self._old_wakeup)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def wait(self, timeout: float) -> None:
        """Sleep until a signal arrives or ``timeout`` seconds pass."""
        try:
            select.select([self._wake_r], [], [], timeout)
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            pass

    def pop(self) -> tuple[int, float | None] | None:
        """The oldest queued ``(signal, monotonic time or None)``, or None; drains the pipe."""
        try:
            while os.read(self._wake_r, 512):
                pass
        except (BlockingIOError, OSError):
            pass
        return self._queue.popleft() if self._queue else None
