"""Read one checkpoint file with plain h5py, in one process, validating before trusting it.

No MPI here: a restore's rank 0 validates the file with it and sends the other ranks
their read plans (:mod:`.restore.read_plan`); every rank opens it only to reshard; and the
command-line tools read checkpoints without mpirun. Every attribute that sizes a read
(rank offsets, rank shapes, the number of ranks) is checked against the dataset shapes
and the file size first, so a crafted or damaged file raises :class:`CorruptCheckpoint`
instead of allocating huge buffers; every byte handed back has passed its xxh3-64
checksum.

Format version 2 adds incremental checkpoints: a file of kind "incremental" holds
only the blocks that changed since its parent, and names the files of its chain
(a full base, then deltas). Opening it opens its chain too, checks that every file
is present, not marked bad and the very file it was written against (by uid), and
:meth:`CheckpointReader.rank_array` assembles a rank's array from the newest copy of
each block in the chain, verifying every block against its hash.

How arrays are described (one ``/meta`` attribute in format version 4, attributes of
each dataset in versions 1-3) is read and checked by :mod:`.file.descriptions`; the format's
names and version are :mod:`.file.format`'s.

Over 500 lines on purpose: verifying and reading a checkpoint (per-rank slices,
resharding, checksums) is one path a restore follows end to end.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.file import heap_check, layout
from hpcckpt.store.file.descriptions import (
    ArrayInfo,
    array_info,
    attributes,
    descriptions,
    integer,
    offsets,
    plain,
)
from hpcckpt.store.file.format import (
    ARRAY_INFO,
    BLOCK_HASHES,
    CHECKSUMS,
    FORMAT,
    FORMAT_VERSION,
    FULL,
    INCREMENTAL,
    MAX_RANKS,
    META,
    RANK_TREE,
    dataset_name,
    delta_name,
    index_name,
)
from hpcckpt.store.io import blocks, direct_io, integrity, safety
from hpcckpt.store.tree import checks as tree_check
from hpcckpt.store.tree.queries import array_paths


def parse_tree(raw: bytes, names: Iterable[str], rank: int, path: Path) -> Any:
    """Rank ``rank``'s state tree from its checksum-verified bytes in file ``path``: only
    the node types hpcckpt writes, naming exactly the arrays ``names``."""
    try:
        tree = json.loads(raw)
        tree_check.check_tree(tree)
        paths = list(array_paths(tree))
    except (ValueError, RecursionError, AttributeError, TypeError, KeyError) as exc:
        why = f"{path.name}: rank {rank}'s state tree is not valid ({exc})"
        raise CorruptCheckpoint(why, culprit=path) from exc
    if sorted(paths) != sorted(names):
        why = f"{path.name}: rank {rank}'s state tree names other arrays than the file holds"
        raise CorruptCheckpoint(why, culprit=path)
    return tree


#: Bytes at the start of a checkpoint file asked from the disk in one request before
#: HDF5 reads its metadata there (the writer's metadata block, the tables after it).
METADATA_PREFETCH = 256 << 10


def prefetch_metadata(fd: int, size: int) -> None:
    """Ask the kernel for the start of the file in one request: HDF5 then finds its
    metadata in the page cache instead of waiting on dozens of small cold reads."""
    try:
        os.posix_fadvise(fd, 0, min(size, METADATA_PREFETCH), os.POSIX_FADV_WILLNEED)
    except (AttributeError, OSError):  # not offered here: HDF5 reads it as before
        pass


class CheckpointReader:
    """An open, structurally validated checkpoint file. Use as a context manager."""

    def __init__(
        self, path: str | os.PathLike[str], *, resolve_chain: bool = True, direct_io: bool = False
    ) -> None:
        """``direct_io``: read array bytes that are not in the page cache past it (see
        :func:`.io.direct_io.read_hashed`), as the store does where its saves write so."""
        self.path = Path(path)
        self.direct_io = direct_io
        self._members: list[CheckpointReader] = []
        self._ids: dict[str, h5py.h5d.DatasetID] = {}  # every dataset of the file, opened
        self._valid: dict[str, h5py.h5d.DatasetID] = {}  # those checked by _checked
        self._starts: dict[str, int | None] = {}  # of those: where their bytes lie as one run
        self._datasets: dict[str, h5py.Dataset] = {}  # h5py's objects of checked ones
        self._fd = -1  # one descriptor for our own reads: the heap check, the array bytes
        safety.check_regular_file(self.path)  # no links, FIFOs or devices
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            self._file_size = os.fstat(self._fd).st_size
            prefetch_metadata(self._fd, self._file_size)
            self._f = h5py.File(self.path, "r")
        except OSError as exc:
            self.close()
            raise CorruptCheckpoint(f"{self.path.name}: unreadable ({exc})") from exc
        try:
            self._validate()
            if resolve_chain and self.kind == INCREMENTAL:
                self._open_chain()
        except CorruptCheckpoint as exc:
            self.close()
            if exc.culprit is None and not str(exc).startswith(self.path.name):
                raise CorruptCheckpoint(f"{self.path.name}: {exc}") from exc  # name the file
            raise
        except CheckpointError:
            self.close()
            raise
        except heap_check.DAMAGE_ERRORS as exc:  # what h5py raises on damaged metadata
            self.close()
            raise CorruptCheckpoint(
                f"{self.path.name}: unreadable ({type(exc).__name__}: {exc})"
            ) from exc

    # -- structure -----------------------------------------------------------------------
    def _corrupt(self, why: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{self.path.name}: {why}", culprit=self.path)

    def _checked(self, name: str) -> h5py.h5d.DatasetID:
        """A dataset whose stored bytes match its shape and fit in the file (no filters),
        as HDF5's low-level object (validation asks this of every array: h5py's object
        would cost twice as much); each checked once per open file."""
        dsid = self._valid.get(name)
        if dsid is not None:
            return dsid
        dsid = self._ids.get(name)
        if dsid is None:
            raise self._corrupt(f"dataset {name!r} is missing")
        dcpl = dsid.get_create_plist()
        if dcpl.get_nfilters() != 0:
            raise self._corrupt(f"dataset {name!r} uses HDF5 filters; hpcckpt never writes them")
        shape, dtype = dsid.shape, dsid.dtype
        if any(n < 0 for n in shape):
            raise self._corrupt(f"dataset {name!r} has a negative extent {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        stored = dsid.get_storage_size()
        if nbytes > self._file_size or (nbytes and stored < nbytes):
            raise self._corrupt(
                f"dataset {name!r} claims {nbytes} bytes ({dtype}{list(shape)}) but the "
                f"file stores {stored} of them in a {self._file_size}-byte file"
            )
        self._valid[name] = dsid
        start = dsid.get_offset()  # None while no storage is allocated
        plain = dcpl.get_layout() == h5py.h5d.CONTIGUOUS and dcpl.get_external_count() == 0
        self._starts[name] = int(start) if plain and start is not None else None
        return dsid

    def _dataset(self, name: str) -> h5py.Dataset:
        """A :meth:`_checked` dataset as h5py's object, to read from."""
        d = self._datasets.get(name)
        if d is None:
            d = self._datasets[name] = h5py.Dataset(self._checked(name))
        return d

    def _validate(self) -> None:
        # HDF5 hangs on a damaged heap; the check opens every dataset, kept for _dataset.
        self._ids = heap_check.check_global_heaps(self._f, self.path, self._file_size, self._fd)
        meta = self._f.get(META)
        if not isinstance(meta, h5py.Group):
            raise self._corrupt("not an hpcckpt checkpoint (no /meta group)")
        self.attrs: dict[str, Any] = {k: plain(v) for k, v in attributes(meta).items()}
        described = self.attrs.pop(ARRAY_INFO, None)
        if self.attrs.get("format") != FORMAT:
            raise self._corrupt("not an hpcckpt checkpoint (meta.attrs['format'])")
        version = integer(self.attrs.get("format_version"), "format_version", 1, 1 << 30)
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{self.path.name}: format version {version} is newer than this hpcckpt "
                f"understands ({FORMAT_VERSION}); upgrade hpcckpt"
            )
        self.step = integer(self.attrs.get("step"), "step")
        self.nranks = n = integer(self.attrs.get("nranks"), "nranks", 1, MAX_RANKS)
        self.time = float(self.attrs.get("time", 0.0))
        names = json.loads(self.attrs.get("arrays", "null"))
        if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
            raise self._corrupt("meta.attrs['arrays'] is not a JSON list of array paths")
        if len(set(names)) != len(names):
            raise self._corrupt("meta.attrs['arrays'] lists an array twice")

        cs = self._dataset(CHECKSUMS)
        if cs.shape != (n, len(names) + 1) or cs.dtype != np.uint64:
            raise self._corrupt(
                f"checksum table is {cs.dtype}{list(cs.shape)}, expected uint64[{n}, "
                f"{len(names) + 1}] for {n} ranks and {len(names)} arrays"
            )
        self.checksums = np.asarray(cs[...], dtype=np.uint64)

        rt = self._dataset(RANK_TREE)
        if rt.ndim != 1 or rt.dtype != np.uint8:
            raise self._corrupt(f"meta/rank_tree is {rt.dtype}{list(rt.shape)}, expected uint8[n]")
        self._tree_offsets = offsets(
            rt.attrs.get("offsets"), n, rt.shape[0], "rank_tree", self.path
        )

        self.format_version = version
        self.kind = FULL
        self.uid: str | None = None
        self.block_size = 0
        self.chain_refs: list[tuple[str, int, str]] = []  # (name, step, uid), base first
        if version >= 2:
            self.kind = self.attrs.get("kind")
            if self.kind not in (FULL, INCREMENTAL):
                raise self._corrupt(f"meta.attrs['kind'] is {self.kind!r}, not full/incremental")
            self.uid = str(self.attrs.get("uid") or "")
            if not self.uid:
                raise self._corrupt("meta.attrs['uid'] is missing")
            self.block_size = integer(self.attrs.get("block_size"), "block_size", 16, 1 << 40)
        listed = descriptions(described, names, version, self.path)
        incremental = self.kind == INCREMENTAL
        self.arrays: dict[str, ArrayInfo] = {}
        for column, name in enumerate(names):
            d = self._checked(delta_name(name) if incremental else dataset_name(name))
            one = None if listed is None else listed[column]
            self.arrays[name] = array_info(d, name, column, n, one, incremental, self.path)
        self._delta: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        if version >= 2:
            self._hash_table(n, names)
            if self.kind == INCREMENTAL:
                for name in names:
                    self._delta[name] = self._delta_index(name, n)
                self.chain_refs = self._chain_refs()

    def _hash_table(self, n: int, names: list[str]) -> None:
        """``meta/block_hashes``: every rank's block hashes of every array, rank-major."""
        d = self._dataset(BLOCK_HASHES)
        if d.ndim != 1 or d.dtype != np.uint64:
            raise self._corrupt(f"meta/block_hashes is {d.dtype}{list(d.shape)}, not uint64[n]")
        offs = offsets(
            d.attrs.get("offsets"), n * len(names), d.shape[0], "block_hashes", self.path
        )
        held = np.diff(np.asarray(offs, dtype=np.int64)).reshape(n, len(names)).T
        infos = [self.arrays[name] for name in names]  # in column order
        # numpy over every (array, rank) at once: O(p) work, once per restore
        starts = np.array([info.rank_offsets for info in infos], dtype=np.int64)
        starts = starts.reshape(len(infos), n + 1)  # (0, n + 1) for a file of no arrays
        per_index = [
            math.prod(info.trailing) if info.layout == "rows" else 1 for info in infos
        ]  # elements per index of axis 0: the sizes were checked to fit the file
        elems = [blocks.block_elems(info.dtype.itemsize, self.block_size) for info in infos]
        sizes = np.diff(starts, axis=1) * np.array(per_index, dtype=np.int64)[:, None]
        want = -(-sizes // np.array(elems, dtype=np.int64)[:, None])
        wrong = np.argwhere(held != want)
        if wrong.size:
            column, r = (int(x) for x in wrong[0])  # the first array, its first rank
            raise self._corrupt(
                f"meta/block_hashes holds {held[column, r]} hashes for array "
                f"{names[column]!r} of rank {r}, which has {want[column, r]} blocks"
            )
        self._hash_offsets = offs
        self._hash_dataset = d  # read per (rank, array) when asked: not p ranks' hashes each

    def _delta_index(self, name: str, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(blocks, starts, rank pointers) of an array's changed blocks, validated."""
        info = self.arrays[name]
        extent = self._checked(delta_name(name)).shape[0]
        idx = self._dataset(index_name(name))
        if idx.dtype.kind not in "iu" or idx.ndim != 2 or idx.shape[1] != 3:
            raise self._corrupt(
                f"{index_name(name)} is {idx.dtype}{list(idx.shape)}, not int[k, 3]"
            )
        entries = np.asarray(idx[...], dtype=np.int64).reshape(-1, 3)
        ranks, blks, starts = entries[:, 0], entries[:, 1], entries[:, 2]
        elems = blocks.block_elems(info.dtype.itemsize, self.block_size)
        counts = np.array([info.rank_elems(r) for r in range(n)], dtype=np.int64)
        bad = np.any((ranks < 0) | (ranks >= n))
        if not bad and entries.size:
            bad = np.any((blks < 0) | (blks >= -(-counts[ranks] // elems)))
            dr, db = np.diff(ranks), np.diff(blks)
            bad = bad or np.any((dr < 0) | ((dr == 0) & (db <= 0)))
        if not bad:
            sizes = np.minimum(elems, counts[ranks] - blks * elems)
            ends = np.cumsum(sizes)
            bad = not (
                np.array_equal(starts, ends - sizes) and int(ends[-1] if ends.size else 0) == extent
            )
        if bad:
            raise self._corrupt(
                f"{index_name(name)}: entries must be (rank, block, start) in order, each block "
                f"inside its rank's array, packed from 0 to the {extent} elements of the deltas"
            )
        return blks, starts, np.searchsorted(ranks, np.arange(n + 1))

    def _chain_refs(self) -> list[tuple[str, int, str]]:
        try:
            raw = json.loads(self.attrs.get("chain", "null"))
        except (TypeError, ValueError):
            raw = None
        if not isinstance(raw, list) or not raw:
            raise self._corrupt("meta.attrs['chain'] must list the base and deltas it needs")
        refs = []
        for item in raw:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[2], str)):
                raise self._corrupt(f"meta.attrs['chain'] has an entry {item!r:.80}")
            step = integer(item[1], "a step of meta.attrs['chain']")
            if not isinstance(item[0], str) or layout.step_of(item[0]) != step:
                raise self._corrupt(f"meta.attrs['chain'] names {item[0]!r} for step {step}")
            refs.append((item[0], step, item[2]))
        if len({s for _, s, _ in refs} | {self.step}) != len(refs) + 1:
            raise self._corrupt("meta.attrs['chain'] names a step twice")
        return refs

    def _open_chain(self) -> None:
        """Open and check the base and deltas this incremental checkpoint is built on."""
        for k, (name, step, uid) in enumerate(self.chain_refs):
            path = self.path.with_name(name)
            what = f"{self.path.name} needs {name} (step {step}) of its chain"
            if not os.path.lexists(path):
                raise CorruptCheckpoint(f"{what}, which is missing", culprit=path)
            reason = layout.read_bad(path)  # a mark of the file it replaced does not count
            if reason is not None:
                raise CorruptCheckpoint(f"{what}, which is marked bad ({reason})", culprit=path)
            member = CheckpointReader(path, resolve_chain=False, direct_io=self.direct_io)
            self._members.append(member)
            if member.uid != uid:
                raise CorruptCheckpoint(
                    f"{what}, but {name} is now another checkpoint of that step (uid "
                    f"{member.uid}, not {uid}): the chain is broken",
                    culprit=self.path,
                )
            kind = FULL if k == 0 else INCREMENTAL
            same = (
                member.kind == kind
                and member.nranks == self.nranks
                and member.block_size == self.block_size
                and list(member.arrays) == list(self.arrays)
                and all(member.arrays[a].same_layout(self.arrays[a]) for a in self.arrays)
            )
            if not same:
                raise CorruptCheckpoint(
                    f"{what}, but {name} is not a {kind} checkpoint with the same ranks, block "
                    "size and arrays",
                    culprit=self.path,
                )

    @property
    def fd(self) -> int:
        """The descriptor this reader holds on its file (-1 once closed): rank 0's planned
        read goes through it rather than open the file once more."""
        return self._fd

    @property
    def chain(self) -> list[CheckpointReader]:
        """The files this checkpoint is made of: the full base first, itself last."""
        return [*self._members, self]

    # -- data ----------------------------------------------------------------------------
    def tree_bytes(self, rank: int) -> bytes:
        """Rank ``rank``'s JSON state tree, checksum verified."""
        lo, hi = self._tree_offsets[rank], self._tree_offsets[rank + 1]
        raw = self._dataset(RANK_TREE)[lo:hi].tobytes() if hi > lo else b""
        if integrity.checksum(raw) != int(self.checksums[rank, -1]):
            raise self._corrupt(f"rank {rank}'s state tree fails its checksum")
        return raw

    def tree(self, rank: int) -> Any:
        """Rank ``rank``'s state tree, verified, whose arrays are exactly this file's arrays."""
        return parse_tree(self.tree_bytes(rank), self.arrays, rank, self.path)

    def rows(self, name: str, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[lo, hi)`` of a "rows" array, read as one hyperslab and verified.

        The read widens to whole slices of the writing ranks that overlap the range,
        because checksums are per writing rank. When ``[lo, hi)`` is exactly one writing
        rank's slice, ``out`` (C-contiguous, of that shape and dtype) receives the rows
        and is returned, without a copy; otherwise it is not used.
        """
        info = self.arrays[name]
        if info.layout != "rows":
            raise CheckpointError(f"array {name!r} has layout {info.layout}: no global rows")
        if not 0 <= lo <= hi <= info.shape[0]:
            raise CheckpointError(f"rows [{lo}, {hi}) outside array {name!r} of {info.shape[0]}")
        if lo == hi:
            return np.empty((0, *info.trailing), dtype=info.dtype)
        offs = info.rank_offsets
        owners = [r for r in range(self.nranks) if offs[r] < hi and offs[r + 1] > lo]
        start, stop = offs[owners[0]], offs[owners[-1] + 1]
        if self.format_version >= 2:
            if out is not None and len(owners) == 1 and (start, stop) == (lo, hi):
                return self.rank_array(name, owners[0], out)
            parts = [self.rank_array(name, r) for r in owners]
            data = parts[0] if len(parts) == 1 else np.concatenate(parts)
            return data[lo - start : hi - start]
        data = self._dataset(dataset_name(name))[start:stop]
        for r in owners:
            part = data[offs[r] - start : offs[r + 1] - start]
            if integrity.checksum(part) != int(self.checksums[r, info.column]):
                raise self._corrupt(f"array {name!r} of writing rank {r} fails its checksum")
        return data[lo - start : hi - start]

    def rank_array(self, name: str, rank: int, out: np.ndarray | None = None) -> np.ndarray:
        """The array ``name`` exactly as rank ``rank`` saved it, verified.

        ``out`` (C-contiguous, of the saved shape and dtype; otherwise not used) is read
        into and returned: a restore into the application's own array needs no second
        copy. If verification fails, ``out`` holds unverified bytes.
        """
        info = self.arrays[name]
        if info.replicated:  # rank 0's copy is every rank's value
            rank = 0
        if self.format_version >= 2:
            shape = tuple(info.rank_shapes[rank])
            if out is not None and out.shape == shape and out.dtype == info.dtype:
                self._materialize(name, rank, out.reshape(-1))
                return out
            return self._materialize(name, rank).reshape(info.rank_shapes[rank])
        lo, hi = info.rank_offsets[rank], info.rank_offsets[rank + 1]
        if info.layout == "rows":
            return self.rows(name, lo, hi).reshape(info.rank_shapes[rank])
        raw = self._dataset(dataset_name(name))[lo:hi] if hi > lo else np.empty(0, info.dtype)
        if integrity.checksum(raw) != int(self.checksums[rank, info.column]):
            raise self._corrupt(f"array {name!r} of rank {rank} fails its checksum")
        return raw.reshape(info.rank_shapes[rank])

    # -- blocks (format version 2) -------------------------------------------------------
    def block_hashes(self, name: str, rank: int) -> np.ndarray:
        """Rank ``rank``'s block hashes of array ``name`` in this file, checksum verified."""
        info = self.arrays[name]
        k = rank * len(self.arrays) + info.column
        lo, hi = self._hash_offsets[k], self._hash_offsets[k + 1]
        h = np.empty(0, np.uint64)
        if hi > lo:
            h = np.asarray(self._hash_dataset[lo:hi], dtype=np.uint64)
        if blocks.hashes_checksum(h) != int(self.checksums[rank, info.column]):
            raise self._corrupt(
                f"the block hashes of array {name!r} of rank {rank} fail their checksum"
            )
        return h

    def delta_pointers(self, name: str) -> np.ndarray:
        """Where each rank's entries start in array ``name``'s delta index (nranks + 1)."""
        return self._delta[name][2]

    def delta_blocks(self, name: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(block indices, element starts in the deltas) of rank ``rank``'s changed blocks."""
        blks, starts, ptr = self._delta[name]
        return blks[ptr[rank] : ptr[rank + 1]], starts[ptr[rank] : ptr[rank + 1]]

    def raw_start(self, dataset: str, dtype: np.dtype) -> int | None:
        """Byte offset in the file of a dataset's data when it can be read as raw bytes of
        ``dtype`` (contiguous, unfiltered, not external, allocated); None otherwise."""
        dsid = self._checked(dataset)
        return self._starts[dataset] if dsid.dtype == dtype else None

    @property
    def tree_offsets(self) -> tuple[int, ...]:
        """Where each rank's tree lies in ``meta/rank_tree`` (nranks + 1 byte offsets)."""
        return self._tree_offsets

    @property
    def hash_offsets(self) -> tuple[int, ...]:
        """Where each (rank, array) row lies in ``meta/block_hashes``, rank-major."""
        return self._hash_offsets

    def block_owners(self, name: str, rank: int, nblocks: int) -> tuple[np.ndarray, np.ndarray]:
        """For each of rank ``rank``'s blocks of ``name``: the file of the chain holding its
        newest copy (0 the base) and, in a delta, its element start there."""
        owner = np.zeros(nblocks, dtype=np.int64)
        where = np.zeros(nblocks, dtype=np.int64)
        for k, part in enumerate(self.chain[1:], start=1):
            blks, starts = part.delta_blocks(name, rank)
            owner[blks] = k
            where[blks] = starts
        return owner, where

    def _raw_offset(self, name: str, rank: int) -> int | None:
        """Byte offset of rank ``rank``'s elements of a full file's array, when they can
        be read as raw bytes (contiguous, unfiltered, stored as the array's dtype)."""
        info = self.arrays[name]
        start = self.raw_start(dataset_name(name), info.dtype)
        if start is None:
            return None
        per_index = info.dtype.itemsize * int(np.prod(info.trailing, dtype=np.int64))
        offset = start + info.rank_offsets[rank] * per_index
        if offset + info.rank_bytes(rank) > self._file_size:
            raise self._corrupt(f"array {name!r} of rank {rank} ends past the end of the file")
        return offset

    def _read_rank_into(self, name: str, rank: int, out: np.ndarray) -> None:
        """Rank ``rank``'s elements of a full file's array into the 1-D ``out`` (unverified)."""
        info = self.arrays[name]
        lo, hi = info.rank_offsets[rank], info.rank_offsets[rank + 1]
        d = self._dataset(dataset_name(name))
        dest = out.reshape(info.rank_shapes[rank]) if info.layout == "rows" else out
        d.read_direct(dest, np.s_[lo:hi])

    def _materialize(self, name: str, rank: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rank ``rank``'s array (1-D, into ``out`` if given) from the newest copy of each
        block in the chain, verified."""
        info = self.arrays[name]
        count = info.rank_elems(rank)
        elems = blocks.block_elems(info.dtype.itemsize, self.block_size)
        want = self.block_hashes(name, rank)
        if out is None:
            out = np.empty(count, dtype=info.dtype)
        if count == 0:
            return out
        chain = self.chain
        owner, where = self.block_owners(name, rank, want.size)
        got = None
        try:
            raw = None if np.any(owner) else chain[0]._raw_offset(name, rank)
            if raw is not None:  # one contiguous read, hashed as it arrives
                step = elems * info.dtype.itemsize
                got = direct_io.read_hashed(
                    chain[0].path,
                    raw,
                    memoryview(out).cast("B"),
                    step,
                    fd=chain[0]._fd,
                    direct=self.direct_io,
                )
            elif np.any(owner == 0):
                chain[0]._read_rank_into(name, rank, out)
            for k, part in enumerate(chain[1:], start=1):
                d = part._dataset(delta_name(name))
                for b0, b1 in blocks.runs(np.nonzero(owner == k)[0]):
                    e0, e1 = b0 * elems, min(b1 * elems, count)
                    p0 = int(where[b0])
                    d.read_direct(out, np.s_[p0 : p0 + e1 - e0], np.s_[e0:e1])
        except (OSError, ValueError) as exc:
            raise self._corrupt(f"array {name!r} of rank {rank}: unreadable ({exc})") from exc
        if got is None:
            got = blocks.block_hashes(out, self.block_size)
        wrong = np.nonzero(got != want)[0]
        if wrong.size:
            j = int(wrong[0])
            part = chain[int(owner[j])]
            if int(part.block_hashes(name, rank)[j]) != int(got[j]):
                raise part._corrupt(
                    f"array {name!r} of rank {rank}, block {j}, fails its checksum"
                    + ("" if part is self else f" (needed by {self.path.name})")
                )
            raise self._corrupt(
                f"array {name!r} of rank {rank}, block {j}: the chain's copy (in "
                f"{part.path.name}) does not match this checkpoint's hash"
            )
        return out

    def verify(self) -> list[str]:
        """Check every rank's tree and arrays; the problems found (empty when good).

        Reads one writing rank's slice at a time, so memory stays at the largest slice.
        """
        problems = []
        for r in range(self.nranks):
            try:
                self.tree(r)
            except CheckpointError as exc:
                problems.append(str(exc))
            for name in self.arrays:
                if r and self.arrays[name].replicated:
                    continue  # every rank's value is rank 0's copy, verified once
                try:
                    self.rank_array(name, r)
                except CheckpointError as exc:
                    problems.append(str(exc))
                except (OSError, ValueError) as exc:
                    problems.append(f"{self.path.name}: array {name!r} of rank {r}: {exc}")
        return problems

    def replicated(self, name: str) -> bool:
        """Whether ``name`` was declared replicated, or every rank saved the same shape and
        bytes (equal checksums)."""
        info = self.arrays[name]
        if info.replicated:
            return True
        col = self.checksums[:, info.column]
        return len(set(info.rank_shapes)) == 1 and bool(np.all(col == col[0]))

    def close(self) -> None:
        for member in self._members:
            member.close()
        self._datasets.clear()
        self._valid.clear()
        self._starts.clear()
        self._ids = {}
        f = getattr(self, "_f", None)
        if f is not None and f.id.valid:
            f.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
