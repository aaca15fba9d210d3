"""Read a checkpoint file once for the mirror: its whole-file xxh3-64, the check of every
array block against the checkpoint's own hashes, and the bytes handed on to be sent, in
one pass over the file.

A full checkpoint's arrays lie in the file as contiguous runs of fixed-size blocks, each
with its xxh3-64 in the file's hash table (itself checksummed): :class:`SourceCheck`
learns where they lie from the file's metadata, and hashes each block as the bytes of
the stream pass by. What it cannot check so (an incremental file, whose arrays need
their chain; an array stored otherwise) it reads through :class:`CheckpointReader` first,
as the full check would; the state trees are small and read that way too.

:func:`copy_checked` is the other way for a directory mirror: the kernel copies the
file (``sendfile``, the call ``shutil.copyfile`` makes) while this thread reads the
*destination* behind it and checks it instead of the source: each array block against
the checkpoint's own hash, every other byte against the source's, the whole-file
xxh3-64 taken from the destination's bytes; a damaged source fails that check too.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from hpcckpt import libc
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file.format import FULL, dataset_name
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io import blocks


@dataclass
class _Run:
    """One rank's array in the file: ``start`` byte, blocks of ``step`` bytes, their hashes."""

    start: int
    size: int
    step: int
    want: np.ndarray
    what: str
    width: int  # bytes per element, to group by when compressing (0: not numbers)


class SourceCheck:
    """Checks a checkpoint file's bytes against its own hashes as they stream by.

    Build it (reads only metadata, trees and whatever cannot be checked in the stream;
    CheckpointError when one of those fails), :meth:`feed` it every byte of the file in
    order, then :meth:`finish`: CheckpointError naming the first block that failed.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.runs: list[_Run] = []
        self.problem: str | None = None
        try:
            with CheckpointReader(self.path) as r:
                self._plan(r)
        except CheckpointError as exc:
            self._fail(str(exc))
        except OSError as exc:
            self._fail(f"cannot be read: {exc}")
        self.runs.sort(key=lambda run: run.start)
        self._starts = [run.start for run in self.runs]
        self._next = 0  # first run not fully hashed
        self._partial: dict[int, xxhash.xxh3_64] = {}  # block key -> hasher of a cut block

    def _fail(self, why: str) -> None:
        raise CheckpointError(f"{self.path.name} is not mirrored: it fails its checks ({why})")

    def _plan(self, r: CheckpointReader) -> None:
        problems: list[str] = []
        for rank in range(r.nranks):
            try:
                r.tree(rank)
            except CheckpointError as exc:
                problems.append(str(exc))
        streamable = r.format_version >= 2 and r.kind == FULL
        for name, info in r.arrays.items():
            for rank in range(r.nranks):
                if rank and info.replicated:
                    continue
                try:
                    base = r.raw_start(dataset_name(name), info.dtype) if streamable else None
                    if base is None:
                        r.rank_array(name, rank)  # checked here, by the reader
                        continue
                    size = info.rank_bytes(rank)
                    if size == 0:
                        continue
                    per_index = info.dtype.itemsize * int(np.prod(info.trailing, dtype=np.int64))
                    start = base + info.rank_offsets[rank] * per_index
                    step = blocks.block_bytes(info.dtype, r.block_size)
                    want = r.block_hashes(name, rank)
                    if want.size != blocks.nblocks(size, step):
                        raise CheckpointError(
                            f"{self.path.name}: array {name!r} of rank {rank} has "
                            f"{want.size} block hashes for {size} bytes"
                        )
                    width = info.dtype.itemsize if info.dtype.kind in "fiuV" else 0
                    self.runs.append(
                        _Run(start, size, step, want, f"{name!r} of rank {rank}", width)
                    )
                except CheckpointError as exc:
                    problems.append(str(exc))
                except (OSError, ValueError) as exc:
                    problems.append(f"{self.path.name}: array {name!r} of rank {rank}: {exc}")
        if problems:
            raise CheckpointError(problems[0])

    def width_at(self, offset: int) -> tuple[int, int]:
        """The element width of the array whose bytes lie at file ``offset`` (0: none)
        and the offset where that stops holding."""
        k = bisect.bisect_right(self._starts, offset) - 1
        if k >= 0 and offset < self.runs[k].start + self.runs[k].size:
            run = self.runs[k]
            return (run.width if run.width in (2, 4, 8) else 0), run.start + run.size
        nxt = self.runs[k + 1].start if k + 1 < len(self.runs) else 1 << 62
        return 0, nxt

    def feed(self, offset: int, data: memoryview | bytes) -> None:
        """Hash the blocks that the file's bytes ``offset .. offset+len(data)`` cover."""
        end = offset + len(data)
        view = memoryview(data)
        k = self._next
        while k < len(self.runs):
            run = self.runs[k]
            if run.start >= end:
                break
            lo = max(offset, run.start)
            hi = min(end, run.start + run.size)
            pos = lo
            while pos < hi:
                j = (pos - run.start) // run.step
                b0 = run.start + j * run.step
                b1 = min(b0 + run.step, run.start + run.size)
                piece = view[pos - offset : min(hi, b1) - offset]
                if pos == b0 and min(hi, b1) == b1:
                    got = xxhash.xxh3_64_intdigest(piece)
                else:
                    h = self._partial.setdefault((k << 32) | j, xxhash.xxh3_64())
                    h.update(piece)
                    if min(hi, b1) < b1:
                        pos = min(hi, b1)
                        continue
                    got = h.intdigest()
                    del self._partial[(k << 32) | j]
                if got != int(run.want[j]) and self.problem is None:
                    self.problem = f"array {run.what}, block {j}, fails its checksum"
                pos = min(hi, b1)
            if run.start + run.size <= end and k == self._next:
                self._next += 1
            k += 1

    def finish(self, size: int) -> None:
        """After the whole file (``size`` bytes) went through :meth:`feed`: raise
        CheckpointError if a block failed or was not covered."""
        if self.problem is None and self.runs and self._next < len(self.runs):
            self.problem = f"the file ends before array {self.runs[self._next].what}"
        if self.problem is not None:
            self._fail(f"{self.path.name}: {self.problem}")


