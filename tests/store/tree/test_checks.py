"""``hpcckpt.store.tree.checks``: every node hpcckpt writes passes; anything else, or a
node that would call a function or size an allocation from the file, is named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpcckpt.store.tree.checks import BIT_GENERATORS, check_tree
from hpcckpt.store.tree.state_tree import encode


class Counter:
    """An object with ``state_dict()``: a ``stateful`` node."""

    def __init__(self) -> None:
        self.n = 3

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_every_node_hpcckpt_writes_passes():
    state = {
        "big": 2**200,
        "raw": b"\x00\xff",
        "c": 1 + 2j,
        "t": (1, "a", None),
        "x": np.float32(1.5),
        "u": np.arange(3.0),
        "g": np.random.default_rng(1),
        "r": np.random.RandomState(2),
        "k": {1: "one", None: "none"},
        "counter": Counter(),
    }
    tree, _ = encode(state)
    check_tree(json.loads(json.dumps(tree)))  # as read back from the file


def test_numpys_bit_generators_only():
    assert {"MT19937", "PCG64"} <= BIT_GENERATORS
    good = {"$t": "generator", "state": {"bit_generator": "PCG64", "state": {}}}
    check_tree(good)
    for name in ("seed", "__class__", "RandomState"):
        bad = {"$t": "generator", "state": {"bit_generator": name}}
        with pytest.raises(ValueError, match="bit generator"):
            check_tree(bad)
    with pytest.raises(ValueError, match="bit generator"):
        check_tree({"$t": "randomstate", "state": {"bit_generator": "PCG64"}})


@pytest.mark.parametrize(
    "node, fragment",
    [
        ({"$t": "pickle", "v": "gASV"}, "unknown node type"),
        (3 + 4j, "not a state tree node"),
        ({"$t": "npscalar", "dtype": "(1000000000,)f8", "hex": "00"}, "dtype"),
        ({"$t": "npscalar", "dtype": "O", "hex": "00"}, "not allowed"),
        ({"$t": "npscalar", "dtype": "f8", "hex": "00"}, "16 hex digits"),
        ({"$t": "bytes", "v": "not base64!"}, "base64"),
        ({"$t": "int", "hex": "0x12"}, "hex digits"),
        ({"$t": "complex", "v": [1, True]}, r"\[real, imag\]"),
        ({"$t": "tensor", "path": "w", "dtype": "torch.float32"}, "torch dtype"),
        ({"$t": "kdict", "v": [[[1], 2]]}, "scalar key"),
        ({"$t": "stateful", "v": {}}, "type name"),
        ({"$t": "array"}, "needs a path"),
    ],
)
def test_anything_else_is_refused(node, fragment):
    with pytest.raises(ValueError, match=fragment):
        check_tree(node)


def test_the_refusal_names_where_in_the_tree():
    tree = {"$t": "dict", "v": {"model": {"$t": "tuple", "v": [1, {"$t": "nope"}]}}}
    with pytest.raises(ValueError, match=r"^<root>/model/1: unknown node type 'nope'"):
        check_tree(tree)


def test_a_generator_state_holds_flat_numeric_arrays_only():
    state = {"bit_generator": "MT19937", "state": {"key": {"$t": "ndarray", "dtype": "<u4"}}}
    state["state"]["key"]["v"] = [1, 2]
    check_tree({"$t": "randomstate", "state": state})
    state["state"]["key"]["v"] = [[1, 2]]
    with pytest.raises(ValueError, match="flat list of numbers"):
        check_tree({"$t": "randomstate", "state": state})
