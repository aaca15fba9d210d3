"""Read a checkpoint file once for the mirror: its whole-file xxh3-64, the check of every
array block against the checkpoint's own hashes, and the bytes handed on to be sent, in
one pass over the file.

A full checkpoint's arrays lie in the file as contiguous runs of fixed-size blocks, each
with its xxh3-64 in the file's hash table (itself checksummed): :class:`SourceCheck`
learns where they lie from the file's metadata, and hashes each block as the bytes of
the stream pass by. What it cannot check so (an incremental file, whose arrays need
their chain; an array stored otherwise) it reads through :class:`CheckpointReader` first,
as the full check would; the state trees are small and read that way too.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

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
    path: Path, chunk: int, check: SourceCheck | None, seen: Streamed
) -> Iterator[bytes]:
    """The file's bytes in pieces of ``chunk``, each hashed into ``seen`` and fed to
    ``check`` before it is handed on; ``seen`` is complete once the iterator ends (and
    ``check`` has then passed: CheckpointError otherwise)."""
    h = xxhash.xxh3_64()
    offset = 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        while piece := os.read(fd, chunk):
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
