"""What an encoded tree says without the state: ``hpcckpt.store.tree.queries``."""

from __future__ import annotations

import numpy as np
import pytest

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.tree.queries import (
    array_paths,
    dtensor_pieces,
    scalar_leaves,
    select_keys,
    subtree,
    summarize,
    tensor_dtypes,
)
from hpcckpt.store.tree.state_tree import TAG, encode


class Stateful:
    def __init__(self) -> None:
        self.w = np.zeros(2)

    def state_dict(self) -> dict:
        return {"w": self.w, "lr": 0.5}

    def load_state_dict(self, state: dict) -> None:
        self.w[...] = state["w"]


STATE = {
    "fields": {"u": np.zeros(3), "a/b": [np.ones(2), 7]},
    "opt": Stateful(),
    "k": {0: b"xy", 1: 2j},
    "t": (1.5, None),
}


def test_array_paths_in_tree_order():
    tree, arrays = encode(STATE)
    assert list(array_paths(tree)) == ["fields/u", "fields/a%2Fb/0", "opt/w"]
    assert set(arrays) == set(array_paths(tree))


def tensor(path: str, dtype: str, piece: dict | None = None) -> dict:
    node = {TAG: "tensor", "path": path, "dtype": dtype}
    if piece is not None:
        node["dtensor"] = piece
    return node


def test_tensors_and_dtensor_pieces_of_a_tree():
    piece = {"shape": [4], "offset": [2], "holder": True}
    tree = {
        TAG: "dict",
        "v": {"a": tensor("a", "bfloat16"), "b": [tensor("b/0", "float32", piece)]},
    }
    assert tensor_dtypes(tree) == {"a": "bfloat16", "b/0": "float32"}
    assert dtensor_pieces(tree) == {"b/0": piece}
    assert tensor_dtypes(encode({"u": np.zeros(1)})[0]) == {}


def test_subtree_follows_key_paths_through_objects():
    tree, _ = encode(STATE)
    assert subtree(tree, "fields/a%2Fb/1") == 7
    assert subtree(tree, "opt/lr") == 0.5
    assert subtree(tree, "") is tree
    with pytest.raises(KeyError):
        subtree(tree, "fields/missing")


def test_select_keys_keeps_the_top_level_keys_asked_for():
    tree, _ = encode({"a": 1, "b": 2})
    assert select_keys(tree, None) is tree
    assert select_keys(tree, ("b",)) == {TAG: "dict", "v": {"b": 2}}
    with pytest.raises(CheckpointError, match=r"\['c'\] not in the checkpoint"):
        select_keys(tree, ("a", "c"))
    with pytest.raises(CheckpointError, match="not a dict"):
        select_keys(encode([1])[0], ("a",))


def test_a_tree_summarized_for_people():
    tree, _ = encode(STATE)
    assert summarize(tree) == {
        "fields": {"u": "<array fields/u>", "a/b": ["<array fields/a%2Fb/0>", 7]},
        "opt": {"w": "<array opt/w>", "lr": 0.5},
        "k": {"0": "<2 bytes>", "1": "2j"},
        "t": [1.5, None],
    }
    assert dict(scalar_leaves(tree)) == {
        "fields/a%2Fb/1": 7,
        "opt/lr": 0.5,
        "k/0": "<2 bytes>",
        "k/1": "2j",
        "t/0": 1.5,
        "t/1": None,
    }
    assert list(scalar_leaves(encode(3)[0])) == [("<root>", 3)]
