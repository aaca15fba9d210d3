"""This process's C library, loaded once: the few calls Python's ``os`` lacks.

Stdlib only, a leaf every layer may import (``statfs``, ``fallocate``, ``prctl``,
``ioctl``/``syscall`` for write tracking). The library already mapped into the process
is used (``CDLL(None)``): looking it up by name runs ``ldconfig`` in a child process,
which cost a restore 1.8 ms each time.
"""

from __future__ import annotations

import ctypes
import sys


def _load() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


#: The C library with ``use_errno``, or None where there is none to call (not Linux).
LIBC: ctypes.CDLL | None = _load()


def function(name: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C function ``name`` (its own object, so argtypes set on it stay local), or None."""
    if LIBC is None:
        return None
    try:
        return LIBC[name]  # a new object each time, unlike getattr's cached one
    except AttributeError:
        return None
