"""Any box of a DTensor's global array, read from the pieces a checkpoint stores of it.

A checkpoint stores each DTensor as the writing ranks' pieces (:mod:`.tree.sharded`). A restore
on any mesh, any rank count, asks for this rank's new box: for every stored piece that
overlaps it, only the piece's elements from the first to the last one of the overlap are
read (rounded out to whole blocks, each checked against its block hash), seen as the
overlap, and copied into place. A ``Shard(0)`` box thus reads exactly its own rows; a box
cut along a later dimension reads the rows of the pieces it crosses. Memory: the box
itself plus one such span of one piece at a time.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.file.format import INCREMENTAL, dataset_name
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io import blocks, direct_io
from hpcckpt.store.tree import sharded, tensors


class PieceReader:
    """Reads boxes of the DTensors of one open checkpoint, verified block by block."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self._hashes: dict[tuple[str, int], np.ndarray] = {}
        #: Array bytes read from the file (for the tests and the log: what a box cost).
        self.bytes_read = 0

    def box(
        self,
        name: str,
        offset: tuple[int, ...],
        shape: tuple[int, ...],
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """The elements of DTensor ``name`` in the box at ``offset`` of ``shape``, into
        ``out`` when it is given (C-contiguous, of that shape and the stored dtype)."""
        info = self.reader.arrays[name]
        if info.dtensor_shape is None:
            raise CheckpointError(f"array {name!r} is not a DTensor: it has no boxes")
        want: sharded.Box = (tuple(offset), tuple(shape))
        inside = len(offset) == len(shape) == len(info.dtensor_shape) and all(
            0 <= o and o + n <= g for o, n, g in zip(offset, shape, info.dtensor_shape, strict=True)
        )
        if not inside:
            raise CheckpointError(
                f"DTensor {name!r}: box {list(shape)} at {list(offset)} lies outside its "
                f"global shape {list(info.dtensor_shape)}"
            )
        if out is None or out.shape != want[1] or out.dtype != info.dtype:
            out = np.empty(want[1], dtype=info.dtype)
        found, parts = 0, []
        # One direct descriptor and one hashing thread for every run this box reads.
        reads = direct_io.HashedReads(direct=self.reader.direct_io)
        try:
            for r in info.holders():
                piece: sharded.Box = (info.piece_offsets[r], info.rank_shapes[r])  # type: ignore[assignment]
                part = sharded.intersect(want, piece)
                if part is None:
                    continue
                first, stop, strides = sharded.span(piece, part)
                where = tuple(
                    slice(p - o, p - o + n)
                    for p, o, n in zip(part[0], want[0], part[1], strict=True)
                )
                target = out[where]
                if stop - first == sharded.volume(part[1]) and target.flags.c_contiguous:
                    # the overlap is one run of the piece and of ``out``: read it in place
                    self._elements(name, r, first, stop, target.reshape(-1), reads)
                else:
                    flat = self._elements(name, r, first, stop, reads=reads)
                    out[where] = sharded.strided(flat, part[1], strides)
                found += sharded.volume(part[1])
                parts.append(part)
        finally:
            reads.close()
        overlap = any(
            sharded.intersect(a, b) is not None for i, a in enumerate(parts) for b in parts[:i]
        )
        if overlap or found != sharded.volume(want[1]):
            raise CorruptCheckpoint(
                f"{self.reader.path.name}: DTensor {name!r}: the stored pieces "
                f"{'overlap in' if overlap else f'cover {found} of the elements of'} box "
                f"{list(shape)} at {list(offset)}",
                culprit=self.reader.path,
            )
        return out

    def whole(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """DTensor ``name`` as its global array."""
        shape = self.reader.arrays[name].dtensor_shape
        assert shape is not None
        return self.box(name, (0,) * len(shape), shape, out)

    def _elements(
        self,
        name: str,
        rank: int,
        first: int,
        stop: int,
        dest: np.ndarray | None = None,
        reads: direct_io.HashedReads | None = None,
    ) -> np.ndarray:
        """Elements ``[first, stop)`` of rank ``rank``'s piece (C order), verified; into
        ``dest`` (flat, contiguous, ``stop - first`` elements) when it is given: the
        blocks that lie wholly inside are read straight into it, only the partial blocks
        at either end through a buffer of one block (a restore on the rank count that
        wrote the file thus copies nothing)."""
        r = self.reader
        info = r.arrays[name]
        start = r.raw_start(dataset_name(name), info.dtype) if r.kind != INCREMENTAL else None
        if r.format_version < 2 or start is None:  # a chain, or not raw: the whole piece
            whole = r.rank_array(name, rank).reshape(-1)
            self.bytes_read += whole.nbytes
            if dest is None:
                return whole[first:stop]
            dest[...] = whole[first:stop]
            return dest
        per_row = info.dtype.itemsize * int(np.prod(info.trailing, dtype=np.int64))
        at = start + (
            info.rank_offsets[rank] * per_row
            if info.layout == "rows"
            else info.rank_offsets[rank] * info.dtype.itemsize
        )
        elems = blocks.block_elems(info.dtype.itemsize, r.block_size)
        count = info.rank_elems(rank)
        b0, b1 = first // elems, -(-stop // elems)
        hashes = self._block_hashes(name, rank)
        fd = os.open(r.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if dest is None:
                e0, e1 = b0 * elems, min(b1 * elems, count)
                buf = np.empty(e1 - e0, dtype=info.dtype)
                self._read_blocks(fd, name, rank, at, elems, b0, buf, hashes, reads)
                return buf[first - e0 : stop - e0]
            inner0 = -(-first // elems)  # the first block wholly inside [first, stop)
            inner1 = b1 if min(b1 * elems, count) <= stop else b1 - 1  # one past the last
            if inner0 < inner1:
                lo, hi = inner0 * elems, min(inner1 * elems, count)
                self._read_blocks(
                    fd, name, rank, at, elems, inner0, dest[lo - first : hi - first], hashes, reads
                )
            for b in sorted({b0, b1 - 1}):
                if inner0 <= b < inner1:
                    continue
                lo, hi = b * elems, min((b + 1) * elems, count)
                buf = np.empty(hi - lo, dtype=info.dtype)
                self._read_blocks(fd, name, rank, at, elems, b, buf, hashes, reads)
                a, z = max(lo, first), min(hi, stop)
                dest[a - first : z - first] = buf[a - lo : z - lo]
            return dest
        finally:
            os.close(fd)

    def _read_blocks(
        self,
        fd: int,
        name: str,
        rank: int,
        at: int,
        elems: int,
        b0: int,
        buf: np.ndarray,
        hashes: np.ndarray,
        reads: direct_io.HashedReads | None = None,
    ) -> None:
        """Fill ``buf`` with the elements of rank ``rank``'s piece from block ``b0`` on
        (whole blocks, the piece's last one possibly short) and check their hashes."""
        r = self.reader
        offset = at + b0 * elems * buf.itemsize
        view = memoryview(buf).cast("B")
        if offset + len(view) > os.fstat(fd).st_size:
            raise CorruptCheckpoint(
                f"{r.path.name}: DTensor {name!r} of rank {rank} ends past the end of the file",
                culprit=r.path,
            )
        # Each piece hashed while the next is read, past the page cache when cold: as
        # the planned read of the same bytes (a reshard's read costs no pass of its own).
        if reads is None:
            got = direct_io.read_hashed(
                r.path, offset, view, elems * buf.itemsize, fd=fd, direct=r.direct_io
            )
        else:
            got = reads.read_hashed(r.path, offset, view, elems * buf.itemsize, fd=fd)
        self.bytes_read += len(view)
        want = hashes[b0 : b0 + -(-buf.size // elems)]
        bad = np.nonzero(got != want)[0]
        if bad.size:
            raise CorruptCheckpoint(
                f"{r.path.name}: array {name!r} of rank {rank}, block {b0 + int(bad[0])}, "
                "fails its checksum",
                culprit=r.path,
            )

    def _block_hashes(self, name: str, rank: int) -> np.ndarray:
        key = (name, rank)
        if key not in self._hashes:
            self._hashes[key] = self.reader.block_hashes(name, rank)
        return self._hashes[key]


def wanted_box(held: Any, shape: tuple[int, ...]) -> sharded.Box:
    """The box of a DTensor of global ``shape`` that a restore reads into ``held`` (the
    application's value there): the box of a DTensor's local shard; the whole array for
    anything else (a plain tensor, or nothing there)."""
    if tensors.is_dtensor(held) and tuple(int(x) for x in held.shape) == tuple(shape):
        try:
            piece = sharded.describe(held)
        except TypeError as exc:
            raise CheckpointError(f"restoring into a DTensor: {exc}") from None
        return piece.offset, piece.local
    return (0,) * len(shape), tuple(shape)
