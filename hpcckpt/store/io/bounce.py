"""Buffers of huge pages that a restore's direct reads land in, copied in place after.

A direct read into an application's memory of 4 KiB pages (torch's allocator; numpy
advises huge pages for its large arrays) reaches the device as requests of at most 254
pages, about 1 MiB; into huge pages, as requests of the device's largest size (4 MiB
here). On this machine's virtio disk that made two ranks' direct reads of an FSDP
state into its tensors 1.2x slower than into huge pages (docs/performance.md). The copy
in place costs what the move of a piece read a few bytes past its place cost before.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

#: Alignment of a buffer of at least this size: one huge page.
HUGE_PAGE = 2 << 20
#: Alignment of a smaller one (and of a direct read's memory).
PAGE = 4096


class BounceRing:
    """Buffers of ``piece`` bytes, each taken for one direct read and given back once
    the hashing thread has copied it in place. A buffer is made whenever none is free:
    the copies outpace the device, so a restore holds two or three per reader."""

    def __init__(self, piece: int) -> None:
        self.piece = piece
        self.made = 0
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        """A free buffer, or a new one (MemoryError when none can be mapped)."""
        with self._lock:
            if self._free:
                return self._free.pop()
            self.made += 1
        align = HUGE_PAGE if self.piece >= HUGE_PAGE else PAGE
        try:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            mapped = mmap.mmap(-1, self.piece + align, flags=flags)
        except OSError as exc:  # no memory: not the file's fault (an OSError would say so)
            raise MemoryError(f"no memory for a {self.piece}-byte read buffer: {exc}") from exc
        with contextlib.suppress(AttributeError, OSError):  # a hint: the reads work without
            mapped.madvise(mmap.MADV_HUGEPAGE)
        raw = np.frombuffer(mapped, dtype=np.uint8)  # keeps the mapping alive
        start = -raw.ctypes.data % align
        return raw[start : start + self.piece]

    def give(self, buf: np.ndarray) -> None:
        """``buf`` is free again."""
        with self._lock:
            self._free.append(buf)


def read_pieces(
    direct_fd: int,
    offset: int,
    start: int,
    end: int,
    ring: BounceRing,
    move: Callable[[tuple[Any, ...]], None],
) -> int:
    """Read bytes ``start`` to ``end`` (both multiples of PAGE past ``offset`` in the
    file) of an extent at ``offset`` through ``direct_fd``, a piece per buffer of
    ``ring``, each handed on as ``move((at, n, buf, ring))``. Returns where it stopped:
    ``end``, or sooner after a short read or a refused first one (the caller reads the
    rest through the page cache)."""
    done = start
    while done < end:
        want = min(ring.piece, end - done)
        buf = ring.take()
        try:
            got = os.preadv(direct_fd, [memoryview(buf)[:want]], offset + done)
        except OSError as exc:
            ring.give(buf)
            if exc.errno != errno.EINVAL or done != start:
                raise
            return done  # direct reads refused after all (a larger block size)
        if got <= 0:
            ring.give(buf)
            return done
        move((done, got, buf, ring))
        done += got
        if got < want:
            break
    return done
