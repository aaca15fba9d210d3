"""What an encoded state tree says without the state: its array paths, tensors and
DTensor pieces, the node at a key path, the top-level keys a restore takes, and a plain
view of it for people (``hpcckpt inspect``, exports). Read-only: no tree is changed.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import numpy as np

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.tree.state_tree import TAG, children, join_path


def array_paths(tree: Any) -> Iterator[str]:
    """The array paths a tree refers to, in tree order."""
    if isinstance(tree, dict) and tree.get(TAG) in ("array", "tensor"):
        yield tree["path"]
        return
    for _, sub in children(tree):
        yield from array_paths(sub)


def tensor_dtypes(tree: Any) -> dict[str, str]:
    """{array path: torch dtype} of every tensor of a tree."""
    out: dict[str, str] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and node.get(TAG) == "tensor":
            out[node["path"]] = node["dtype"]
        else:
            stack.extend(sub for _, sub in children(node))
    return out


def dtensor_pieces(tree: Any) -> dict[str, dict[str, Any]]:
    """{array path: the ``dtensor`` entry of its node} of every DTensor of a tree."""
    out: dict[str, dict[str, Any]] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and node.get(TAG) == "tensor":
            if isinstance(node.get("dtensor"), dict):
                out[node["path"]] = node["dtensor"]
        else:
            stack.extend(sub for _, sub in children(node))
    return out


def subtree(tree: Any, path: str) -> Any:
    """The node at key path ``path`` (components as in array paths), or KeyError."""
    node = tree
    for part in path.split("/") if path else []:
        while isinstance(node, dict) and node.get(TAG) == "stateful":
            node = node["v"]
        for name, sub in children(node):
            if name == part:
                node = sub
                break
        else:
            raise KeyError(path)
    return node


def select_keys(tree: Any, keys: tuple[str, ...] | None) -> Any:
    """The root dict node of ``tree`` with only the top-level ``keys`` (all when None)."""
    if keys is None:
        return tree
    if not (isinstance(tree, dict) and tree.get(TAG) == "dict"):
        raise CheckpointError("this checkpoint's state is not a dict: it cannot be restored by key")
    missing = [k for k in keys if k not in tree["v"]]
    if missing:
        raise CheckpointError(
            f"restore(only={list(keys)}): {missing} not in the checkpoint, whose top-level "
            f"keys are {sorted(tree['v'])}"
        )
    return {TAG: "dict", "v": {k: v for k, v in tree["v"].items() if k in keys}}


def summarize(tree: Any) -> Any:
    """A plain JSON view of a state tree for people: arrays and blobs become short strings."""
    if isinstance(tree, list):
        return [summarize(t) for t in tree]
    if not isinstance(tree, dict):
        return tree
    tag = tree.get(TAG)
    if tag == "dict":
        return {k: summarize(v) for k, v in tree["v"].items()}
    if tag == "kdict":
        return {str(k): summarize(v) for k, v in tree["v"]}
    if tag == "stateful":
        return summarize(tree["v"])
    if tag == "tuple":
        return [summarize(t) for t in tree["v"]]
    if tag == "array":
        return f"<array {tree['path']}>"
    if tag == "tensor" and isinstance(tree.get("dtensor"), dict):
        piece = tree["dtensor"]
        what = f"{tree['dtype']} {piece.get('shape')} {piece.get('placements')}"
        return f"<dtensor {what} {tree['path']}>"
    if tag == "tensor":
        return f"<tensor {tree['dtype']} {tree['path']}>"
    if tag == "bytes":
        return f"<{len(base64.b64decode(tree['v']))} bytes>"
    if tag == "complex":
        return str(complex(*tree["v"]))
    if tag == "int":
        return f"<int of {int(tree['hex'], 16).bit_length()} bits, hex {tree['hex'][:12]}...>"
    if tag == "npscalar":
        return np.frombuffer(bytes.fromhex(tree["hex"]), dtype=np.dtype(tree["dtype"]))[0].item()
    if tag == "generator":
        return f"<numpy Generator {tree['state'].get('bit_generator', '?')}>"
    if tag == "randomstate":
        return "<numpy RandomState>"
    return f"<{tag}>"


def scalar_leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(key path, summarized value) of every value of a state tree that is not an array."""
    if isinstance(tree, dict) and tree.get(TAG) in ("array", "tensor"):
        return
    kids = children(tree)
    if (
        kids
        or isinstance(tree, list)
        or (isinstance(tree, dict) and tree.get(TAG) in ("dict", "kdict", "tuple", "stateful"))
    ):
        for part, sub in kids:
            yield from scalar_leaves(sub, join_path(path, part) if part else path)
        return
    yield path or "<root>", summarize(tree)
