"""Record catchable job-control signals from the first instant of the process.

The wrapper calls :func:`install` before importing anything heavy; later it takes
over with :func:`take` and receives any signal that arrived in between.
"""

from __future__ import annotations

import signal

#: Signals Slurm uses to warn a job: the ``--signal`` choice and preemption/limit TERM.
WATCHED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)

_pending: list[int] = []


def _record(signum: int, _frame: object) -> None:
    _pending.append(signum)


def install() -> None:
    """Record the watched signals instead of dying from them."""
    for sig in WATCHED:
        signal.signal(sig, _record)


def take() -> list[int]:
    """Return the signals recorded so far (in order) and forget them."""
    got = list(_pending)
    _pending.clear()
    return got


def release() -> None:
    """Give the signals back to their default actions, replaying any recorded one.

    Commands other than the wrapper call this so Ctrl-C and friends behave normally.
    """
    pending = take()
    for sig in WATCHED:
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    for sig in pending:
        signal.raise_signal(sig)
