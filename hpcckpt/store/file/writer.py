"""Create one checkpoint = one HDF5 file for all ranks: rank 0 makes it, each rank fills its part.

Rank 0 creates the file with its metadata and its datasets allocated (plain HDF5, no
MPI-IO); each rank then writes its own bytes at their offsets
(:mod:`hpcckpt.store.io.direct_io`). A save costs three small collectives here whatever
the rank count, and no rank handles another rank's data or metadata but rank 0.

The layout is documented for users in docs/format.md and read back (without MPI)
by :mod:`hpcckpt.store.file.reader` (names and version: :mod:`hpcckpt.store.file.format`):

- ``/state/<path>``: one dataset per array path. When every rank's array has at
  least one dimension and the same trailing shape, the dataset is the ranks'
  arrays stacked along axis 0 (``layout="rows"``; a domain-decomposed field is then
  the global field). Otherwise the ranks' C-order elements are concatenated
  (``layout="flat"``).
- ``/meta``: attributes ``format``, ``format_version``, ``step``, ``nranks``,
  ``time``, ``checksum``, ``arrays`` (JSON list of array paths, the checksum columns),
  ``array_info`` (JSON: per array, its layout, each rank's range along axis 0
  ``rank_offsets`` and shape ``rank_shapes``, whether it is ``distributed``...: one
  attribute for all arrays, since HDF5 costs about as much per attribute as per dataset);
  dataset ``rank_tree`` (uint8: every rank's JSON state tree, concatenated,
  ``offsets`` attribute); dataset ``checksums`` (uint64, nranks x (arrays + 1):
  xxh3-64 of each rank's block hashes of each array, last column of its tree);
  dataset ``block_hashes`` (uint64: every rank's xxh3-64 of each block of each array).

An *incremental* file (``kind="incremental"``, format version 2) replaces
``/state/<path>`` by ``/delta/<path>`` (the changed blocks of all ranks, concatenated)
and ``/delta_index/<path>`` ((rank, block, start) of each), and names in ``chain`` the
base and deltas it is built on. See docs/format.md.

Where each rank's bytes go is planned, without HDF5 or MPI, by :mod:`.plan`; this
module runs the collectives around that plan and creates the file it describes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcckpt._version import __version__
from hpcckpt.store.comm import Comm
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.file.format import (
    ARRAY_INFO,
    BLOCK_HASHES,
    CHECKSUMS,
    FORMAT,
    FORMAT_VERSION,
    INCREMENTAL,
    LIBVER,
    META,
    RANK_TREE,
    dataset_name,
    delta_name,
    index_name,
)
from hpcckpt.store.file.plan import FilePlan, array_info, array_specs, plan_file, rank_counts
from hpcckpt.store.io import blocks, integrity
from hpcckpt.store.io.blocks import ChainPolicy, ChainState
from hpcckpt.store.io.direct_io import Extent

__all__ = ["DeferredHashes", "Written", "set_attrs", "write_file"]


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
    all_bytes: int = 0  # array data and trees, over all ranks
    #: With ``hash_while_writing``: the block hashes still to compute as the extents go.
    hashing: DeferredHashes | None = None
    #: A full file: why not a delta (:meth:`ChainPolicy.why_full`).
    full_reason: str | None = None


@dataclass(frozen=True)
class DeferredHashes:
    """Block hashes computed while a rank's array bytes are written, not before.

    ``progress(i, n)`` (for :func:`.io.direct_io.write_extents`) hashes what extent ``i``
    has handed on; ``before(i)`` completes every hash and the rank's checksum row when
    extent ``i`` is the first that holds them (they come after the array bytes).
    """

    hashers: dict[int, blocks.BlockHasher]  # extent index -> its array's hasher
    first: int  # index of the first extent that holds hashes
    fill: Any  # () -> None: completes the hash table row and the checksum row

    def progress(self, i: int, nbytes: int) -> None:
        hasher = self.hashers.get(i)
        if hasher is not None:
            hasher.upto(nbytes)

    def before(self, i: int) -> None:
        if i == self.first:
            for hasher in self.hashers.values():
                hasher.upto(len(hasher.raw))
            self.fill()


def write_file(
    path: Path,
    comm: Comm,
    step: int,
    tree: Any,
    arrays: dict[str, np.ndarray],
    extra_meta: dict[str, Any] | None = None,
    *,
    distributed: Collection[str] = (),
    alignment: tuple[int, int] | None = None,
    block_size: int = blocks.DEFAULT_BLOCK_SIZE,
    parent: ChainState | None = None,
    policy: ChainPolicy | None = None,
    hashes: dict[str, np.ndarray] | None = None,
    uid: str | None = None,
    replicated: Collection[str] = (),
    hash_while_writing: bool = False,
    prepare: Callable[[int], None] | None = None,
) -> Written:
    """Create one checkpoint file at ``path`` for all ranks; returns what this rank must
    write into it.

    Rank 0 alone creates the file (plain HDF5, no MPI-IO) with all its metadata and
    its datasets contiguous and allocated, but no bytes in them: the other ranks send
    it only their specs and counts (a gather), learn the datasets' file offsets (a
    bcast) and their own place in each (an exclusive prefix sum), so that no rank
    handles data or metadata of the others: three collectives, whatever the rank count.
    ``Written.extents`` is this rank's part of the file (its state tree, its row of
    checksums, its block hashes, its arrays' bytes or changed blocks and their index
    rows), written by :func:`.io.direct_io.write_extents` or a staged save's writer.

    ``alignment`` is the HDF5 (threshold, interval) in bytes from
    :mod:`hpcckpt.store.io.filesystem`. Every rank hashes its arrays' blocks (one pass
    over the state); with a ``parent`` (the last committed checkpoint, the same on
    every rank) and the ``policy`` allowing it, only the blocks whose hash changed go
    into the file (an incremental file), else everything. Raises CheckpointError on
    every rank alike when the ranks' states do not fit one layout, or rank 0 could not
    create the file. For a staged save (:mod:`hpcckpt.store.save.staging`), ``hashes`` are
    the arrays' block hashes computed while copying them (or some of them, the rest are
    computed here) and ``uid`` the id the ranks agreed on. ``replicated`` are the array
    paths stored once, from rank 0 (:mod:`hpcckpt.store.tree.replicated`: the other ranks
    pass empty stand-ins). ``hash_while_writing``: when there is no ``parent`` (nothing
    to compare with, a full file), the hashes nobody passed are computed while the array
    bytes are written (``Written.hashing``), and the hash table and checksum rows are
    written after them. ``prepare(state_bytes)``: rank 0 calls it right before it
    creates the file (the store readies its directory there); what it raises fails the
    save on every rank like a failure to create the file, in the same bcast.
    """
    rank, size = comm.rank, comm.size
    policy = policy or ChainPolicy()
    name = layout.checkpoint_name(step)
    hash_seconds, dirty = 0.0, None
    local_error: BaseException | None = None
    try:  # what this rank meets here reaches rank 0 in the gather: no rank is left waiting
        tree_bytes = json.dumps(tree, separators=(",", ":"), allow_nan=True).encode()
        specs = array_specs(tree, arrays)
        t_hash = time.perf_counter()
        hashes, later = _block_hashes(
            arrays, dict(hashes or {}), block_size, hash_while_writing and parent is None
        )
        hash_seconds = time.perf_counter() - t_hash
        mine = blocks.specs_of(arrays, distributed)
        if (
            policy.incremental
            and parent is not None
            and parent.fits(size, block_size, mine)
            and name not in parent.names  # never overwrite a file the delta needs
        ):
            dirty = {p: np.nonzero(h != parent.hashes[p])[0] for p, h in hashes.items()}
        counts = rank_counts(arrays, hashes, dirty, block_size)
        payload: Any = (specs, len(tree_bytes), dirty is not None, counts)
    except Exception as exc:
        local_error = exc
        payload = f"rank {rank} could not describe its arrays: {type(exc).__name__}: {exc}"
    names = sorted(arrays)
    gathered = comm.gather(payload, root=0)
    try:
        plan = _created(
            comm,
            path,
            gathered,
            lambda gathered: _create(
                path,
                gathered,
                step,
                size,
                extra_meta,
                distributed,
                alignment,
                block_size,
                parent,
                policy,
                uid,
                replicated,
                prepare,
            ),
        )
    except CheckpointError:
        if local_error is not None:  # this rank's own error, as it is; the others name it
            raise local_error from None
        raise
    if rank != 0 and list(plan["names"]) != names:
        raise CheckpointError(f"rank {rank} holds other arrays than rank 0")
    # Every rank's arrays have the names rank 0 planned (the plan checked them).
    before = _ranks_before(comm, len(tree_bytes), names, arrays, counts)
    incremental = plan["kind"] == INCREMENTAL
    uid = plan["uid"]
    extents, written, hashing = _rank_extents(
        plan, rank, names, arrays, tree_bytes, hashes, later, dirty, before, block_size
    )
    if incremental:
        assert parent is not None
        chain = (*parent.chain, (name, step, uid))
        chain_bytes = parent.chain_bytes + plan["delta_bytes"]
    else:
        chain, chain_bytes = ((name, step, uid),), 0
    state_bytes = plan["state_bytes"]
    state = ChainState(step, uid, block_size, size, mine, hashes, chain, chain_bytes, state_bytes)
    return Written(
        written + len(tree_bytes),
        plan["kind"],
        int(plan["dirty_blocks"]),
        int(plan["total_blocks"]),
        int(plan["data_bytes"]),
        hash_seconds,
        state,
        uid,
        tuple(extents),
        int(plan["data_bytes"]) + int(plan["tree_bytes"]),
        hashing,
        plan["full_reason"],
    )


def _block_hashes(
    arrays: dict[str, np.ndarray], hashes: dict[str, np.ndarray], block_size: int, defer: bool
) -> tuple[dict[str, np.ndarray], set[str]]:
    """Every array's block hashes: those given, the others computed now or (``defer``)
    left to compute while their bytes are written; and the paths left so."""
    later = set()
    for p, a in arrays.items():
        if p in hashes:
            continue
        if defer:
            nb = blocks.nblocks(a.size, blocks.block_elems(a.itemsize, block_size))
            hashes[p] = np.empty(nb, dtype=np.uint64)
            later.add(p)
        else:
            hashes[p] = blocks.block_hashes(a, block_size)
    return hashes, later


def _ranks_before(
    comm: Comm,
    tree_len: int,
    names: list[str],
    arrays: dict[str, np.ndarray],
    counts: dict[str, tuple[int, int, int]],
) -> np.ndarray:
    """This rank's place in every dataset: the sums of the counts of the ranks before it
    (an exclusive prefix sum): its tree's bytes, then per array (in ``names`` order) its
    blocks, dirty blocks, dirty elements, rows and elements."""
    mine_counts = [tree_len]
    for p in names:
        a = arrays[p]
        mine_counts += [*counts[p], a.shape[0] if a.ndim else 0, a.size]
    return comm.exscan_sum(np.asarray(mine_counts, dtype=np.int64))


def _created(
    comm: Comm,
    path: Path,
    gathered: list[Any] | None,
    create: Callable[[list[Any]], dict[str, Any]],
) -> dict[str, Any]:
    """Rank 0 creates the file (``create``); every rank gets what it must write, or
    raises alike what went wrong (rank 0 its own exception as it is)."""
    plan: dict[str, Any] | str | None = None
    failure: BaseException | None = None
    if comm.rank == 0:
        assert gathered is not None
        said = [g for g in gathered if isinstance(g, str)]  # a rank's own failure
        try:
            plan = said[0] if said else create(gathered)
        except CheckpointError as exc:  # the states do not fit one layout: said alike
            plan = str(exc)
        except Exception as exc:  # rank 0 raises it as it is (ENOSPC is explained so)
            plan = f"rank 0 could not create {path.name}: {type(exc).__name__}: {exc}"
            failure = exc
    plan = comm.bcast(plan)
    if isinstance(plan, str):
        if failure is not None:
            raise failure
        raise CheckpointError(plan)
    assert isinstance(plan, dict)
    return plan


def _rank_extents(
    plan: dict[str, Any],
    rank: int,
    names: list[str],
    arrays: dict[str, np.ndarray],
    tree_bytes: bytes,
    hashes: dict[str, np.ndarray],
    later: set[str],
    dirty: dict[str, np.ndarray] | None,
    before: np.ndarray,
    block_size: int,
) -> tuple[list[Extent], int, DeferredHashes | None]:
    """This rank's part of the created file: its extents (tree, checksum row, block
    hashes, array bytes or changed blocks), its array bytes, and the hashes still to
    compute while writing (``later``: the hash rows then come after the array bytes)."""
    incremental = plan["kind"] == INCREMENTAL
    extents: list[Extent] = []
    bases = plan["bases"]
    if tree_bytes:
        extents.append(Extent(bases["rank_tree"] + int(before[0]), memoryview(tree_bytes)))
    sums_row = np.zeros(len(names) + 1, dtype="<u8")
    hash_row = np.zeros(sum(hashes[p].size for p in names), dtype="<u8")

    def fill_rows() -> None:
        sums = [blocks.hashes_checksum(hashes[p]) for p in names]
        sums_row[:] = np.array(sums + [integrity.checksum(tree_bytes)], dtype="<u8")
        if hash_row.size:
            hash_row[:] = np.concatenate([hashes[p] for p in names])

    hash_extents = [Extent(bases["checksums"] + rank * sums_row.nbytes, _bytes(sums_row))]
    if hash_row.size:
        first_hash = sum(int(before[1 + 5 * j]) for j in range(len(names)))
        hash_extents.append(Extent(bases["block_hashes"] + 8 * first_hash, _bytes(hash_row)))
    hashers: dict[int, blocks.BlockHasher] = {}
    if not later:
        fill_rows()
        extents += hash_extents
    written = 0
    for j, p in enumerate(names):
        nb, ndirty, nelems, rows, elems = (int(x) for x in before[1 + 5 * j : 6 + 5 * j])
        data = np.ascontiguousarray(arrays[p])
        if incremental:
            assert dirty is not None
            written += _delta_extents(
                data, dirty[p], block_size, rank, bases[p], nelems, ndirty, extents
            )
            continue
        if not data.nbytes:  # no bytes: HDF5 allocates an empty dataset no storage
            continue
        if plan["layouts"][p] == "rows":
            offset = rows * (data.nbytes // data.shape[0])
        else:
            offset = elems * data.itemsize
        if p in later:  # the bytes written are the bytes hashed
            hashers[len(extents)] = blocks.BlockHasher(data, block_size, hashes[p])
        extents.append(Extent(bases[p]["data"] + offset, _bytes(data)))
        written += data.nbytes
    hashing = None
    if later:  # after the array bytes, once their hashes are complete
        hashing = DeferredHashes(hashers, len(extents), fill_rows)
        extents += hash_extents
    return extents, written, hashing


def _create(
    path: Path,
    gathered: list[Any],
    step: int,
    size: int,
    extra_meta: dict[str, Any] | None,
    distributed: Collection[str],
    alignment: tuple[int, int] | None,
    block_size: int,
    parent: ChainState | None,
    policy: ChainPolicy,
    uid: str | None,
    replicated: Collection[str],
    prepare: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Rank 0: plan the file from every rank's specs and counts (:func:`.plan.plan_file`),
    create it with all metadata and allocated, empty datasets; what every rank needs to
    write."""
    plan = plan_file(gathered, size, distributed, replicated, parent, policy)
    uid = uid or uuid.uuid4().hex
    options: dict[str, Any] = {
        "meta_block_size": meta_block_size(len(plan.layouts), plan.incremental)
    }
    if alignment is not None:
        options["alignment_threshold"], options["alignment_interval"] = alignment
    if prepare is not None:
        prepare(plan.state_bytes)
    attrs = _meta_attrs(plan, step, size, block_size, uid, parent, extra_meta)
    with h5py.File(path, "w", libver=LIBVER, **options) as f:
        bases = _datasets(f, plan, attrs, gathered, size)
    layouts = plan.layouts
    return {
        "names": [lay.path for lay in layouts],
        "layouts": {lay.path: lay.layout for lay in layouts},
        "kind": plan.kind,
        "full_reason": plan.why_full,
        "uid": uid,
        "bases": bases,
        "state_bytes": plan.state_bytes,
        "delta_bytes": plan.delta_bytes,
        "data_bytes": plan.data_bytes,
        "tree_bytes": int(plan.tree_offsets[-1]),
        "dirty_blocks": plan.dirty_blocks,
        "total_blocks": plan.total_blocks,
    }


