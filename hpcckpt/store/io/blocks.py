"""Fixed-size blocks of an array and their xxh3-64 hashes: what makes a save incremental.

A rank's array is seen as its C-order elements split into blocks of ``block_size``
bytes (``block_elems = block_size // itemsize`` elements; the last block of a rank may
be shorter). One pass over the bytes gives every block's hash; the rank's checksum of
the array is the xxh3-64 of that list of hashes (little-endian uint64), so a save
reads the state once to both checksum it and find its dirty blocks.

Measure the hash throughput per block size with ``python -m hpcckpt.store.io.blocks``.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

#: The default block: 1 MiB. Hashing runs at full speed from 256 KiB up (see
#: docs/format.md, "Incremental checkpoints"), and 1 MiB keeps the per-block work (one
#: write call per run of dirty blocks, 24 bytes of index) negligible at any dirty fraction.
DEFAULT_BLOCK_SIZE = 1 << 20
#: A delta must leave out this many bytes per array and rank (ChainPolicy.min_delta_saving):
#: what 0.5 GB/s writes in the 0.13 ms that a delta's second dataset per array costs to
#: create and validate (measured here, docs/performance.md).
DEFAULT_MIN_DELTA_SAVING = 64 << 10
#: Smallest block allowed; block sizes are multiples of 16 (the largest itemsize).
MIN_BLOCK_SIZE = 4096


def check_block_size(block_size: int) -> int:
    """``block_size`` as an int, or ValueError when it is too small or not a multiple of 16."""
    if int(block_size) != block_size or block_size < MIN_BLOCK_SIZE or block_size % 16:
        raise ValueError(
            f"block_size must be an integer >= {MIN_BLOCK_SIZE} and a multiple of 16 bytes, "
            f"not {block_size!r}"
        )
    return int(block_size)


def block_elems(itemsize: int, block_size: int) -> int:
    """Elements per block of an array whose elements have ``itemsize`` bytes."""
    return max(1, block_size // itemsize)


def block_bytes(dtype: np.dtype, block_size: int) -> int:
    """Bytes per block of an array of ``dtype`` (whole elements, at most ``block_size``)."""
    return block_elems(dtype.itemsize, block_size) * dtype.itemsize


def nblocks(nelems: int, elems: int) -> int:
    return -(-nelems // elems)


def flat_bytes(data: np.ndarray) -> memoryview:
    """The C-order bytes of ``data`` (copied only when it is not C-contiguous)."""
    data = np.ascontiguousarray(data)
    return memoryview(data.reshape(-1).view(np.uint8))


def block_hashes(data: np.ndarray, block_size: int) -> np.ndarray:
    """uint64[nblocks]: the xxh3-64 of each block of ``data``'s C-order bytes."""
    step = block_bytes(data.dtype, block_size)
    out = np.empty(nblocks(data.nbytes, step), dtype=np.uint64)
    BlockHasher(data, block_size, out).upto(data.nbytes)
    return out


class BlockHasher:
    """The block hashes of ``data``, computed piece by piece as its bytes are handed on.

    ``upto(n)`` hashes every block that ends within the first ``n`` bytes (and the last,
    shorter block once ``n`` is the whole length) into ``out``, which ends up equal to
    :func:`block_hashes`. A synchronous save calls it while its direct writes run, so
    the hashing costs CPU time the save would spend waiting for the device.
    """

    def __init__(self, data: np.ndarray, block_size: int, out: np.ndarray) -> None:
        self.step = block_bytes(data.dtype, block_size)
        self.raw = flat_bytes(data) if data.size else memoryview(b"")
        self.out = out
        self.done = 0  # blocks hashed
        if out.size != nblocks(len(self.raw), self.step):
            raise ValueError(f"{out.size} hash slots for {len(self.raw)} bytes")

    def upto(self, nbytes: int) -> None:
        stop = self.out.size if nbytes >= len(self.raw) else nbytes // self.step
        self.blocks(range(self.done, stop))
        self.done = max(self.done, stop)

    def blocks(self, which: Iterable[int]) -> int:
        """Hash the blocks ``which`` into ``out``; the bytes read."""
        digest = xxhash.xxh3_64_intdigest
        read = 0
        for j in which:
            piece = self.raw[j * self.step : (j + 1) * self.step]
            self.out[j] = digest(piece)
            read += len(piece)
        return read


def rehash(data: np.ndarray, block_size: int, hashes: np.ndarray, which: np.ndarray) -> int:
    """Hash again only the blocks ``which`` of ``data`` into ``hashes``; the bytes read."""
    return BlockHasher(data, block_size, hashes).blocks(which.tolist())


def hashes_checksum(hashes: np.ndarray) -> int:
    """The checksum of a rank's array: xxh3-64 of its block hashes as little-endian uint64."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(hashes, dtype="<u8").tobytes())


def runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """Sorted block indices as maximal runs ``[start, stop)`` of consecutive blocks."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return []
    breaks = np.nonzero(np.diff(idx) != 1)[0]
    starts = np.concatenate([[0], breaks + 1])
    stops = np.concatenate([breaks + 1, [idx.size]])
    return [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(starts, stops, strict=True)]


