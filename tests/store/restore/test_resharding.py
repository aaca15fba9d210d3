"""The pure decisions behind a restart on another rank count."""

from __future__ import annotations

import pytest

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.restore.resharding import common_tree, even_split, resolve_ranges
from hpcckpt.store.tree.state_tree import encode


@pytest.mark.parametrize("rows, n", [(17, 3), (17, 2), (2, 5), (0, 3), (100, 7)])
def test_even_split_tiles_in_rank_order(rows, n):
    parts = [even_split(rows, n, r) for r in range(n)]
    assert parts[0][0] == 0 and parts[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
    sizes = [hi - lo for lo, hi in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_counts_become_consecutive_ranges():
    assert resolve_ranges("u", [("count", 5), ("count", 0), ("count", 3)], 8) == [
        (0, 5),
        (5, 5),
        (5, 8),
    ]


def test_ranges_must_tile_the_global_array():
    assert resolve_ranges("u", [("range", 0, 4), ("range", 4, 9)], 9) == [(0, 4), (4, 9)]
    with pytest.raises(CheckpointError, match=r"state\['u'\]: rank 1 asks for rows \[5, 9\)"):
        resolve_ranges("u", [("range", 0, 4), ("range", 5, 9)], 9)
    with pytest.raises(CheckpointError, match="add up to 8 rows.*has 9"):
        resolve_ranges("u", [("count", 4), ("count", 4)], 9)
    with pytest.raises(CheckpointError, match=r"ranks \[0\] hold an array"):
        resolve_ranges("u", [("count", 4), ("range", 4, 9)], 9)


def test_common_tree_takes_equal_trees_and_names_the_first_difference():
    same = [encode({"t": 1.5, "cfg": {"n": 3}})[0] for _ in range(3)]
    assert common_tree(same, 3, 2) == same[0]
    trees = [encode({"t": 1.5, "cfg": {"n": 3, "seed": r}})[0] for r in range(3)]
    with pytest.raises(CheckpointError, match=r"state\['cfg/seed'\].*rank 1 of the 3 ranks.*has 2"):
        common_tree(trees, 3, 2)
