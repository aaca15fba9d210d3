"""DTensors (FSDP2, tensor parallelism) as pieces of global arrays: which box of the
global array each rank holds, and which rank stores a box that several ranks hold.

A DTensor of global shape ``G`` on a device mesh holds on each rank one N-dimensional
box of ``G``. Mesh dimension ``i`` of size ``n`` with placement ``Shard(d)`` cuts the box's
extent along dimension ``d`` into ``n`` chunks as ``torch.chunk`` does (chunks of
``ceil(len / n)``, the last ones shorter or empty); ``Replicate()`` gives every rank of
that mesh dimension the same box. Each rank saves its local shard as it is; of the ranks
holding the same box, only the one at coordinate 0 of every ``Replicate`` mesh dimension
(the *holder*) stores it, once the copies are checked equal. Pure functions: no torch
import here beyond reading a DTensor handed in, no MPI, no files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcckpt.store.tree import tensors

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) in the global array


@dataclass(frozen=True)
class Piece:
    """What one rank's DTensor is: its global shape, placements (``"S<dim>"`` or
    ``"R"``), mesh shape, and this rank's box and whether it stores it."""

    shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh: tuple[int, ...]
    offset: tuple[int, ...]
    local: tuple[int, ...]
    holder: bool

    def node(self) -> dict[str, Any]:
        """The entry of the tree node (``"dtensor"``, docs/format.md)."""
        return {
            "shape": list(self.shape),
            "placements": list(self.placements),
            "mesh": list(self.mesh),
            "offset": list(self.offset),
            "holder": self.holder,
        }

    @property
    def replicas(self) -> bool:
        """Whether other ranks hold the same box (a Replicate placement on a mesh
        dimension of more than one rank)."""
        return any(p == "R" and n > 1 for p, n in zip(self.placements, self.mesh, strict=True))


def chunk(length: int, n: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk ``index`` of ``n`` along an extent of ``length``, as
    ``torch.chunk`` and DTensor's ``Shard`` cut it (trailing chunks may be empty)."""
    size = -(-length // n) if n else 0
    start = min(size * index, length)
    return start, max(0, min(length, start + size) - start)


def local_box(
    shape: tuple[int, ...],
    mesh: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[str, ...],
) -> Box:
    """This rank's (offset, shape) in a global array of ``shape`` placed by ``placements``
    (one per mesh dimension, applied in mesh order) at mesh ``coordinate``."""
    offset, local = [0] * len(shape), list(shape)
    for n, c, p in zip(mesh, coordinate, placements, strict=True):
        if p == "R":
            continue
        d = int(p[1:])
        start, length = chunk(local[d], n, c)
        offset[d] += start
        local[d] = length
    return tuple(offset), tuple(local)


def is_holder(
    mesh: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[str, ...]
) -> bool:
    """Whether this rank stores its box: coordinate 0 along every Replicate mesh dimension."""
    return all(c == 0 for c, p in zip(coordinate, placements, strict=True) if p == "R")


def placement_name(placement: Any, ndim: int) -> str:
    """``"S<dim>"`` for ``Shard(dim)``, ``"R"`` for ``Replicate()``; TypeError for others
    (``Partial`` holds no values of its own; strided shards are not boxes)."""
    kind = type(placement).__name__
    if kind == "Replicate":
        return "R"
    if kind == "Shard":
        dim = int(placement.dim)
        return f"S{dim + ndim if dim < 0 else dim}"
    raise TypeError(
        f"a DTensor placed {placement} cannot be saved as it is: only Shard(dim) and "
        "Replicate() placements are saved without gathering; redistribute it to those first"
    )


def describe(dtensor: Any) -> Piece:
    """The piece this rank holds of ``dtensor``; TypeError when it is not a box this
    module can name (a placement other than Shard/Replicate, a rank outside its mesh,
    a local shard whose shape is not the one its placements give)."""
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise TypeError("this rank is not in the DTensor's device mesh: it holds no shard")
    shape = tuple(int(x) for x in dtensor.shape)
    placements = tuple(placement_name(p, len(shape)) for p in dtensor.placements)
    mesh_shape = tuple(int(x) for x in mesh.shape)
    coord = tuple(int(x) for x in coordinate)
    offset, local = local_box(shape, mesh_shape, coord, placements)
    held = tuple(int(x) for x in tensors.local_part(dtensor).shape)
    if held != local:
        raise TypeError(
            f"the DTensor's local shard has shape {list(held)}, its placements "
            f"{list(placements)} on mesh {list(mesh_shape)} give {list(local)}: it is not "
            "cut as torch.chunk cuts; redistribute it to plain Shard/Replicate placements"
        )
    return Piece(
        shape, placements, mesh_shape, offset, local, is_holder(mesh_shape, coord, placements)
    )


def intersect(a: Box, b: Box) -> Box | None:
    """The box where boxes ``a`` and ``b`` overlap, or None when they do not (or it is empty)."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def volume(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def span(piece: Box, part: Box) -> tuple[int, int, tuple[int, ...]]:
    """Where box ``part`` (inside ``piece``) lies in the C-order elements of ``piece``:
    (first element, one past its last element, element strides of ``piece``). The
    elements of ``part`` are then ``flat[first:stop]`` seen with those strides."""
    shape = piece[1]
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    rel = [p - q for p, q in zip(part[0], piece[0], strict=True)]
    first = sum(r * s for r, s in zip(rel, strides, strict=True))
    last = sum((r + n - 1) * s for r, n, s in zip(rel, part[1], strides, strict=True))
    return first, last + 1, tuple(strides)


def strided(flat: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """A read-only view of ``flat`` (from a box's first element on) as that box."""
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(
        flat, shape=shape, strides=tuple(s * item for s in strides), writeable=False
    )
