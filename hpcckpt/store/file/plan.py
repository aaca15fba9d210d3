"""Where each rank's bytes lie in a checkpoint file: pure planning, no HDF5, no MPI.

Each rank says what it holds (:func:`array_specs`) and how many blocks of each array it
writes (:func:`rank_counts`); from every rank's, :func:`plan_layouts` decides one
dataset per array path (the ranks' arrays stacked along axis 0, or their elements
concatenated; a DTensor's pieces checked to fill its global array once) and
:func:`plan_file` the file's kind and sizes. :mod:`.writer` creates the file so planned
(docs/format.md). Every rank can run the same plan on the same gathered specs, so a
state that does not fit one layout is refused alike everywhere.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file.format import FULL, INCREMENTAL
from hpcckpt.store.io import blocks
from hpcckpt.store.io.blocks import ChainPolicy, ChainState
from hpcckpt.store.tree.queries import dtensor_pieces, tensor_dtypes

__all__ = [
    "ArrayLayout",
    "ArraySpec",
    "FilePlan",
    "array_info",
    "array_specs",
    "plan_file",
    "plan_layouts",
    "rank_counts",
]


@dataclass(frozen=True)
class ArraySpec:
    """What one rank holds under one array path."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    torch_dtype: str = ""  # the tensor's torch dtype, "" for a numpy array
    #: A DTensor's global shape (None for anything else), and the offset of this rank's
    #: piece in it (None when another rank stores the same box: a replica's stand-in).
    global_shape: tuple[int, ...] | None = None
    offset: tuple[int, ...] | None = None


def array_specs(tree: Any, arrays: dict[str, np.ndarray]) -> list[ArraySpec]:
    """This rank's spec of each array of an encoded state (its tree and its arrays)."""
    torch_dtypes = tensor_dtypes(tree)
    pieces = dtensor_pieces(tree)
    specs = []
    for p, a in arrays.items():
        piece = pieces.get(p)
        if piece is None:
            specs.append(ArraySpec(p, a.dtype.str, tuple(a.shape), torch_dtypes.get(p, "")))
            continue
        offset = tuple(piece["offset"]) if piece["holder"] else None
        specs.append(
            ArraySpec(
                p, a.dtype.str, tuple(a.shape), torch_dtypes[p], tuple(piece["shape"]), offset
            )
        )
    return specs


def rank_counts(
    arrays: dict[str, np.ndarray],
    hashes: dict[str, np.ndarray],
    dirty: dict[str, np.ndarray] | None,
    block_size: int,
) -> dict[str, tuple[int, int, int]]:
    """{path: (blocks, dirty blocks, dirty elements)} of this rank (``dirty`` None: a
    full file, every block written)."""
    counts = {}
    for p, a in arrays.items():
        nb = hashes[p].size
        d = dirty[p] if dirty is not None else np.arange(nb)
        counts[p] = (
            nb,
            d.size,
            blocks.dirty_elems(d, blocks.block_elems(a.itemsize, block_size), a.size),
        )
    return counts


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
    #: A DTensor: its global shape and each rank's offset in it (None: a replica's stand-in).
    dtensor: tuple[tuple[int, ...], list[tuple[int, ...] | None]] | None = None

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
    by_path = [{s.path: s for s in specs} for specs in per_rank]
    first = by_path[0]
    for rank, specs in enumerate(by_path):
        if specs.keys() != first.keys():
            diff = sorted(specs.keys() ^ first.keys())
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
        specs = [rank_specs[path] for rank_specs in by_path]
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
        pieces = _pieces(path, specs, shapes, path in distributed or path in replicated)
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
                pieces,
            )
        )
    return layouts


def _pieces(
    path: str, specs: list[ArraySpec], shapes: list[tuple[int, ...]], declared: bool
) -> tuple[tuple[int, ...], list[tuple[int, ...] | None]] | None:
    """A DTensor's global shape and each rank's offset (None for a replica's stand-in),
    checked: every rank holds it, its pieces lie inside it and fill it once."""
    kinds = {s.global_shape for s in specs}
    if kinds == {None}:
        return None
    if None in kinds or len(kinds) != 1:
        raise CheckpointError(
            f"array {path!r} is a DTensor on some ranks and not on others, or of different "
            f"global shapes ({sorted(map(str, kinds))}); save the same DTensor on every rank"
        )
    if declared:
        raise CheckpointError(
            f"array {path!r} is a DTensor: its placements say how it is split; do not "
            "declare it distributed or replicated"
        )
    shape = specs[0].global_shape
    assert shape is not None
    filled = 0
    for rank, (spec, held) in enumerate(zip(specs, shapes, strict=True)):
        if spec.offset is None:
            continue
        inside = len(spec.offset) == len(shape) == len(held) and all(
            0 <= o and o + n <= g for o, n, g in zip(spec.offset, held, shape, strict=True)
        )
        if not inside:
            raise CheckpointError(
                f"DTensor {path!r}: rank {rank}'s shard {list(held)} at {list(spec.offset)} "
                f"does not lie inside the global shape {list(shape)}"
            )
        filled += int(np.prod(held, dtype=np.int64))
    if filled != int(np.prod(shape, dtype=np.int64)):
        raise CheckpointError(
            f"DTensor {path!r}: the ranks' shards hold {filled} elements, the global shape "
            f"{list(shape)} has {int(np.prod(shape, dtype=np.int64))}; every element must "
            "be stored once"
        )
    return shape, [s.offset for s in specs]