def meta_block_size(arrays: int, incremental: bool) -> int:
    """HDF5's metadata block for a file of ``arrays`` arrays: large enough for every
    object header, so the metadata lies in one run at the start of the file and a cold
    restore reads it in one request (HDF5's default, 2 KiB, scatters it between the
    arrays' bytes: one disk access per spot). A power of two, at most 1 MiB; unused
    space at its end stays a hole in the file."""
    datasets = 4 + arrays * (2 if incremental else 1)
    need = META_BLOCK_BASE + META_BLOCK_PER_DATASET * datasets
    return min(1 << 20, max(META_BLOCK_MIN, 1 << (need - 1).bit_length()))


def _meta_attrs(
    plan: FilePlan,
    step: int,
    size: int,
    block_size: int,
    uid: str,
    parent: ChainState | None,
    extra_meta: dict[str, Any] | None,
) -> dict[str, Any]:
    """The attributes of ``/meta`` (docs/format.md), its creation time now."""
    layouts, incremental = plan.layouts, plan.incremental
    attrs: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "nranks": size,
        "time": time.time(),
        "checksum": integrity.ALGORITHM,
        "hpcckpt_version": __version__,
        "arrays": json.dumps([lay.path for lay in layouts]),
        ARRAY_INFO: json.dumps(
            [array_info(lay, incremental, block_size) for lay in layouts], separators=(",", ":")
        ),
        "kind": plan.kind,
        "uid": uid,
        "block_size": block_size,
        "state_bytes": plan.state_bytes,
        "data_bytes": plan.data_bytes,
        "total_blocks": plan.total_blocks,
        "dirty_blocks": plan.dirty_blocks,
    }
    if incremental:
        assert parent is not None
        for key, (ref_name, ref_step, ref_uid) in (
            ("parent", parent.chain[-1]),
            ("base", parent.chain[0]),
        ):
            attrs[key] = ref_name
            attrs[f"{key}_step"] = ref_step
            attrs[f"{key}_uid"] = ref_uid
        attrs["chain"] = json.dumps([list(ref) for ref in parent.chain])
        attrs["chain_length"] = len(parent.chain)
        attrs["chain_bytes"] = parent.chain_bytes + plan.delta_bytes
    attrs.update(extra_meta or {})
    return attrs


