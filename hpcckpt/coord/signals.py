"""Catch stop signals on every rank: the handler only sets a flag that ``due`` shares."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

from hpcckpt.signames import parse_signal

log = logging.getLogger("hpcckpt")


class StopSignals:
    """Installs handlers that record the first stop signal; restores the old ones on close."""

    def __init__(self, signals: Iterable[str | int | signal.Signals]) -> None:
        self.signals = [parse_signal(s) for s in signals]
        self.received: signal.Signals | None = None
        self.count = 0
        self._previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            log.warning("Checkpointer created outside the main thread: stop signals are not caught")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        if self.received is None:
            self.received = signal.Signals(signum)

    def close(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._previous.clear()
