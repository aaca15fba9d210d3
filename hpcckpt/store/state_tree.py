"""Turn a state (nested dicts and lists of arrays and scalars) into JSON plus arrays, and back.

No pickle: every value maps to a JSON node, and every numpy array to a named
dataset. A value of any other type is a ``TypeError`` that names its key path.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import numpy as np

TAG = "$t"

#: dtype kinds stored as arrays: bool, signed, unsigned, float, complex.
ARRAY_KINDS = "biufc"

#: Python ints longer than this are stored as hex text: Python (>= 3.11) refuses to
#: write or parse decimal integers of more than 4300 digits (about 14 000 bits).
BIG_INT_BITS = 12_000


@dataclass(frozen=True)
class ArraySpec:
    """What one rank holds under one array path."""

    path: str
    dtype: str
    shape: tuple[int, ...]


def escape(key: str) -> str:
    """Make a dict key safe as one HDF5 path component (no '/', '.', '..' or empty names)."""
    if not isinstance(key, str):
        raise TypeError(f"state keys must be str, not {type(key).__name__} ({key!r})")
    if "\x00" in key:
        raise TypeError(f"state key {key!r} contains a NUL character")
    name = quote(key, safe="")
    if name in ("", ".", ".."):
        name = name.replace(".", "%2E") or "%00empty"
    return name


def unescape(name: str) -> str:
    return "" if name == "%00empty" else unquote(name)


def _join(prefix: str, part: str) -> str:
    return f"{prefix}/{part}" if prefix else part


def encode(state: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """Split ``state`` into a JSON-able tree and a {path: array} mapping."""
    arrays: dict[str, np.ndarray] = {}
    tree = _encode(state, "", arrays)
    return tree, arrays


def _encode(value: Any, path: str, arrays: dict[str, np.ndarray]) -> Any:
    where = path or "<root>"
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if value.bit_length() > BIG_INT_BITS:  # JSON decimal text is capped at 4300 digits
            return {TAG: "int", "hex": format(value, "x")}
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            part = escape(key)
            out[key] = _encode(item, _join(path, part), arrays)
        return {TAG: "dict", "v": out}
    if isinstance(value, list):
        return [_encode(item, _join(path, str(i)), arrays) for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return {
            TAG: "tuple",
            "v": [_encode(v, _join(path, str(i)), arrays) for i, v in enumerate(value)],
        }
    if isinstance(value, (bytes, bytearray)):
        return {TAG: "bytes", "v": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, complex):
        return {TAG: "complex", "v": [value.real, value.imag]}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in ARRAY_KINDS or value.dtype.fields is not None:
            raise TypeError(
                f"state[{where!r}]: numpy dtype {value.dtype} cannot be checkpointed; "
                "use a numeric or bool dtype"
            )
        arrays[path] = value
        return {TAG: "array", "path": path}
    if isinstance(value, np.generic):
        if value.dtype.kind not in ARRAY_KINDS:
            raise TypeError(f"state[{where!r}]: numpy scalar of dtype {value.dtype} not supported")
        return {TAG: "npscalar", "dtype": value.dtype.str, "hex": value.tobytes().hex()}
    if isinstance(value, np.random.Generator):
        return {TAG: "generator", "state": _jsonable(value.bit_generator.state)}
    if isinstance(value, np.random.RandomState):
        return {TAG: "randomstate", "state": _jsonable(value.get_state(legacy=False))}
    raise TypeError(
        f"state[{where!r}]: {type(value).__name__} cannot be checkpointed; use numpy arrays, "
        "int, float, bool, complex, str, bytes, None, dict, list, tuple or numpy random generators"
    )


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return {TAG: "ndarray", "dtype": obj.dtype.str, "v": obj.tolist()}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _unjsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.get(TAG) == "ndarray":
            return np.asarray(obj["v"], dtype=np.dtype(obj["dtype"]))
        return {k: _unjsonable(v) for k, v in obj.items()}
    return obj


def array_paths(tree: Any) -> Iterator[str]:
    """The array paths a tree refers to, in tree order."""
    if isinstance(tree, list):
        for item in tree:
            yield from array_paths(item)
    elif isinstance(tree, dict):
        tag = tree.get(TAG)
        if tag == "array":
            yield tree["path"]
        elif tag in ("dict", "tuple"):
            items = tree["v"].values() if tag == "dict" else tree["v"]
            for item in items:
                yield from array_paths(item)


def check_fits(target: Any, tree: Any, arrays: dict[str, np.ndarray]) -> str | None:
    """Why ``tree`` cannot be restored into the application's ``target``, or None if it can.

    An array the application already holds must keep its shape and dtype: it is
    filled in place, and silently swapping in an array of another shape would
    leave the application's own references stale.
    """
    if isinstance(tree, list):
        for i, sub in enumerate(tree):
            held = target[i] if isinstance(target, list) and i < len(target) else None
            if (why := check_fits(held, sub, arrays)) is not None:
                return why
        return None
    if not isinstance(tree, dict):
        return None
    tag = tree.get(TAG)
    if tag == "dict":
        for key, sub in tree["v"].items():
            held = target.get(key) if isinstance(target, dict) else None
            if (why := check_fits(held, sub, arrays)) is not None:
                return why
    elif tag == "array" and isinstance(target, np.ndarray):
        data = arrays.get(tree["path"])
        if data is None:
            return f"state[{tree['path']!r}]: array missing from the checkpoint"
        if target.shape != data.shape or target.dtype != data.dtype:
            return (
                f"state[{tree['path']!r}]: the checkpoint holds {data.dtype}{list(data.shape)}, "
                f"the application's array is {target.dtype}{list(target.shape)}; "
                "restore with the same problem size and dtypes"
            )
    return None


def decode_into(target: Any, tree: Any, arrays: dict[str, np.ndarray]) -> Any:
    """Rebuild the value of ``tree``, reusing ``target``'s containers and arrays in place.

    Returns the value to store at this position; containers, arrays and random
    generators that already exist in ``target`` are filled in place, so the
    application's own references see the restored state.
    """
    if isinstance(tree, list):
        values = [
            decode_into(
                target[i] if isinstance(target, list) and i < len(target) else None, t, arrays
            )
            for i, t in enumerate(tree)
        ]
        if isinstance(target, list):
            target[:] = values
            return target
        return values
    if not isinstance(tree, dict):
        return tree
    tag = tree.get(TAG)
    if tag == "dict":
        out = target if isinstance(target, dict) else {}
        for key, sub in tree["v"].items():
            out[key] = decode_into(out.get(key), sub, arrays)
        return out
    if tag == "tuple":
        return tuple(decode_into(None, t, arrays) for t in tree["v"])
    if tag == "bytes":
        return base64.b64decode(tree["v"])
    if tag == "int":
        return int(tree["hex"], 16)
    if tag == "complex":
        return complex(*tree["v"])
    if tag == "npscalar":
        dtype = np.dtype(tree["dtype"])
        raw = bytes.fromhex(tree["hex"])
        if len(raw) != dtype.itemsize:
            raise ValueError(f"numpy scalar of dtype {dtype} has {len(raw)} bytes")
        return np.frombuffer(raw, dtype=dtype)[0]
    if tag == "array":
        data = arrays[tree["path"]]
        if isinstance(target, np.ndarray):
            if data is not target:  # the restore may have read straight into it
                target[...] = data  # check_fits ran first: same shape and dtype
            return target
        return data
    if tag == "generator":
        state = _unjsonable(tree["state"])
        if isinstance(target, np.random.Generator):
            target.bit_generator.state = state
            return target
        bitgen = getattr(np.random, state["bit_generator"])()
        bitgen.state = state
        return np.random.Generator(bitgen)
    if tag == "randomstate":
        state = _unjsonable(tree["state"])
        rs = target if isinstance(target, np.random.RandomState) else np.random.RandomState()
        rs.set_state(state)
        return rs
    raise ValueError(f"unknown node in checkpoint tree: {tag!r}")


def lookup(state: Any, path: str) -> Any:
    """The application's value at an array path (escaped keys and list indices joined by
    '/'), or None when the state holds nothing there."""
    node = state
    for part in path.split("/") if path else []:
        if isinstance(node, dict):
            node = node.get(unescape(part))
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The key path where two JSON state trees first differ, or None when they are equal."""
    if type(a) is not type(b):
        return path or "<root>"
    if isinstance(a, dict):
        if a.get(TAG) == "dict" and b.get(TAG) == "dict":
            ka, kb = a["v"], b["v"]
            for key in list(ka) + [k for k in kb if k not in ka]:
                if key not in ka or key not in kb:
                    return _join(path, escape(key))
                if (
                    where := first_difference(ka[key], kb[key], _join(path, escape(key)))
                ) is not None:
                    return where
            return None
        return None if a == b else (path or "<root>")
    if isinstance(a, list):
        if len(a) != len(b):
            return path or "<root>"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (where := first_difference(x, y, _join(path, str(i)))) is not None:
                return where
        return None
    return None if a == b else (path or "<root>")


def summarize(tree: Any) -> Any:
    """A plain JSON view of a state tree for people: arrays and blobs become short strings."""
    if isinstance(tree, list):
        return [summarize(t) for t in tree]
    if not isinstance(tree, dict):
        return tree
    tag = tree.get(TAG)
    if tag == "dict":
        return {k: summarize(v) for k, v in tree["v"].items()}
    if tag == "tuple":
        return [summarize(t) for t in tree["v"]]
    if tag == "array":
        return f"<array {tree['path']}>"
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
    if isinstance(tree, list):
        for i, sub in enumerate(tree):
            yield from scalar_leaves(sub, _join(path, str(i)))
        return
    tag = tree.get(TAG) if isinstance(tree, dict) else None
    if tag == "dict":
        for key, sub in tree["v"].items():
            yield from scalar_leaves(sub, _join(path, escape(key)))
    elif tag == "tuple":
        for i, sub in enumerate(tree["v"]):
            yield from scalar_leaves(sub, _join(path, str(i)))
    elif tag != "array":
        yield path or "<root>", summarize(tree)
