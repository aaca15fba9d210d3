"""Write one checkpoint = one HDF5 file, by all ranks at once through MPI-IO.

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
  xxh3-64 of each rank's bytes of each array, last column its tree).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from mpi4py import MPI

from hpcckpt._version import __version__
from hpcckpt.store import integrity
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.reader import FORMAT, FORMAT_VERSION, dataset_name
from hpcckpt.store.state_tree import ArraySpec

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ArrayLayout",
    "CheckpointError",
    "CorruptCheckpoint",
    "plan_layouts",
    "write_file",
]


@dataclass(frozen=True)
class ArrayLayout:
    path: str
    dtype: np.dtype
    layout: str  # "rows" or "flat"
    shapes: list[tuple[int, ...]]
    offsets: list[int]  # nranks + 1
    distributed: bool = False

    @property
    def global_shape(self) -> tuple[int, ...]:
        if self.layout == "rows":
            return (self.offsets[-1], *self.shapes[0][1:])
        return (self.offsets[-1],)


def plan_layouts(
    per_rank: list[list[ArraySpec]], distributed: Collection[str] = ()
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
) -> int:
    """Collectively write one checkpoint file at ``path``; returns this rank's bytes written.

    ``hints`` are MPI-IO hints (an ``MPI.Info``) and ``alignment`` the HDF5
    (threshold, interval) in bytes, both from :mod:`hpcckpt.store.filesystem`.
    Raises CheckpointError on every rank alike when the ranks' states do not fit one
    layout. The caller makes the file durable and commits it.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    tree_bytes = json.dumps(tree, separators=(",", ":"), allow_nan=True).encode()
    specs = [ArraySpec(p, a.dtype.str, tuple(a.shape)) for p, a in arrays.items()]
    gathered = comm.allgather((specs, len(tree_bytes)))
    layouts = plan_layouts([g[0] for g in gathered], distributed)
    tree_offsets = np.concatenate([[0], np.cumsum([g[1] for g in gathered])]).astype(np.int64)

    sums = [integrity.checksum(arrays[lay.path]) for lay in layouts]
    sums = np.array(sums + [integrity.checksum(tree_bytes)], dtype=np.uint64)
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
            meta.attrs["format_version"] = FORMAT_VERSION
            meta.attrs["step"] = step
            meta.attrs["nranks"] = size
            meta.attrs["time"] = comm.bcast(time.time() if rank == 0 else None)
            meta.attrs["checksum"] = integrity.ALGORITHM
            meta.attrs["hpcckpt_version"] = __version__
            meta.attrs["arrays"] = json.dumps([lay.path for lay in layouts])
            for key, value in (extra_meta or {}).items():
                meta.attrs[key] = value
            rt = meta.create_dataset(
                "rank_tree", shape=(int(tree_offsets[-1]),), dtype=np.uint8, fill_time="never"
            )
            rt.attrs["offsets"] = tree_offsets
            cs = meta.create_dataset(
                "checksums", shape=(size, len(layouts) + 1), dtype=np.uint64, fill_time="never"
            )
            dsets = []
            for lay in layouts:
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
                dsets.append(d)

            lo, hi = int(tree_offsets[rank]), int(tree_offsets[rank + 1])
            if hi > lo:
                rt[lo:hi] = np.frombuffer(tree_bytes, dtype=np.uint8)
            cs[rank] = sums
            for lay, d in zip(layouts, dsets, strict=True):
                lo, hi = lay.offsets[rank], lay.offsets[rank + 1]
                if hi == lo:
                    continue
                data = np.ascontiguousarray(arrays[lay.path])
                d[lo:hi] = data if lay.layout == "rows" else data.reshape(-1)
                written += data.nbytes
            f.flush()
    finally:
        if info != MPI.INFO_NULL:
            info.Free()
    return written + len(tree_bytes)


def file_bytes(path: Path) -> int:
    return os.stat(path).st_size
