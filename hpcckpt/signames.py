"""Signal names as users write them: ``USR1``, ``SIGUSR1``, ``10``."""

from __future__ import annotations

import signal


def parse_signal(value: str | int | signal.Signals) -> signal.Signals:
    """The signal named by ``value``; ValueError naming the accepted forms otherwise."""
    if isinstance(value, signal.Signals):
        return value
    text = str(value).strip().upper()
    if text.isdigit():
        try:
            return signal.Signals(int(text))
        except ValueError:
            pass
    else:
        name = text if text.startswith("SIG") else "SIG" + text
        if name in signal.Signals.__members__:
            return signal.Signals[name]
    raise ValueError(
        f"unknown signal {value!r}: use a name like USR1, SIGUSR2, TERM or a number like 10"
    )


def short_name(sig: int) -> str:
    """``USR1`` for SIGUSR1: the way sbatch's --signal spells it."""
    return signal.Signals(sig).name.removeprefix("SIG")


def signal_name(sig: int) -> str:
    """``USR1`` for SIGUSR1 (Slurm's spelling); the number as text if there is no such signal."""
    try:
        return short_name(sig)
    except ValueError:
        return str(sig)