@dataclass(frozen=True)
class FilePlan:
    """One file planned from every rank's specs and counts: each array's dataset, where
    each rank's tree and block hashes lie, and whether it is a delta."""

    layouts: list[ArrayLayout]
    #: nranks + 1: where each rank's JSON state tree starts in ``rank_tree``.
    tree_offsets: np.ndarray
    #: The block hash table's segments, rank-major, one per (rank, array).
    hash_offsets: np.ndarray
    why_full: str | None  # why not a delta (:meth:`ChainPolicy.why_full`); None: a delta
    state_bytes: int  # the global state's array bytes
    delta_bytes: int  # the changed blocks' bytes, over all ranks
    data_bytes: int  # the array bytes this file holds (the delta's, or the state's)
    total_blocks: int
    dirty_blocks: int  # blocks this file holds

    @property
    def incremental(self) -> bool:
        return self.why_full is None

    @property
    def kind(self) -> str:
        return INCREMENTAL if self.incremental else FULL


def plan_file(
    gathered: list[Any],
    size: int,
    distributed: Collection[str],
    replicated: Collection[str],
    parent: ChainState | None,
    policy: ChainPolicy,
) -> FilePlan:
    """The plan of one file from what every rank sent (``(specs, tree bytes, fits the
    parent, rank_counts)`` per rank); CheckpointError when the states do not fit one
    layout."""
    layouts = plan_layouts([g[0] for g in gathered], distributed, replicated)
    tree_offsets = np.concatenate([[0], np.cumsum([g[1] for g in gathered])]).astype(np.int64)
    state_bytes = sum(
        int(np.prod(lay.global_shape, dtype=np.int64)) * lay.dtype.itemsize for lay in layouts
    )
    delta_bytes = sum(g[3][lay.path][2] * lay.dtype.itemsize for g in gathered for lay in layouts)
    fits = all(g[2] for g in gathered)
    why_full = policy.why_full(parent, fits, delta_bytes, state_bytes, len(layouts), size)
    nblk = [g[3][lay.path][0] for g in gathered for lay in layouts]
    hash_offsets = np.concatenate([[0], np.cumsum(nblk, dtype=np.int64)]).astype(np.int64)
    total_blocks = int(hash_offsets[-1])
    if why_full is None:
        dirty_blocks = sum(g[3][lay.path][1] for g in gathered for lay in layouts)
        data_bytes = delta_bytes
    else:
        dirty_blocks, data_bytes = total_blocks, state_bytes
    return FilePlan(
        layouts,
        tree_offsets,
        hash_offsets,
        why_full,
        state_bytes,
        delta_bytes,
        data_bytes,
        total_blocks,
        dirty_blocks,
    )


def array_info(lay: ArrayLayout, incremental: bool, block_size: int) -> dict[str, Any]:
    """One array's entry of ``meta.attrs['array_info']``: how the ranks' parts lie in its
    dataset (in a delta, also the array's global shape and elements per block)."""
    described: dict[str, Any] = {
        "layout": lay.layout,
        "rank_offsets": lay.offsets,  # Python ints (plan_layouts), as JSON takes them
        "rank_shapes": lay.shapes,
        "distributed": bool(lay.distributed),
    }
    if incremental:
        described["shape"] = lay.global_shape
        described["block_elems"] = blocks.block_elems(lay.dtype.itemsize, block_size)
    if lay.torch_dtype:
        described["torch_dtype"] = lay.torch_dtype
    if lay.replicated:
        described["replicated"] = True
    if lay.dtensor is not None:
        shape, offsets = lay.dtensor
        described["dtensor"] = {
            "shape": list(shape),
            "offsets": [None if o is None else list(o) for o in offsets],
        }
    return described
