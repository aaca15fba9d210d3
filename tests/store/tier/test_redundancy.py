"""Sets of ranks on distinct nodes, and the checks of the redundancy options (no MPI)."""

from __future__ import annotations

import pytest

from hpcckpt.store.tier import redundancy


def test_one_rank_per_node_is_cut_into_sets_of_the_size_asked():
    nodes = [f"n{i}" for i in range(12)]
    assert redundancy.form_sets(nodes, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_a_remainder_is_spread_evenly_never_a_set_of_one():
    assert redundancy.form_sets([f"n{i}" for i in range(10)], 8) == [
        [0, 1, 2, 3, 4],
        [5, 6, 7, 8, 9],
    ]
    assert redundancy.form_sets(["a", "b", "c"], 2) == [[0, 1, 2]]


def test_fewer_nodes_than_the_set_size_make_smaller_sets():
    assert redundancy.form_sets(["n1", "n2", "n3"], 8) == [[0, 1, 2]]


def test_no_set_holds_two_ranks_of_one_node():
    # ranks placed by node in blocks and cyclically: sets pair rank k of each node
    block = ["a", "a", "a", "b", "b", "b", "c", "c", "c"]
    sets = redundancy.form_sets(block, 3)
    assert sets == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    cyclic = ["a", "b", "a", "b"]
    assert redundancy.form_sets(cyclic, 8) == [[0, 1], [2, 3]]
    for nodes in (block, cyclic):
        for members in redundancy.form_sets(nodes, 3):
            assert len({nodes[r] for r in members}) == len(members)


def test_one_node_or_uneven_ranks_per_node_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match="at least 2 nodes, or pass redundancy=None"):
        redundancy.form_sets(["n1", "n1"], 2)
    with pytest.raises(ValueError, match="rank 2 .*node 'a'"):
        redundancy.form_sets(["a", "a", "a", "b", "b"], 2)


def test_the_options_are_checked():
    redundancy.check_scheme(None, 8)
    redundancy.check_scheme("xor", 2)
    with pytest.raises(ValueError, match="'partner', 'xor' or None"):
        redundancy.check_scheme("rs", 8)
    with pytest.raises(ValueError, match="redundancy_set must be an integer >= 2"):
        redundancy.check_scheme("xor", 1)


def test_file_names_sort_with_the_copy_they_protect():
    assert redundancy.file_name(7, 3, "xor") == "ckpt-0000000007.rank3.xor"
    assert redundancy.manifest_name(7, 3) == "ckpt-0000000007.rank3.red.json"
