"""Create one checkpoint = one HDF5 file, by all ranks at once through MPI-IO.

The ranks create the file with its metadata and its array datasets allocated; each
rank then writes its own array bytes at their offsets (:mod:`hpcckpt.store.direct_io`).

The layout is documented for users in docs/format.md and read back (without MPI)
by :mod:`hpcckpt.store.reader`:

- ``/state/<path>``: one dataset per array path. When every rank's array has at
  least one dimension and the same trailing shape, the dataset is the ranks'
  arrays stacked along axis 0 (``layout="rows"``; a domain-decomposed field is then
  the global field). Otherwise the ranks' C-order elements are concatenated
  (``layout="flat"``). Attribute ``rank_offsets`` (nranks + 1 integers) gives each
  rank's range along axis 0; ``rank_shapes`` (JSON) each rank's shape;
  ``distributed`` whether the application declared it split along axis 0.
- ``/meta``: attributes ``format``, ``format_version``, ``step``, ``nranks``,
  ``time``, ``checksum``, ``arrays`` (JSON list of array paths, the checksum columns);
  dataset ``rank_tree`` (uint8: every rank's JSON state tree, concatenated,
  ``offsets`` attribute); dataset ``checksums`` (uint64, nranks x (arrays + 1):
  xxh3-64 of each rank's block hashes of each array, last column of its tree);
  dataset ``block_hashes`` (uint64: every rank's xxh3-64 of each block of each array).

An *incremental* file (``kind="incremental"``, format version 2) replaces
``/state/<path>`` by ``/delta/<path>`` (the changed blocks of all ranks, concatenated)
and ``/delta_index/<path>`` ((rank, block, start) of each), and names in ``chain`` the
base and deltas it is built on. See docs/format.md.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from mpi4py import MPI

from hpcckpt._version import __version__
from hpcckpt.store import blocks, integrity, layout
from hpcckpt.store.blocks import ChainPolicy, ChainState
from hpcckpt.store.direct_io import Extent
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.reader import (
    FORMAT,
    FORMAT_VERSION,
    FULL,
    INCREMENTAL,
    dataset_name,
    delta_name,
    index_name,
)
from hpcckpt.store.state_tree import V3_TAGS, ArraySpec, tensor_dtypes, uses_tags

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ArrayLayout",
    "CheckpointError",
    "CorruptCheckpoint",
    "Written",
    "plan_layouts",
    "write_file",
]


@dataclass(frozen=True)
class Written:
    """What one rank's ``write_file`` did."""

    bytes: int  # this rank's bytes written (array data and tree)
    kind: str  # "full" or "incremental"
    dirty_blocks: int  # blocks written, over all ranks (all of them for a full file)
    total_blocks: int  # blocks of the state, over all ranks
    data_bytes: int  # array bytes written, over all ranks
    hash_seconds: float  # this rank's time hashing its blocks
    state: ChainState  # what the next save compares against, once this file is committed
    uid: str = ""  # the file's unique id (meta attribute ``uid``)
    #: This rank's array bytes and where they go in the file, still to be written.
    extents: tuple[Extent, ...] = ()


@dataclass(frozen=True)
class ArrayLayout:
    path: str
    dtype: np.dtype
    layout: str  # "rows" or "flat"
    shapes: list[tuple[int, ...]]
    offsets: list[int]  # nranks + 1
    distributed: bool = False
    torch_dtype: str = ""  # a tensor's torch dtype (raw bits when numpy lacks it)
    replicated: bool = False  # rank 0's copy only: every other rank holds an empty stand-in

    @property
    def global_shape(self) -> tuple[int, ...]:
        if self.layout == "rows":
            return (self.offsets[-1], *self.shapes[0][1:])
        return (self.offsets[-1],)


