"""Values declared replicated: identical on every rank, so written once, by rank 0.

Data-parallel ranks hold the same model parameters and optimizer state; an HPC code
holds the same global parameters or lookup tables. Such a value is named by its key
path (``"model"`` covers every array and scalar under ``state["model"]``). At each save
every rank hashes its copy (the arrays' block hashes, the JSON of the scalars); the
ranks compare the hashes, and when any rank's copy differs from rank 0's every rank
raises :class:`~hpcckpt.store.errors.CheckpointError` naming the value and the ranks.
Otherwise ranks other than 0 stand in an empty array for each replicated array: the
file stores rank 0's copy once (dataset attribute ``replicated = true``), and restore
gives every rank, on any rank count, that copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from hpcckpt.store.comm import Comm
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.io import blocks
from hpcckpt.store.tree.matching import first_difference
from hpcckpt.store.tree.queries import subtree


def normalize(names: Iterable[str] | str) -> tuple[str, ...]:
    """Declared names as key paths without surrounding slashes, deduplicated."""
    if isinstance(names, str):
        names = [names]
    out = []
    for name in names:
        if not isinstance(name, str) or not name.strip("/"):
            raise ValueError(f"replicated names key paths such as 'model', not {name!r}")
        out.append(name.strip("/"))
    return tuple(dict.fromkeys(out))


def covers(names: Iterable[str], path: str) -> bool:
    """Whether array path ``path`` lies under one of the replicated key paths."""
    return any(path == n or path.startswith(n + "/") for n in names)


def check_and_stand_in(
    comm: Comm,
    names: tuple[str, ...],
    tree: Any,
    arrays: dict[str, np.ndarray],
    block_size: int,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], set[str]]:
    """Compare every rank's copy of the replicated values; collective.

    Returns (arrays with empty stand-ins on ranks other than 0, the block hashes rank 0
    already computed of its replicated arrays, the replicated array paths). Raises
    CheckpointError on every rank alike when a name is not in the state or a copy differs.
    """
    rank = comm.rank
    problem = None
    digests: dict[str, Any] = {}
    hashes: dict[str, np.ndarray] = {}
    paths = sorted(p for p in arrays if covers(names, p))
    for name in names:
        try:
            node = subtree(tree, name)
        except KeyError:
            problem = f"replicated names {name!r}, which is not in the state"
            break
        digests[name] = json.dumps(node, sort_keys=True, allow_nan=True)
    if problem is None:
        for p in paths:
            hashes[p] = blocks.block_hashes(arrays[p], block_size)
            a = arrays[p]
            digests[p] = (a.dtype.str, tuple(a.shape), blocks.hashes_checksum(hashes[p]))
    everyone = comm.allgather((problem, digests if problem is None else None))
    problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(everyone) if p]
    if problems:
        raise CheckpointError(
            f"{'; '.join(problems[:4])}. Name key paths of the state (e.g. 'model')"
        )
    first = everyone[0][1]
    for r, (_, theirs) in enumerate(everyone[1:], start=1):
        for key in sorted(set(first) | set(theirs)):
            if first.get(key) == theirs.get(key):
                continue
            if key in names:  # the scalars differ: name the first key that does
                where = first_difference(
                    json.loads(first[key]) if key in first else None,
                    json.loads(theirs[key]) if key in theirs else None,
                    key,
                )
                what = f"value {where!r}"
            else:
                what = f"array {key!r}"
            raise CheckpointError(
                f"{what} is declared replicated (under {_owner(names, key)!r}) but differs "
                f"between rank 0 and rank {r} (compared by checksum): a replicated value must "
                "be identical on every rank. Synchronize it first (e.g. broadcast from rank 0), "
                "or do not declare it replicated"
            )
    if rank == 0:
        return arrays, hashes, set(paths)
    out = dict(arrays)
    for p in paths:
        a = arrays[p]
        out[p] = np.empty((0, *a.shape[1:]) if a.ndim else (0,), dtype=a.dtype)
    return out, {}, set(paths)


def _owner(names: Iterable[str], key: str) -> str:
    return next((n for n in names if key == n or key.startswith(n + "/")), key)
