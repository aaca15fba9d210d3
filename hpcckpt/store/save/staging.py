"""Host memory a staged save copies the state into: buffers kept between saves, in a budget.

A staged save splits a checkpoint in two (docs/async-and-fast-tier.md). In the foreground
each rank copies its arrays into a staging area: these host buffers (:class:`HostBuffers`)
or files on a node-local tier (:mod:`hpcckpt.store.tier.copies`); in the background a
thread writes them into the checkpoint file (:mod:`hpcckpt.store.save.background`). The
buffers are reused from save to save (page-aligned, in huge pages when large, mapped and
populated ahead by a restore's reservation), device tensors are copied straight into
host buffers lent for them (pinned for CUDA), and the block hashes are computed during
the copy only where the save needs them in the foreground (to find a delta's blocks).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from typing import Any

import numpy as np
import xxhash

from hpcckpt.store.io import blocks, memory
from hpcckpt.store.io.direct_io import ring_buffers
from hpcckpt.store.save import staging_budget
from hpcckpt.store.save.device_checksums import DeviceChecksums
from hpcckpt.store.tree import devices, tensors
from hpcckpt.store.tree.state_tree import is_stateful

__all__ = ["HostBuffers", "copy_and_hash", "device_tensors"]

log = logging.getLogger("hpcckpt.store")

#: Buffers from this size on are mapped on their own, in huge pages, populated at once.
_MAPPED_BYTES = 2 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels fault the pages in on first write


def _populate(area: mmap.mmap) -> None:
    """Advise ``area`` into transparent huge pages and fault all its pages in, one call
    (the GIL is released meanwhile)."""
    for advice in (getattr(mmap, "MADV_HUGEPAGE", None), _MADV_POPULATE_WRITE):
        if advice is not None:
            with contextlib.suppress(OSError):
                area.madvise(advice)


def new_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A C-contiguous host array for a staged copy, its pages present from the start.

    A large one is an anonymous map advised into transparent huge pages and populated
    in one call: the first save's copy then costs about twice a later one's instead of
    one page fault per 4 KiB (three to ten times a copy into touched memory).
    """
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if nbytes < _MAPPED_BYTES:
        return np.empty(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _populate(area)
    return np.frombuffer(area, dtype=dtype, count=count).reshape(shape)


def _page_up(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def host_array_sizes(value: Any) -> list[int]:
    """The bytes of each array of a state a staged save copies into a mapped buffer of its
    own (numpy arrays and host tensors of at least 2 MiB; a DTensor's local part), without
    encoding it. Device tensors are left out: their copies land in lent buffers."""
    if isinstance(value, np.ndarray):
        return [value.nbytes] if value.nbytes >= _MAPPED_BYTES else []
    if tensors.is_tensor(value):
        local = tensors.local_part(value) if tensors.is_dtensor(value) else value
        size = tensors.nbytes(local)
        return [size] if size >= _MAPPED_BYTES and devices.on_host(local) else []
    if is_stateful(value):
        return host_array_sizes(value.state_dict())
    if isinstance(value, dict):
        return [n for v in value.values() for n in host_array_sizes(v)]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in host_array_sizes(v)]
    return []


def device_tensors(value: Any, cpu: bool = False) -> list[Any]:
    """The tensors of a state whose copies a staged save takes into lent host buffers, in
    the order the save meets them: those on a device holding values (a DTensor's local
    part), and with ``cpu`` CPU tensors too (tests of the device path)."""
    if tensors.is_tensor(value):
        local = tensors.local_part(value) if tensors.is_dtensor(value) else value
        lent = cpu or not devices.on_host(local)
        return [local] if lent and devices.unsupported(local) is None else []
    if is_stateful(value):
        return device_tensors(value.state_dict(), cpu)
    if isinstance(value, dict):
        return [t for v in value.values() for t in device_tensors(v, cpu)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in device_tensors(v, cpu)]
    return []


def _lent_key(tensor: Any) -> tuple[Any, ...]:
    """Lent buffers are kept and reused per shape, dtype and pinning."""
    return (tuple(tensor.shape), str(tensor.dtype), devices.pinned(tensor))


class _Pinning:
    """Host buffers for device tensors' copies (pinned for CUDA) allocated by a thread of
    their own before the first save: page-locking took about 0.6 s per GiB on an H200 node,
    which inside the first save's blocked window made it 17-19 times a later one."""

    def __init__(self, like: list[Any]) -> None:
        self.nbytes = sum(tensors.nbytes(t) for t in like)
        self.made: dict[tuple[Any, ...], list[Any]] = {}
        memory.promise(self.nbytes)
        self.promised = self.nbytes  # until allocated: these bytes in the promise
        self.thread = threading.Thread(
            target=self._make, args=(like,), name="hpcckpt-pinning", daemon=True
        )
        self.thread.start()

    def _make(self, like: list[Any]) -> None:
        try:
            for t in like:
                self.made.setdefault(_lent_key(t), []).append(devices.empty_host(t))
        except Exception as exc:  # the save allocates what is missing, as without this
            log.info("host buffers for device tensors not made ahead: %s", exc)
        finally:
            memory.settle(self.nbytes)
            self.promised = 0

    def take(self) -> dict[tuple[Any, ...], list[Any]]:
        """The buffers made (waited for)."""
        self.thread.join()
        return self.made


class _Arena:
    """Host memory mapped for the buffers of a coming save and populated by a thread of
    its own meanwhile; the save carves its new buffers out of it (:meth:`take`)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.used = nbytes, 0
        self.area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        memory.promise(nbytes)
        self.promised = nbytes  # until populated: this arena's own bytes in the promise
        self.thread = threading.Thread(target=self._populate, name="hpcckpt-staging", daemon=True)
        self.thread.start()

    def _populate(self) -> None:
        try:
            _populate(self.area)
        finally:
            memory.settle(self.nbytes)
            self.promised = 0

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """A buffer of ``shape`` and ``dtype`` in the arena (its pages present once the
        thread is done: waited for here), or None when the arena has no room left."""
        self.thread.join()
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        if nbytes < _MAPPED_BYTES or self.used + nbytes > self.nbytes:
            return None
        out = np.frombuffer(self.area, dtype=dtype, count=count, offset=self.used)
        self.used += _page_up(nbytes)
        return out.reshape(shape)


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def copy_and_hash(src: np.ndarray, dst: np.ndarray, block_size: int) -> np.ndarray:
    """Copy ``src`` into ``dst`` (same shape and dtype) and return the block hashes of it.

    Each block is hashed right after it is copied, while it is still in the CPU cache,
    so the hashes cost little beyond the copy. The hashes equal
    :func:`hpcckpt.store.io.blocks.block_hashes` of ``src``.
    """
    step = blocks.block_elems(src.dtype.itemsize, block_size)
    flat_src = np.ascontiguousarray(src).reshape(-1)
    flat_dst = dst.reshape(-1)  # dst is C-contiguous: a view
    n = blocks.nblocks(flat_src.size, step)
    out = np.empty(n, dtype=np.uint64)
    digest = xxhash.xxh3_64_intdigest
    for j in range(n):
        a, b = j * step, min((j + 1) * step, flat_src.size)
        np.copyto(flat_dst[a:b], flat_src[a:b])
        out[j] = digest(memoryview(flat_dst[a:b]).cast("B"))
    return out


class HostBuffers:
    """Reused host memory for the state of an asynchronous save, within a budget.

    ``budget``: the bytes this rank's staging may hold (None: a fraction of the
    node's available memory, see :mod:`hpcckpt.store.save.staging_budget`). A state that
    fits is copied whole into one buffer per array path, kept between saves while the
    array's shape and dtype stay the same (plus the array being resized, during a save
    that changes a shape); a larger one goes through a ring of buffers of the budget's
    size (:meth:`ring`), kept too. Only one of the two is held at a time.

    Tensors on a device are copied straight into host buffers this object lends
    (:meth:`lending`: pinned for CUDA, kept between saves by shape and dtype in the
    order the state presents them); :meth:`stage` takes those copies as they are.
    ``checks`` finds on the device which blocks of those tensors changed since their
    buffer's last copy, so that only those are copied and hashed again (None: every
    byte, every save; :mod:`hpcckpt.store.save.device_checksums`).

    :meth:`reserve` (at a restore, before the first save) maps and populates the first
    save's buffers in a thread of their own, so that the first save copies into memory
    already there instead of faulting it in inside the blocked window; the buffers lent
    to device tensors (pinned for CUDA) are made ahead the same way.
    """

    def __init__(self, budget: int | None = None, checks: DeviceChecksums | None = None) -> None:
        self.budget = budget
        #: The default budget, fixed by the first :meth:`plan` when ``budget`` is None.
        self._default: int | None = None
        #: What a :meth:`look` since the last plan found (bytes that would still be
        #: planned as a whole copy, bytes the buffers held then), or None: the next plan
        #: that needs no more, with those buffers still held, takes it without reading.
        self._roomy: tuple[int, int] | None = None
        self.checks = DeviceChecksums() if checks is None else checks
        #: Ranks on this node sharing the memory (learnt by :meth:`reserve`; None: unknown).
        self.local_ranks: int | None = None
        self._buffers: dict[str, np.ndarray] = {}
        self._arena: _Arena | None = None
        self._carved: set[str] = set()  # paths whose buffers lie in the arena
        self._ring: list[np.ndarray] = []
        #: Host tensors lent to device-to-host copies, per (shape, dtype, pinned).
        self._lent: dict[tuple[Any, ...], list[Any]] = {}
        self._taken: dict[tuple[Any, ...], int] = {}  # lent during this save, per key
        self._lent_now: dict[int, int] = {}  # address -> bytes of those lent this save
        self._pinning: _Pinning | None = None  # lent buffers being made ahead (reserve)
        #: The most bytes held at once since :meth:`reset_peak`.
        self.peak = 0

    def copies(self) -> dict[str, np.ndarray]:
        """The host buffers the last save copied the state's arrays into, by path (kept
        for the next save: what a measurement of the copy's own limit copies into)."""
        return dict(self._buffers)

    @property
    def nbytes(self) -> int:
        return (
            sum(b.nbytes for p, b in self._buffers.items() if p not in self._carved)
            + (0 if self._arena is None else self._arena.nbytes)
            + sum(b.nbytes for b in self._ring)
            + sum(tensors.nbytes(t) for kept in self._lent.values() for t in kept)
            + (0 if self._pinning is None else self._pinning.nbytes)
        )

    @property
    def lent_buffers(self) -> list[Any]:
        """The host tensors kept for device tensors' copies (pinned ones for CUDA)."""
        return [t for kept in self._lent.values() for t in kept]

    @property
    def lent_bytes(self) -> int:
        """Bytes of the host buffers kept for device tensors (pinned ones for CUDA)."""
        return sum(tensors.nbytes(t) for kept in self._lent.values() for t in kept)

    @property
    def reserving(self) -> bool:
        """Whether the memory :meth:`reserve` asked for is still being populated."""
        return any(r is not None and r.thread.is_alive() for r in (self._arena, self._pinning))

    def available(self) -> int | None:
        """Memory this rank may still take, its own arena's promise given back (the arena
        counts as held: :attr:`nbytes`)."""
        free = memory.available_bytes()
        own = sum(r.promised for r in (self._arena, self._pinning) if r is not None)
        return None if free is None else free + own

    def reserve(self, state: Any, comm: Any, copies: int = 1) -> int:
        """Map the buffers the first save of ``state`` will copy into, and populate them in
        a background thread; the bytes reserved (0: none). Collective over ``comm`` (the
        ranks on a node share the budget's memory); called where every rank is, a restore.

        Only before buffers exist, and only when the whole state fits the budget as a
        staged save would plan it (:func:`.save.staging_budget.plan`): the reservation is
        what that save would allocate anyway, a little earlier. ``copies``: of the state's
        bytes the budget must hold (2 for a cache's saves: their host copy and the tier's).
        """
        if self.local_ranks is None:
            node = comm.split_node()
            self.local_ranks = node.size
            node.free()
        fresh = not (self._buffers or self._arena is not None or self._ring)
        total = sum(_page_up(n) for n in host_array_sizes(state)) if fresh else 0
        like = [] if self._lent or self._pinning else device_tensors(state, self.checks.on_cpu)
        lent = sum(tensors.nbytes(t) for t in like)
        if not total and not lent:
            return 0
        plan = self.plan(copies * (total + lent), self.local_ranks)
        if plan.mode != staging_budget.COPY:
            return 0
        if total:
            self._arena = _Arena(total)
        if lent:
            self._pinning = _Pinning(like)
        self._held()
        return total + lent

    def plan(self, nbytes: int, local_ranks: int | None) -> staging_budget.StagingPlan:
        """The way to stage ``nbytes`` within this rank's budget and the memory there now
        (:func:`.save.staging_budget.plan`; ``local_ranks``: ranks on the node).

        The default budget (a fraction of the memory available) is fixed by the first
        plan, so that buffers kept between saves stay within it when other memory is
        taken later; each plan checks that memory is there (pieces or sync if not), or
        takes what a :meth:`look` since the last plan found.
        """
        budget = self.planned_budget
        roomy, self._roomy = self._roomy, None
        if roomy is not None and budget is not None and nbytes <= min(roomy[0], budget):
            if self.nbytes >= roomy[1]:  # the buffers it found are still held
                return staging_budget.StagingPlan(staging_budget.COPY, nbytes, budget, None)
        made = staging_budget.plan(nbytes, budget, self.available(), local_ranks or 1, self.nbytes)
        if self.budget is None and self._default is None:
            self._default = made.budget
        return made

    def look(self, copies: int = 1) -> None:
        """Read the memory now, off the blocked path (a save's background thread): when
        ``copies`` times what the buffers hold (2: a cache's host copy and the tier's)
        would still be planned as a whole copy, the next plan that needs no more than that
        takes it without reading the memory (which reads the job's cgroup: up to a
        millisecond); else the next plan reads it again."""
        budget = self.planned_budget
        try:
            held = self.nbytes
        except RuntimeError:  # changed while counted: the next plan reads the memory
            return
        if budget is None or not held:
            return
        need = copies * held
        made = staging_budget.plan(need, budget, self.available(), self.local_ranks or 1, held)
        self._roomy = (need, held) if made.mode == staging_budget.COPY else None

    @property
    def planned_budget(self) -> int | None:
        """The budget plans are made against: the one given, else the default fixed by
        the first :meth:`plan` (None before it)."""
        return self.budget if self.budget is not None else self._default

    def _take(self, path: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A new buffer for ``path``: from the reserved arena when it has room, else mapped."""
        if self._arena is not None:
            buf = self._arena.take(shape, dtype)
            if buf is not None:
                self._carved.add(path)
                return buf
        return new_buffer(shape, dtype)

    def _forget(self, path: str) -> None:
        """Drop the buffer of ``path``; the arena goes with the last buffer carved from it."""
        self._buffers.pop(path, None)
        if path in self._carved:
            self._carved.discard(path)
            if not self._carved:
                self._drop_arena()

    def _drop_arena(self) -> None:
        if self._arena is not None:
            self._arena.thread.join()  # never unmapped while being populated
        self._arena, self._carved = None, set()

    def reset_peak(self) -> None:
        self.peak = self.nbytes

    def _held(self) -> None:
        self.peak = max(self.peak, self.nbytes)

    @contextlib.contextmanager
    def lending(self, copies: str = "changed") -> Any:
        """Within the block (a save's encoding), device tensors are copied to the host
        into buffers of this object (:func:`hpcckpt.store.tree.devices.host_buffers`):
        only their changed blocks, or every byte (``copies``:
        :data:`hpcckpt.store.save.device_checksums.COPIES`)."""
        self._taken, self._lent_now = {}, {}
        self._adopt_pinning()
        self.checks.begin(copies)
        with devices.host_buffers(self.lend, self.checks.copy, cpu=self.checks.on_cpu):
            yield

    def _adopt_pinning(self) -> None:
        """Keep the lent buffers :meth:`reserve` had made ahead (waited for)."""
        if self._pinning is not None:
            for key, made in self._pinning.take().items():
                self._lent.setdefault(key, []).extend(made)
            self._pinning = None

    def lend(self, tensor: Any) -> Any:
        """A host tensor for ``tensor``'s values: the one kept from an earlier save for the
        same place in the state (same shape and dtype), else a new one; None (the copy
        makes its own) when a new one would pass the budget."""
        key = _lent_key(tensor)
        i = self._taken.get(key, 0)
        self._taken[key] = i + 1
        kept = self._lent.setdefault(key, [])
        if i < len(kept):
            host = kept[i]
        else:
            size = tensors.nbytes(tensor)
            cap = self.planned_budget
            if cap is not None and self.nbytes + size > cap:
                return None
            host = devices.empty_host(tensor)
            kept.append(host)
            self._held()
        if host.numel():
            self._lent_now[int(host.data_ptr())] = tensors.nbytes(host)
        return host

    def _drop_unlent(self) -> None:
        """Free the lent buffers this save did not take (the state changed)."""
        for key in list(self._lent):
            del self._lent[key][self._taken.get(key, 0) :]
            if not self._lent[key]:
                del self._lent[key]

    def _lent_copy(self, src: np.ndarray) -> bool:
        """Whether ``src`` is exactly a host buffer lent during this save (the save's copy)."""
        return (
            src.size > 0
            and src.flags.c_contiguous
            and self._lent_now.get(_address(src)) == src.nbytes
        )

    def ring(self, nbytes: int) -> list[np.ndarray]:
        """Page-aligned buffers of ``nbytes`` in all (reused when the size is the same);
        the whole-state buffers are freed first."""
        self._buffers.clear()
        self._drop_arena()
        if sum(b.nbytes for b in self._ring) != nbytes or not self._ring:
            self._ring = []  # free the old ring before allocating the new one
            self._ring = ring_buffers(nbytes)
        self._held()
        return self._ring

    def stage(
        self, arrays: dict[str, np.ndarray], block_size: int, hashed: bool = True
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Copies of ``arrays`` in the buffers and (``hashed``) their block hashes.

        Without ``hashed`` it is one copy of each array and nothing more (the hashes
        are computed later, from the copies). An array that is a device tensor's copy
        into a buffer lent during this save (:meth:`lending`) is that copy already.
        """
        self._ring = []
        self._drop_unlent()
        for stale in set(self._buffers) - set(arrays):
            self._forget(stale)
        copies, hashes = {}, {}
        for path, src in arrays.items():
            if self._lent_copy(src):
                self._forget(path)
                copies[path] = src
                if hashed:
                    known = self.checks.hashes(src, block_size)  # only the copied blocks
                    hashes[path] = blocks.block_hashes(src, block_size) if known is None else known
                continue
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                self._forget(path)  # free the old one before allocating
                buf = self._take(path, src.shape, src.dtype)
                self._buffers[path] = buf
                self._held()
            if hashed:
                hashes[path] = copy_and_hash(src, buf, block_size)
            else:
                np.copyto(buf, src)
            copies[path] = buf
        if self._arena is not None and not self._carved:
            self._drop_arena()  # reserved for arrays this state does not have
        self._taken, self._lent_now = {}, {}  # the next save lends anew
        return copies, hashes

    def release(self) -> None:
        self._buffers.clear()
        self._drop_arena()
        self._ring = []
        if self._pinning is not None:
            self._pinning.take()  # its buffers go with it
            self._pinning = None
        self._lent.clear()
        self._lent_now = {}
        self.checks.forget()