def plan_layouts(
    per_rank: list[list[ArraySpec]],
    distributed: Collection[str] = (),
    replicated: Collection[str] = (),
) -> list[ArrayLayout]:
    """Decide each array's dataset from every rank's specs; names the array on mismatch.

    Runs on every rank on the same gathered specs, so every rank raises alike.
    """
    first = {s.path: s for s in per_rank[0]}
    for rank, specs in enumerate(per_rank):
        names = {s.path for s in specs}
        if names != set(first):
            diff = sorted(names ^ set(first))
            raise CheckpointError(
                f"ranks hold different arrays: rank 0 and rank {rank} differ in {diff}; "
                "every rank must save the same array names"
            )
    missing = sorted(set(distributed) - set(first))
    if missing:
        raise CheckpointError(
            f"arrays declared distributed are not numpy arrays in the state: {missing}; "
            f"the state's array paths are {sorted(first)}"
        )
    layouts = []
    for path in sorted(first):
        specs = [next(s for s in rank_specs if s.path == path) for rank_specs in per_rank]
        dtypes = {s.dtype for s in specs}
        kinds = {s.torch_dtype or "numpy" for s in specs}
        if len(kinds) != 1:
            raise CheckpointError(
                f"array {path!r} is a torch tensor on some ranks and not on others, or of "
                f"different torch dtypes ({sorted(kinds)}); save one kind on every rank"
            )
        if path in distributed and path in replicated:
            raise CheckpointError(
                f"array {path!r} is declared both distributed and replicated; choose one"
            )
        if len(dtypes) != 1:
            raise CheckpointError(
                f"array {path!r} has different dtypes on different ranks ({sorted(dtypes)}); "
                "cast it to one dtype on every rank"
            )
        shapes = [tuple(s.shape) for s in specs]
        rows = all(len(s) >= 1 for s in shapes) and len({s[1:] for s in shapes}) == 1
        if path in distributed and not rows:
            raise CheckpointError(
                f"array {path!r} is declared distributed along axis 0, but the ranks' shapes "
                f"{[list(s) for s in shapes]} differ beyond axis 0 (or are 0-d)"
            )
        sizes = [s[0] if rows else int(np.prod(s, dtype=np.int64)) for s in shapes]
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(int).tolist()
        layouts.append(
            ArrayLayout(
                path,
                np.dtype(specs[0].dtype),
                "rows" if rows else "flat",
                shapes,
                offsets,
                path in distributed,
                specs[0].torch_dtype,
                path in replicated,
            )
        )
    return layouts