@dataclass(frozen=True)
class ChainPolicy:
    """When a save may be incremental, and when the chain must restart with a full one.

    ``incremental``: write only the changed blocks when a previous checkpoint of the
    same layout is known. A full checkpoint is written instead when the chain already
    holds ``max_chain`` incremental checkpoints, when the bytes written by the
    chain's incrementals (this one included) would pass ``max_chain_fraction`` of a
    full checkpoint (then most blocks change and a full one costs about the same), or
    when the delta would leave out fewer than ``min_delta_saving`` bytes per array and
    rank: each array of a delta costs two HDF5 datasets instead of one, and a restore
    reads every file of the chain, which for a state of many small arrays costs more
    than writing them whole.
    """

    incremental: bool = True
    max_chain: int = 8
    max_chain_fraction: float = 0.5
    min_delta_saving: int = DEFAULT_MIN_DELTA_SAVING

    def __post_init__(self) -> None:
        if int(self.max_chain) != self.max_chain or self.max_chain < 1:
            raise ValueError(f"max_chain must be a positive integer, not {self.max_chain!r}")
        if not 0 < self.max_chain_fraction:
            value = self.max_chain_fraction
            raise ValueError(f"max_chain_fraction must be positive, not {value!r}")
        value = self.min_delta_saving
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"min_delta_saving must be a byte count >= 0 (0: any saving), not {value!r}"
            )

    def full_by_count(self, parent: ChainState | None) -> bool:
        """Whether the save after ``parent`` is a full one whatever changed: incremental
        saves are off, there is no parent, or its chain is as long as allowed."""
        return self._why_full_by_count(parent) is not None

    def _why_full_by_count(self, parent: ChainState | None) -> str | None:
        if not self.incremental:
            return "incremental saves are off"
        if parent is None:
            return (
                "no checkpoint of this run to build on (the first save, a restore on another"
                " rank count, or a file of the last chain missing or marked bad)"
            )
        if len(parent.chain) > self.max_chain:
            return f"the chain already holds max_chain={self.max_chain} incremental checkpoints"
        return None

    def why_full(
        self,
        parent: ChainState | None,
        fits: bool,
        delta_bytes: int,
        state_bytes: int,
        arrays: int,
        ranks: int,
    ) -> str | None:
        """Why this save is full rather than a delta of ``parent`` (None: a delta).

        ``fits``: every rank's arrays match ``parent`` and its chain is intact;
        ``delta_bytes``: the delta's array bytes over all ranks; ``state_bytes``: a full
        checkpoint's; ``arrays``, ``ranks``: the datasets and ranks of the file.
        """
        by_count = self._why_full_by_count(parent)
        if by_count is not None:
            return by_count
        assert parent is not None  # else _why_full_by_count named it
        if not fits:
            return (
                "the arrays, ranks or block size differ from the last checkpoint's, or this"
                " step's file name is one its chain needs"
            )
        if parent.chain_bytes + delta_bytes > self.max_chain_fraction * state_bytes:
            return (
                f"the chain's deltas would pass max_chain_fraction={self.max_chain_fraction}"
                " of a full checkpoint"
            )
        saved = state_bytes - delta_bytes
        if saved < self.min_delta_saving * arrays * ranks:
            per = saved // max(1, arrays * ranks)
            return (
                f"a delta would leave out {per:,} bytes per array and rank, less than "
                f"min_delta_saving={self.min_delta_saving:,}"
            )
        return None


def delta_did_not_pay(written: Any, parent: ChainState) -> bool:
    """Whether ``written`` (a file's ``kind`` and ``full_reason``) is full instead of a
    delta of ``parent`` because its delta alone would not pay (the reason
    :meth:`ChainPolicy.why_full` gave), not for the chain's length or the layout."""
    why = written.full_reason
    if written.kind != "full" or why is None:
        return False
    return "min_delta_saving" in why or (
        "max_chain_fraction" in why and parent.chain_bytes == 0  # the delta alone
    )


@dataclass(frozen=True)
class ChainState:
    """What one rank remembers of the last committed checkpoint, to save the next as a delta.

    Built after a committed save from the hashes computed while saving, or after a
    restore from the hashes stored in the restored file (never from the data).
    """

    step: int
    uid: str
    block_size: int
    nranks: int
    specs: dict[str, tuple[str, tuple[int, ...], bool]]  # path -> (dtype, shape, distributed)
    hashes: dict[str, np.ndarray]  # this rank's block hashes per array path
    chain: tuple[tuple[str, int, str], ...]  # (name, step, uid) of the base ... this one
    chain_bytes: int  # array bytes written by the chain's incrementals, over all ranks
    state_bytes: int  # array bytes of the whole state, over all ranks

    @property
    def names(self) -> set[str]:
        return {name for name, _, _ in self.chain}

    def fits(self, nranks: int, block_size: int, specs: dict[str, Any]) -> bool:
        """Whether this rank's state can be saved as a delta against this checkpoint."""
        return nranks == self.nranks and block_size == self.block_size and specs == self.specs


def specs_of(
    arrays: dict[str, Any], distributed: Any
) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """What :meth:`ChainState.fits` compares: each array's dtype, shape, and whether it is
    distributed."""
    return {p: (a.dtype.str, tuple(a.shape), p in distributed) for p, a in arrays.items()}


def dirty_elems(dirty: np.ndarray, elems: int, count: int) -> int:
    """Elements covered by the blocks ``dirty`` of an array of ``count`` elements."""
    if dirty.size == 0:
        return 0
    return int(np.minimum(elems, count - dirty.astype(np.int64) * elems).sum())


def throughput(block_size: int, mib: int = 256, repeat: int = 5) -> float:
    """Bytes per second :func:`block_hashes` reaches on one core (best of ``repeat``)."""
    data = np.random.default_rng(0).integers(0, 255, size=mib * 2**20, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        block_hashes(data, block_size)
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best


if __name__ == "__main__":  # pragma: no cover
    for size in (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20):
        rate = throughput(size)
        print(f"block {size >> 10:>6} KiB: xxh3_64 {rate / 2**20:7.0f} MiB/s on one core")
