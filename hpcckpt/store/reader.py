"""Read one checkpoint file with plain h5py, in one process, validating before trusting it.

No MPI here: restore opens the file on every rank independently (so a bad file on
one rank cannot hang the others), and the command-line tools read checkpoints
without mpirun. Every attribute that sizes a read (rank offsets, rank shapes, the
number of ranks) is checked against the dataset shapes and the file size first, so
a crafted or damaged file raises :class:`CorruptCheckpoint` instead of allocating
huge buffers; every byte handed back has passed its xxh3-64 checksum.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcckpt.store import integrity
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.state_tree import ARRAY_KINDS, array_paths

FORMAT = "hpcckpt"
FORMAT_VERSION = 1
#: More ranks than this in a file is taken as damage, not as a real run.
MAX_RANKS = 1 << 24
_MAX_DIM = 1 << 62


def dataset_name(path: str) -> str:
    """The HDF5 dataset of an array path (``state/<escaped keys joined by '/'>``)."""
    return "state/" + path


@dataclass(frozen=True)
class ArrayInfo:
    """One array of a checkpoint: its dataset and how the writing ranks' parts lie in it."""

    name: str
    column: int  # column of the checksum table
    dtype: np.dtype
    layout: str  # "rows": ranks' arrays stacked along axis 0; "flat": C-order elements
    shape: tuple[int, ...]  # the dataset's shape (the global array for "rows")
    rank_offsets: tuple[int, ...]  # nranks + 1: rank r holds [offsets[r], offsets[r+1]) of axis 0
    rank_shapes: tuple[tuple[int, ...], ...]
    distributed: bool  # declared distributed along axis 0 by the application

    @property
    def trailing(self) -> tuple[int, ...]:
        return self.shape[1:]

    def rank_bytes(self, rank: int) -> int:
        return int(np.prod(self.rank_shapes[rank], dtype=np.int64)) * self.dtype.itemsize


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _int(value: Any, what: str, lo: int = 0, hi: int = _MAX_DIM) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise CorruptCheckpoint(f"{what} is not an integer ({value!r})")
    if not lo <= int(value) <= hi:
        raise CorruptCheckpoint(f"{what} = {int(value)} is outside [{lo}, {hi}]")
    return int(value)


