"""DTensor pieces as boxes of the global array: the chunks torch cuts, each rank's box on
1-D and 2-D meshes, overlaps, and a box read as a strided view of a piece's elements."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from torch.distributed.tensor import Shard

from hpcckpt.store.tree import sharded


@pytest.mark.parametrize("length", [0, 1, 2, 5, 7, 10, 31])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_chunks_are_torchs(length, n):
    for c in range(n):
        size, offset = Shard.local_shard_size_and_offset(length, n, c)
        start, got = sharded.chunk(length, n, c)
        assert got == size
        if size:  # an empty chunk's offset does not matter: it holds nothing
            assert start == offset


def covered(shape, mesh, placements):
    """Every rank's box, and how often each element of the global array is in a holder's."""
    count = np.zeros(shape, dtype=int)
    boxes = {}
    for coord in itertools.product(*(range(n) for n in mesh)):
        offset, local = sharded.local_box(shape, mesh, coord, placements)
        boxes[coord] = (offset, local)
        if sharded.is_holder(mesh, coord, placements):
            count[tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))] += 1
    return boxes, count


@pytest.mark.parametrize(
    "shape, mesh, placements",
    [
        ((10, 6), (3,), ("S0",)),
        ((5, 7), (2,), ("S1",)),
        ((2, 3), (4,), ("S0",)),  # empty shards
        ((10, 6), (2, 2), ("S0", "S1")),
        ((9, 4), (2, 3), ("S0", "S0")),  # one dimension cut twice
        ((5, 7), (2, 2), ("R", "S1")),
        ((3, 4), (2, 2), ("R", "R")),
        ((), (3,), ("R",)),
    ],
)
def test_holders_boxes_tile_the_global_array_once(shape, mesh, placements):
    boxes, count = covered(shape, mesh, placements)
    assert np.all(count == 1)
    for offset, local in boxes.values():
        assert all(o + n <= g for o, n, g in zip(offset, local, shape, strict=True))


def test_replicas_share_the_holders_box():
    boxes, _ = covered((5, 7), (2, 2), ("R", "S1"))
    assert boxes[(1, 0)] == boxes[(0, 0)] and boxes[(1, 1)] == boxes[(0, 1)]
    assert sharded.is_holder((2, 2), (0, 1), ("R", "S1"))
    assert not sharded.is_holder((2, 2), (1, 1), ("R", "S1"))


def test_a_box_is_read_as_a_strided_view_of_the_span_of_a_piece():
    rng = np.random.default_rng(0)
    full = np.arange(9 * 8 * 5).reshape(9, 8, 5)
    for _ in range(200):
        lo = rng.integers(0, [9, 8, 5])
        hi = [int(rng.integers(x + 1, g + 1)) for x, g in zip(lo, (9, 8, 5), strict=True)]
        piece = (tuple(int(x) for x in lo), tuple(h - x for h, x in zip(hi, lo, strict=True)))
        data = full[tuple(slice(o, o + n) for o, n in zip(*piece, strict=True))].copy()
        want_lo = rng.integers(0, [9, 8, 5])
        want_hi = [int(rng.integers(x + 1, g + 1)) for x, g in zip(want_lo, (9, 8, 5), strict=True)]
        want = (
            tuple(int(x) for x in want_lo),
            tuple(h - x for h, x in zip(want_hi, want_lo, strict=True)),
        )
        part = sharded.intersect(want, piece)
        if part is None:
            sl = [
                slice(max(a, b), min(a + n, b + m))
                for a, n, b, m in zip(*want, *piece, strict=True)
            ]
            assert any(s.stop <= s.start for s in sl)
            continue
        first, stop, strides = sharded.span(piece, part)
        flat = data.reshape(-1)[first:stop]
        view = sharded.strided(flat, part[1], strides)
        expect = full[tuple(slice(o, o + n) for o, n in zip(*part, strict=True))]
        assert np.array_equal(view, expect)
        assert stop - first <= data.size


def test_placements_other_than_shard_and_replicate_are_refused():
    from torch.distributed.tensor import Partial, Replicate

    assert sharded.placement_name(Shard(-1), 3) == "S2"
    assert sharded.placement_name(Replicate(), 3) == "R"
    with pytest.raises(TypeError, match="redistribute it to those first"):
        sharded.placement_name(Partial(), 2)