def write_file(
    path: Path,
    comm: MPI.Comm,
    step: int,
    tree: Any,
    arrays: dict[str, np.ndarray],
    extra_meta: dict[str, Any] | None = None,
    *,
    distributed: Collection[str] = (),
    hints: dict[str, str] | None = None,
    alignment: tuple[int, int] | None = None,
    block_size: int = blocks.DEFAULT_BLOCK_SIZE,
    parent: ChainState | None = None,
    policy: ChainPolicy | None = None,
    hashes: dict[str, np.ndarray] | None = None,
    uid: str | None = None,
    replicated: Collection[str] = (),
) -> Written:
    """Collectively create one checkpoint file at ``path``; returns what this rank must
    write into it.

    ``hints`` are MPI-IO hints (an ``MPI.Info``) and ``alignment`` the HDF5
    (threshold, interval) in bytes, both from :mod:`hpcckpt.store.filesystem`.
    Every rank hashes its arrays' blocks (one pass over the state); with a ``parent``
    (the last committed checkpoint, the same on every rank) and the ``policy``
    allowing it, only the blocks whose hash changed go into the file (an incremental
    file), else everything. Raises CheckpointError on every rank alike when the
    ranks' states do not fit one layout.

    The file gets all its metadata, trees and block hashes, but no array bytes: its
    datasets are contiguous and allocated at creation, and ``Written.extents`` says
    where each piece of this rank's bytes goes (:func:`.direct_io.write_extents` writes
    them). The caller then makes the file durable and commits it. For a staged save
    (:mod:`hpcckpt.store.staging`), ``hashes`` are the arrays' block hashes computed
    while copying them (or some of them, the rest are computed here) and ``uid`` the id
    the ranks agreed on. ``replicated`` are the array paths stored once, from rank 0
    (:mod:`hpcckpt.store.replicated`: the other ranks pass empty stand-ins).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    policy = policy or ChainPolicy()
    tree_bytes = json.dumps(tree, separators=(",", ":"), allow_nan=True).encode()
    torch_dtypes = tensor_dtypes(tree)
    specs = [
        ArraySpec(p, a.dtype.str, tuple(a.shape), torch_dtypes.get(p, ""))
        for p, a in arrays.items()
    ]
    t_hash = time.perf_counter()
    hashes = dict(hashes or {})
    for p, a in arrays.items():
        if p not in hashes:
            hashes[p] = blocks.block_hashes(a, block_size)
    hash_seconds = time.perf_counter() - t_hash
    mine = {p: (a.dtype.str, tuple(a.shape), p in distributed) for p, a in arrays.items()}
    name = layout.checkpoint_name(step)
    dirty: dict[str, np.ndarray] | None = None
    if (
        policy.incremental
        and parent is not None
        and parent.fits(size, block_size, mine)
        and name not in parent.names  # never overwrite a file the delta needs
    ):
        dirty = {p: np.nonzero(h != parent.hashes[p])[0] for p, h in hashes.items()}
    counts = {}  # path -> (blocks, dirty blocks, dirty elements)
    for p, a in arrays.items():
        nb = hashes[p].size
        d = dirty[p] if dirty is not None else np.arange(nb)
        counts[p] = (
            nb,
            d.size,
            blocks.dirty_elems(d, blocks.block_elems(a.itemsize, block_size), a.size),
        )
    v3 = bool(replicated) or uses_tags(tree, V3_TAGS)
    gathered = comm.allgather((specs, len(tree_bytes), dirty is not None, counts, v3))
    layouts = plan_layouts([g[0] for g in gathered], distributed, replicated)
    # Version 3 only when the file needs it, so that older readers still read the rest.
    version = FORMAT_VERSION if any(g[4] for g in gathered) else 2
    tree_offsets = np.concatenate([[0], np.cumsum([g[1] for g in gathered])]).astype(np.int64)
    state_bytes = sum(
        int(np.prod(lay.global_shape, dtype=np.int64)) * lay.dtype.itemsize for lay in layouts
    )
    delta_bytes = sum(g[3][lay.path][2] * lay.dtype.itemsize for g in gathered for lay in layouts)
    incremental = (
        parent is not None
        and all(g[2] for g in gathered)
        and len(parent.chain) <= policy.max_chain
        and parent.chain_bytes + delta_bytes <= policy.max_chain_fraction * state_bytes
    )
    kind = INCREMENTAL if incremental else FULL
    # The block hash table: rank-major segments, one per (rank, array).
    nblk = [g[3][lay.path][0] for g in gathered for lay in layouts]
    hash_offsets = np.concatenate([[0], np.cumsum(nblk, dtype=np.int64)]).astype(np.int64)
    total_blocks = int(hash_offsets[-1])
    if incremental:
        dirty_blocks = sum(g[3][lay.path][1] for g in gathered for lay in layouts)
        data_bytes = delta_bytes
    else:
        dirty_blocks, data_bytes = total_blocks, state_bytes

    sums = [blocks.hashes_checksum(hashes[lay.path]) for lay in layouts]
    sums = np.array(sums + [integrity.checksum(tree_bytes)], dtype=np.uint64)
    when, new_uid = comm.bcast((time.time(), uuid.uuid4().hex) if rank == 0 else None)
    uid = uid or new_uid
    extents: list[Extent] = []
    options: dict[str, Any] = {}
    info = MPI.INFO_NULL
    if hints:
        info = MPI.Info.Create()
        for key, value in hints.items():
            info.Set(key, str(value))
        options["info"] = info
    if alignment is not None:
        options["alignment_threshold"], options["alignment_interval"] = alignment
    written = 0
    try:
        with h5py.File(path, "w", driver="mpio", comm=comm, **options) as f:
            meta = f.create_group("meta")
            meta.attrs["format"] = FORMAT
            meta.attrs["format_version"] = version
            meta.attrs["step"] = step
            meta.attrs["nranks"] = size
            meta.attrs["time"] = when
            meta.attrs["checksum"] = integrity.ALGORITHM
            meta.attrs["hpcckpt_version"] = __version__
            meta.attrs["arrays"] = json.dumps([lay.path for lay in layouts])
            meta.attrs["kind"] = kind
            meta.attrs["uid"] = uid
            meta.attrs["block_size"] = block_size
            meta.attrs["state_bytes"] = state_bytes
            meta.attrs["data_bytes"] = data_bytes
            meta.attrs["total_blocks"] = total_blocks
            meta.attrs["dirty_blocks"] = dirty_blocks
            if incremental:
                assert parent is not None
                for key, (ref_name, ref_step, ref_uid) in (
                    ("parent", parent.chain[-1]),
                    ("base", parent.chain[0]),
                ):
                    meta.attrs[key] = ref_name
                    meta.attrs[f"{key}_step"] = ref_step
                    meta.attrs[f"{key}_uid"] = ref_uid
                meta.attrs["chain"] = json.dumps([list(ref) for ref in parent.chain])
                meta.attrs["chain_length"] = len(parent.chain)
                meta.attrs["chain_bytes"] = parent.chain_bytes + delta_bytes
            for key, value in (extra_meta or {}).items():
                meta.attrs[key] = value
            rt = meta.create_dataset(
                "rank_tree", shape=(int(tree_offsets[-1]),), dtype=np.uint8, fill_time="never"
            )
            rt.attrs["offsets"] = tree_offsets
            cs = meta.create_dataset(
                "checksums", shape=(size, len(layouts) + 1), dtype=np.uint64, fill_time="never"
            )
            bh = meta.create_dataset(
                "block_hashes", shape=(total_blocks,), dtype=np.uint64, fill_time="never"
            )
            bh.attrs["offsets"] = hash_offsets
            dsets = []
            for lay in layouts:
                ix = None
                if incremental:
                    elems = sum(g[3][lay.path][2] for g in gathered)
                    d = f.create_dataset(
                        delta_name(lay.path), shape=(elems,), dtype=lay.dtype, fill_time="never"
                    )
                    d.attrs["shape"] = json.dumps([int(x) for x in lay.global_shape])
                    d.attrs["block_elems"] = blocks.block_elems(lay.dtype.itemsize, block_size)
                    ix = f.create_dataset(
                        index_name(lay.path),
                        shape=(sum(g[3][lay.path][1] for g in gathered), 3),
                        dtype=np.int64,
                        fill_time="never",
                    )
                else:
                    d = f.create_dataset(
                        dataset_name(lay.path),
                        shape=lay.global_shape,
                        dtype=lay.dtype,
                        fill_time="never",
                    )
                d.attrs["layout"] = lay.layout
                d.attrs["rank_offsets"] = np.asarray(lay.offsets, dtype=np.int64)
                d.attrs["rank_shapes"] = json.dumps([list(s) for s in lay.shapes])
                d.attrs["distributed"] = lay.distributed
                if lay.torch_dtype:
                    d.attrs["torch_dtype"] = lay.torch_dtype
                if lay.replicated:
                    d.attrs["replicated"] = True
                dsets.append((d, ix))

            lo, hi = int(tree_offsets[rank]), int(tree_offsets[rank + 1])
            if hi > lo:
                rt[lo:hi] = np.frombuffer(tree_bytes, dtype=np.uint8)
            cs[rank] = sums
            lo, hi = (
                int(hash_offsets[rank * len(layouts)]),
                int(hash_offsets[(rank + 1) * len(layouts)]),
            )
            if hi > lo:
                bh[lo:hi] = np.concatenate([hashes[lay.path] for lay in layouts])
            for lay, (d, ix) in zip(layouts, dsets, strict=True):
                if incremental:
                    assert dirty is not None and ix is not None
                    written += _write_delta(
                        d,
                        ix,
                        arrays[lay.path],
                        dirty[lay.path],
                        block_size,
                        [g[3][lay.path] for g in gathered],
                        rank,
                        extents,
                    )
                    continue
                lo, hi = lay.offsets[rank], lay.offsets[rank + 1]
                if hi == lo:
                    continue
                data = np.ascontiguousarray(arrays[lay.path])
                if data.nbytes:  # rows of zero bytes: HDF5 allocates the dataset no storage
                    row = data.nbytes // max(1, hi - lo)  # bytes per row (or element, flat)
                    extents.append(Extent(_offset(d) + lo * row, _bytes(data)))
                written += data.nbytes
    finally:
        if info != MPI.INFO_NULL:
            info.Free()
    if incremental:
        assert parent is not None
        chain = (*parent.chain, (name, step, uid))
        chain_bytes = parent.chain_bytes + delta_bytes
    else:
        chain, chain_bytes = ((name, step, uid),), 0
    state = ChainState(step, uid, block_size, size, mine, hashes, chain, chain_bytes, state_bytes)
    return Written(
        written + len(tree_bytes),
        kind,
        int(dirty_blocks),
        total_blocks,
        int(data_bytes),
        hash_seconds,
        state,
        uid,
        tuple(extents),
    )


def _offset(d: h5py.Dataset) -> int:
    """Byte offset of a contiguous dataset's data in its file (allocated at creation)."""
    offset = d.id.get_offset()
    if offset is None:  # cannot happen with the mpio driver, which allocates early
        raise CheckpointError(f"dataset {d.name} has no storage allocated yet")
    return int(offset)


