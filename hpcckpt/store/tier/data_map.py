"""A rank's node-local data file kept mapped between saves: its copy is one ``memcpy``.

Writing a copy with ``pwrite`` into tmpfs costs three to four times a ``memcpy`` of the
same bytes (the page cache's work per page); copying into pages already mapped costs
one. :class:`DataMap` keeps this rank's data file mapped (shared, read-write) from save
to save while the tier recycles it (:func:`.tier.copies.recycle` renames the same
file, and a mapping follows the file, not its name), and maps it again when the file is
another one (a new inode) or its size changed. Stores through a shared map of a memory
file system reach its pages at once, as ``pwrite`` does: the copy survives the process.
Only for memory file systems (tmpfs, ramfs): on a disk the kernel would write-protect
each cleaned page and fault it at the next save (:func:`maps_well`).
"""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

import numpy as np

from hpcckpt.store.io import blocks, filesystem, safety
from hpcckpt.store.tier.copies import ALIGN, data_name

#: statfs magic numbers of the memory file systems.
_MEMORY_MAGIC = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


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
        self._key: tuple[int, int, int] | None = None  # (device, inode, size) mapped
        self._area: mmap.mmap | None = None

    def close(self) -> None:
        """Let the mapping go (unmapped once the last array viewing it is gone)."""
        self._key, self._area = None, None

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
