"""Turn a state (nested dicts and lists of arrays and scalars) into JSON plus arrays, and back.

No pickle: every value maps to a JSON node, and every numpy array or torch tensor to a
named dataset. An object with ``state_dict()``/``load_state_dict()`` (a torch module,
optimizer, scheduler, data loader, or any class following that convention) is saved as
its state dict and restored by calling ``load_state_dict`` with what was saved. A value
of any other type is a ``TypeError`` that names its key path.

Over 500 lines on purpose: encoding and decoding are mirror images of one tree grammar
(dicts, int-keyed dicts, lists, tuples, scalars, arrays, tensors, stateful objects);
split apart, a node kind added on one side could be forgotten on the other.
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import numpy as np

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.tree import sharded, tensors

TAG = "$t"

#: dtype kinds stored as arrays: bool, signed, unsigned, float, complex.
ARRAY_KINDS = "biufc"

#: Python ints longer than this are stored as hex text: Python (>= 3.11) refuses to
#: write or parse decimal integers of more than 4300 digits (about 14 000 bits).
BIG_INT_BITS = 12_000


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


def key_part(key: Any) -> str:
    """The path component of a dict key: the escaped string, or the text of an int,
    float, bool or None key (optimizer state dicts are keyed by parameter index)."""
    if isinstance(key, str):
        return escape(key)
    if key is None or isinstance(key, (bool, int, float)):
        return escape(str(key))
    raise TypeError(
        f"state keys must be str, int, float, bool or None, not {type(key).__name__} ({key!r})"
    )


def is_stateful(value: Any) -> bool:
    """Whether ``value`` follows the ``state_dict()``/``load_state_dict()`` convention."""
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


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
        if all(isinstance(key, str) for key in value):
            out = {}
            for key, item in value.items():
                out[key] = _encode(item, _join(path, escape(key)), arrays)
            return {TAG: "dict", "v": out}
        items, seen = [], {}
        for key, item in value.items():
            try:
                part = key_part(key)
            except TypeError as exc:
                raise TypeError(f"state[{where!r}]: {exc}") from None
            if part in seen:
                raise TypeError(
                    f"state[{where!r}]: keys {seen[part]!r} and {key!r} would share the name "
                    f"{part!r}; use keys whose text differs"
                )
            seen[part] = key
            items.append([key, _encode(item, _join(path, part), arrays)])
        return {TAG: "kdict", "v": items}
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
    if tensors.is_dtensor(value):
        return _encode_dtensor(value, path, where, arrays)
    if tensors.is_tensor(value):
        why = tensors.check_supported(value)
        if why is not None:
            raise TypeError(f"state[{where!r}]: {why}")
        arrays[path] = tensors.to_array(value)
        node = {TAG: "tensor", "path": path, "dtype": tensors.dtype_name(value)}
        if value.requires_grad:
            node["requires_grad"] = True
        return node
    if is_stateful(value):
        kind = type(value)
        return {
            TAG: "stateful",
            "type": f"{kind.__module__}.{kind.__qualname__}",
            "v": _encode(value.state_dict(), path, arrays),
        }
    raise TypeError(
        f"state[{where!r}]: {type(value).__name__} cannot be checkpointed; use numpy arrays, "
        "torch tensors, int, float, bool, complex, str, bytes, None, dict, list, tuple, numpy "
        "random generators, or objects with state_dict()/load_state_dict()"
    )


def _encode_dtensor(value: Any, path: str, where: str, arrays: dict[str, np.ndarray]) -> Any:
    """A DTensor: this rank's local shard as the array, the piece it is in the node."""
    try:
        piece = sharded.describe(value)
    except TypeError as exc:
        raise TypeError(f"state[{where!r}]: {exc}") from None
    local = tensors.local_part(value)
    why = tensors.check_supported(local)
    if why is not None:
        raise TypeError(f"state[{where!r}]: {why}")
    arrays[path] = tensors.to_array(local)
    node = {TAG: "tensor", "path": path, "dtype": tensors.dtype_name(value)}
    node["dtensor"] = piece.node()
    if value.requires_grad:
        node["requires_grad"] = True
    return node


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


