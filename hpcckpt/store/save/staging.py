"""Saves that finish in the background: a copy of the state, and a thread that writes it.

A staged save splits a checkpoint in two. In the foreground every rank copies its
arrays into a staging area (reused host buffers, or files on a node-local fast tier:
:mod:`hpcckpt.store.tier.copies`), hashing each block while it is in cache, and the
ranks create the checkpoint file collectively with all its metadata; the datasets are
contiguous and allocated at creation, so every rank knows the file offsets of its
bytes. In the background one thread per rank writes those bytes with ``pwrite`` at
their offsets and fsyncs: no MPI and no HDF5 call leaves the main thread, so the
application's own MPI traffic and the background write never meet in a library.
The checkpoint is committed later, collectively (:meth:`CheckpointStore.finish_save`),
only once every rank's thread reports its bytes durable.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from hpcckpt.store.io import blocks
from hpcckpt.store.io.direct_io import Extent, StreamedWrite, ring_buffers, write_extents
from hpcckpt.store.io.faults import fault_point

__all__ = ["BackgroundWrite", "Extent", "HostBuffers", "copy_and_hash", "stream_pieces"]


def copy_and_hash(src: np.ndarray, dst: np.ndarray, block_size: int) -> np.ndarray:
    """Copy ``src`` into ``dst`` (same shape and dtype) and return the block hashes of it.

    Each block is hashed right after it is copied, while it is still in the CPU cache,
    so the hashes cost little beyond the copy. The hashes equal
    :func:`hpcckpt.store.io.blocks.block_hashes` of ``src``.
    """
    step = blocks.block_elems(src.dtype.itemsize, block_size)
    flat_src = np.ascontiguousarray(src).reshape(-1)
    flat_dst = dst.reshape(-1)  # dst is C-contiguous: a view
    n = blocks.nblocks(flat_src.size, step)
    out = np.empty(n, dtype=np.uint64)
    digest = xxhash.xxh3_64_intdigest
    for j in range(n):
        a, b = j * step, min((j + 1) * step, flat_src.size)
        np.copyto(flat_dst[a:b], flat_src[a:b])
        out[j] = digest(memoryview(flat_dst[a:b]).cast("B"))
    return out


class HostBuffers:
    """Reused host memory for the state of an asynchronous save, within a budget.

    ``budget``: the bytes this rank's staging may hold (None: a fraction of the
    node's available memory, see :mod:`hpcckpt.store.save.staging_budget`). A state that
    fits is copied whole into one buffer per array path, kept between saves while the
    array's shape and dtype stay the same (plus the array being resized, during a save
    that changes a shape); a larger one goes through a ring of buffers of the budget's
    size (:meth:`ring`), kept too. Only one of the two is held at a time.
    """

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self._buffers: dict[str, np.ndarray] = {}
        self._ring: list[np.ndarray] = []

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values()) + sum(b.nbytes for b in self._ring)

    def ring(self, nbytes: int) -> list[np.ndarray]:
        """Page-aligned buffers of ``nbytes`` in all (reused when the size is the same);
        the whole-state buffers are freed first."""
        self._buffers.clear()
        if sum(b.nbytes for b in self._ring) != nbytes or not self._ring:
            self._ring = []  # free the old ring before allocating the new one
            self._ring = ring_buffers(nbytes)
        return self._ring

    def stage(
        self, arrays: dict[str, np.ndarray], block_size: int
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Copies of ``arrays`` in the buffers and their block hashes."""
        self._ring = []
        for stale in set(self._buffers) - set(arrays):
            del self._buffers[stale]
        copies, hashes = {}, {}
        for path, src in arrays.items():
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                self._buffers.pop(path, None)  # free the old one before allocating
                buf = np.empty(src.shape, dtype=src.dtype)
                self._buffers[path] = buf
            hashes[path] = copy_and_hash(src, buf, block_size)
            copies[path] = buf
        return copies, hashes

    def release(self) -> None:
        self._buffers.clear()
        self._ring = []


@dataclass
class BackgroundWrite:
    """One rank's thread writing its extents into ``path`` and fsyncing it.

    ``error`` holds what went wrong (never raised in the thread); ``seconds`` the
    time from start to durable bytes. With ``stream`` (a save staged in pieces, whose
    bytes the foreground already fed into its ring) the thread finishes that stream.
    """

    path: Path
    extents: list[Extent]
    direct: bool = True  # O_DIRECT where the file system takes it (see direct_io)
    error: BaseException | None = None
    seconds: float = 0.0
    bytes: int = 0
    stream: StreamedWrite | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> BackgroundWrite:
        if self.error is None:  # a stream that failed while fed has nothing left to write
            self._thread = threading.Thread(target=self._run, name="hpcckpt-write", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        if self.stream is not None:
            try:
                self.bytes = self.stream.finish().bytes
            except BaseException as exc:  # surfaced to the main thread by finish_save
                self.error = exc
            self.seconds = time.perf_counter() - t0
            return
        try:
            done = write_extents(
                self.path,
                self.extents,
                direct=self.direct,
                before=lambda i: fault_point("drain.eio"),  # tests: a write that fails
                after=self._written,
            )
            self.bytes = done.bytes
        except BaseException as exc:  # surfaced to the main thread by finish_save
            self.error = exc
        self.seconds = time.perf_counter() - t0

    def _written(self, i: int) -> None:
        self.bytes += self.extents[i].data.nbytes
        if i == 0:
            fault_point("drain.writing")  # tests: die with the write half done

    def done(self) -> bool:
        """Whether the thread has finished (successfully or not); never blocks."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


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