def _datasets(
    f: h5py.File, plan: FilePlan, attrs: dict[str, Any], gathered: list[Any], size: int
) -> dict[str, Any]:
    """Create ``/meta`` with ``attrs`` and every dataset, allocated and empty; the file
    offset of each dataset's bytes (per array: its data, and in a delta its index)."""
    layouts, incremental = plan.layouts, plan.incremental
    bases: dict[str, Any] = {}
    set_attrs(f.create_group(META), attrs)
    rt = _allocated(f, RANK_TREE, (int(plan.tree_offsets[-1]),), np.uint8)
    set_attrs(h5py.Dataset(rt), {"offsets": plan.tree_offsets})
    cs = _allocated(f, CHECKSUMS, (size, len(layouts) + 1), np.uint64)
    bh = _allocated(f, BLOCK_HASHES, (plan.total_blocks,), np.uint64)
    set_attrs(h5py.Dataset(bh), {"offsets": plan.hash_offsets})
    bases["rank_tree"], bases["checksums"] = _where(rt), _where(cs)
    bases["block_hashes"] = _where(bh)
    for lay in layouts:
        if incremental:
            elems = sum(g[3][lay.path][2] for g in gathered)
            d = _allocated(f, delta_name(lay.path), (elems,), lay.dtype)
            rows = sum(g[3][lay.path][1] for g in gathered)
            ix = _allocated(f, index_name(lay.path), (rows, 3), np.int64)
            bases[lay.path] = {"data": _where(d), "index": _where(ix)}
        else:
            d = _allocated(f, dataset_name(lay.path), lay.global_shape, lay.dtype)
            bases[lay.path] = {"data": _where(d)}
    return bases


