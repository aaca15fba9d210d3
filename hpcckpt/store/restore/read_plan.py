"""What one rank reads of a checkpoint that rank 0 has validated: byte extents in the
chain's files and the hashes that check them, so a rank restores with POSIX reads only.

Validating a checkpoint (HDF5 structure, global heaps, every rank's offsets, shapes and
hash counts) is O(p) work through HDF5. Done by every rank, it cost each rank O(p) and
had p processes parse the same metadata. Rank 0 now does it once and sends each rank a
:class:`RankPlan` of a few numbers per array. The trust stays where it was: every byte a
rank takes has passed its block hash, its hashes their checksum, its tree its checksum.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.file.descriptions import FEW_RANKS
from hpcckpt.store.file.format import BLOCK_HASHES, FULL, RANK_TREE, dataset_name, delta_name
from hpcckpt.store.file.reader import CheckpointReader, parse_tree
from hpcckpt.store.io import blocks, direct_io, integrity
from hpcckpt.store.io.direct_io import HashedReads

#: Arrays read at once by one rank, each with its own hashing thread: while one drains
#: (its last piece moved and hashed) the next is already reading, and the device sees
#: two requests instead of one. Arrays below OVERLAP_BYTES are read one by one.
READERS = 2
OVERLAP_BYTES = 1 << 20
#: Bytes at either end of an array read past the page cache that the read takes
#: through it (its unaligned first and last bytes lie within these).
EDGE_BYTES = 2 * direct_io.ALIGN

#: One file extent of an array: (file of the chain, byte offset in it, byte offset in
#: the rank's array, bytes).
Extent = tuple[int, int, int, int]


class ArrayPlan(NamedTuple):
    """One array as this rank reads it (a tuple: rank 0 makes p x arrays of them per
    restore and pickles them for the scatter, both several times faster than a dataclass)."""

    name: str
    dtype: str  # numpy dtype string
    shape: tuple[int, ...]  # the array this rank takes (rank 0's copy when replicated)
    own_shape: tuple[int, ...]  # the array this rank saved
    rows: int  # the saved global extent along axis 0
    own: tuple[int, int]  # this rank's saved [lo, hi) along axis 0
    layout: str
    distributed: bool
    torch_dtype: str
    replicated: bool
    hashes: tuple[int, int, int, int]  # (hash row: 0 own/1 rank 0's, start, count, checksum)
    own_hashes: tuple[int, int, int]  # (start in own row, count, checksum): the chain's memory
    extents: tuple[Extent, ...]
    #: A DTensor's (global shape, this rank's piece offset): the plan reads the piece this
    #: rank saved, which is its new shard only on the same mesh (the loader checks). None:
    #: not a DTensor.
    dtensor: tuple[tuple[int, ...], tuple[int, ...]] | None = None


class RankPlan(NamedTuple):
    """Everything one rank reads of one checkpoint, as rank 0 validated it."""

    rank: int
    files: tuple[str, ...]  # the chain's files, the full base first, the checkpoint last
    tree: tuple[int, int, int]  # (byte offset, bytes, checksum) of this rank's tree
    rows: tuple[tuple[int, int], ...]  # (byte offset, count) of its hash row and rank 0's
    names: tuple[str, ...]  # every array of the file, in column order
    arrays: tuple[ArrayPlan, ...]
    block_size: int
    step: int
    uid: str
    nranks: int
    chain: tuple[tuple[str, int, str], ...]  # (name, step, uid), base first, itself last
    chain_bytes: int
    state_bytes: int


def plans(reader: CheckpointReader) -> list[RankPlan] | None:
    """Every rank's plan of a validated, open checkpoint; None when some part cannot be
    read as raw bytes (format version 1, or a dataset HDF5 would have to convert), or
    when a DTensor's piece is stored once for several ranks (replicas): those ranks read
    the boxes of their shards from the pieces other ranks stored (:mod:`.restore.pieces`),
    which a plan of their own bytes cannot say. A DTensor every rank stored a piece of
    is planned as that piece; it is this rank's new shard only on the same mesh, which
    the loader checks on every rank before it reads (else the pieces are read).

    O(p) on the one process that calls it: what is the same for every rank is computed
    once, and each rank's numbers come from numpy columns over the ranks.
    """
    if reader.format_version < 2:
        return None
    if any(
        info.dtensor_shape is not None and None in info.piece_offsets
        for info in reader.arrays.values()
    ):
        return None
    files = reader.chain
    n, narrays = reader.nranks, len(reader.arrays)
    tree_start = reader.raw_start(RANK_TREE, np.dtype(np.uint8))
    hash_start = reader.raw_start(BLOCK_HASHES, np.dtype(np.uint64))
    tree_offs = np.asarray(reader.tree_offsets, dtype=np.int64)
    if hash_start is None or (tree_start is None and tree_offs[-1] > 0):
        return None
    offs = np.asarray(reader.hash_offsets, dtype=np.int64)
    row_start = offs[0 : n * narrays + 1 : narrays]  # where each rank's hash row starts
    row_spans = list(
        zip((hash_start + 8 * row_start[:-1]).tolist(), np.diff(row_start).tolist(), strict=True)
    )
    sums = reader.checksums.tolist()
    trees = list(
        zip(((tree_start or 0) + tree_offs[:-1]).tolist(), np.diff(tree_offs).tolist(), strict=True)
    )
    columns = []  # per array: the numbers of every rank
    for name, info in reader.arrays.items():
        col = info.column
        at = offs[col : n * narrays : narrays] - row_start[:-1]  # in each rank's own row
        count = offs[col + 1 : n * narrays + 1 : narrays] - offs[col : n * narrays : narrays]
        extents = _all_extents(files, name)
        if extents is None:
            return None
        columns.append((name, info, at.tolist(), count.tolist(), extents))
    header = (
        tuple(str(f.path) for f in files),
        tuple(reader.arrays),
        reader.block_size,
        reader.step,
        str(reader.uid),
        n,
        (*reader.chain_refs, (reader.path.name, reader.step, str(reader.uid))),
        int(reader.attrs.get("chain_bytes", 0)),
        int(reader.attrs.get("state_bytes", 0)),
    )
    out = []
    for r in range(n):
        arrays = []
        for name, info, at, count, extents in columns:
            s = 0 if info.replicated else r
            col = info.column
            arrays.append(
                ArrayPlan(
                    name,
                    info.dtype.str,
                    info.rank_shapes[s],
                    info.rank_shapes[r],
                    info.shape[0],
                    (info.rank_offsets[r], info.rank_offsets[r + 1]),
                    info.layout,
                    info.distributed,
                    info.torch_dtype,
                    info.replicated,
                    (int(s != r), at[s], count[s], sums[s][col]),
                    (at[r], count[r], sums[r][col]),
                    extents[s],
                    None
                    if info.dtensor_shape is None
                    else (info.dtensor_shape, info.piece_offsets[r]),  # type: ignore[arg-type]
                )
            )
        files_, names, block_size, step, uid, nranks, chain, chain_bytes, state_bytes = header
        out.append(
            RankPlan(
                r,
                files_,
                (*trees[r], sums[r][-1]),
                (row_spans[r], row_spans[0]),
                names,
                tuple(arrays),
                block_size,
                step,
                uid,
                nranks,
                chain,
                chain_bytes,
                state_bytes,
            )
        )
    return out


def _all_extents(files: list[CheckpointReader], name: str) -> list[tuple[Extent, ...]] | None:
    """Every rank's extents of array ``name``: one per rank from the full base, in one
    numpy pass, except for the ranks whose blocks a delta of the chain replaced."""
    info = files[-1].arrays[name]
    base = files[0].raw_start(dataset_name(name), info.dtype)
    offs = info.rank_offsets
    if base is None:
        return [()] * (len(offs) - 1) if offs[-1] == offs[0] else None
    per_index = info.dtype.itemsize * math.prod(info.trailing)
    if len(offs) <= FEW_RANKS + 1:  # plain Python beats numpy's fixed cost at a few ranks
        starts = [base + o * per_index for o in offs[:-1]]
        sizes = [(hi - lo) * per_index for lo, hi in itertools.pairwise(offs)]
    else:
        at = np.asarray(offs, dtype=np.int64)
        starts = (base + at[:-1] * per_index).tolist()
        sizes = (np.diff(at) * per_index).tolist()
    out: list[tuple[Extent, ...]] = [
        ((0, start, 0, size),) if size else () for start, size in zip(starts, sizes, strict=True)
    ]
    changed: set[int] = set()
    for part in files[1:]:
        changed.update(np.nonzero(np.diff(part.delta_pointers(name)))[0].tolist())
    for r in sorted(changed):
        extents = _extents(files, name, r)
        if extents is None:
            return None
        out[r] = extents
    return out


def _extents(files: list[CheckpointReader], name: str, rank: int) -> tuple[Extent, ...] | None:
    """Where rank ``rank``'s bytes of array ``name`` lie: the newest copy of each block."""
    info = files[-1].arrays[name]
    count = info.rank_elems(rank)
    if count == 0:
        return ()
    elems = blocks.block_elems(info.dtype.itemsize, files[-1].block_size)
    nblk = blocks.nblocks(count, elems)
    owner, where = files[-1].block_owners(name, rank, nblk)
    item = info.dtype.itemsize
    out: list[Extent] = []
    for k, part in enumerate(files):
        mine = np.nonzero(owner == k)[0]
        if not mine.size:
            continue
        if part.kind == FULL:
            base = part.raw_start(dataset_name(name), info.dtype)
            if base is None:
                return None
            first = base + info.rank_offsets[rank] * item * int(
                np.prod(info.trailing, dtype=np.int64)
            )
            for b0, b1 in blocks.runs(mine):
                e0, e1 = b0 * elems, min(b1 * elems, count)
                out.append((k, first + e0 * item, e0 * item, (e1 - e0) * item))
        else:
            base = part.raw_start(delta_name(name), info.dtype)
            if base is None:
                return None
            for b0, b1 in blocks.runs(mine):
                e0, e1 = b0 * elems, min(b1 * elems, count)
                # blocks of one rank lie in rank-then-block order in the deltas
                out.append((k, base + int(where[b0]) * item, e0 * item, (e1 - e0) * item))
    return tuple(out)


