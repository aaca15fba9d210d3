"""A state held against a checkpoint's tree: ``hpcckpt.store.tree.matching``."""

from __future__ import annotations

import numpy as np
import pytest

from hpcckpt.store.tree.matching import (
    SHOWN_KEYS,
    KeyDifferences,
    check_fits,
    check_keys,
    first_difference,
    key_differences,
    lookup,
)
from hpcckpt.store.tree.state_tree import Targets, encode


def test_which_keys_a_strict_restore_compares():
    """Keys of dicts at any depth (int keys too), through lists and tuples position by
    position; an empty dict takes anything; ``only`` leaves the top level alone."""
    tree, _ = encode({"a": {0: {"x": 1}, 1: 2}, "l": [{"p": 1}, {"q": 2}], "t": ({"m": 1},)})
    same = {"a": {0: {"x": 0}, 1: 0}, "l": [{"p": 0}, {"q": 0}], "t": ({"m": 0},)}
    assert key_differences(same, tree) == KeyDifferences() and not KeyDifferences()
    other = {"a": {0: {"y": 0}, 2: 0}, "l": [{"p": 0}], "t": ({"n": 0},), "z": 0}
    assert key_differences(other, tree) == KeyDifferences(
        skipped=("z", "a/2", "a/0/y", "t/0/n"), added=("a/1", "a/0/x", "t/0/m")
    )
    assert key_differences({"a": {}, "l": [], "t": None}, tree) == KeyDifferences()
    assert key_differences({"a": {0: {"y": 0}}, "z": 0}, tree, only=("a",)) == KeyDifferences(
        skipped=("a/0/y",), added=("a/1", "a/0/x")
    )


def test_first_difference_finds_keys_inside_objects():
    a, _ = encode({"o": {0: {"x": 1}}})
    b, _ = encode({"o": {0: {"x": 2}}})
    assert first_difference(a, b) == "o/0/x"


@pytest.mark.parametrize(
    "a, b, where",
    [
        ({"x": 1}, {"x": 1}, None),
        ({"x": 1}, {"x": 2}, "x"),
        ({"x": [1, 2]}, {"x": [1, 3]}, "x/1"),
        ({"x": [1, 2]}, {"x": [1]}, "x"),
        ({"a/b": 1}, {"a/b": 2}, "a%2Fb"),
        ({"x": 1}, {"x": 1, "y": 2}, "y"),
        ({"g": np.random.default_rng(1)}, {"g": np.random.default_rng(2)}, "g"),
        ({"u": np.zeros(3)}, {"u": np.ones(5)}, None),  # arrays are compared elsewhere
    ],
)
def test_first_difference(a, b, where):
    assert first_difference(encode(a)[0], encode(b)[0]) == where


def test_lookup_follows_array_paths():
    u = np.zeros(3)
    state = {"fields": {"u": u, "a/b": [None, u]}, "l": [1, (2, u)]}
    tree, arrays = encode(state)
    for path in arrays:
        assert lookup(state, path) is u
    assert lookup(state, "fields/missing") is None and lookup(state, "l/9") is None


def test_a_strict_restore_names_the_keys_that_differ_and_the_way_out():
    tree, _ = encode({"a": 1, "b": 2})
    assert check_keys({"a": 0, "b": 0}, tree, 5) is None
    extra = check_keys({"a": 0}, tree, 5)
    assert extra is not None and "step 5 holds keys ['b'] that the state lacks" in extra
    missing = check_keys({"a": 0, "b": 0, "c": 0}, tree, 5)
    assert missing is not None and "the state holds keys ['c']" in missing
    both = check_keys({"a": 0, "c": 0}, tree, 5)
    assert both is not None and "rename them back" in both and "strict=False" in both
    assert check_keys({"a": 0, "c": 0}, tree, 5, Targets(strict=False)) is None
    many = encode({f"k{i}": i for i in range(SHOWN_KEYS + 3)})[0]
    text = check_keys({"z": 0}, many, 1) or ""  # an empty dict would take anything
    assert text.count("'k") == SHOWN_KEYS and "and 3 more" in text


def test_arrays_the_application_holds_must_keep_shape_and_dtype():
    tree, arrays = encode({"u": np.zeros((2, 3)), "n": 1})
    assert check_fits({"u": np.ones((2, 3)), "n": 0}, tree, arrays) is None
    assert check_fits({"u": None}, tree, arrays) is None  # nothing held: it is replaced
    why = check_fits({"u": np.ones(6)}, tree, arrays)
    assert why == (
        "state['u']: the checkpoint holds float64[2, 3], the application's value is "
        "float64[6]; restore with the same problem size and dtypes"
    )
    assert "float32" in (check_fits({"u": np.ones((2, 3), "f4")}, tree, arrays) or "")
    assert check_fits({"u": None}, tree, {}) == "state['u']: array missing from the checkpoint"