#: Metadata bytes of the file and of one dataset, with room to spare (an FSDP file of
#: 32 arrays used 15 KiB), and the smallest block asked for.
META_BLOCK_BASE, META_BLOCK_PER_DATASET, META_BLOCK_MIN = 8192, 1024, 16384

_STR = h5py.h5t.py_create(h5py.string_dtype(), logical=True)


def set_attrs(obj: h5py.HLObject, attrs: dict[str, Any]) -> None:
    """Create the attributes of a new object with HDF5's own calls: the types h5py's
    ``obj.attrs[k] = v`` gives (UTF-8 variable-length strings, bool as h5py's enum), at
    about half its cost (h5py creates each under a temporary name and renames it),
    which a save pays per array. Other kinds of value go through h5py itself."""
    for key, value in attrs.items():
        if isinstance(value, str):
            data, tid = np.array(value, dtype=h5py.string_dtype()), _STR
        elif isinstance(value, (bool, int, float, np.generic, np.ndarray)):
            data = np.asarray(value)
            if data.dtype.kind not in "biuf":
                obj.attrs[key] = value
                continue
            tid = h5py.h5t.py_create(data.dtype)
        else:
            obj.attrs[key] = value
            continue
        if data.ndim == 0:
            space = h5py.h5s.create(h5py.h5s.SCALAR)
        else:
            space = h5py.h5s.create_simple(data.shape)
        h5py.h5a.create(obj.id, key.encode(), tid, space).write(data)


