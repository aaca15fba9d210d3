"""One checkpoint = one HDF5 file written by all ranks at once through MPI-IO.

Layout (documented for users in docs/format.md):

- ``/state/<path>``: one dataset per array path. When every rank's array has at
  least one dimension and the same trailing shape, the dataset is the ranks'
  arrays stacked along axis 0 (``layout="rows"``; a domain-decomposed field is then
  the global field). Otherwise the ranks' C-order elements are concatenated
  (``layout="flat"``). Attribute ``rank_offsets`` (nranks + 1 integers) gives each
  rank's range along axis 0; ``rank_shapes`` (JSON) each rank's shape.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from mpi4py import MPI

from hpcckpt._version import __version__
from hpcckpt.store import integrity
from hpcckpt.store.state_tree import ArraySpec

FORMAT = "hpcckpt"
FORMAT_VERSION = 1


class CheckpointError(Exception):
    """A checkpoint cannot be written or does not match the application."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file failed a structural or checksum check."""


@dataclass(frozen=True)
class ArrayLayout:
    path: str
    dtype: np.dtype
    layout: str  # "rows" or "flat"
    shapes: list[tuple[int, ...]]
    offsets: list[int]  # nranks + 1

    @property
    def global_shape(self) -> tuple[int, ...]:
        if self.layout == "rows":
            return (self.offsets[-1], *self.shapes[0][1:])
        return (self.offsets[-1],)


def plan_layouts(per_rank: list[list[ArraySpec]]) -> list[ArrayLayout]:
    """Decide each array's dataset from every rank's specs; names the array on mismatch."""
    first = {s.path: s for s in per_rank[0]}
    for rank, specs in enumerate(per_rank):
        names = {s.path for s in specs}
        if names != set(first):
            diff = sorted(names ^ set(first))
            raise CheckpointError(
                f"ranks hold different arrays: rank 0 and rank {rank} differ in {diff}; "
                "every rank must save the same array names"
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
        sizes = [s[0] if rows else int(np.prod(s, dtype=np.int64)) for s in shapes]
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist()
        layouts.append(
            ArrayLayout(path, np.dtype(specs[0].dtype), "rows" if rows else "flat", shapes, offsets)
        )
    return layouts


def _dataset_name(path: str) -> str:
    return "state/" + path


def write_file(
    path: Path,
    comm: MPI.Comm,
    step: int,
    tree: Any,
    arrays: dict[str, np.ndarray],
    extra_meta: dict[str, Any] | None = None,
) -> int:
    """Collectively write one checkpoint file at ``path``; returns this rank's bytes written.

    Raises CheckpointError on every rank alike when the ranks' states do not fit one
    layout. The caller makes the file durable and commits it.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    tree_bytes = json.dumps(tree, separators=(",", ":"), allow_nan=True).encode()
    specs = [ArraySpec(p, a.dtype.str, tuple(a.shape)) for p, a in arrays.items()]
    gathered = comm.allgather((specs, len(tree_bytes)))
    layouts = plan_layouts([g[0] for g in gathered])
    tree_offsets = np.concatenate([[0], np.cumsum([g[1] for g in gathered])]).astype(np.int64)

    sums = np.array(
        [integrity.checksum(arrays[lay.path]) for lay in layouts] + [integrity.checksum(tree_bytes)],
        dtype=np.uint64,
    )
    written = 0
    with h5py.File(path, "w", driver="mpio", comm=comm) as f:
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
                _dataset_name(lay.path), shape=lay.global_shape, dtype=lay.dtype, fill_time="never"
            )
            d.attrs["layout"] = lay.layout
            d.attrs["rank_offsets"] = np.asarray(lay.offsets, dtype=np.int64)
            d.attrs["rank_shapes"] = json.dumps([list(s) for s in lay.shapes])
            dsets.append(d)

        lo, hi = int(tree_offsets[rank]), int(tree_offsets[rank + 1])
        if hi > lo:
            rt[lo:hi] = np.frombuffer(tree_bytes, dtype=np.uint8)
        cs[rank] = sums
        for lay, d in zip(layouts, dsets):
            lo, hi = lay.offsets[rank], lay.offsets[rank + 1]
            if hi == lo:
                continue
            data = np.ascontiguousarray(arrays[lay.path])
            d[lo:hi] = data if lay.layout == "rows" else data.reshape(-1)
            written += data.nbytes
        f.flush()
    return written + len(tree_bytes)


def read_file(path: Path, comm: MPI.Comm) -> tuple[Any, dict[str, np.ndarray], dict[str, Any]]:
    """Read and verify this rank's part of a checkpoint: (tree, arrays, meta attributes).

    Every rank opens the file on its own (no collective calls), so a failure on one
    rank cannot hang the others. Raises CorruptCheckpoint when the file is not a
    readable hpcckpt checkpoint or a checksum differs, CheckpointError when it was
    written by a different number of ranks.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        with h5py.File(path, "r") as f:
            meta = f["meta"]
            attrs = {k: meta.attrs[k] for k in meta.attrs}
            if attrs.get("format") != FORMAT:
                raise CorruptCheckpoint(f"{path.name}: not an hpcckpt checkpoint")
            if int(attrs["format_version"]) > FORMAT_VERSION:
                raise CheckpointError(
                    f"{path.name}: format version {attrs['format_version']} is newer than "
                    f"this hpcckpt understands ({FORMAT_VERSION}); upgrade hpcckpt"
                )
            nranks = int(attrs["nranks"])
            if nranks != size:
                raise CheckpointError(
                    f"{path.name} was written by {nranks} ranks; this run has {size}. "
                    "Restart with the same number of ranks"
                )
            names = json.loads(attrs["arrays"])
            sums = np.asarray(meta["checksums"][rank], dtype=np.uint64)
            if sums.shape != (len(names) + 1,):
                raise CorruptCheckpoint(f"{path.name}: checksum table has the wrong shape")
            offsets = np.asarray(meta["rank_tree"].attrs["offsets"], dtype=np.int64)
            tree_bytes = meta["rank_tree"][int(offsets[rank]) : int(offsets[rank + 1])].tobytes()
            if integrity.checksum(tree_bytes) != int(sums[-1]):
                raise CorruptCheckpoint(f"{path.name}: rank {rank}'s state tree fails its checksum")
            tree = json.loads(tree_bytes)
            arrays: dict[str, np.ndarray] = {}
            for i, name in enumerate(names):
                d = f[_dataset_name(name)]
                offs = np.asarray(d.attrs["rank_offsets"], dtype=np.int64)
                shape = tuple(json.loads(d.attrs["rank_shapes"])[rank])
                lo, hi = int(offs[rank]), int(offs[rank + 1])
                if hi > lo:
                    data = d[lo:hi]
                else:
                    data = np.empty(0, dtype=d.dtype)
                data = data.reshape(shape)
                if integrity.checksum(data) != int(sums[i]):
                    raise CorruptCheckpoint(
                        f"{path.name}: array {name!r} on rank {rank} fails its checksum"
                    )
                arrays[name] = data
    except (CheckpointError, CorruptCheckpoint):
        raise
    except (OSError, KeyError, ValueError, TypeError, IndexError) as exc:
        raise CorruptCheckpoint(f"{path.name}: unreadable ({type(exc).__name__}: {exc})") from exc
    return tree, arrays, attrs


def file_bytes(path: Path) -> int:
    return os.stat(path).st_size
