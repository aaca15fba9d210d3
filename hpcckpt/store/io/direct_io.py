"""Write byte extents into an existing file and fsync it, past the page cache where allowed.

Every rank writes its own extents of the one checkpoint file. Through the page cache,
two ranks' writes into one file take turns on the file's lock, every byte is copied
into the cache and the fsync writes the file back as one stream; that is why one
shared file trailed a file per rank on this machine's ext4. With ``O_DIRECT`` each
rank's bytes go from a page-aligned bounce buffer straight to the device, while a
second buffer is being filled, and the ranks' writes run side by side (measured in
docs/performance.md). The unaligned first and last bytes of an extent, and extents
too small to gain, go through the page cache; the final ``fsync`` covers both.

A file system that refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some FUSE mounts)
gets buffered writes. No MPI and no HDF5 here: a background thread may call this.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from hpcckpt import libc
from hpcckpt.store.io import bounce

#: Alignment of file offsets, lengths and memory for O_DIRECT (the largest logical
#: block size in common use; a multiple of every smaller one).
ALIGN = 4096
#: Size of each of the two bounce buffers.
BOUNCE_BYTES = 32 << 20
#: Extents shorter than this go through the page cache.
MIN_DIRECT_BYTES = 4 << 20
#: Largest single write; Linux writes at most 2 GiB - 4 KiB per call anyway.
WRITE_CHUNK = 1 << 30
#: Reads of a verified restore: each piece is hashed while the next one is read.
READ_PIECE_BYTES = 16 << 20
#: Direct reads of a restore: each piece is copied in place and hashed meanwhile (one
#: huge page: 2 MiB pieces beat 4 and 8 MiB at 256 MiB and 2 GiB per rank, measured).
DIRECT_READ_PIECE_BYTES = 2 << 20
#: How a restore reads an extent of at least MIN_DIRECT_BYTES that is not in the page
#: cache (chosen by measurement, docs/performance.md): "direct" past the page cache into
#: the destination (where the caller allows it), "buffered" through the cache with a
#: descriptor of its own (its own readahead state) and sequential readahead.
COLD_READ = "direct"
#: A restore's direct reads land in huge pages (:class:`.bounce.BounceRing`), copied in
#: place, not in the destination itself (moved by up to a page): see that module.
DIRECT_BOUNCE = True


@dataclass(frozen=True)
class Extent:
    """``data`` goes to byte ``offset`` of the file."""

    offset: int
    data: memoryview


@dataclass(frozen=True)
class Outcome:
    """What :func:`write_extents` wrote: all bytes, and those that went past the cache."""

    bytes: int
    direct_bytes: int


def write_extents(
    path: str | os.PathLike[str],
    extents: Sequence[Extent],
    *,
    direct: bool = True,
    before: Callable[[int], None] | None = None,
    after: Callable[[int], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Outcome:
    """Write every extent at its offset of ``path`` (which exists), then fsync the file.

    ``before(i)`` / ``after(i)`` run around extent ``i`` (fault injection in tests).
    ``progress(i, n)`` runs whenever the first ``n`` bytes of extent ``i`` have been
    handed on (copied into a bounce buffer, or written), at least once with its whole
    length: work done there overlaps the device's writes of the bounce buffers.
    Raises OSError as the system reports it; the file is then incomplete.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    total = direct_total = 0
    writer: _DirectWriter | None = None
    try:
        if direct and any(len(_flat(e.data)) >= MIN_DIRECT_BYTES for e in extents):
            writer = _DirectWriter.open(path, fd)
        for i, extent in enumerate(extents):
            if before is not None:
                before(i)
            data = _flat(extent.data)
            head, body = _split(extent.offset, len(data))
            if writer is None or body < MIN_DIRECT_BYTES:
                pwrite_all(fd, data, extent.offset)
            else:
                pwrite_all(fd, data[:head], extent.offset)
                chunk = None if progress is None else (lambda n, i=i, h=head: progress(i, h + n))
                writer.write(data[head : head + body], extent.offset + head, chunk)
                pwrite_all(fd, data[head + body :], extent.offset + head + body)
                direct_total += body
            if progress is not None:
                progress(i, len(data))
            total += len(data)
            if after is not None:
                if writer is not None:
                    writer.drain()  # "written" means handed to the device
                after(i)
        if writer is not None:
            writer.close()
            writer = None
        os.fsync(fd)
    finally:
        if writer is not None:
            with contextlib.suppress(BaseException):
                writer.close()
        os.close(fd)
    return Outcome(total, direct_total)