#: The entries of a DTensor's node that are this rank's own (its box, whether it stores
#: it, the mesh it ran on): the ranks' trees may differ there and still be one state.
PER_RANK_PIECE = ("offset", "holder", "mesh")


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


def children(tree: Any) -> list[tuple[str, Any]]:
    """(path component, child node) of a container node, in order; [] for a leaf."""
    if isinstance(tree, list):
        return [(str(i), t) for i, t in enumerate(tree)]
    if not isinstance(tree, dict):
        return []
    tag = tree.get(TAG)
    if tag == "dict":
        return [(escape(k), t) for k, t in tree["v"].items()]
    if tag == "kdict":
        return [(key_part(k), t) for k, t in tree["v"]]
    if tag == "tuple":
        return [(str(i), t) for i, t in enumerate(tree["v"])]
    if tag == "stateful":
        return [("", tree["v"])]  # the state dict stands at the object's own path
    return []


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


class Targets:
    """The application's values a restore fills, seen through stateful objects: the
    ``state_dict()`` of each object is taken once per restore and reused, so the bytes
    read straight into its tensors are the ones ``load_state_dict`` receives.

    ``strict`` (the default): the state's keys and the checkpoint's must be the same
    (:func:`check_keys`); False: what matches is restored (an object gets its saved
    values for the keys its ``state_dict()`` has, its own for the others)."""

    def __init__(self, strict: bool = True) -> None:
        self._dicts: dict[int, tuple[Any, Any]] = {}
        self.strict = strict

    def state_dict(self, obj: Any) -> Any:
        held = self._dicts.get(id(obj))
        if held is None:
            init_sharded_optimizer(obj)
            held = self._dicts[id(obj)] = (obj, obj.state_dict())
        return held[1]

    def open(self, value: Any) -> Any:
        """``value``, or its state dict when it is a stateful object."""
        return self.state_dict(value) if is_stateful(value) and not is_container(value) else value


def init_sharded_optimizer(obj: Any) -> None:
    """Give a torch optimizer of DTensor parameters that has not stepped yet its state
    (moments of zeros, as ``torch.distributed.checkpoint``'s ``set_state_dict`` does: one
    step with zero gradients and a learning rate of 0), so that a restore has DTensors of
    the right placements to read the saved moments into."""
    kind = type(obj)
    if not any(
        c.__name__ == "Optimizer" and c.__module__ == "torch.optim.optimizer" for c in kind.__mro__
    ):
        return
    params = [p for group in obj.param_groups for p in group["params"]]
    if obj.state or not any(tensors.is_dtensor(p) for p in params):
        return
    if any(p.grad is not None for p in params):
        return  # a step under way: not this restore's to take
    torch = sys.modules["torch"]
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [group.get("lr") for group in obj.param_groups]
    for group in obj.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
    obj.step()
    for group, lr in zip(obj.param_groups, lrs, strict=True):
        if lr is not None:
            group["lr"] = lr
    obj.zero_grad(set_to_none=True)


def is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple)) or tensors.is_tensor(value)


def _child(value: Any, part: str) -> Any:
    """The application's value under path component ``part`` of container ``value``."""
    if isinstance(value, dict):
        key = unescape(part)
        if key in value:
            return value[key]
        for k in value:
            if not isinstance(k, str) and key_part(k) == part:
                return value[k]
        return None
    if isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
        return value[int(part)]
    return None