def _bytes(data: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def _write_delta(
    d: h5py.Dataset,
    ix: h5py.Dataset,
    array: np.ndarray,
    dirty: np.ndarray,
    block_size: int,
    counts: list[tuple[int, int, int]],
    rank: int,
    extents: list[Extent],
) -> int:
    """Write the index rows of this rank's changed blocks of one array and append the
    blocks to ``extents`` (file offset, bytes); the bytes of those blocks.

    ``counts`` is every rank's (blocks, dirty blocks, dirty elements) of the array:
    rank r's blocks follow those of ranks 0..r-1 in both datasets.
    """
    if dirty.size == 0:
        return 0
    elems = blocks.block_elems(array.dtype.itemsize, block_size)
    first = sum(c[2] for c in counts[:rank])
    row = sum(c[1] for c in counts[:rank])
    sizes = np.minimum(elems, array.size - dirty.astype(np.int64) * elems)
    starts = first + np.cumsum(sizes) - sizes
    ix[row : row + dirty.size] = np.column_stack(
        [np.full(dirty.size, rank, dtype=np.int64), dirty.astype(np.int64), starts]
    )
    flat = np.ascontiguousarray(array).reshape(-1)
    pos = first
    base = _offset(d)
    for b0, b1 in blocks.runs(dirty):
        e0, e1 = b0 * elems, min(b1 * elems, array.size)
        extents.append(Extent(base + pos * array.itemsize, _bytes(flat[e0:e1])))
        pos += e1 - e0
    return (pos - first) * array.dtype.itemsize
