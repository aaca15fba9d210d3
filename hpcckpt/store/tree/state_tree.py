"""Turn a state (nested dicts and lists of arrays and scalars) into JSON plus arrays, and back.

No pickle: every value maps to a JSON node, and every numpy array or torch tensor to a
named dataset. An object with ``state_dict()``/``load_state_dict()`` (a torch module,
optimizer, scheduler, data loader, or any class following that convention) is saved as
its state dict and restored by calling ``load_state_dict`` with what was saved. A value
of any other type is a ``TypeError`` that names its key path.

Encoding, decoding and :func:`children` (the walk every reader of a tree uses) stay in
one module: they are mirror images of one tree grammar (dicts, int-keyed dicts, lists,
tuples, scalars, arrays, tensors, stateful objects), and split apart a node kind added on
one side could be forgotten on the other. Questions a tree answers without the state
are in :mod:`.queries`; a state held against a checkpoint (its keys, its arrays' shapes,
where two trees differ) in :mod:`.matching`.
"""

from __future__ import annotations

import base64
import functools
import sys
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
    return _escaped(key)


@functools.lru_cache(maxsize=1 << 14)
def _escaped(key: str) -> str:
    """:func:`escape` of a str (cached: a state's keys are the same at every save)."""
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


def join_path(prefix: str, part: str) -> str:
    return f"{prefix}/{part}" if prefix else part


def is_stateful(value: Any) -> bool:
    """Whether ``value`` follows the ``state_dict()``/``load_state_dict()`` convention."""
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple)) or tensors.is_tensor(value)


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
                out[key] = _encode(item, join_path(path, escape(key)), arrays)
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
            items.append([key, _encode(item, join_path(path, part), arrays)])
        return {TAG: "kdict", "v": items}
    if isinstance(value, list):
        return [_encode(item, join_path(path, str(i)), arrays) for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return {
            TAG: "tuple",
            "v": [_encode(v, join_path(path, str(i)), arrays) for i, v in enumerate(value)],
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


class Targets:
    """The application's values a restore fills, seen through stateful objects: the
    ``state_dict()`` of each object is taken once per restore and reused, so the bytes
    read straight into its tensors are the ones ``load_state_dict`` receives.

    ``strict`` (the default): the state's keys and the checkpoint's must be the same
    (:func:`.matching.check_keys`); False: what matches is restored (an object gets its saved
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
