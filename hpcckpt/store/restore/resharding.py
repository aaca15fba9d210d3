"""Restart on a different number of ranks: who reads which rows, and which scalars carry over.

Pure functions, no MPI and no files: the store gathers what each rank asks for and
calls these on every rank with the same inputs, so every rank reaches the same
answer (or the same error) before anything is read or overwritten.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.tree.matching import first_difference

#: What a rank asks for: ("count", n) rows after the previous rank's, or ("range", lo, hi).
Request = tuple[Any, ...]


def even_split(rows: int, nranks: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of ``rank`` when ``rows`` are split as evenly as possible, in rank order."""
    base, extra = divmod(rows, nranks)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def resolve_ranges(name: str, requests: Sequence[Request], rows: int) -> list[tuple[int, int]]:
    """Every new rank's rows of the global array ``name`` from what each rank asked for.

    Raises CheckpointError naming the array when the ranks' requests do not tile the
    ``rows`` rows of the checkpoint exactly, in rank order.
    """
    kinds = {r[0] for r in requests}
    if kinds == {"count"}:
        ranges, lo = [], 0
        for req in requests:
            ranges.append((lo, lo + int(req[1])))
            lo += int(req[1])
    elif kinds == {"range"}:
        ranges = [(int(r[1]), int(r[2])) for r in requests]
    else:
        holders = [i for i, r in enumerate(requests) if r[0] == "count"]
        raise CheckpointError(
            f"state[{name!r}]: ranks {holders} hold an array and the others do not; pass an "
            "array on every rank (its length along axis 0 is the rank's share) or on none"
        )
    pos = 0
    for rank, (lo, hi) in enumerate(ranges):
        if lo != pos or hi < lo:
            raise CheckpointError(
                f"state[{name!r}]: rank {rank} asks for rows [{lo}, {hi}), expected to start at "
                f"row {pos}; the ranks' shares must tile the global array in rank order"
            )
        pos = hi
    if pos != rows:
        raise CheckpointError(
            f"state[{name!r}]: the ranks' shares add up to {pos} rows along axis 0, the "
            f"checkpoint's global array has {rows}; restore with the same global problem size"
        )
    return ranges


def common_tree(trees: Sequence[Any], saved: int, now: int) -> Any:
    """The one state tree every new rank takes when the rank count changed.

    Scalars are per rank in a checkpoint: when ``saved`` ranks wrote equal trees, the
    value is unambiguous; otherwise there is no telling which value a new rank should
    take, so this raises CheckpointError naming the first key that differs.
    """
    for rank, tree in enumerate(trees[1:], start=1):
        where = first_difference(trees[0], tree)
        if where is not None:
            raise CheckpointError(
                f"state[{where!r}] differs between rank 0 and rank {rank} of the {saved} ranks "
                f"that wrote the checkpoint, and this run has {now} ranks: hpcckpt cannot tell "
                "which value each new rank should take. Keep per-rank values in arrays declared "
                f"distributed, make the value equal on every rank, or restart with {saved} ranks"
            )
    return trees[0]
