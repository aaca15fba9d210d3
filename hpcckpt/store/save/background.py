"""A rank's staged bytes written in a thread of its own, and fsynced.

The foreground of a staged save copies the state and (deferred: in the deferred saves'
thread) the ranks create the file; then each rank's :class:`BackgroundWrite` writes its
extents with ``pwrite`` at their offsets and fsyncs, with no MPI or HDF5 call, so the
application's MPI traffic and the write never meet in a library. A
:class:`DeferredWrite` runs the collective steps first, then that write;
:func:`stream_pieces` feeds a state larger than the staging budget through a ring.
The commit (:meth:`.save.commit.Saver.finish_save`) waits for them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcckpt.store.io.direct_io import Extent, StreamedWrite, write_extents
from hpcckpt.store.io.faults import fault_point


@dataclass
class BackgroundWrite:
    """One rank's thread writing its extents into ``path`` and fsyncing it.

    ``error`` holds what went wrong (never raised in the thread); ``seconds`` the
    time from start to durable bytes. With ``stream`` (a save staged in pieces, whose
    bytes the foreground already fed into its ring) the thread finishes that stream.
    With ``hashing`` (a full save staged without its hashes) the thread hashes the
    staged bytes as it writes them and writes the hash rows and checksums after them.
    """

    path: Path
    extents: list[Extent]
    direct: bool = True  # O_DIRECT where the file system takes it (see direct_io)
    error: BaseException | None = None
    seconds: float = 0.0
    bytes: int = 0
    stream: StreamedWrite | None = field(default=None, repr=False)
    hashing: Any = field(default=None, repr=False)  # a file.writer.DeferredHashes
    #: Run by the thread first, once it has hashed every byte (a staged save through the
    #: node-local tier): seals the copy the drain writes from, so that a crash during the
    #: drain leaves it restorable; ``sealed`` says it succeeded.
    seal: Callable[[], None] | None = field(default=None, repr=False)
    sealed: bool = False
    seal_error: BaseException | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)
    _go: threading.Event = field(default_factory=threading.Event, repr=False)

    def start(self) -> BackgroundWrite:
        """Start the thread, held until :meth:`go` (or :meth:`wait`): the caller ends its
        own short work (events, heartbeat) before the write competes with it for the
        interpreter, which a thread holds for up to its switch interval (5 ms)."""
        if self.error is None:  # a stream that failed while fed has nothing left to write
            self._thread = threading.Thread(target=self._run, name="hpcckpt-write", daemon=True)
            self._thread.start()
        return self

    def go(self) -> None:
        """Let the started thread write (again is harmless)."""
        self._go.set()

    def _run(self) -> None:
        self._go.wait()
        t0 = time.perf_counter()
        if self.stream is not None:
            try:
                self.bytes = self.stream.finish().bytes
            except BaseException as exc:  # surfaced to the main thread by finish_save
                self.error = exc
            self.seconds = time.perf_counter() - t0
            return
        hashing = self.hashing
        if self.seal is not None:  # the node-local copy: hashed and sealed before the drain
            try:
                if hashing is not None:
                    hashing.before(hashing.first)
            except BaseException as exc:
                self.seal_error = exc
            self._seal()

        def before(i: int) -> None:
            fault_point("drain.eio")  # tests: a write that fails
            if hashing is not None:
                hashing.before(i)  # the hash rows: complete before they are written

        try:
            done = write_extents(
                self.path,
                self.extents,
                direct=self.direct,
                before=before,
                after=self._written,
                progress=None if hashing is None else hashing.progress,
            )
            self.bytes = done.bytes
        except BaseException as exc:  # surfaced to the main thread by finish_save
            self.error = exc
        self.seconds = time.perf_counter() - t0

    def _seal(self) -> None:
        if self.seal is None or self.sealed or self.seal_error is not None:
            return
        try:
            self.seal()
            self.sealed = True
        except BaseException as exc:  # the drain goes on: that copy just cannot be restored
            self.seal_error = exc

    def _written(self, i: int) -> None:
        self.bytes += self.extents[i].data.nbytes
        if i == 0:
            fault_point("drain.writing")  # tests: die with the write half done

    @property
    def seals(self) -> bool:
        """Whether it seals a node-local copy before it drains it."""
        return self.seal is not None

    def done(self) -> bool:
        """Whether the thread has finished (successfully or not); never blocks."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        self.go()
        if self._thread is not None:
            self._thread.join()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread (let go first); whether it ended."""
        self.go()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout))
        return self.done()


class DeferredWrite:
    """One rank's part of a save whose collective steps were deferred, run by the
    deferred saves' thread (:mod:`.save.deferred`): ``steps`` (the ranks agree, rank 0
    creates the file; they return the started :class:`BackgroundWrite` of this rank's
    extents), then that write; what went wrong is kept as :class:`BackgroundWrite`
    keeps it (never raised in the thread)."""

    def __init__(
        self,
        steps: Callable[[], BackgroundWrite],
        launch: Callable[[], None] | None = None,
        seals: bool = False,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.steps = steps
        #: Run in the thread once the write ended, well or not (the commit, when it is
        #: made there); it keeps what goes wrong for the caller and never raises.
        self.after = after
        #: Whether its write seals a node-local copy (the same on every rank).
        self.seals = seals
        self.error: BaseException | None = None
        self.seconds = 0.0  # from the steps' start to durable bytes
        self.bytes = 0
        self._write: BackgroundWrite | None = None
        self._done = threading.Event()
        self._launch = launch  # hands it to its thread, at go()

    @property
    def sealed(self) -> bool:
        """Whether its write sealed this rank's node-local copy."""
        return self._write is not None and self._write.sealed

    @property
    def seal_error(self) -> BaseException | None:
        """Why it did not seal (None: sealed, or nothing to seal)."""
        if self._write is None:
            return self.error if self.seals else None
        return self._write.seal_error

    def go(self) -> None:
        """Hand it to the thread that runs it, once (again is harmless)."""
        launch, self._launch = self._launch, None
        if launch is not None:
            launch()

    def run(self) -> None:
        """The steps and the write, in the calling thread."""
        t0 = time.perf_counter()
        try:
            self._write = write = self.steps()
            write.wait()
            self.error, self.bytes = write.error, write.bytes
        except BaseException as exc:  # surfaced to the main thread by finish_save
            self.error = exc
        self.seconds = time.perf_counter() - t0
        if self.after is not None:
            self.after()
        self._done.set()

    def done(self) -> bool:
        """Whether the steps and the write have finished (well or not); never blocks."""
        return self._done.is_set()

    def wait(self) -> None:
        self.go()
        self._done.wait()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the steps and the write (handed to their
        thread first); whether they ended."""
        self.go()
        return self._done.wait(max(0.0, timeout))


def stream_pieces(
    path: Path, extents: list[Extent], ring: list[np.ndarray], direct: bool
) -> BackgroundWrite:
    """Copy ``extents`` through ``ring`` into ``path`` (blocking while the ring is full)
    and return the started write of what remains; a failure is kept in its ``error``."""
    stream = None
    try:
        stream = StreamedWrite(path, ring, direct=direct)
        stream.feed(extents, before=lambda i: fault_point("drain.eio"))
    except BaseException as exc:  # finish_save agrees on it, like a background failure
        if stream is not None:
            with contextlib.suppress(BaseException):
                stream.finish()
        return BackgroundWrite(path, [], direct, error=exc).start()
    return BackgroundWrite(path, [], direct, stream=stream).start()
