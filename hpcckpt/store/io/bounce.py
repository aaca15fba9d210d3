"""Buffers of huge pages that a restore's direct reads land in, copied in place after.

A direct read into an application's memory of 4 KiB pages (torch's allocator; numpy
advises huge pages for its large arrays) reaches the device as requests of at most 254
pages, about 1 MiB; into huge pages, as requests of the device's largest size (4 MiB
here). On this machine's virtio disk that made two ranks' direct reads of an FSDP
state into its tensors 1.2x slower than into huge pages (docs/performance.md). The copy
in place costs what the move of a piece read a few bytes past its place cost before.

A ring makes a bounded number of buffers: reads that get ahead of the copies wait for
one given back. Nothing can leave them waiting for good: a consumer that fails gives
back the buffers of the pieces left and its reader raises its error (:class:`Handoff`),
and a closed ring raises in every taker (:class:`RingClosed`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

#: Alignment of a buffer of at least this size: one huge page.
HUGE_PAGE = 2 << 20
#: Alignment of a smaller one (and of a direct read's memory).
PAGE = 4096
#: Most buffers a ring makes (16 MiB of 2 MiB pieces). Two readers of a cold GiB, machine
#: loaded: 5-7 made uncapped, up to 14 under a cap of 16, as fast with 8 or 4
#: (docs/performance.md, "The bounce ring's cap").
RING_BUFFERS = 8
#: Buffers each reader reading at once may have out whatever RING_BUFFERS says: one
#: being read, one being copied in place.
PER_READER = 2


class RingClosed(RuntimeError):
    """A read waited for a buffer of a ring that was closed (its restore had ended)."""


class BounceRing:
    """Buffers of ``piece`` bytes, each taken for one direct read and given back once
    the hashing thread has copied it in place. A buffer is made while none is free and
    fewer than :data:`RING_BUFFERS` (or :data:`PER_READER` per reader reading at once)
    are out; past that, :meth:`take` waits its turn (first come, first served) for one
    given back. So a restore holds at most that much, however far its hashing threads
    fall behind the device; :meth:`close` wakes any waiter with an error."""

    def __init__(self, piece: int, limit: int | None = None) -> None:
        self.piece = piece
        self.limit = RING_BUFFERS if limit is None else limit
        self.made = 0  # buffers made so far (out, or free to take again)
        self.readers = 0  # read_pieces calls running
        self._free: list[np.ndarray] = []
        self._turns: collections.deque[object] = collections.deque()  # waiting takers
        self._closed: str | None = None
        self._cond = threading.Condition()

    @property
    def held(self) -> int:
        """Buffers taken and not given back yet."""
        with self._cond:
            return self.made - len(self._free)

    @property
    def waiting(self) -> int:
        """Takers waiting for their turn or a buffer."""
        with self._cond:
            return len(self._turns)

    def cap(self) -> int:
        """The most buffers this ring makes while its readers read."""
        return max(self.limit, PER_READER * self.readers)

    def take(self) -> np.ndarray:
        """A free buffer, or a new one below the cap, else the next one given back.
        MemoryError when none can be mapped; RingClosed once the ring is closed."""
        turn = object()
        with self._cond:
            self._turns.append(turn)
            try:
                while self._closed is None and not self._may_take(turn):
                    self._cond.wait()
                if self._closed is not None:
                    raise RingClosed(self._closed)
                if self._free:
                    return self._free.pop()
                self.made += 1
            finally:
                self._turns.remove(turn)
                self._cond.notify_all()  # the next in line may take one too
        try:
            return self._make()
        except BaseException:
            with self._cond:
                self.made -= 1
                self._cond.notify_all()
            raise

    def _may_take(self, turn: object) -> bool:
        return self._turns[0] is turn and (bool(self._free) or self.made < self.cap())

    def _make(self) -> np.ndarray:
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
        with self._cond:
            self._free.append(buf)
            self._cond.notify_all()

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """One more reader while the block runs: the cap grows to :data:`PER_READER` each."""
        with self._cond:
            self.readers += 1
        try:
            yield
        finally:
            with self._cond:
                self.readers -= 1

    def close(self, why: str = "the reads of this restore were closed") -> None:
        """Wake every taker, now and later, with :class:`RingClosed` (``why``)."""
        with self._cond:
            self._closed = why
            self._free.clear()  # their memory goes with the last reference
            self._cond.notify_all()


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
    with ring.reading():
        while done < end:
            want = min(ring.piece, end - done)
            buf = ring.take()
            try:
                got = os.preadv(direct_fd, [memoryview(buf)[:want]], offset + done)
            except BaseException as exc:
                ring.give(buf)
                if not isinstance(exc, OSError) or exc.errno != errno.EINVAL or done != start:
                    raise
                return done  # direct reads refused after all (a larger block size)
            if got <= 0:
                ring.give(buf)
                return done
            move((done, got, buf, ring))  # the buffer is the consumer's now
            done += got
            if got < want:
                break
    return done


def give_back(items: queue.Queue[Any]) -> None:
    """Take ``items`` until None, giving back the buffers of those from
    :func:`read_pieces`: what a consumer that failed does with the rest, so that its
    reader, which may be waiting for a buffer, reads on to its next piece (and there
    learns of the failure) and the other readers of the ring are not starved."""
    while (item := items.get()) is not None:
        if isinstance(item, tuple) and len(item) == 4 and isinstance(item[3], BounceRing):
            item[3].give(item[2])


class Handoff:
    """The items a reader hands on to the thread that consumes them, ended by None.
    If the consumer fails, it gives back the ring buffers of the items left
    (:func:`give_back`) and the reader's next :meth:`put` raises its error: a reader is
    never left waiting for a buffer that a stopped consumer holds."""

    def __init__(self) -> None:
        self.items: queue.Queue[Any] = queue.Queue()
        self.error: BaseException | None = None

    def put(self, item: Any) -> None:
        """Hand ``item`` on; raises the consumer's error once it has failed."""
        self.items.put(item)
        if self.error is not None:
            raise self.error

    def get(self) -> Any:
        """The next item (None: the last)."""
        return self.items.get()

    def end(self) -> None:
        """No more items."""
        self.items.put(None)

    def consume(self, work: Callable[[], None]) -> None:
        """Run ``work``, which takes the items until None; if it raises, keep its error
        and take the rest, giving back their buffers."""
        try:
            work()
        except BaseException as exc:  # raised by put and by wait
            self.error = exc
            give_back(self.items)

    def wait(self, join: Callable[[], object]) -> None:
        """``join()`` (what waits for the consumer), then raise its error if it failed."""
        join()
        if self.error is not None:
            raise self.error