def read_hashed(
    path: str | os.PathLike[str],
    offset: int,
    out: memoryview,
    block_bytes: int,
    *,
    fd: int | None = None,
    direct: bool = True,
) -> np.ndarray:
    """Read ``len(out)`` bytes at ``offset`` of ``path`` into ``out`` and return the
    xxh3-64 of each ``block_bytes`` block (the last may be shorter). ``fd``: a
    descriptor open on ``path`` to read through (left open), instead of opening it.

    A second thread hashes each piece while the next one is read (``preadv``, the move
    and the hash release the GIL), so verifying a restore costs no pass of its own.
    With ``direct``, an extent of at least :data:`MIN_DIRECT_BYTES` that is not in the
    page cache is read past it (:func:`_read_shifted`). Raises OSError when the file
    ends early.
    """
    return start_hashed(path, offset, out, block_bytes, fd=fd, direct=direct)()


def start_hashed(
    path: str | os.PathLike[str],
    offset: int,
    out: memoryview,
    block_bytes: int,
    *,
    fd: int | None = None,
    direct: bool = True,
    reads: HashedReads | None = None,
) -> Callable[[], np.ndarray]:
    """:func:`read_hashed` that returns as soon as every byte is read, while the last
    pieces are still moved in place and hashed by the hashing thread: the caller's
    thread goes on to its next read, and the device is not left idle while an array
    drains. The function returned waits for them and returns the hashes; ``out`` is not
    the file's bytes before it has returned. ``reads``: the restore's
    :class:`HashedReads`, whose direct descriptor and hashing threads are used instead
    of opening and starting new ones. Raises OSError (once the hashing has stopped).
    """
    out = _flat(out)
    nblk = -(-len(out) // block_bytes)
    hashes = np.empty(nblk, dtype=np.uint64)
    own = fd is None
    if fd is None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    opened = fd
    direct_fd = -1
    own_fd = -1  # a cold buffered read's own descriptor
    try:
        if len(out) >= MIN_DIRECT_BYTES and not _cached(fd, offset, len(out)):
            if COLD_READ == "direct" and direct:
                direct_fd = _open_direct(path) if reads is None else reads.direct_fd(path)
            elif COLD_READ == "buffered":
                own_fd = fd = _open_sequential(path, offset, len(out))
        if direct_fd < 0 and len(out) <= READ_PIECE_BYTES:
            # One piece: nothing to overlap, and a thread costs more.
            pread_all(fd, out, offset, path)
            digest = xxhash.xxh3_64_intdigest
            for j in range(nblk):
                hashes[j] = digest(out[j * block_bytes : (j + 1) * block_bytes])
            return lambda: hashes
        # Items: the bytes in place so far; (at, n, shift): n bytes read shift bytes past
        # ``at``, to move in place first; (at, tail): the last bytes, read aside while
        # the moves before them were pending, to copy in place after them; (at, n, buf,
        # ring): n bytes read into a ring's buffer, to copy to ``at`` and give back.
        ready = bounce.Handoff()  # its put raises once the hashing thread has failed
        addr = np.frombuffer(out, dtype=np.uint8).ctypes.data if len(out) else 0

        def hash_pieces() -> None:
            digest = xxhash.xxh3_64_intdigest
            first = 0  # the blocks before it are hashed
            while (end := ready.get()) is not None:
                if isinstance(end, tuple) and len(end) == 4:
                    at, moved, buf, ring = end
                    try:
                        ctypes.memmove(addr + at, buf.ctypes.data, moved)
                    finally:
                        ring.give(buf)
                    end = at + moved
                elif isinstance(end, tuple) and len(end) == 2:
                    at, tail = end
                    out[at : at + len(tail)] = tail
                    end = at + len(tail)
                elif isinstance(end, tuple):
                    at, moved, shift = end
                    ctypes.memmove(addr + at, addr + at + shift, moved)
                    end = at + moved
                last = nblk if end >= len(out) else end // block_bytes  # whole blocks in place
                for j in range(first, last):
                    hashes[j] = digest(out[j * block_bytes : (j + 1) * block_bytes])
                first = max(first, last)

        if reads is None:
            hasher = threading.Thread(
                target=ready.consume, args=(hash_pieces,), name="hpcckpt-hash", daemon=True
            )
            hasher.start()
            join: Callable[[], Any] = hasher.join
        else:
            join = reads.hash(lambda: ready.consume(hash_pieces))
        try:
            if direct_fd >= 0:
                ring = reads.ring() if reads is not None and DIRECT_BOUNCE else None
                _read_shifted(direct_fd, fd, out, offset, path, ready.put, ready.put, ring)
            else:
                done = 0
                while done < len(out):
                    stop = min(done + READ_PIECE_BYTES, len(out))
                    pread_all(fd, out[done:stop], offset + done, path)
                    done = stop
                    ready.put(done)
        except BaseException:
            ready.end()
            ready.wait(join)
            raise
        ready.end()
    finally:
        if direct_fd >= 0 and reads is None:
            os.close(direct_fd)
        if own_fd >= 0:
            os.close(own_fd)
        if own:
            os.close(opened)

    def finish() -> np.ndarray:
        ready.wait(join)
        return hashes

    return finish


class HashedReads:
    """The reads of one restore (:func:`start_hashed` of many arrays, from several
    threads): one ``O_DIRECT`` descriptor per file, opened at its first direct read,
    and hashing threads kept from one array to the next (one more only while every
    one is busy), where each array would otherwise open its own descriptor and start
    its own thread between two reads."""

    def __init__(self, *, direct: bool = True) -> None:
        self.direct = direct
        self.direct_opens = 0  # direct descriptors opened
        self.threads: list[threading.Thread] = []  # hashing threads started
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._idle = 0
        self._ring: bounce.BounceRing | None = None

    def start(
        self,
        path: str | os.PathLike[str],
        offset: int,
        out: memoryview,
        block_bytes: int,
        *,
        fd: int | None = None,
    ) -> Callable[[], np.ndarray]:
        """:func:`start_hashed` through this restore's descriptors and threads."""
        return start_hashed(path, offset, out, block_bytes, fd=fd, direct=self.direct, reads=self)

    def read_hashed(
        self,
        path: str | os.PathLike[str],
        offset: int,
        out: memoryview,
        block_bytes: int,
        *,
        fd: int | None = None,
    ) -> np.ndarray:
        """:func:`read_hashed` through this restore's descriptors and threads."""
        return self.start(path, offset, out, block_bytes, fd=fd)()

    def ring(self) -> bounce.BounceRing:
        """The bounce buffers of this restore's direct reads (made at the first)."""
        with self._lock:
            if self._ring is None:
                self._ring = bounce.BounceRing(DIRECT_READ_PIECE_BYTES)
            return self._ring

    def direct_fd(self, path: str | os.PathLike[str]) -> int:
        """The ``O_DIRECT`` descriptor on ``path`` (-1 where the file system has none)."""
        key = os.fspath(path)
        with self._lock:
            if key not in self._fds:
                self._fds[key] = _open_direct(path)
                self.direct_opens += 1
            return self._fds[key]

    def hash(self, job: Callable[[], None]) -> Callable[[], None]:
        """Run ``job`` on an idle hashing thread (a new one if none is); returns what
        waits for it and raises its error."""
        done = threading.Event()
        failed: list[BaseException] = []
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                name = f"hpcckpt-hash-{len(self.threads)}"
                thread = threading.Thread(target=self._work, name=name, daemon=True)
                thread.start()
                self.threads.append(thread)
            self._jobs.put((job, done, failed))

        def wait() -> None:
            done.wait()
            if failed:
                raise failed[0]

        return wait

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, done, failed = item
            try:
                job()
            except BaseException as exc:  # raised by the waiter
                failed.append(exc)
            with self._lock:
                self._idle += 1  # before the waiter wakes: its next job finds this thread
            done.set()

    def close(self) -> None:
        """End the hashing threads and close the descriptors (every read has ended)."""
        with self._lock:
            threads, self.threads = self.threads, []
            fds, self._fds = self._fds, {}
            self._idle = 0
            ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()  # a read still waiting for one of its buffers raises, not hangs
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join()
        for fd in fds.values():
            if fd >= 0:
                os.close(fd)

    def __enter__(self) -> HashedReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cached(fd: int, offset: int, length: int) -> bool:
    """Whether the middle page of the extent is in the page cache (then a buffered read
    is faster than the device)."""
    page = mmap.PAGESIZE
    return resident_pages(fd, (offset + length // 2) // page * page, 1) > 0


def resident_pages(fd: int, offset: int, length: int) -> int:
    """How many pages of ``length`` bytes from ``offset`` (a multiple of the page size)
    are in the page cache; 0 where it cannot tell. Asked with ``mincore``, which reads
    nothing: a ``RWF_NOWAIT`` read starts reading the page it asks for, and on a fast
    device it sometimes finds it there (seen here: 2 in 300 probes of dropped pages)."""
    mincore = libc.function("mincore")
    if mincore is None or length <= 0:
        return 0
    npages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * npages)()
    try:
        with mmap.mmap(fd, length, access=mmap.ACCESS_COPY, offset=offset) as mapped:
            start = ctypes.c_char.from_buffer(mapped)
            rc = mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(length), vec)
            del start  # the mapping cannot close while a ctypes object points into it
    except (OSError, ValueError, BufferError):  # no mmap here, or past the end
        return 0
    return sum(v & 1 for v in vec) if rc == 0 else 0


def _open_sequential(path: str | os.PathLike[str], offset: int, length: int) -> int:
    """A buffered read-only descriptor on ``path`` for one extent read from start to end:
    its own readahead state (two readers of one descriptor share one and spoil it), the
    kernel told the reads are sequential (a larger readahead window)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    with contextlib.suppress(AttributeError, OSError):  # a hint: the reads work without it
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_SEQUENTIAL)
    return fd


def _open_direct(path: str | os.PathLike[str]) -> int:
    """A read-only ``O_DIRECT`` descriptor on ``path``, or -1 if the file system has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | flag)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return -1
        raise


