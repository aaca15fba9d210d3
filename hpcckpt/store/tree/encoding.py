"""A state in, agreed on by every rank: its tree and arrays for a save, and back into the
application's objects at a restore.

The save side is step 1 of the commit protocol (docs/format.md): every rank encodes its
state, replicated values are checked equal and left to rank 0, and one reduction agrees
that every rank could (a value that cannot be checkpointed is a TypeError on every rank,
naming the rank and key path). The directory and the node-local tier both save through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcckpt.store.agreement import Agreement
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.io import blocks
from hpcckpt.store.tree import devices, tensors
from hpcckpt.store.tree.options import ArrayOptions
from hpcckpt.store.tree.queries import dtensor_pieces
from hpcckpt.store.tree.replicated import check_and_stand_in
from hpcckpt.store.tree.state_tree import Targets, decode_into, encode, is_stateful


@dataclass
class LocalEncoding:
    """One rank's state encoded alone, before the ranks agree on it: its tree and arrays,
    or the error that kept it from being encoded."""

    tree: Any
    arrays: dict[str, Any]
    error: BaseException | None = None


def encode_local(state: Any) -> LocalEncoding:
    """This rank's state as a tree and arrays (no collective); a value that cannot be
    checkpointed is kept as the error the ranks agree on. Device tensors' copies into
    lent host buffers are complete when it returns."""
    try:
        tree, arrays = encode(state)
    except (TypeError, ValueError) as exc:
        return LocalEncoding(None, {}, exc)
    finally:
        devices.settle()
    return LocalEncoding(tree, arrays)


@dataclass
class Encoded:
    """One rank's encoded state, as every rank agreed on it."""

    tree: Any
    arrays: dict[str, Any]
    #: The bytes to store over all ranks (replicated arrays counted once).
    state_bytes: int
    #: Whether some rank answered yes to the question that rode on the agreement.
    answer: bool = False
    #: The replicated array paths, and rank 0's block hashes of them (computed by the check).
    replicated: set[str] = field(default_factory=set)
    known_hashes: dict[str, np.ndarray] = field(default_factory=dict)


class Encoder:
    """Encodes states for saves and decodes them at restores, collectively."""

    def __init__(self, agreement: Agreement, arrays: ArrayOptions, block_size: int) -> None:
        self.agreement = agreement
        self.replicated: tuple[str, ...] = tuple(arrays.replicated)
        self.block_size = block_size

    def encode(self, step: int, state: Any, answer: bool = False) -> Encoded:
        """The state's tree and arrays, agreed in one reduction that also carries each
        rank's ``answer`` to a yes/no question of the caller's (yes when any rank says
        yes: the chain check answers on rank 0 only); TypeError on every rank if any
        rank's state cannot be encoded."""
        return self.agree_on(step, encode_local(state), answer)

    def agree_on(
        self,
        step: int,
        local: LocalEncoding,
        answer: bool = False,
        agreement: Agreement | None = None,
    ) -> Encoded:
        """:meth:`encode`'s collective half, over ``agreement`` (the encoder's own when
        None): a staged save agrees on its copy (``local.arrays`` replaced by the staged
        copies) from a background thread."""
        agreement = agreement or self.agreement
        tree, arrays = local.tree, local.arrays
        mine = sum(a.nbytes for a in arrays.values())
        copies = {p: d for p, d in dtensor_pieces(tree).items() if _has_replicas(d)}
        state_bytes, said, replicas = agreement.agree(
            local.error,
            f"encoding the state of step {step}",
            TypeError,
            (mine, answer, len(copies)),
        )
        encoded = Encoded(tree, arrays, state_bytes, bool(said))
        if replicas:  # some DTensor is replicated over a mesh dimension: stored once
            arrays, hashes, dropped = check_replicas(
                agreement, copies, arrays, self.block_size, step
            )
            encoded.arrays, encoded.known_hashes = arrays, hashes
            encoded.state_bytes -= dropped
        if self.replicated:
            before = arrays
            encoded.arrays, encoded.known_hashes, encoded.replicated = check_and_stand_in(
                agreement.comm, self.replicated, tree, arrays, self.block_size
            )
            # Checked equal on every rank: all but rank 0 dropped the same bytes.
            replicated_bytes = sum(before[p].nbytes for p in encoded.replicated)
            encoded.state_bytes -= (agreement.nranks - 1) * replicated_bytes
        return encoded

    def decode(
        self, state: dict[str, Any], tree: Any, arrays: dict[str, Any], targets: Targets
    ) -> None:
        """Fill the application's state (``load_state_dict`` of its objects); agreed."""
        error: BaseException | None = None
        try:
            decode_into(state, tree, arrays, targets)
        except (CheckpointError, ValueError, TypeError) as exc:
            error = exc
        self.agreement.agree(error, "loading the restored state")


def _has_replicas(piece: dict[str, Any]) -> bool:
    return any(p == "R" and n > 1 for p, n in zip(piece["placements"], piece["mesh"], strict=True))


def check_replicas(
    agreement: Agreement,
    copies: dict[str, dict[str, Any]],
    arrays: dict[str, np.ndarray],
    block_size: int,
    step: int,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """Compare the copies of the DTensor pieces several ranks hold (Replicate
    placements) with the holder's, by block hashes; collective (one allgather of
    digests, no data). Returns (arrays with empty stand-ins for the copies that are
    not stored, this rank's block hashes of the pieces it stores, the bytes dropped over
    all ranks); CheckpointError on every rank when a copy differs."""
    digests, hashes = {}, {}
    for path, piece in copies.items():
        a = arrays[path]
        hashes[path] = blocks.block_hashes(a, block_size)
        digests[path] = (
            tuple(piece["offset"]),
            bool(piece["holder"]),
            a.dtype.str,
            tuple(a.shape),
            blocks.hashes_checksum(hashes[path]),
        )
    everyone = agreement.comm.allgather(digests)
    problems, dropped = [], 0
    for path in sorted(copies):
        held = {}
        for r, theirs in enumerate(everyone):
            got = theirs.get(path)
            if got is not None and got[1]:
                held[got[0]] = (r, got[2:])
        for r, theirs in enumerate(everyone):
            got = theirs.get(path)
            if got is None or got[1]:
                continue
            owner = held.get(got[0])
            if owner is None or owner[1] != got[2:]:
                problems.append(
                    f"DTensor {path!r}: rank {r}'s copy of the shard at {list(got[0])} differs "
                    f"from rank {owner[0] if owner else '?'}'s, which its Replicate placement "
                    "says it equals"
                )
            else:
                dropped += int(np.prod(got[3], dtype=np.int64)) * np.dtype(got[2]).itemsize
    if problems:
        raise CheckpointError(
            f"saving step {step}: {'; '.join(problems[:4])}. Synchronize the replicas (a "
            "collective of the model's replicate dimension) before saving"
        )
    out = dict(arrays)
    for path, piece in copies.items():
        if not piece["holder"]:
            a = arrays[path]
            out[path] = np.empty((0, *a.shape[1:]) if a.ndim else (0,), dtype=a.dtype)
            del hashes[path]
    return out, hashes, dropped


def state_bytes(value: Any) -> int:
    """The bytes of every numpy array and tensor inside a state, without encoding it (the
    Checkpointer sizes its first cost estimate with it before anything is measured)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if tensors.is_tensor(value):
        return tensors.nbytes(tensors.local_part(value) if tensors.is_dtensor(value) else value)
    if is_stateful(value):
        return state_bytes(value.state_dict())
    if isinstance(value, dict):
        return sum(state_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(state_bytes(v) for v in value)
    return 0