class CheckpointReader:
    """An open, structurally validated checkpoint file. Use as a context manager."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._file_size = os.stat(self.path).st_size
            self._f = h5py.File(self.path, "r")
        except OSError as exc:
            raise CorruptCheckpoint(f"{self.path.name}: unreadable ({exc})") from exc
        try:
            self._validate()
        except CheckpointError:
            self.close()
            raise
        except (OSError, KeyError, ValueError, TypeError, IndexError, RecursionError) as exc:
            self.close()
            raise CorruptCheckpoint(
                f"{self.path.name}: unreadable ({type(exc).__name__}: {exc})"
            ) from exc

    # -- structure -----------------------------------------------------------------------
    def _corrupt(self, why: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{self.path.name}: {why}")

    def _dataset(self, name: str) -> h5py.Dataset:
        """A dataset whose stored bytes match its shape and fit in the file (no filters)."""
        d = self._f.get(name)
        if not isinstance(d, h5py.Dataset):
            raise self._corrupt(f"dataset {name!r} is missing")
        if d.id.get_create_plist().get_nfilters() != 0:
            raise self._corrupt(f"dataset {name!r} uses HDF5 filters; hpcckpt never writes them")
        if any(n < 0 for n in d.shape):
            raise self._corrupt(f"dataset {name!r} has a negative extent {d.shape}")
        nbytes = int(np.prod(d.shape, dtype=object)) * d.dtype.itemsize
        stored = d.id.get_storage_size()
        if nbytes > self._file_size or (nbytes and stored < nbytes):
            raise self._corrupt(
                f"dataset {name!r} claims {nbytes} bytes ({d.dtype}{list(d.shape)}) but the "
                f"file stores {stored} of them in a {self._file_size}-byte file"
            )
        return d

    def _validate(self) -> None:
        meta = self._f.get("meta")
        if not isinstance(meta, h5py.Group):
            raise self._corrupt("not an hpcckpt checkpoint (no /meta group)")
        self.attrs: dict[str, Any] = {k: _plain(meta.attrs[k]) for k in meta.attrs}
        if self.attrs.get("format") != FORMAT:
            raise self._corrupt("not an hpcckpt checkpoint (meta.attrs['format'])")
        version = _int(self.attrs.get("format_version"), "format_version", 1, 1 << 30)
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{self.path.name}: format version {version} is newer than this hpcckpt "
                f"understands ({FORMAT_VERSION}); upgrade hpcckpt"
            )
        self.step = _int(self.attrs.get("step"), "step")
        self.nranks = n = _int(self.attrs.get("nranks"), "nranks", 1, MAX_RANKS)
        self.time = float(self.attrs.get("time", 0.0))
        names = json.loads(self.attrs.get("arrays", "null"))
        if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
            raise self._corrupt("meta.attrs['arrays'] is not a JSON list of array paths")
        if len(set(names)) != len(names):
            raise self._corrupt("meta.attrs['arrays'] lists an array twice")

        cs = self._dataset("meta/checksums")
        if cs.shape != (n, len(names) + 1) or cs.dtype != np.uint64:
            raise self._corrupt(
                f"checksum table is {cs.dtype}{list(cs.shape)}, expected uint64[{n}, "
                f"{len(names) + 1}] for {n} ranks and {len(names)} arrays"
            )
        self.checksums = np.asarray(cs[...], dtype=np.uint64)

        rt = self._dataset("meta/rank_tree")
        if rt.ndim != 1 or rt.dtype != np.uint8:
            raise self._corrupt(f"meta/rank_tree is {rt.dtype}{list(rt.shape)}, expected uint8[n]")
        self._tree_offsets = self._offsets(rt.attrs.get("offsets"), n, rt.shape[0], "rank_tree")

        self.arrays: dict[str, ArrayInfo] = {}
        for column, name in enumerate(names):
            self.arrays[name] = self._array_info(name, column, n)

    def _offsets(self, raw: Any, n: int, extent: int, what: str) -> tuple[int, ...]:
        offs = np.asarray(raw if raw is not None else [])
        if offs.shape != (n + 1,) or offs.dtype.kind not in "iu":
            raise self._corrupt(f"{what}: offsets must be {n + 1} integers, found {offs!r:.80}")
        offs = offs.astype(np.int64)
        if offs[0] != 0 or offs[-1] != extent or np.any(np.diff(offs) < 0):
            raise self._corrupt(
                f"{what}: offsets {offs.tolist()[:8]}... must rise from 0 to the dataset's "
                f"extent {extent}"
            )
        return tuple(int(x) for x in offs)

    def _array_info(self, name: str, column: int, n: int) -> ArrayInfo:
        d = self._dataset(dataset_name(name))
        what = f"array {name!r}"
        if d.dtype.kind not in ARRAY_KINDS or d.dtype.fields is not None:
            raise self._corrupt(f"{what} has dtype {d.dtype}, not a numeric or bool dtype")
        layout = _plain(d.attrs.get("layout"))
        if layout not in ("rows", "flat") or d.ndim < 1 or (layout == "flat" and d.ndim != 1):
            raise self._corrupt(f"{what}: layout {layout!r} does not fit shape {d.shape}")
        offs = self._offsets(d.attrs.get("rank_offsets"), n, d.shape[0], what)
        shapes = json.loads(_plain(d.attrs.get("rank_shapes", "null")))
        if not isinstance(shapes, list) or len(shapes) != n:
            raise self._corrupt(f"{what}: rank_shapes must list {n} shapes")
        rank_shapes = []
        for r, shape in enumerate(shapes):
            if not isinstance(shape, list):
                raise self._corrupt(f"{what}: rank_shapes[{r}] is not a list")
            dims = tuple(_int(x, f"{what}: rank_shapes[{r}]") for x in shape)
            extent = offs[r + 1] - offs[r]
            if layout == "rows":
                ok = len(dims) == d.ndim and dims[0] == extent and dims[1:] == d.shape[1:]
            else:
                ok = int(np.prod(dims, dtype=object)) == extent
            if not ok:
                raise self._corrupt(
                    f"{what}: rank {r}'s shape {list(dims)} does not match its extent "
                    f"[{offs[r]}, {offs[r + 1]}) of the {layout} dataset {list(d.shape)}"
                )
            rank_shapes.append(dims)
        distributed = bool(_plain(d.attrs.get("distributed", False)))
        if distributed and layout != "rows":
            raise self._corrupt(f"{what} is marked distributed but its layout is {layout}")
        return ArrayInfo(
            name, column, d.dtype, layout, tuple(d.shape), offs, tuple(rank_shapes), distributed
        )

    # -- data ----------------------------------------------------------------------------
    def tree_bytes(self, rank: int) -> bytes:
        """Rank ``rank``'s JSON state tree, checksum verified."""
        lo, hi = self._tree_offsets[rank], self._tree_offsets[rank + 1]
        raw = self._f["meta/rank_tree"][lo:hi].tobytes() if hi > lo else b""
        if integrity.checksum(raw) != int(self.checksums[rank, -1]):
            raise self._corrupt(f"rank {rank}'s state tree fails its checksum")
        return raw

    def tree(self, rank: int) -> Any:
        """Rank ``rank``'s state tree, verified, whose arrays are exactly this file's arrays."""
        try:
            tree = json.loads(self.tree_bytes(rank))
            paths = list(array_paths(tree))
        except (ValueError, RecursionError, AttributeError, TypeError, KeyError) as exc:
            raise self._corrupt(f"rank {rank}'s state tree is not valid ({exc})") from exc
        if sorted(paths) != sorted(self.arrays):
            raise self._corrupt(f"rank {rank}'s state tree names other arrays than the file holds")
        return tree

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of a "rows" array, read as one hyperslab and verified.

        The read widens to whole slices of the writing ranks that overlap the range,
        because checksums are per writing rank.
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
        data = self._dataset(dataset_name(name))[start:stop]
        for r in owners:
            part = data[offs[r] - start : offs[r + 1] - start]
            if integrity.checksum(part) != int(self.checksums[r, info.column]):
                raise self._corrupt(f"array {name!r} of writing rank {r} fails its checksum")
        return data[lo - start : hi - start]

    def rank_array(self, name: str, rank: int) -> np.ndarray:
        """The array ``name`` exactly as rank ``rank`` saved it, verified."""
        info = self.arrays[name]
        lo, hi = info.rank_offsets[rank], info.rank_offsets[rank + 1]
        if info.layout == "rows":
            return self.rows(name, lo, hi).reshape(info.rank_shapes[rank])
        raw = self._dataset(dataset_name(name))[lo:hi] if hi > lo else np.empty(0, info.dtype)
        if integrity.checksum(raw) != int(self.checksums[rank, info.column]):
            raise self._corrupt(f"array {name!r} of rank {rank} fails its checksum")
        return raw.reshape(info.rank_shapes[rank])

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
                try:
                    self.rank_array(name, r)
                except CheckpointError as exc:
                    problems.append(str(exc))
                except (OSError, ValueError) as exc:
                    problems.append(f"{self.path.name}: array {name!r} of rank {r}: {exc}")
        return problems

    def replicated(self, name: str) -> bool:
        """Whether every rank saved the same shape and bytes (equal checksums) for ``name``."""
        info = self.arrays[name]
        col = self.checksums[:, info.column]
        return len(set(info.rank_shapes)) == 1 and bool(np.all(col == col[0]))

    def close(self) -> None:
        f = getattr(self, "_f", None)
        if f is not None and f.id.valid:
            f.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
