"""Which blocks of a device tensor changed since the last save, found on the device itself.

An incremental save of GPU state would otherwise copy every byte to the host and hash it
there. Here each block of a tensor's C-order bytes gets a checksum computed by torch
kernels on the tensor's own device; the checksums are compared there with those of the
bytes already in the tensor's host staging buffer (the last save's copy), and only the
blocks that differ cross to the host. The buffer then holds the whole tensor again, so
whatever the save writes (a delta or a full file) comes from a complete copy; the xxh3
block hashes the file needs are recomputed only for the blocks copied.

The checksum of a block (:func:`block_checksums`): its bytes, zero-padded to whole
32-bit words, read as signed words ``w_0 .. w_{n-1}`` (each word's value widened to
int64), give three sums modulo 2**64::

    A = sum m_i * w_i     B = sum k_i * w_i     C = sum (i + 1) * w_i

``m_i`` and ``k_i`` are fixed odd 64-bit multipliers, drawn independently from a seeded
generator (independent of the data). A change of the block turns each word into
``w_i + d_i`` with ``|d_i| < 2**32``; it is missed only if all three sums of ``m_i d_i``,
``k_i d_i`` and ``(i + 1) d_i`` vanish modulo 2**64:

- a change confined to one word (a single-bit flip, a sign flip of any float, any change
  of one element of 4 bytes or less; words never straddle such elements) is always
  caught: ``m_i`` is odd, hence invertible modulo 2**64, and ``d_i`` is not 0 modulo 2**64;
- a swap of two different words ``i < j`` (two elements of 4 bytes) is always caught:
  C changes by ``(w_i - w_j)(j - i)``, not 0 and under 2**63 in magnitude for blocks
  under 2 GiB; a swap of two 1- or 2-byte elements in different words is caught too (at
  the same place in their words by C as above, at different places by A: the term with
  the lower power of two is odd times it, and nothing cancels it);
- any other change (shifts, scattered edits, 8-byte elements whose two word changes
  cancel in C) is missed by A with probability at most 2**-32 over the multipliers
  (the smallest power of two dividing a nonzero ``d_i`` is below 2**32), and by A and B
  together, drawn independently, with probability at most 2**-64.

A save the chain policy makes full by count (the first, or one after a chain as long as
allowed) copies every byte and checksums it afresh, so a miss, however unlikely, lives
one chain at most. Tensors under :data:`WHOLE_BELOW` are copied whole (cheaper than the
kernels), and so is a tensor found mostly changed, for its next :data:`REST_SAVES` saves.
CPU tensors and numpy arrays never come here (their hashes are exact); tests force the
path on CPU tensors with ``on_cpu=True``.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcckpt.store.io import blocks
from hpcckpt.store.tree import devices

log = logging.getLogger("hpcckpt.store")

#: Bytes per checksummed block: the store's default block, so that on default settings
#: one changed checksum block is one changed file block.
BLOCK_BYTES = blocks.DEFAULT_BLOCK_SIZE
#: Words widened to int64 at a time (bounds the device memory the sums borrow: 8 bytes
#: per word for the widened words and 24 for the three products, 64 MiB at this size;
#: where even that is not free, the tensor is copied whole).
_CHUNK_WORDS = 2 << 20
#: Tensors smaller than this are copied whole: the copy costs less than the kernels'
#: launches and the wait for their verdict (tens of microseconds per tensor).
WHOLE_BELOW = 256 << 10
#: What a save's copies of lent buffers do (:meth:`DeviceChecksums.begin`): only the
#: blocks whose checksums changed; every byte, checksummed afresh (a full save); every
#: byte, no checksums at all (exact hashing asked for).
COPIES = ("changed", "all", "off")
#: A tensor whose blocks more than this fraction changed since its last save is copied
#: whole, without checksums, for its next REST_SAVES saves (it is rewritten between
#: saves: the checksums would only add their cost to the copy), then compared again.
DENSE = 0.5
REST_SAVES = 4
_SEED = 0x6870_6363_6B70_7421  # any fixed value: the multipliers must not depend on data
_SUMS = 3


def _torch() -> Any:
    import torch  # only reached with a tensor in hand

    return torch


def _out_of_memory() -> type[BaseException]:
    """What torch raises when a device allocation fails."""
    torch = _torch()
    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


_WEIGHTS: dict[tuple[str, int], Any] = {}


def _weights(device: Any, nwords: int) -> Any:
    """int64[3, nwords] on ``device``: the odd multipliers of A and B, and i + 1 for C."""
    key = (str(device), nwords)
    w = _WEIGHTS.get(key)
    if w is None:
        torch = _torch()
        rng = np.random.default_rng(_SEED)
        odd = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, (2, nwords)) | 1
        table = np.concatenate([odd, np.arange(1, nwords + 1, dtype=np.int64)[None]])
        w = torch.from_numpy(table).to(device)
        _WEIGHTS[key] = w
    return w


def _as_bytes(tensor: Any) -> Any:
    """uint8[nbytes]: ``tensor``'s C-order bytes on its device (a copy only when needed)."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    torch = _torch()
    try:
        return flat.view(torch.uint8)
    except RuntimeError:  # e.g. a view whose offset is not whole words: take a copy
        return flat.clone().view(torch.uint8)