@dataclass
class Streamed:
    """What :func:`read_source` saw: the file's size and whole-file xxh3-64 (hex)."""

    size: int = 0
    checksum: str = ""


def read_source(
    path: Path,
    chunk: int,
    check: SourceCheck | None,
    seen: Streamed,
    pause: Callable[[], None] | None = None,
) -> Iterator[bytes]:
    """The file's bytes in pieces of ``chunk``, each hashed into ``seen`` and fed to
    ``check`` before it is handed on; ``seen`` is complete once the iterator ends (and
    ``check`` has then passed: CheckpointError otherwise). ``pause`` is called before
    each read: it may hold the stream (and so whatever consumes it) for a while."""
    h = xxhash.xxh3_64()
    offset = 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        while True:
            if pause is not None:
                pause()
            piece = os.read(fd, chunk)
            if not piece:
                break
            h.update(piece)
            if check is not None:
                check.feed(offset, piece)
            offset += len(piece)
            yield piece
    finally:
        os.close(fd)
    seen.size, seen.checksum = offset, h.hexdigest()
    if check is not None:
        check.finish(offset)


#: Bytes per kernel copy call of :func:`copy_checked`: large enough to keep system calls
#: few, small enough that the check follows the copy closely (benchmarks/bench_mirror.py).
COPY_CHUNK = 8 << 20

#: sync_file_range(2)'s flag: start writing the range back, do not wait.
_SYNC_FILE_RANGE_WRITE = 2
#: Its flags WAIT_BEFORE | WRITE | WAIT_AFTER: the range's write-back done when it returns.
_SYNC_FILE_RANGE_WAIT = 1 | 2 | 4
#: Bytes of a kernel copy whose write-back may still be under way behind it: the copy
#: goes no faster than the disk takes it (as copyfile + fsync does in all), so when a save
#: begins and the copy steps aside, no more than this is still on its way to the disk.
WRITE_BEHIND = 2 * COPY_CHUNK
_sync_file_range = libc.function("sync_file_range")
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


class CopyMismatch(CheckpointError):
    """The destination of :func:`copy_checked` does not hold the checkpoint's bytes (a
    block fails its hash, or a byte outside the arrays differs from the source's)."""


def _gaps(check: SourceCheck, size: int) -> list[tuple[int, int]]:
    """The byte ranges of a ``size``-byte file that no array block covers."""
    out = []
    pos = 0
    for run in check.runs:
        if run.start > pos:
            out.append((pos, min(run.start, size)))
        pos = max(pos, run.start + run.size)
    if pos < size:
        out.append((pos, size))
    return [(a, b) for a, b in out if a < b]