def check_fits(
    target: Any, tree: Any, arrays: dict[str, np.ndarray], targets: Targets | None = None
) -> str | None:
    """Why ``tree`` cannot be restored into the application's ``target``, or None if it can.

    An array or tensor the application already holds must keep its shape and dtype: it
    is filled in place, and silently swapping in another of another shape would leave
    the application's own references stale.
    """
    targets = targets or Targets()
    target = targets.open(target)
    if isinstance(tree, dict) and tree.get(TAG) in ("array", "tensor"):
        data = arrays.get(tree["path"])
        if data is None:
            return f"state[{tree['path']!r}]: array missing from the checkpoint"
        if isinstance(target, np.ndarray):
            have = f"{target.dtype}{list(target.shape)}"
            fits = (
                target.shape == data.shape
                and target.dtype == data.dtype
                and tree.get(TAG) == "array"  # a saved tensor does not go into a numpy array
            )
        elif tensors.is_tensor(target):
            local = tensors.local_part(target) if tensors.is_dtensor(target) else target
            have = f"torch.{tensors.dtype_name(target)}{list(local.shape)}"
            fits = tuple(local.shape) == data.shape and tensors.dtype_name(target) == tree.get(
                "dtype"
            )
        else:
            return None
        if not fits:
            saved = (
                f"torch.{tree['dtype']}" if tree.get(TAG) == "tensor" else str(data.dtype)
            ) + str(list(data.shape))
            return (
                f"state[{tree['path']!r}]: the checkpoint holds {saved}, the application's "
                f"value is {have}; restore with the same problem size and dtypes"
            )
        return None
    if isinstance(tree, dict) and tree.get(TAG) == "stateful":
        return check_fits(target, tree["v"], arrays, targets)
    for part, sub in children(tree):
        if (why := check_fits(_child(target, part), sub, arrays, targets)) is not None:
            return why
    return None


@dataclass(frozen=True)
class KeyDifferences:
    """Where the keys of a state and of a checkpoint differ, as key paths ('fields/u',
    'model/head.weight'): see :func:`key_differences`."""

    #: Keys of the state the checkpoint lacks: left as the application set them.
    skipped: tuple[str, ...] = ()
    #: Keys of the checkpoint the state lacks: added to the state's dicts.
    added: tuple[str, ...] = ()
    #: Keys of an object's saved state dict its ``state_dict()`` lacks now: not given to
    #: its ``load_state_dict`` (it could not take them).
    ignored: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.skipped or self.added or self.ignored)


def key_differences(
    state: Any, tree: Any, targets: Targets | None = None, only: tuple[str, ...] | None = None
) -> KeyDifferences:
    """Where the keys of the application's ``state`` and of the checkpoint's ``tree`` differ.

    Keys are compared in every dict both hold at the same key path, at any depth, through
    lists and tuples (position by position: their lengths are data), and, for an object
    with ``state_dict()``, the keys of its state dict (not deeper: what is inside, e.g. an
    optimizer's per-parameter state, is for its ``load_state_dict`` to judge). An empty
    dict of the application is a place to fill, not a list of keys: it takes whatever the
    checkpoint holds there. With ``only`` (top-level keys restored alone), the top level
    is not compared, only what is below those keys.
    """
    targets = targets or Targets()
    out: dict[str, list[str]] = {"skipped": [], "added": [], "ignored": []}
    _differences(state, tree, targets, "", out, only)
    return KeyDifferences(**{k: tuple(v) for k, v in out.items()})


def _dict_items(tree: Any) -> dict[Any, Any] | None:
    """{key: node} of a dict node of a tree (its keys as the application wrote them)."""
    if isinstance(tree, dict) and tree.get(TAG) == "dict":
        return dict(tree["v"])
    if isinstance(tree, dict) and tree.get(TAG) == "kdict":
        return {k: t for k, t in tree["v"]}
    return None


def _differences(
    target: Any,
    tree: Any,
    targets: Targets,
    path: str,
    out: dict[str, list[str]],
    only: tuple[str, ...] | None = None,
) -> None:
    def where(key: Any) -> str:
        return f"{path}/{key}" if path else str(key)

    if isinstance(tree, dict) and tree.get(TAG) == "stateful":
        if not (is_stateful(target) and not is_container(target)):
            _differences(target, tree["v"], targets, path, out)  # a dict where it was an object
            return
        held, saved = targets.state_dict(target), _dict_items(tree["v"])
        if isinstance(held, dict) and held and saved is not None:
            out["skipped"] += [where(k) for k in held if k not in saved]
            out["ignored"] += [where(k) for k in saved if k not in held]
        return
    if isinstance(tree, list) or (isinstance(tree, dict) and tree.get(TAG) == "tuple"):
        items = tree if isinstance(tree, list) else tree["v"]
        if isinstance(target, (list, tuple)):
            for i, (held, sub) in enumerate(zip(target, items, strict=False)):
                _differences(held, sub, targets, where(i), out)
        return
    saved = _dict_items(tree)
    if saved is None or not isinstance(target, dict) or not target:
        return
    if only is None:
        out["skipped"] += [where(k) for k in target if k not in saved]
        out["added"] += [where(k) for k in saved if k not in target]
    for key, held in target.items():
        if key in saved and (only is None or key in only):
            _differences(held, saved[key], targets, where(key), out)