def block_checksums(tensor: Any, block_bytes: int = BLOCK_BYTES) -> Any:
    """int64[nblocks, 3] on ``tensor``'s device: the sums A, B, C (module docstring) of
    each block of ``block_bytes`` bytes of its C-order bytes (the last may be shorter)."""
    torch = _torch()
    raw = _as_bytes(tensor)
    nbytes = raw.numel()
    n = blocks.nblocks(nbytes, block_bytes)
    out = torch.empty((n, _SUMS), dtype=torch.int64, device=raw.device)
    if n == 0:
        return out
    nwords = -(-block_bytes // 4)
    weights = _weights(raw.device, nwords)
    full = nbytes // block_bytes
    rows = max(1, _CHUNK_WORDS // nwords)
    for a in range(0, full, rows):
        b = min(full, a + rows)
        piece = raw[a * block_bytes : b * block_bytes].view(b - a, block_bytes)
        _sums(piece, weights, out[a:b])
    if full < n:  # the last, shorter block
        _sums(raw[full * block_bytes :].view(1, -1), weights, out[full:])
    return out


def _sums(piece: Any, weights: Any, out: Any) -> None:
    """The sums of each row of ``piece`` (uint8[rows, bytes]) into ``out`` (int64[rows, 3]);
    a row's zero padding adds nothing, so a short row is padded to whole words only."""
    torch = _torch()
    pad = -piece.shape[1] % 4
    if pad:
        piece = torch.nn.functional.pad(piece, (0, pad))
    if piece.storage_offset() % 4:
        piece = piece.clone()
    words = piece.view(torch.int32).to(torch.int64)
    out.copy_((words[:, None, :] * weights[None, :, : words.shape[1]]).sum(dim=2))


@dataclass
class Copied:
    """What one save's device-to-host copies moved, over every tensor copied."""

    blocks: int = 0  # checksum blocks copied
    total: int = 0  # checksum blocks of those tensors
    bytes: int = 0  # bytes copied
    tensors: int = 0


@dataclass
class _Kept:
    """What is known of one host buffer's bytes: their device checksums, their xxh3."""

    host: weakref.ref[Any]
    sums: Any  # int64[nblocks, 3] on the device the bytes came from
    block: int  # checksum block bytes
    rest: int = 0  # saves left copied whole without checksums (DENSE)
    hashes: np.ndarray | None = None  # xxh3 block hashes at ``hash_block`` (None: none)
    hash_block: int = 0
    stale: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # per checksum block


class DeviceChecksums:
    """The device checksums of the host buffers a staged save lends (one per tensor).

    :meth:`copy` is the device-to-host copy of a lent buffer: whole the first time (or
    with ``"all"`` or ``"off"``), else only the blocks whose checksum changed.
    :meth:`hashes` gives the buffer's xxh3 block hashes, recomputed only where bytes
    were copied since. ``on_cpu``: CPU tensors too (tests; a save never needs it).
    Tensors under ``whole_below`` bytes are copied whole (:data:`WHOLE_BELOW`).
    """

    def __init__(
        self, on_cpu: bool = False, block_bytes: int = BLOCK_BYTES, whole_below: int = WHOLE_BELOW
    ) -> None:
        self.on_cpu = on_cpu
        self.block_bytes = blocks.check_block_size(block_bytes)
        self.whole_below = whole_below
        #: This save's copies, one of :data:`COPIES`.
        self.copies = "changed"
        #: What this save's copies moved (reset by :meth:`begin`).
        self.copied = Copied()
        self._kept: dict[int, _Kept] = {}  # host data_ptr -> what its bytes are

    def applies(self, tensor: Any) -> bool:
        """Whether ``tensor``'s host copies go through here."""
        return self.on_cpu or not devices.on_host(tensor)

    def begin(self, copies: str = "changed") -> None:
        """A save starts: count its copies anew; ``copies``: one of :data:`COPIES`."""
        if copies not in COPIES:
            raise ValueError(f"copies must be one of {', '.join(COPIES)}, not {copies!r}")
        self.copies = copies
        self.copied = Copied()
        self._kept = {p: k for p, k in self._kept.items() if k.host() is not None}

    def forget(self) -> None:
        """Drop every kept checksum (the buffers were freed)."""
        self._kept.clear()

    def _entry(self, host: Any) -> _Kept | None:
        kept = self._kept.get(int(host.data_ptr()))
        if kept is None or kept.host() is not host:
            return None
        return kept

    def copy(self, tensor: Any, host: Any) -> None:
        """Make ``host`` (a contiguous CPU tensor of ``tensor``'s shape and dtype) hold
        ``tensor``'s values, copying only the blocks whose checksum differs from those
        of the bytes ``host`` already holds."""
        nbytes = host.numel() * host.element_size()
        self.copied.tensors += 1
        if nbytes == 0:
            return
        step = blocks.block_elems(host.element_size(), self.block_bytes) * host.element_size()
        n = blocks.nblocks(nbytes, step)
        kept = self._entry(host)
        if kept is None or kept.block != step:
            kept = _Kept(weakref.ref(host), None, step, stale=np.ones(n, bool))
            self._kept[int(host.data_ptr())] = kept
        changing = self.copies == "changed"
        if nbytes < self.whole_below or self.copies == "off" or (changing and kept.rest > 0):
            kept.rest = max(0, kept.rest - 1)
            kept.sums = None  # the next comparing save computes them afresh
            changed = self._whole(tensor, host, n)
        else:
            try:
                changed, sums, compared = self._copy_changed(tensor, host, kept, step, changing)
            except _out_of_memory() as exc:  # the device is full: copy as without checksums
                log.info("device checksums skipped for a tensor, its device is full: %s", exc)
                kept.sums, kept.rest = None, REST_SAVES
                changed = self._whole(tensor, host, n)
            else:
                if compared and changed.size > DENSE * n:
                    kept.rest = REST_SAVES
                kept.sums = sums
        kept.stale[changed] = True
        self.copied.blocks += int(changed.size)
        self.copied.total += n
        self.copied.bytes += int(np.minimum(step, nbytes - changed.astype(np.int64) * step).sum())

    @staticmethod
    def _whole(tensor: Any, host: Any, n: int) -> np.ndarray:
        """Copy every value (no device memory taken); the blocks copied: all ``n``."""
        devices.copy_to_host(tensor.detach(), host)
        return np.arange(n)

    @staticmethod
    def _copy_changed(
        tensor: Any, host: Any, kept: _Kept, step: int, changing: bool
    ) -> tuple[np.ndarray, Any, bool]:
        """Copy into ``host`` the blocks of ``tensor`` whose checksums differ from
        ``kept``'s (every block unless ``changing`` and ``kept`` has sums); returns the
        blocks copied, the new checksums (on the device) and whether they were compared.
        Without a comparison the copy is issued first and the checksums are queued after
        it on the same stream: the copy never waits for them."""
        # conjugate and negative views resolved: the values are compared and copied
        flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        elems = step // host.element_size()
        old = kept.sums
        if changing and old is not None and old.device == flat.device:
            sums = block_checksums(flat, step)
            changed = (sums != old).any(dim=1).nonzero().reshape(-1).cpu().numpy()
            devices.copy_runs(flat, host, [(a * elems, b * elems) for a, b in blocks.runs(changed)])
            return changed, sums, True
        devices.copy_runs(flat, host, [(0, flat.numel())])
        sums = block_checksums(flat, step)  # for the next save's comparison
        return np.arange(sums.shape[0]), sums, False

    def hashes(self, array: np.ndarray, block_size: int) -> np.ndarray | None:
        """The xxh3 block hashes of ``array`` (a lent buffer's numpy view, whole), computed
        again only for the blocks copied since they were last asked; None when ``array``
        is no buffer this object copied into."""
        kept = self._kept.get(int(array.__array_interface__["data"][0]))
        host = None if kept is None else kept.host()
        if kept is None or host is None or host.numel() * host.element_size() != array.nbytes:
            return None
        if kept.hashes is None or kept.hash_block != block_size:
            kept.hashes = blocks.block_hashes(array, block_size)
            kept.hash_block = block_size
        else:
            stale = _hash_blocks(np.flatnonzero(kept.stale), kept.block, array, block_size)
            blocks.rehash(array, block_size, kept.hashes, stale)
        kept.stale[:] = False
        return kept.hashes.copy()


def _hash_blocks(changed: np.ndarray, step: int, array: np.ndarray, block_size: int) -> np.ndarray:
    """The hash blocks of ``array`` that overlap the checksum blocks ``changed``."""
    if changed.size == 0:
        return changed
    hstep = blocks.block_bytes(array.dtype, block_size)
    last = blocks.nblocks(array.nbytes, hstep) - 1
    first = changed.astype(np.int64) * step // hstep
    end = np.minimum(((changed.astype(np.int64) + 1) * step - 1) // hstep, last)
    spans = [np.arange(a, b + 1) for a, b in zip(first.tolist(), end.tolist(), strict=True)]
    return np.unique(np.concatenate(spans))
