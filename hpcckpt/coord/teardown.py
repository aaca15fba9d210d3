"""What a Checkpointer leaves behind once it is done, and the process's exit.

``finish()`` and ``close()`` end with ``Checkpointer.release()``: the background write of a staged
save that was never committed is waited for (bounded), rank 0's mirror thread is
stopped and joined, the kernel write tracking of the state's memory is closed, the
staging buffers are freed, the stop-signal handlers are restored and the directory lock
is given back with its refresh thread joined. After it, hpcckpt holds no thread and no
reference to the application's arrays, tensors or DTensors.

An ``atexit`` hook, installed with the first Checkpointer, releases the Checkpointers the
application never finished or closed (locally: nothing collective runs at exit, and a
staged save not committed stays uncommitted), joins what is left of hpcckpt's threads,
and, while torch.distributed's gloo worker threads run, holds the interpreter's
finalization back for a moment with the GIL released: a gloo worker that drops the last
reference to a tensor Python once held takes the GIL to free its Python object, and doing
so once finalization began kills the thread inside a C++ destructor, which aborts the
process with ``terminate called without an active exception`` (exit status 134, a job
Slurm counts as failed): pytorch/pytorch#117762, the abandoned fix pytorch/pytorch#179291.
"""

from __future__ import annotations

import atexit
import gc
import glob
import logging
import sys
import threading
import time
import weakref
from typing import Any

log = logging.getLogger("hpcckpt")

#: Seconds a teardown waits for one of hpcckpt's threads before it leaves it (a daemon).
JOIN_TIMEOUT = 10.0
#: Seconds the exit holds finalization back, GIL released, while gloo's workers run.
GLOO_GRACE = 0.2
#: The names of hpcckpt's threads start with it.
THREAD_PREFIX = "hpcckpt-"
#: The name torch gives the worker threads of a gloo process group.
GLOO_WORKER = "pt_gloo_runloop"

# The Checkpointers (typed Any: coord/checkpointer.py imports this module).
_live: weakref.WeakSet[Any] = weakref.WeakSet()
_installed = False
_install_lock = threading.Lock()


def register(ck: Any) -> None:
    """Remember ``ck`` (weakly) for the exit hook, installed once per process."""
    global _installed
    _live.add(ck)
    with _install_lock:
        if not _installed:
            atexit.register(at_exit)
            _installed = True


def close_store(pending: Any, store: Any, buffers: Any, timeout: float = JOIN_TIMEOUT) -> None:
    """A Checkpointer's store given up (again is harmless): ``pending``, a staged save
    never committed, has its write joined and is dropped; the mirror's thread is stopped
    and joined (a copy under way ends before it sees the stop), the write tracking is
    closed and the staging ``buffers`` freed, all within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    mirroring = store.mirroring
    if pending is not None and pending.writer is not None:  # never committed: not waited on
        pending.go()  # still held if its save() raised before letting it go: it runs out
        pending.writer.join(end - time.monotonic())
    store.close()
    if mirroring is not None:
        mirroring.join(end - time.monotonic())
    if buffers is not None:
        buffers.release()


def hpcckpt_threads() -> list[threading.Thread]:
    """hpcckpt's threads still alive in this process."""
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


def join_threads(timeout: float = JOIN_TIMEOUT) -> list[str]:
    """Join hpcckpt's threads within ``timeout`` seconds in all; the names of those left."""
    end = time.monotonic() + timeout
    for t in hpcckpt_threads():
        if t is not threading.current_thread():
            t.join(max(0.0, end - time.monotonic()))
    return [t.name for t in hpcckpt_threads()]


def gloo_workers() -> int:
    """How many gloo worker threads run in this process (0 without torch.distributed)."""
    if "torch.distributed" not in sys.modules:
        return 0
    count = 0
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as fh:
                count += fh.read().strip() == GLOO_WORKER
        except OSError:
            continue  # the thread ended meanwhile
    return count


def settle_gloo(grace: float = GLOO_GRACE) -> bool:
    """With gloo's workers running: collect garbage (its tensors freed now, on this
    thread) and wait ``grace`` seconds with the GIL released, so that a worker freeing the
    tensors of its last finished work does so before finalization. Whether it waited."""
    if not gloo_workers():
        return False
    gc.collect()
    end = time.monotonic() + grace
    while time.monotonic() < end:
        time.sleep(0.01)  # each sleep hands the GIL to a thread waiting for it
    return True


def at_exit() -> None:
    """The interpreter is exiting: release what the application left open, join
    hpcckpt's threads, and let gloo's workers settle (see the module's docs)."""
    for ck in list(_live):
        try:
            ck.release()
        except Exception as exc:  # noqa: BLE001 (the exit goes on; say what was left)
            log.warning("releasing the Checkpointer of %s at exit: %s", ck.directory, exc)
    left = join_threads()
    if left:
        log.warning("hpcckpt threads still running at exit: %s", ", ".join(left))
    settle_gloo()
