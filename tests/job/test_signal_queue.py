"""The wrapper's signal plumbing (hpcckpt/job/signal_queue.py), with real signals."""

from __future__ import annotations

import os
import signal
import time

from hpcckpt.job import early_signals
from hpcckpt.job.signal_queue import SignalQueue


def test_signals_are_queued_in_order_and_handlers_restored():
    before = signal.getsignal(signal.SIGUSR2)
    early_signals.install()
    os.kill(os.getpid(), signal.SIGUSR1)  # arrives "while Python starts"
    q = SignalQueue()
    q.install([signal.SIGUSR1, signal.SIGUSR2])
    try:
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR2)
        q.wait(5.0)  # woken by the signal, not by the timeout
        assert time.monotonic() - t0 < 4.0
        first, second = q.pop(), q.pop()
        assert first == (signal.SIGUSR1, None)
        assert second is not None and second[0] == signal.SIGUSR2 and second[1] >= t0
        assert q.pop() is None
    finally:
        q.restore()
        early_signals.release()
        signal.signal(signal.SIGUSR2, before)
    assert q.pop() is None  # after restore: nothing, no error