def _allocated(group: h5py.Group, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
    """A contiguous dataset whose storage is allocated now and never filled: its bytes
    have a file offset from the start, and only the ranks' own writes fill them.

    Made with HDF5's own calls (an ``h5py.h5d.DatasetID``) and the properties h5py's
    ``create_dataset`` would give it, at about half its cost, which a save pays per array.
    """
    space = h5py.h5s.create_simple(tuple(int(n) for n in shape))
    tid = h5py.h5t.py_create(np.dtype(dtype), logical=True)
    return h5py.h5d.create(group.id, name.encode(), tid, space, dcpl=_DCPL, lcpl=_LCPL)


def _dataset_create_plist() -> Any:
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)
    return dcpl


def _link_create_plist() -> Any:
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    lcpl.set_char_encoding(h5py.h5t.CSET_UTF8)
    return lcpl


_DCPL, _LCPL = _dataset_create_plist(), _link_create_plist()


def _where(d: Any) -> int:
    """Byte offset of a dataset's data in its file (0 for one with no bytes: never used)."""
    offset = d.get_offset()
    return 0 if offset is None else int(offset)


def _bytes(data: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def _delta_extents(
    array: np.ndarray,
    dirty: np.ndarray,
    block_size: int,
    rank: int,
    bases: dict[str, int],
    first: int,
    row: int,
    extents: list[Extent],
) -> int:
    """Append this rank's changed blocks of one array, and their index rows, to
    ``extents``; the bytes of those blocks.

    ``first``/``row``: the dirty elements and dirty blocks of the ranks before this one
    (rank r's blocks follow those of ranks 0..r-1 in both datasets).
    """
    if dirty.size == 0:
        return 0
    elems = blocks.block_elems(array.dtype.itemsize, block_size)
    sizes = np.minimum(elems, array.size - dirty.astype(np.int64) * elems)
    starts = first + np.cumsum(sizes) - sizes
    index = np.column_stack(
        [np.full(dirty.size, rank, dtype=np.int64), dirty.astype(np.int64), starts]
    ).astype("<i8")
    extents.append(Extent(bases["index"] + row * 3 * 8, _bytes(index)))
    flat = np.ascontiguousarray(array).reshape(-1)
    pos = first
    for b0, b1 in blocks.runs(dirty):
        e0, e1 = b0 * elems, min(b1 * elems, array.size)
        extents.append(Extent(bases["data"] + pos * array.itemsize, _bytes(flat[e0:e1])))
        pos += e1 - e0
    return (pos - first) * array.dtype.itemsize
