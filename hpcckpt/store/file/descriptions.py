"""How a checkpoint file describes its arrays, read and checked before it sizes any read.

Format version 4 describes every array (its layout, the ranks' offsets and shapes) in
one JSON attribute of ``/meta``, ``array_info``, where versions 1-3 put 4-6 attributes on
each array's dataset: HDF5 costs about as much per attribute as per dataset, and a model
holds thousands of arrays. Both are normalized here into one :class:`ArrayInfo`, every
value checked against the dataset's shape, so a crafted description raises
:class:`CorruptCheckpoint` instead of allocating huge buffers. The helpers that check
attribute values (:func:`integer`, :func:`offsets`) serve the reader's other metadata too.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.file.format import ARRAY_ATTRS, ARRAY_INFO, MAX_DIM
from hpcckpt.store.tree.state_tree import ARRAY_KINDS

#: Rank counts up to which a description's per-rank lists are checked in plain Python:
#: numpy's fixed cost per call (tens of microseconds) is more than the loop's at a few
#: ranks, and a restore checks every array's lists before any rank reads.
FEW_RANKS = 64


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
    torch_dtype: str = ""  # a torch tensor's dtype (format version 3), "" for numpy
    replicated: bool = False  # rank 0's copy is every rank's value (format version 3)
    #: A DTensor's global shape (None for other arrays), and where each writing rank's
    #: piece lies in it (None for a rank that stored no piece: a replica's stand-in).
    dtensor_shape: tuple[int, ...] | None = None
    piece_offsets: tuple[tuple[int, ...] | None, ...] = ()

    def holders(self) -> list[int]:
        """The writing ranks that stored a piece of a DTensor."""
        return [r for r, o in enumerate(self.piece_offsets) if o is not None]

    @property
    def trailing(self) -> tuple[int, ...]:
        return self.shape[1:]

    def rank_bytes(self, rank: int) -> int:
        return self.rank_elems(rank) * self.dtype.itemsize

    def rank_elems(self, rank: int) -> int:
        return int(np.prod(self.rank_shapes[rank], dtype=np.int64))

    def same_layout(self, other: ArrayInfo) -> bool:
        return (self.dtype, self.layout, self.shape, self.rank_offsets, self.rank_shapes) == (
            other.dtype,
            other.layout,
            other.shape,
            other.rank_offsets,
            other.rank_shapes,
        )


def _corrupt(path: Path, why: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{path.name}: {why}", culprit=path)


def attributes(obj: h5py.HLObject, names: frozenset[str] | None = None) -> dict[str, Any]:
    """An object's attributes (those in ``names`` when given) as read from the file:
    listed once, each read once (a lookup by name searches them, ``.get`` twice)."""
    attrs = obj.attrs
    return {k: attrs[k] for k in attrs if names is None or k in names}


def plain(value: Any) -> Any:
    """An attribute's value as plain Python: text for bytes, numbers and lists for numpy."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def integer(value: Any, what: str, lo: int = 0, hi: int = MAX_DIM) -> int:
    """``value`` as an int in ``[lo, hi]``; CorruptCheckpoint naming ``what`` otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise CorruptCheckpoint(f"{what} is not an integer ({value!r})")
    if not lo <= int(value) <= hi:
        raise CorruptCheckpoint(f"{what} = {int(value)} is outside [{lo}, {hi}]")
    return int(value)


def offsets(raw: Any, n: int, extent: int, what: str, path: Path) -> tuple[int, ...]:
    """``n + 1`` integers rising from 0 to ``extent``: where each of ``n`` parts lies."""
    if (
        n <= FEW_RANKS
        and type(raw) is list
        and len(raw) == n + 1
        and all(type(x) is int for x in raw)
        and raw[0] == 0
        and raw[-1] == extent
        and all(a <= b for a, b in itertools.pairwise(raw))
    ):
        return tuple(raw)
    offs = np.asarray(raw if raw is not None else [])
    if offs.shape != (n + 1,) or offs.dtype.kind not in "iu":
        raise _corrupt(path, f"{what}: offsets must be {n + 1} integers, found {offs!r:.80}")
    offs = offs.astype(np.int64)
    if offs[0] != 0 or offs[-1] != extent or np.any(np.diff(offs) < 0):
        raise _corrupt(
            path,
            f"{what}: offsets {offs.tolist()[:8]}... must rise from 0 to the dataset's "
            f"extent {extent}",
        )
    return tuple(offs.tolist())


def descriptions(raw: Any, names: list[str], version: int, path: Path) -> list[dict] | None:
    """Format version 4: ``meta.attrs['array_info']`` (``raw``), one description per
    array of ``names`` (in that order); None for older files, which describe each on its
    dataset."""
    if version < 4:
        return None
    try:
        described = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        described = None
    if (
        not isinstance(described, list)
        or len(described) != len(names)
        or not all(isinstance(x, dict) for x in described)
    ):
        raise _corrupt(
            path,
            f"meta.attrs['{ARRAY_INFO}'] is not a JSON list of {len(names)} array "
            "descriptions, one per entry of meta.attrs['arrays']",
        )
    return described


def array_info(
    d: h5py.h5d.DatasetID,
    name: str,
    column: int,
    n: int,
    described: dict | None,
    incremental: bool,
    path: Path,
) -> ArrayInfo:
    """Array ``name`` (checksum column ``column``) of an ``n``-rank file, checked against
    its dataset ``d`` (the deltas when ``incremental``): from its version-4 description
    ``described``, or, when None, from the attributes of ``d`` (versions 1-3)."""
    what = f"array {name!r}"
    if described is None:  # format versions 1-3: attributes of the dataset, JSON text
        attrs = {k: plain(v) for k, v in attributes(h5py.Dataset(d), ARRAY_ATTRS).items()}
        for key in ("shape", "rank_shapes"):
            try:
                attrs[key] = json.loads(attrs[key]) if key in attrs else None
            except (TypeError, ValueError):
                attrs[key] = None
    else:
        attrs = described
    dtype = d.dtype
    if dtype.kind not in ARRAY_KINDS or dtype.fields is not None:
        raise _corrupt(path, f"{what} has dtype {dtype}, not a numeric or bool dtype")
    shape = tuple(d.shape)
    if incremental:  # the deltas are 1-D; the array's global shape is described
        dims = attrs.get("shape")
        if not isinstance(dims, list) or len(shape) != 1:
            raise _corrupt(path, f"{what}: delta dataset without a 'shape' list")
        shape = tuple(integer(x, f"{what}: shape") for x in dims)
    layout = attrs.get("layout")
    if layout not in ("rows", "flat") or len(shape) < 1 or (layout == "flat" and len(shape) != 1):
        raise _corrupt(path, f"{what}: layout {layout!r} does not fit shape {shape}")
    offs = offsets(attrs.get("rank_offsets"), n, shape[0], what, path)
    shapes = attrs.get("rank_shapes")
    if not isinstance(shapes, list) or len(shapes) != n:
        raise _corrupt(path, f"{what}: rank_shapes must list {n} shapes")
    rank_shapes = checked_rank_shapes(shapes, offs, shape, layout, what, path)
    distributed = bool(attrs.get("distributed", False))
    if distributed and layout != "rows":
        raise _corrupt(path, f"{what} is marked distributed but its layout is {layout}")
    torch_dtype = attrs.get("torch_dtype", "")
    replicated = bool(attrs.get("replicated", False))
    if not isinstance(torch_dtype, str) or (torch_dtype and not torch_dtype.isidentifier()):
        raise _corrupt(path, f"{what}: torch_dtype {torch_dtype!r:.40} is not a dtype name")
    if replicated and (distributed or any(offs[r + 1] > offs[r] for r in range(1, n))):
        raise _corrupt(path, f"{what} is marked replicated but ranks other than 0 hold data")
    dtensor_shape, piece_offsets = None, ()
    if attrs.get("dtensor") is not None:
        if distributed or replicated or not torch_dtype:
            raise _corrupt(path, f"{what}: a DTensor is neither distributed nor replicated")
        dtensor_shape, piece_offsets = _pieces(attrs["dtensor"], rank_shapes, what, path)
    return ArrayInfo(
        name,
        column,
        dtype,
        layout,
        shape,
        offs,
        rank_shapes,
        distributed,
        torch_dtype,
        replicated,
        dtensor_shape,
        piece_offsets,
    )


def _pieces(
    described: Any, rank_shapes: tuple[tuple[int, ...], ...], what: str, path: Path
) -> tuple[tuple[int, ...], tuple[tuple[int, ...] | None, ...]]:
    """A DTensor's global shape and its writing ranks' offsets, checked: each piece (of
    its rank's shape) lies inside the global shape, a rank without one holds nothing,
    and the pieces hold as many elements as the global array."""
    if not isinstance(described, dict) or not isinstance(described.get("shape"), list):
        raise _corrupt(path, f"{what}: its 'dtensor' entry has no global 'shape' list")
    shape = tuple(integer(x, f"{what}: dtensor shape") for x in described["shape"])
    listed = described.get("offsets")
    if not isinstance(listed, list) or len(listed) != len(rank_shapes):
        raise _corrupt(path, f"{what}: its 'dtensor' entry must list {len(rank_shapes)} offsets")
    offsets: list[tuple[int, ...] | None] = []
    filled = 0
    for r, (raw, held) in enumerate(zip(listed, rank_shapes, strict=True)):
        if raw is None:
            if math.prod(held) != 0:
                raise _corrupt(path, f"{what}: rank {r} holds data but no place in the DTensor")
            offsets.append(None)
            continue
        if not isinstance(raw, list):
            raise _corrupt(path, f"{what}: dtensor offsets[{r}] is not a list")
        offset = tuple(integer(x, f"{what}: dtensor offsets[{r}]") for x in raw)
        inside = len(offset) == len(shape) == len(held) and all(
            o + n <= g for o, n, g in zip(offset, held, shape, strict=True)
        )
        if not inside:
            raise _corrupt(
                path,
                f"{what}: rank {r}'s piece {list(held)} at {list(offset)} lies outside the "
                f"DTensor's global shape {list(shape)}",
            )
        filled += math.prod(held)
        offsets.append(offset)
    if filled != math.prod(shape):
        raise _corrupt(
            path,
            f"{what}: the pieces hold {filled} elements, the global shape {list(shape)} has "
            f"{math.prod(shape)}",
        )
    return shape, tuple(offsets)


def checked_rank_shapes(
    shapes: list,
    offs: tuple[int, ...],
    shape: tuple[int, ...],
    layout: str,
    what: str,
    path: Path,
) -> tuple[tuple[int, ...], ...]:
    """The ranks' shapes, each matching its extent of the dataset: checked in one numpy
    pass when every shape is a list of plain integers of one length (what hpcckpt
    writes; rank 0 checks p of them per restore), else rank by rank, naming the first."""
    ndims = {len(s) if isinstance(s, list) else -1 for s in shapes}
    few = len(shapes) <= FEW_RANKS  # the loop below is the faster check
    flat = [x for s in shapes for x in s] if len(ndims) == 1 and min(ndims) > 0 else None
    flat = None if few else flat
    simple = flat is not None and set(map(type, flat)) <= {int}  # bool is not int here
    if simple and min(flat) >= 0 and max(flat) <= MAX_DIM:  # flat: one entry per rank
        dims = np.array(flat, dtype=np.int64).reshape(len(shapes), -1)
        extents = np.diff(np.asarray(offs, dtype=np.int64))
        if layout == "rows":
            ok = dims.shape[1] == len(shape) and np.array_equal(dims[:, 0], extents)
            ok = ok and bool(np.all(dims[:, 1:] == np.asarray(shape[1:], dtype=np.int64)))
        else:
            sizes = np.prod(dims.astype(object), axis=1)  # exact: no int64 overflow
            ok = bool(np.all(sizes == extents.astype(object)))
        if ok:
            return tuple(map(tuple, shapes))
    rank_shapes = []
    for r, listed in enumerate(shapes):
        if not isinstance(listed, list):
            raise _corrupt(path, f"{what}: rank_shapes[{r}] is not a list")
        dims = tuple(integer(x, f"{what}: rank_shapes[{r}]") for x in listed)
        extent = offs[r + 1] - offs[r]
        if layout == "rows":
            ok = len(dims) == len(shape) and dims[0] == extent and dims[1:] == shape[1:]
        else:
            ok = math.prod(dims) == extent
        if not ok:
            raise _corrupt(
                path,
                f"{what}: rank {r}'s shape {list(dims)} does not match its extent "
                f"[{offs[r]}, {offs[r + 1]}) of the {layout} dataset {list(shape)}",
            )
        rank_shapes.append(dims)
    return tuple(rank_shapes)
