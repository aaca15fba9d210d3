"""Checks of a state tree read from a file, node by node, before anything is built from it.

Only the node types hpcckpt writes (docs/format.md) pass: no unknown tags, only numpy's
own bit generators, no dtypes with sub-arrays or objects; so a crafted tree can neither
call arbitrary functions nor ask for a huge allocation.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import numpy as np

#: The bit generators a checkpoint may name (numpy's own; never any other attribute).
BIT_GENERATORS = frozenset({"MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64"})
_HEX = re.compile(r"^-?[0-9a-fA-F]+$")
_TORCH_DTYPE = re.compile(r"^[a-z][a-z0-9_]{1,31}$")
_NODE_TAGS = frozenset(
    {
        "dict",
        "tuple",
        "bytes",
        "int",
        "complex",
        "npscalar",
        "array",
        "generator",
        "randomstate",
        "tensor",
        "kdict",
        "stateful",
    }
)


def _dtype(text: Any, kinds: str, where: str) -> np.dtype:
    if not isinstance(text, str) or len(text) > 16:
        raise ValueError(f"{where}: dtype {text!r:.40} is not a short dtype string")
    dtype = np.dtype(text)
    if dtype.kind not in kinds or dtype.fields is not None or dtype.shape != ():
        raise ValueError(f"{where}: dtype {dtype} is not allowed")
    return dtype


def _check_state_dict(obj: Any, where: str) -> None:
    """A random generator's state: plain JSON, plus flat numeric arrays."""
    if isinstance(obj, dict):
        if obj.get("$t") == "ndarray":
            _dtype(obj.get("dtype"), "biuf", where)
            values = obj.get("v")
            if not isinstance(values, list) or any(
                not isinstance(x, (int, float)) or isinstance(x, bool) for x in values
            ):
                raise ValueError(f"{where}: a generator array must be a flat list of numbers")
            return
        for key, value in obj.items():
            _check_state_dict(value, f"{where}/{key}")
    elif isinstance(obj, list):
        for value in obj:
            _check_state_dict(value, where)
    elif obj is not None and not isinstance(obj, (str, int, float, bool)):
        raise ValueError(f"{where}: unexpected {type(obj).__name__} in a generator state")


def check_tree(tree: Any, where: str = "<root>") -> None:
    """Raise ValueError unless every node of ``tree`` is one hpcckpt writes (docs/format.md)."""
    if tree is None or isinstance(tree, (bool, str, int, float)):
        return
    if isinstance(tree, list):
        for i, item in enumerate(tree):
            check_tree(item, f"{where}/{i}")
        return
    if not isinstance(tree, dict):
        raise ValueError(f"{where}: {type(tree).__name__} is not a state tree node")
    tag = tree.get("$t")
    if tag not in _NODE_TAGS:
        raise ValueError(f"{where}: unknown node type {tag!r:.40}")
    value = tree.get("v")
    if tag == "dict":
        if not isinstance(value, dict):
            raise ValueError(f"{where}: a dict node needs a dict 'v'")
        for key, item in value.items():
            check_tree(item, f"{where}/{key}")
    elif tag == "tuple":
        if not isinstance(value, list):
            raise ValueError(f"{where}: a tuple node needs a list 'v'")
        for i, item in enumerate(value):
            check_tree(item, f"{where}/{i}")
    elif tag == "kdict":
        if not isinstance(value, list):
            raise ValueError(f"{where}: a kdict node needs a list of [key, value] pairs")
        for pair in value:
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and (pair[0] is None or isinstance(pair[0], (bool, int, float, str)))
            ):
                raise ValueError(f"{where}: a kdict entry must be [scalar key, value]")
            check_tree(pair[1], f"{where}/{pair[0]}")
    elif tag == "stateful":
        if not isinstance(tree.get("type"), str):
            raise ValueError(f"{where}: a stateful node needs its type name")
        check_tree(value, where)
    elif tag == "tensor":
        if not isinstance(tree.get("path"), str) or not isinstance(tree.get("dtype"), str):
            raise ValueError(f"{where}: a tensor node needs a path and a torch dtype name")
        if not _TORCH_DTYPE.match(tree["dtype"]):
            raise ValueError(f"{where}: {tree['dtype']!r:.40} is not a torch dtype name")
    elif tag == "bytes":
        if not isinstance(value, str):
            raise ValueError(f"{where}: a bytes node needs base64 text")
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{where}: bad base64 ({exc})") from None
    elif tag == "int":
        if not isinstance(tree.get("hex"), str) or not _HEX.match(tree["hex"]):
            raise ValueError(f"{where}: an int node needs hex digits")
    elif tag == "complex":
        if not (
            isinstance(value, list)
            and len(value) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
        ):
            raise ValueError(f"{where}: a complex node needs [real, imag]")
    elif tag == "npscalar":
        dtype = _dtype(tree.get("dtype"), "biufc", where)
        raw = tree.get("hex")
        if not isinstance(raw, str) or len(raw) != 2 * dtype.itemsize or not _HEX.match(raw):
            raise ValueError(f"{where}: a {dtype} scalar needs {2 * dtype.itemsize} hex digits")
    elif tag == "array":
        if not isinstance(tree.get("path"), str):
            raise ValueError(f"{where}: an array node needs a path")
    else:  # generator, randomstate
        state = tree.get("state")
        if not isinstance(state, dict):
            raise ValueError(f"{where}: a {tag} node needs a state dict")
        name = state.get("bit_generator")
        allowed = BIT_GENERATORS if tag == "generator" else {"MT19937"}
        if name not in allowed:
            raise ValueError(f"{where}: bit generator {name!r:.40} is not one of {sorted(allowed)}")
        _check_state_dict(state, where)
