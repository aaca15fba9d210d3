"""The mirror's copy yields to the application: the thread that copies runs at the
lowest CPU priority (nice 19) and best-effort I/O priority 7, so the ranks' compute and
their own writes go first when they compete for the node's cores and disks.

Linux applies both to one thread when given its thread id; elsewhere, or where the
system refuses, the copy runs as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

#: nice value of the copying thread (19: runs only on cycles nobody else wants).
NICE = 19
#: ioprio: best-effort class (2), lowest level (7); the idle class could starve the copy.
IOPRIO_CLASS_BE = 2
IOPRIO_LEVEL = 7
_IOPRIO_WHO_PROCESS = 1
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}
_SYS_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "ppc64le": 274}

_local = threading.local()


def _syscall(table: dict[str, int], *args: int) -> int:
    number = table.get(os.uname().machine)
    if number is None:
        return -1
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return int(libc.syscall(number, *args))


def lower_background(force: bool = False) -> bool:
    """Lower the calling thread's CPU and I/O priority, once per thread, unless it is
    the main thread (a command-line copy runs at the user's priority) and not ``force``.
    Whether it is lowered."""
    if threading.current_thread() is threading.main_thread() and not force:
        return False
    if getattr(_local, "lowered", False):
        return True
    _local.lowered = True
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, NICE)
    except (AttributeError, OSError):
        return False
    value = (IOPRIO_CLASS_BE << 13) | IOPRIO_LEVEL
    _syscall(_SYS_IOPRIO_SET, _IOPRIO_WHO_PROCESS, tid, value)
    return True


def thread_priority(tid: int | None = None) -> tuple[int, int]:
    """(nice, ioprio) of a thread (the caller's by default); ioprio is -1 where unknown."""
    tid = threading.get_native_id() if tid is None else tid
    return os.getpriority(os.PRIO_PROCESS, tid), _syscall(_SYS_IOPRIO_GET, 1, tid)
