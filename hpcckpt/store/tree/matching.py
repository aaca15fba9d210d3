"""A state held against a checkpoint's tree: the application's value at an array path,
whether its arrays fit the saved ones (shape, dtype), whether their keys match (a strict
restore refuses any difference, naming the keys), and where two trees first differ (the
ranks' trees of one state, beyond each rank's own DTensor pieces).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcckpt.store.tree import tensors
from hpcckpt.store.tree.state_tree import (
    TAG,
    Targets,
    children,
    is_container,
    is_stateful,
    join_path,
    key_part,
    unescape,
)


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


#: The entries of a DTensor's node that are this rank's own (its box, whether it stores
#: it, the mesh it ran on): the ranks' trees may differ there and still be one state.
PER_RANK_PIECE = ("offset", "holder", "mesh")


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
            where = join_path(path, key) if key else path
            if key not in ka or key not in kb:
                return where or "<root>"
            if (found := first_difference(ka[key], kb[key], where)) is not None:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return path or "<root>"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (where := first_difference(x, y, join_path(path, str(i)))) is not None:
                return where
        return None
    return None if a == b else (path or "<root>")


def _shared_piece(node: dict[str, Any]) -> dict[str, Any]:
    piece = node["dtensor"]
    if not isinstance(piece, dict):
        return node
    return {**node, "dtensor": {k: v for k, v in piece.items() if k not in PER_RANK_PIECE}}