def _read_shifted(
    direct_fd: int,
    fd: int,
    out: memoryview,
    offset: int,
    path: str | os.PathLike[str],
    ready: Callable[[int], None],
    move: Callable[[tuple[Any, ...]], None] | None = None,
    ring: bounce.BounceRing | None = None,
) -> int:
    """Fill ``out`` from ``offset`` with ``O_DIRECT`` reads into ``out`` itself; the
    number of bytes read past the page cache.

    O_DIRECT needs the memory and the file offset aligned alike, and an application's
    array rarely is (numpy's large arrays start 16 bytes into a page). So each piece is
    read ``shift`` bytes past its place, where both align, and moved back: no bounce
    buffer to fault in, one memory move, and the bytes it lands on are not placed yet.
    The unaligned first bytes and the last ``shift`` or so go through the page cache,
    as does the rest after a short or refused direct read. ``ready(n)``: the first
    ``n`` bytes are in place. With ``move``, each move is handed on as ``move((at, n,
    shift))`` (made by another thread, in order, while the next piece is read; the
    pieces' spans do not overlap) instead of being made here, and the last bytes, which
    the last piece's shifted tail still occupies, as ``move((at, tail))``: read aside,
    to be copied in place after the moves (no waiting for them here). With ``ring``
    (and ``move``), each piece is read into one of its buffers instead and handed on as
    ``move((at, n, buf, ring))``, to be copied in place and given back.
    """
    n = len(out)
    head = min(n, -offset % ALIGN)
    pread_all(fd, out[:head], offset, path)
    if ring is not None and move is not None:
        end = head + (n - head) // ALIGN * ALIGN
        done = bounce.read_pieces(direct_fd, offset, head, end, ring, move)
        pread_all(fd, out[done:], offset + done, path)  # beside the copies: other bytes
        ready(n)
        return done - head
    addr = np.frombuffer(out, dtype=np.uint8).ctypes.data
    shift = (offset - addr) % ALIGN  # (addr + i + shift) and (offset + i) align alike
    done = head
    end = head + max(0, n - head - shift) // ALIGN * ALIGN
    piece = DIRECT_READ_PIECE_BYTES
    while done < end:
        want = min(piece, end - done)
        try:
            got = os.preadv(direct_fd, [out[done + shift : done + shift + want]], offset + done)
        except OSError as exc:
            if exc.errno != errno.EINVAL or done != head:
                raise
            break  # direct reads refused after all (a larger block size): the cache
        if got <= 0:
            break
        if shift and move is not None:
            move((done, got, shift))
        elif shift:
            ctypes.memmove(addr + done, addr + done + shift, got)
        done += got
        if not shift or move is None:
            ready(done)
        if got < want:
            break
    if shift and move is not None and done > head:
        tail = bytearray(n - done)
        pread_all(fd, memoryview(tail), offset + done, path)
        move((done, tail))
        return done - head
    pread_all(fd, out[done:], offset + done, path)
    ready(n)
    return done - head