#: Key paths named in a strict restore's error at most.
SHOWN_KEYS = 8


def _keys_text(keys: list[str]) -> str:
    shown = repr(keys[:SHOWN_KEYS])
    return shown if len(keys) <= SHOWN_KEYS else f"{shown} and {len(keys) - SHOWN_KEYS} more"


def check_keys(
    state: Any,
    tree: Any,
    step: int,
    targets: Targets | None = None,
    only: tuple[str, ...] | None = None,
) -> str | None:
    """Why a strict restore of ``tree`` (the checkpoint of ``step``) refuses the
    application's ``state``: their keys differ (:func:`key_differences`); None when they
    do not, or when ``targets`` is not strict."""
    targets = targets or Targets()
    if not targets.strict:
        return None
    found = key_differences(state, tree, targets, only)
    extra, missing = [*found.added, *found.ignored], list(found.skipped)
    way_out = "restore(state, strict=False) to take what matches"
    if extra and missing:
        return (
            f"the checkpoint of step {step} holds keys {_keys_text(extra)} that the state "
            f"lacks, and the state holds {_keys_text(missing)} that the checkpoint lacks: "
            f"rename them back, or {way_out}"
        )
    if extra:
        return (
            f"the checkpoint of step {step} holds keys {_keys_text(extra)} that the state "
            f"lacks: add them to the state, or {way_out}"
        )
    if missing:
        return (
            f"the state holds keys {_keys_text(missing)} that the checkpoint of step {step} "
            f"lacks: remove them from the state, or {way_out} and leave them as they are"
        )
    return None


def decode_into(
    target: Any, tree: Any, arrays: dict[str, np.ndarray], targets: Targets | None = None
) -> Any:
    """Rebuild the value of ``tree``, reusing ``target``'s containers and arrays in place.

    Returns the value to store at this position; containers, arrays, tensors and random
    generators that already exist in ``target`` are filled in place, so the
    application's own references see the restored state. A stateful object gets
    ``load_state_dict`` with the saved state dict (its tensors filled in place too).
    """
    return _decode(target, tree, arrays, targets or Targets(), False, "")


def _fresh_like(target: Any) -> dict:
    """An empty dict of ``target``'s kind, keeping a module state dict's ``_metadata``."""
    out: dict = {}
    if isinstance(target, dict) and type(target) is not dict:
        try:
            out = type(target)()
        except TypeError:
            out = {}
    meta = getattr(target, "_metadata", None)
    if meta is not None:
        try:
            out._metadata = meta  # type: ignore[attr-defined]
        except AttributeError:
            pass
    return out


