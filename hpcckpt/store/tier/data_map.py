"""A rank's node-local data file kept mapped between saves: its copy is one ``memcpy``.

Writing a copy with ``pwrite`` into tmpfs costs three to four times a ``memcpy`` of the
same bytes (the page cache's work per page); copying into pages already mapped costs
one. :class:`DataMap` keeps this rank's data file mapped (shared, read-write) from save
to save while the tier recycles it (:func:`.tier.copies.recycle` renames the same
file, and a mapping follows the file, not its name), and maps it again when the file is
another one (a new inode) or its size changed. Stores through a shared map of a memory
file system reach its pages at once, as ``pwrite`` does: the copy survives the process.
Every page of a file is allocated (``fallocate``) before it is mapped: a full tmpfs then
fails the save with ENOSPC, as a ``pwrite`` would, never with a SIGBUS in the copy.
Only for memory file systems (tmpfs, ramfs): on a disk the kernel would write-protect
each cleaned page and fault it at the next save (:func:`maps_well`).

Before a rank's first copy (at a restore) :meth:`DataMap.reserve` makes a data file of
the state's size named as step :data:`RESERVE_STEP` and allocates and maps its pages in a
background thread: the first save recycles it as it would a previous copy's file
(:func:`.tier.copies.recycle` takes the newest) and copies into pages already there.
Without a manifest it is never a copy; the tier's cleanup removes it like any other.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
from pathlib import Path
from typing import Any

import numpy as np

from hpcckpt.store.io import blocks, filesystem, memory, safety
from hpcckpt.store.tier.copies import ALIGN, data_name
from hpcckpt.store.tree import tensors
from hpcckpt.store.tree.state_tree import is_stateful

#: statfs magic numbers of the memory file systems.
_MEMORY_MAGIC = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
#: The step a reserved data file is named as: the newest, and one no job reaches.
RESERVE_STEP = 10**10 - 1
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels fault the pages in at the copy


def file_bytes(value: Any) -> int:
    """The size of the data file a copy of the state ``value`` takes (each array and
    tensor rounded up to :data:`.tier.copies.ALIGN`), without encoding it."""
    if isinstance(value, np.ndarray):
        return -(-value.nbytes // ALIGN) * ALIGN
    if tensors.is_tensor(value):
        local = tensors.local_part(value) if tensors.is_dtensor(value) else value
        return -(-tensors.nbytes(local) // ALIGN) * ALIGN
    if is_stateful(value):
        return file_bytes(value.state_dict())
    if isinstance(value, dict):
        return sum(file_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(file_bytes(v) for v in value)
    return 0


def maps_well(path: Path) -> bool:
    """Whether ``path`` (or its nearest existing parent) is on a memory file system."""
    while not path.exists() and path != path.parent:
        path = path.parent
    magic = filesystem.statfs_magic(path)
    if magic is not None:
        return magic in _MEMORY_MAGIC
    return filesystem.mountinfo_type(path) in _MEMORY_MAGIC.values()


class DataMap:
    """This rank's data file, mapped once and written through the map at every save."""

    def __init__(self) -> None:
        #: (device, inode, size) of the file mapped, every page of it allocated.
        self._key: tuple[int, int, int] | None = None
        self._area: mmap.mmap | None = None
        self._reserving: threading.Thread | None = None
        self._reserve_failed = False

    def close(self) -> None:
        """Let the mapping go (unmapped once the last array viewing it is gone)."""
        self._settle()
        self._key, self._area = None, None

    def _settle(self) -> None:
        """Wait for the reserving thread; a reservation it could not allocate is let go."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        if self._reserve_failed:
            self._key, self._area, self._reserve_failed = None, None, False

    def reserve(self, cache: Path, rank: int, size: int, mode: int) -> Path | None:
        """Make this rank's data file of ``size`` bytes for its first copy, named as step
        :data:`RESERVE_STEP`; its pages are allocated and mapped by a background thread.
        The file made (None: nothing to reserve, or it could not be made)."""
        if size <= 0:
            return None
        self.close()
        path = cache / data_name(RESERVE_STEP, rank)
        try:
            safety.remove_leftover(path)
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CREAT | os.O_EXCL, mode)
        except OSError:
            return None
        try:
            os.ftruncate(fd, size)
            st = os.fstat(fd)
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            area = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        self._key, self._area = (st.st_dev, st.st_ino, size), area

        def populate() -> None:
            try:
                os.posix_fallocate(fd, 0, size)  # ENOSPC: the first save allocates, and says so
            except OSError:
                self._reserve_failed = True
                return
            finally:
                os.close(fd)
                memory.settle(size)  # fallocated: out of MemAvailable now (or given up)
            with contextlib.suppress(OSError):  # the copy faults in what is not mapped yet
                area.madvise(_MADV_POPULATE_WRITE)

        memory.promise(size)
        self._reserving = threading.Thread(target=populate, name="hpcckpt-reserve", daemon=True)
        self._reserving.start()
        return path

    def write(
        self,
        cache: Path,
        step: int,
        rank: int,
        arrays: dict[str, np.ndarray],
        block_size: int,
        mode: int,
        *,
        hashed: bool = True,
        reuse: bool = False,
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, int]]:
        """:func:`.tier.copies.write_data` through the map: (arrays viewing the copy in the
        data file, block hashes (``hashed``; else none), offsets). With ``reuse`` the data
        file of ``step`` is already there (recycled) and written over in place."""
        self._settle()
        path = cache / data_name(step, rank)
        offsets, size = {}, 0
        for name, src in arrays.items():
            offsets[name] = size
            size += -(-src.nbytes // ALIGN) * ALIGN
        flags = os.O_RDWR | os.O_NOFOLLOW
        if reuse and _regular(path):
            fd = os.open(path, flags)
            os.fchmod(fd, mode)
        else:
            self.close()
            safety.remove_leftover(path)
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino, size)
            if key != self._key or st.st_size != size:
                self.close()
                if st.st_size != size:
                    os.ftruncate(fd, size)
                if size:
                    os.posix_fallocate(fd, 0, size)  # ENOSPC now, not a SIGBUS in the copy
                    prot = mmap.PROT_READ | mmap.PROT_WRITE
                    self._area = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
                self._key = key
        finally:
            os.close(fd)
        views, hashes = {}, {}
        for name, src in arrays.items():
            view = self._view(offsets[name], src)
            if view.size:
                np.copyto(view, src)
            if hashed:
                hashes[name] = blocks.block_hashes(view, block_size)
            view.flags.writeable = False
            views[name] = view
        return views, hashes, offsets

    def _view(self, offset: int, src: np.ndarray) -> np.ndarray:
        if src.size == 0 or self._area is None:
            return np.empty(src.shape, dtype=src.dtype)
        out = np.frombuffer(self._area, dtype=src.dtype, count=src.size, offset=offset)
        return out.reshape(src.shape)


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