def pread_all(fd: int, out: memoryview, offset: int, path: str | os.PathLike[str]) -> None:
    """Fill ``out`` from byte ``offset``; OSError when the file ends first."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"{os.fspath(path)} ends at byte {offset + done}")
        done += n


def _flat(data: memoryview) -> memoryview:
    return data.cast("B") if data.format != "B" or data.ndim != 1 else data


def _split(offset: int, length: int) -> tuple[int, int]:
    """(head, body): the unaligned bytes before the first aligned offset, then the
    longest aligned run after them."""
    head = min(length, -offset % ALIGN)
    body = (length - head) // ALIGN * ALIGN
    return head, body


def pwrite_all(fd: int, data: memoryview, offset: int) -> int:
    """Write all of ``data`` at ``offset`` (pwrite may write less than asked)."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done : done + WRITE_CHUNK], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes at offset {offset + done}")
        done += n
    return done


class _DirectWriter:
    """A thread writing filled bounce buffers with ``O_DIRECT`` while the caller fills
    the other one. Falls back to the buffered descriptor when a direct write is refused."""

    def __init__(
        self, direct_fd: int, buffered_fd: int, buffers: Sequence[np.ndarray] | None = None
    ) -> None:
        self.fd = direct_fd
        self.direct_fd = direct_fd
        self.buffered_fd = buffered_fd
        self.buffers = list(buffers) if buffers else [_aligned(BOUNCE_BYTES) for _ in range(2)]
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(len(self.buffers)):
            self.free.put(i)
        self.todo: queue.Queue[tuple[int, int, int] | None] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hpcckpt-direct", daemon=True)
        self.thread.start()

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        buffered_fd: int,
        buffers: Sequence[np.ndarray] | None = None,
    ) -> _DirectWriter | None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | flag)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return None  # this file system takes no O_DIRECT
            raise
        return cls(fd, buffered_fd, buffers)

    def write(
        self, data: memoryview, offset: int, queued: Callable[[int], None] | None = None
    ) -> None:
        """Queue ``data`` (a multiple of ALIGN long) for ``offset`` (aligned);
        ``queued(n)`` after the first ``n`` bytes are in bounce buffers."""
        _preallocate(self.direct_fd, offset, len(data))
        src = np.frombuffer(data, dtype=np.uint8)
        pos = 0
        while pos < len(data):
            i = self.free.get()
            if self.error is not None:
                self.free.put(i)
                raise self.error
            n = min(len(self.buffers[i]), len(data) - pos)
            np.copyto(self.buffers[i][:n], src[pos : pos + n])  # releases the GIL
            self.todo.put((i, n, offset + pos))
            pos += n
            if queued is not None:
                queued(pos)

    def drain(self) -> None:
        """Wait until every queued buffer is written."""
        held = [self.free.get() for _ in self.buffers]
        for i in held:
            self.free.put(i)
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Write what is queued, stop the thread, close the direct descriptor."""
        try:
            self.todo.put(None)
            self.thread.join()
        finally:
            if self.direct_fd != self.buffered_fd:
                os.close(self.direct_fd)
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            i, n, offset = item
            if self.error is None:
                try:
                    self._write(self.buffers[i][:n], offset)
                except BaseException as exc:  # raised in the caller's thread
                    self.error = exc
            self.free.put(i)

    def _write(self, buf: np.ndarray, offset: int) -> None:
        try:
            pwrite_all(self.fd, memoryview(buf), offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL or self.fd == self.buffered_fd:
                raise
            self.fd = self.buffered_fd  # the file system refuses this alignment
            pwrite_all(self.fd, memoryview(buf), offset)


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes]


_fallocate = libc.function("fallocate")
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _fallocate.restype = ctypes.c_int


def _preallocate(fd: int, offset: int, length: int) -> None:
    """Allocate the blocks of a range before writing it, where the file system can.

    ext4 lets direct writes to one file run side by side only into allocated blocks;
    writes into a hole take the file's lock one at a time. Not ``posix_fallocate``,
    which writes zeros where ``fallocate(2)`` is not supported.
    """
    if _fallocate is not None:
        _fallocate(fd, 0, offset, length)  # failure only costs speed


class StreamedWrite:
    """Extents written through a ring of reused, page-aligned buffers.

    :meth:`feed` copies every byte of the extents into the ring, waiting while every
    buffer is being written, and returns once the caller's memory is no longer needed;
    a thread writes the buffers (``O_DIRECT`` where allowed). :meth:`finish` (from any
    thread) waits for the writes and fsyncs. The memory held is the ring, whatever the
    size of the extents: what lets a staged save stay within a memory budget.
    """

    def __init__(
        self, path: str | os.PathLike[str], ring: Sequence[np.ndarray], *, direct: bool = True
    ) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        self.total = self.direct_total = 0
        try:
            writer = _DirectWriter.open(path, self.fd, ring) if direct else None
            self.direct = writer is not None
            self.writer = writer or _DirectWriter(self.fd, self.fd, ring)
        except BaseException:
            os.close(self.fd)
            raise

    def feed(self, extents: Sequence[Extent], before: Callable[[int], None] | None = None) -> None:
        """Copy (or, for short and unaligned bytes, write through the page cache) every extent."""
        for i, extent in enumerate(extents):
            if before is not None:
                before(i)
            data = _flat(extent.data)
            head, body = _split(extent.offset, len(data))
            if body < MIN_DIRECT_BYTES:
                pwrite_all(self.fd, data, extent.offset)
            else:
                pwrite_all(self.fd, data[:head], extent.offset)
                self.writer.write(data[head : head + body], extent.offset + head)
                pwrite_all(self.fd, data[head + body :], extent.offset + head + body)
                self.direct_total += body if self.direct else 0
            self.total += len(data)

    def finish(self) -> Outcome:
        """Wait for every queued buffer, fsync and close; raises the first write error."""
        try:
            self.writer.close()
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
        return Outcome(self.total, self.direct_total)


def ring_buffers(nbytes: int, piece: int = BOUNCE_BYTES) -> list[np.ndarray]:
    """Page-aligned buffers of at most ``piece`` bytes, ``nbytes`` in all (at least two)."""
    piece = max(ALIGN, min(piece, nbytes // 2) // ALIGN * ALIGN)
    return [_aligned(piece) for _ in range(max(2, nbytes // piece))]