def _decode(
    target: Any, tree: Any, arrays: dict[str, np.ndarray], targets: Targets, fresh: bool, path: str
) -> Any:
    """``fresh``: inside a state dict handed to ``load_state_dict``: containers are new and
    hold exactly the saved keys; arrays and tensors are still filled in place."""
    if isinstance(tree, list):
        held = target if isinstance(target, list) else []
        values = [
            _decode(held[i] if i < len(held) else None, t, arrays, targets, fresh, f"{path}/{i}")
            for i, t in enumerate(tree)
        ]
        if isinstance(target, list) and not fresh:
            target[:] = values
            return target
        return values
    if not isinstance(tree, dict):
        return tree
    tag = tree.get(TAG)
    if tag in ("dict", "kdict"):
        items = tree["v"].items() if tag == "dict" else [(k, t) for k, t in tree["v"]]
        held = target if isinstance(target, dict) else {}
        out = target if isinstance(target, dict) and not fresh else _fresh_like(target)
        for key, sub in items:
            out[key] = _decode(held.get(key), sub, arrays, targets, fresh, f"{path}/{key}")
        return out
    if tag == "stateful":
        if is_stateful(target) and not is_container(target):
            held = targets.state_dict(target)
            value = _decode(held, tree["v"], arrays, targets, True, path)
            if not targets.strict:
                value = _matching(value, held)
            try:
                target.load_state_dict(value)
            except Exception as exc:  # the object's own check of what it is given
                raise CheckpointError(
                    f"state[{path.strip('/') or '<root>'!r}]: {type(target).__name__}."
                    f"load_state_dict refused the saved state ({type(exc).__name__}: {exc})"
                ) from exc
            return target
        return _decode(target, tree["v"], arrays, targets, fresh, path)
    if tag == "tuple":
        return tuple(
            _decode(None, t, arrays, targets, fresh, f"{path}/{i}") for i, t in enumerate(tree["v"])
        )
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
    if tag == "tensor":
        data = arrays[tree["path"]]
        if tensors.is_dtensor(target):
            local = tensors.local_part(target)
            if not tensors.shares_memory(local, data):  # else read straight into it
                tensors.copy_into(local, data)  # check_fits ran first: same shape and dtype
            return target
        if tensors.is_tensor(target):
            if not tensors.shares_memory(target, data):  # else read straight into it
                tensors.copy_into(target, data)  # check_fits ran first: same shape and dtype
            return target
        return tensors.from_array(data, tree["dtype"], bool(tree.get("requires_grad")))
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


def _matching(saved: Any, held: Any) -> Any:
    """A state dict for a non-strict restore of an object: its own keys (``held``, its
    ``state_dict()``), with the saved values where the checkpoint has them."""
    if not (isinstance(saved, dict) and isinstance(held, dict) and held):
        return saved
    out = _fresh_like(saved)
    for key, value in held.items():
        out[key] = saved[key] if key in saved else value
    return out


def lookup(state: Any, path: str, targets: Targets | None = None) -> Any:
    """The application's value at an array path (escaped keys and list indices joined by
    '/'), seen through stateful objects' state dicts, or None when the state holds
    nothing there."""
    targets = targets or Targets()
    node = targets.open(state)
    for part in path.split("/") if path else []:
        node = targets.open(_child(node, part))
        if node is None:
            return None
    return node


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The key path where two JSON state trees first differ, or None when they are equal.
    Two nodes of one DTensor differ only where they differ beyond the ranks' own pieces."""
    if type(a) is not type(b):
        return path or "<root>"
    if isinstance(a, dict) and a.get(TAG) == "tensor" and "dtensor" in a and "dtensor" in b:
        a, b = _shared_piece(a), _shared_piece(b)
    if isinstance(a, dict) and a.get(TAG) in ("dict", "kdict", "tuple", "stateful"):
        if a.get(TAG) != b.get(TAG):
            return path or "<root>"
        if a.get(TAG) == "stateful" and a.get("type") != b.get("type"):
            return path or "<root>"
        ka, kb = dict(children(a)), dict(children(b))
        if len(ka) != len(children(a)) or len(kb) != len(children(b)):
            return None if a == b else (path or "<root>")
        for key in list(ka) + [k for k in kb if k not in ka]:
            where = _join(path, key) if key else path
            if key not in ka or key not in kb:
                return where or "<root>"
            if (found := first_difference(ka[key], kb[key], where)) is not None:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return path or "<root>"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (where := first_difference(x, y, _join(path, str(i)))) is not None:
                return where
        return None
    return None if a == b else (path or "<root>")


def _shared_piece(node: dict[str, Any]) -> dict[str, Any]:
    piece = node["dtensor"]
    if not isinstance(piece, dict):
        return node
    return {**node, "dtensor": {k: v for k, v in piece.items() if k not in PER_RANK_PIECE}}


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
            yield from scalar_leaves(sub, _join(path, part) if part else path)
        return
    yield path or "<root>", summarize(tree)


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