class PlanReader:
    """One rank's reads of its plan, each checked: the files are opened once, with no HDF5.

    ``opened``: the reader that validated the plan's checkpoint, still open (rank 0's):
    its descriptors are read through, not opened again, and left open."""

    def __init__(
        self, plan: RankPlan, *, direct_io: bool = False, opened: CheckpointReader | None = None
    ) -> None:
        self.plan = plan
        self.direct_io = direct_io
        self.path = Path(plan.files[-1])
        self._fds: list[int] = []
        self._owned = opened is None
        #: One direct descriptor per file and hashing threads kept for every array.
        self._reads = HashedReads(direct=direct_io)
        try:
            if opened is not None:
                self._fds = [member.fd for member in opened.chain]
                assert [str(m.path) for m in opened.chain] == list(plan.files)
                assert min(self._fds) >= 0, "the validating reader was closed"
            for name in plan.files if opened is None else ():
                self._fds.append(os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
            self._rows = [self._read_row(*row) for row in plan.rows]
        except OSError as exc:
            self.close()
            raise CorruptCheckpoint(f"{self.path.name}: unreadable ({exc})") from exc

    def _read_row(self, offset: int, count: int) -> np.ndarray:
        row = np.empty(count, dtype="<u8")
        if count:
            direct_io.pread_all(self._fds[-1], memoryview(row).cast("B"), offset, self.path)
        return row

    def _corrupt(self, why: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{self.path.name}: {why}", culprit=self.path)

    def hashes(self, a: ArrayPlan) -> np.ndarray:
        """The block hashes that check the bytes of ``a`` this rank takes, verified."""
        row, start, count, checksum = a.hashes
        h = self._rows[row][start : start + count]
        if blocks.hashes_checksum(h) != checksum:
            source = 0 if row else self.plan.rank
            raise self._corrupt(
                f"the block hashes of array {a.name!r} of rank {source} fail their checksum"
            )
        return h

    def own_hashes(self, a: ArrayPlan) -> np.ndarray:
        """This rank's own block hashes of ``a`` (what an incremental save compares with)."""
        start, count, checksum = a.own_hashes
        h = self._rows[0][start : start + count]
        if blocks.hashes_checksum(h) != checksum:
            raise self._corrupt(
                f"the block hashes of array {a.name!r} of rank {self.plan.rank} fail their checksum"
            )
        return h.astype(np.uint64)

    def tree(self) -> object:
        """This rank's state tree, checksum verified and naming exactly the file's arrays."""
        offset, nbytes, checksum = self.plan.tree
        raw = bytearray(nbytes)
        if nbytes:
            direct_io.pread_all(self._fds[-1], memoryview(raw), offset, self.path)
        if integrity.checksum(bytes(raw)) != checksum:
            raise self._corrupt(f"rank {self.plan.rank}'s state tree fails its checksum")
        return parse_tree(bytes(raw), self.plan.names, self.plan.rank, self.path)

    def array(self, a: ArrayPlan, out: np.ndarray | None = None) -> np.ndarray:
        """The array ``a`` as saved, read into ``out`` when given (C-contiguous, of its
        shape and dtype) and verified block by block. On a mismatch the file is opened
        with :class:`.CheckpointReader` to name the file at fault."""
        out, check = self._start(a, out)
        check()
        return out

    def _start(self, a: ArrayPlan, out: np.ndarray | None) -> tuple[np.ndarray, Callable[[], None]]:
        """Read ``a`` (see :meth:`array`) and return the array with what checks it: that
        waits for the hashing of its last pieces, which runs on while this thread goes
        on to its next read, and raises where a block fails. The array is not the
        file's bytes before the check has returned."""
        want = self.hashes(a)
        dtype = np.dtype(a.dtype)
        if out is None or out.shape != a.shape or out.dtype != dtype:
            out = np.empty(a.shape, dtype=dtype)
        if out.size == 0:
            return out, lambda: None
        flat = memoryview(out.reshape(-1).view(np.uint8))
        step = blocks.block_bytes(dtype, self.plan.block_size)
        try:
            if len(a.extents) == 1 and a.extents[0][2:] == (0, len(flat)):
                k, offset = a.extents[0][:2]
                finish = self._reads.start(self.plan.files[k], offset, flat, step, fd=self._fds[k])
            else:
                for k, offset, at, nbytes in a.extents:
                    direct_io.pread_all(
                        self._fds[k], flat[at : at + nbytes], offset, self.plan.files[k]
                    )
                got = blocks.block_hashes(out, self.plan.block_size)
                finish = lambda: got  # noqa: E731
        except OSError as exc:
            raise self._unreadable(a, exc) from exc

        def check() -> None:
            try:
                got = finish()
            except OSError as exc:
                raise self._unreadable(a, exc) from exc
            if not np.array_equal(got, want):
                self._blame(a)

        return out, check

    def _unreadable(self, a: ArrayPlan, exc: OSError) -> CorruptCheckpoint:
        return self._corrupt(f"array {a.name!r} of rank {self.plan.rank}: unreadable ({exc})")

    def read_all(
        self, wanted: list[ArrayPlan], into: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """:meth:`array` of each of ``wanted`` (into ``into[name]`` where given), the large
        ones :data:`READERS` at a time, by name, each reader going on to its next array
        while the last pieces of the one before are hashed; every read and hash has ended
        when it returns or raises (the first error in ``wanted``'s order)."""
        large = [a for a in wanted if _nbytes(a) >= OVERLAP_BYTES]
        if len(large) < 2:
            self.ask_ahead(wanted)
            return {a.name: self.array(a, into.get(a.name)) for a in wanted}
        out: dict[str, np.ndarray] = {}
        checks: dict[str, Callable[[], None]] = {}
        errors: dict[str, Exception] = {}
        with ThreadPoolExecutor(READERS, thread_name_prefix="hpcckpt-read") as pool:
            futures = {a.name: pool.submit(self._start, a, into.get(a.name)) for a in large}
            self.ask_ahead(wanted)  # while the first large arrays are read
            for a in wanted:
                if a.name not in futures:
                    try:
                        out[a.name] = self.array(a, into.get(a.name))
                    except Exception as exc:  # raised below, once every read has ended
                        errors[a.name] = exc
            for name, future in futures.items():
                if (exc := future.exception()) is not None:
                    errors[name] = exc  # type: ignore[assignment]
                else:
                    out[name], checks[name] = future.result()
        for name, check in checks.items():
            try:
                check()
            except Exception as exc:
                errors[name] = exc
        for a in wanted:
            if a.name in errors:
                raise errors[a.name]
        return {a.name: out[a.name] for a in wanted}

    def ask_ahead(self, wanted: list[ArrayPlan]) -> None:
        """Ask the kernel at once for the bytes of ``wanted`` that the reads take through
        the page cache: the arrays too small to read past it, whole, and the first and
        last :data:`EDGE_BYTES` of the others. Each would otherwise be a small read made
        when its turn comes, waiting behind the other reader's large requests (5-9 ms
        seen in a cold restore, between two arrays, with the device at one request)."""
        for a in wanted:
            for k, offset, _, nbytes in a.extents:
                spans = [(offset, nbytes)]
                if self.direct_io and nbytes >= direct_io.MIN_DIRECT_BYTES:
                    spans = [(offset, EDGE_BYTES), (offset + nbytes - EDGE_BYTES, EDGE_BYTES)]
                for start, length in spans:
                    try:
                        os.posix_fadvise(self._fds[k], start, length, os.POSIX_FADV_WILLNEED)
                    except (AttributeError, OSError):  # a hint: the reads work without it
                        return

    def _blame(self, a: ArrayPlan) -> None:
        """Raise the error that names the file at fault, as a full read finds it."""
        source = 0 if a.hashes[0] else self.plan.rank
        with CheckpointReader(self.path) as reader:
            reader.rank_array(a.name, source)
        raise self._corrupt(f"array {a.name!r} of rank {source} fails its checksum")

    def close(self) -> None:
        self._reads.close()
        for fd in self._fds if self._owned else ():
            os.close(fd)
        self._fds = []

    def __enter__(self) -> PlanReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nbytes(a: ArrayPlan) -> int:
    return int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