@contextmanager
def _mapped(fd: int, offset: int, length: int) -> Iterator[memoryview]:
    """Bytes ``offset .. offset+length`` of the file ``fd`` as the page cache holds them,
    mapped read-only (no copy into this process)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    m = mmap.mmap(fd, offset + length - start, offset=start, access=mmap.ACCESS_READ)
    view = memoryview(m)
    part = view[offset - start :]
    try:
        yield part
    finally:
        try:
            part.release()
            view.release()
            m.close()
        except BufferError:  # a traceback holds a slice: the map goes with it
            pass


def copy_checked(
    src: int,
    dst: int,
    check: SourceCheck,
    seen: Streamed,
    copy_range: Callable[[int, int, int, int], int],
    chunk: int = COPY_CHUNK,
    pause: Callable[[], None] | None = None,
) -> None:
    """Copy the file open as ``src`` into the empty file ``dst`` (open for reading and
    writing) with ``copy_range(src, dst, offset, count) -> bytes copied``, and check the
    destination as it fills, every byte of it read back from the page cache once copied:
    array blocks against ``check``'s hashes, the bytes outside them against the source's
    (metadata, trees and hash tables read again), the whole file's xxh3-64 into ``seen``.

    Two threads: a helper copies each range, starts its write-back (the final fsync
    then waits for less) and hashes it whole; this one checks the blocks behind it.
    Both call ``pause`` before each range: it may hold the copy for a while.
    Raises :class:`CopyMismatch` naming the first difference (the source itself may be
    the damaged one: a caller that must know checks it alone), or what the copy raised.
    """
    size = os.fstat(src).st_size
    gaps = _gaps(check, size)
    cond = threading.Condition()
    state = {"copied": 0, "ended": False, "stop": False}
    failed: list[BaseException] = []
    whole = xxhash.xxh3_64()

    def copier() -> None:
        pos = 0
        clean = 0  # bytes of the destination known written back
        try:
            while pos < size and not state["stop"]:
                if pause is not None:
                    pause()
                n = copy_range(src, dst, pos, min(chunk, size - pos))
                if n <= 0:
                    raise OSError(0, f"the source ended at byte {pos} of {size}")
                if _sync_file_range is not None:  # errors: the caller's fsync reports them
                    _sync_file_range(dst, pos, n, _SYNC_FILE_RANGE_WRITE)
                    if pos + n - WRITE_BEHIND > clean:
                        behind = pos + n - WRITE_BEHIND
                        _sync_file_range(dst, clean, behind - clean, _SYNC_FILE_RANGE_WAIT)
                        clean = behind
                with _mapped(dst, pos, n) as piece:
                    whole.update(piece)
                pos += n
                with cond:
                    state["copied"] = pos
                    cond.notify()
        except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread)
            failed.append(exc)
        finally:
            with cond:
                state["ended"] = True
                cond.notify()

    worker = threading.Thread(target=copier, name="hpcckpt-mirror-copy", daemon=True)
    worker.start()
    problem: str | None = None
    pos = 0
    g = 0  # first gap not passed yet
    try:
        while pos < size and problem is None:
            if pause is not None:
                pause()
            with cond:
                while state["copied"] <= pos and not state["ended"]:
                    cond.wait()
                upto = min(state["copied"], pos + chunk)  # bounded: the gaps are read whole
            if upto <= pos:
                break  # the copy failed: raised below
            with _mapped(dst, pos, upto - pos) as piece:
                check.feed(pos, piece)
                while g < len(gaps) and gaps[g][0] < upto:
                    a, b = max(gaps[g][0], pos), min(gaps[g][1], upto)
                    if os.pread(src, b - a, a) != piece[a - pos : b - pos]:
                        problem = f"bytes {a}..{b} differ from the source's"
                        break
                    if gaps[g][1] > upto:
                        break
                    g += 1
            pos = upto
    finally:
        state["stop"] = True  # a copy the check gave up on goes no further
        worker.join()
    if pause is not None and not failed and problem is None:
        pause()  # before the caller's fsync
    if failed:
        raise failed[0]
    problem = problem or check.problem
    if problem is None:
        try:
            check.finish(size)
        except CheckpointError as exc:
            problem = str(exc)
    if problem is not None:
        raise CopyMismatch(f"the copy of {check.path.name} fails its check: {problem}")
    seen.size, seen.checksum = size, whole.hexdigest()
