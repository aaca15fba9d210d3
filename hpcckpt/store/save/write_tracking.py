"""Which pages of the state were written since the last committed save, told by the kernel.

An incremental save must find the blocks that changed. Hashing every block reads the
whole state; instead the arrays' memory is registered with a userfaultfd in
asynchronous write-protect mode (``UFFD_FEATURE_WP_ASYNC``, Linux >= 6.7): the first
write to a protected page just clears its protection, with no signal and no handler,
and the ``PAGEMAP_SCAN`` ioctl on ``/proc/self/pagemap`` lists the written pages and
protects them again in one atomic step. Writes by the kernel on our behalf (``read``
into the array) and by other processes (``process_vm_writev``, Open MPI's single-copy
transfers) go through our page tables too, so they are seen. ctypes only; the
``UFFD_USER_MODE_ONLY`` flag makes it work without privileges.

What the page tables cannot tell is handled conservatively: the whole pages holding
an array are tracked, so a write to a neighbour sharing its first or last page marks
that block too; a page that is neither present nor swapped, or
maps the shared zero page (``MADV_DONTNEED`` zaps a page to zeros without a write), is
"changed"; memory that is shared or backed by a file can change without a write
through our page tables, so it is never tracked (its arrays are hashed); a region
whose scan fails (unmapped, remapped) is dropped and its arrays are hashed in full.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import platform
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcckpt import libc, procfs

PAGE = mmap.PAGESIZE

_SYSCALL = {"x86_64": 323, "aarch64": 282, "ppc64le": 364, "riscv64": 282, "s390x": 355}
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_FEATURE_WP_UNPOPULATED = 1 << 13
_FEATURE_WP_ASYNC = 1 << 15
_FEATURES = _FEATURE_WP_UNPOPULATED | _FEATURE_WP_ASYNC
_MODE_WP = 1 << 1  # UFFDIO_REGISTER_MODE_WP
_WRITEPROTECT_MODE_WP = 1
# Page categories and flags of PAGEMAP_SCAN (include/uapi/linux/fs.h).
_IS_WRITTEN, _IS_PRESENT, _IS_SWAPPED, _IS_PFNZERO = 1 << 1, 1 << 3, 1 << 4, 1 << 5
_WP_MATCHING, _CHECK_WPASYNC = 1 << 0, 1 << 1
_VEC = 4096  # page_region entries per ioctl call


def _ioc(direction: int, kind: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | nr


_UFFDIO_API = _ioc(3, 0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _ioc(3, 0xAA, 0x00, 32)
_UFFDIO_UNREGISTER = _ioc(2, 0xAA, 0x01, 16)
_UFFDIO_WRITEPROTECT = _ioc(3, 0xAA, 0x06, 24)
_PAGEMAP_SCAN = _ioc(3, ord("f"), 16, 96)

_syscall = libc.function("syscall")
_ioctl = libc.function("ioctl")
if _syscall is not None and _ioctl is not None:
    _syscall.restype = ctypes.c_long
    _ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    _ioctl.restype = ctypes.c_int


class TrackingError(OSError):
    """A userfaultfd or PAGEMAP_SCAN call failed; ``errno`` says why."""


def _call(fd: int, request: int, arg: ctypes.Array, what: str) -> int:
    ret = _ioctl(fd, request, ctypes.addressof(arg))
    if ret < 0:
        err = ctypes.get_errno()
        raise TrackingError(err, f"{what}: {os.strerror(err)}")
    return ret


def _open_uffd() -> int:
    """A userfaultfd with asynchronous write-protection enabled; TrackingError if not."""
    nr = _SYSCALL.get(platform.machine())
    if _syscall is None or _ioctl is None:
        raise TrackingError(errno.ENOSYS, "userfaultfd: no C library to call it through")
    if nr is None:
        raise TrackingError(
            errno.ENOSYS, f"userfaultfd: no syscall number for {platform.machine()}"
        )
    fd = _syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY)
    if fd < 0:
        err = ctypes.get_errno()
        raise TrackingError(err, f"userfaultfd: {os.strerror(err)}")
    api = (ctypes.c_uint64 * 3)(_UFFD_API, _FEATURES, 0)
    try:
        _call(fd, _UFFDIO_API, api, "UFFDIO_API with WP_ASYNC")
        if api[1] & _FEATURES != _FEATURES:
            raise TrackingError(errno.EINVAL, "UFFDIO_API: WP_ASYNC not offered")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _probe() -> str | None:
    """None when tracking works here (a write to a protected page is reported, exactly),
    else why not."""
    fd = pagemap = -1
    area = None
    try:
        fd = _open_uffd()
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        area = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.write(b"\1" * (4 * PAGE))
        buf = ctypes.c_char.from_buffer(area)
        start = ctypes.addressof(buf)
        del buf
        _register(fd, start, start + 4 * PAGE)
        area[2 * PAGE] = 7
        vec = (ctypes.c_uint64 * 3 * 8)()
        found, _ = _scan(pagemap, start, start + 4 * PAGE, vec, written=True)
        if found != [(start + 2 * PAGE, start + 3 * PAGE)]:
            return f"PAGEMAP_SCAN reported {found} for one written page"
        return None
    except OSError as exc:
        return f"{exc.strerror or exc}" if isinstance(exc, TrackingError) else str(exc)
    finally:
        if area is not None:
            area.close()
        for f in (fd, pagemap):
            if f >= 0:
                os.close(f)


@functools.cache
def why_unavailable() -> str | None:
    """None when the kernel tracks writes for us here, else the reason (cached)."""
    return _probe()


def available() -> bool:
    """Whether userfaultfd asynchronous write-protect and PAGEMAP_SCAN work here."""
    return why_unavailable() is None


#: What to do when tracking is unavailable, for error messages.
FIX = (
    "kernel write tracking needs Linux >= 6.7 with CONFIG_USERFAULTFD and "
    "CONFIG_PTE_MARKER_UFFD_WP (and userfaultfd not blocked by seccomp); use "
    "change_detection='hashes' (or 'auto') to find changed blocks by hashing instead"
)


def _register(fd: int, start: int, end: int) -> None:
    reg = (ctypes.c_uint64 * 4)(start, end - start, _MODE_WP, 0)
    _call(fd, _UFFDIO_REGISTER, reg, "UFFDIO_REGISTER")
    wp = (ctypes.c_uint64 * 3)(start, end - start, _WRITEPROTECT_MODE_WP)
    try:
        _call(fd, _UFFDIO_WRITEPROTECT, wp, "UFFDIO_WRITEPROTECT")
    except TrackingError:
        _unregister(fd, start, end)
        raise


def _unregister(fd: int, start: int, end: int) -> None:
    rng = (ctypes.c_uint64 * 2)(start, end - start)
    try:
        _call(fd, _UFFDIO_UNREGISTER, rng, "UFFDIO_UNREGISTER")
    except TrackingError:
        pass  # unmapped already, or replaced by memory never registered


def _scan(
    pagemap: int, start: int, end: int, vec: ctypes.Array, *, written: bool
) -> tuple[list[tuple[int, int]], int]:
    """The page ranges of ``[start, end)`` that were written (and protect them again),
    or with ``written=False`` that read as zeros without a write (neither present nor
    swapped, or the zero page); and how many ioctl calls it took. TrackingError when a
    part of the range is not (or no longer) registered."""
    if written:
        flags = _WP_MATCHING | _CHECK_WPASYNC
        inverted, mask, anyof, ret = 0, _IS_WRITTEN, 0, _IS_WRITTEN
    else:  # not swapped, and (not present or the zero page)
        flags = _CHECK_WPASYNC
        inverted, mask = _IS_PRESENT | _IS_SWAPPED, _IS_SWAPPED
        anyof = _IS_PRESENT | _IS_PFNZERO
        ret = _IS_PRESENT | _IS_SWAPPED | _IS_PFNZERO
    found: list[tuple[int, int]] = []
    calls = 0
    at = start
    while at < end:
        arg = (ctypes.c_uint64 * 12)(
            96, flags, at, end, 0, ctypes.addressof(vec), len(vec), 0, inverted, mask, anyof, ret
        )
        n = _call(pagemap, _PAGEMAP_SCAN, arg, "PAGEMAP_SCAN")
        calls += 1
        flat = np.ctypeslib.as_array(vec).reshape(-1, 3)[:n]
        found += [(int(s), int(e)) for s, e, _ in flat]
        walked = int(arg[4])
        if walked <= at:
            raise TrackingError(errno.EIO, "PAGEMAP_SCAN made no progress")
        at = walked
    return found, calls


@dataclass
class _Region:
    """Pages registered together; ``pending`` marks those written since the last commit,
    shared by every array overlapping them (a scan protects pages again, so a second
    array scanning the same pages must find the first scan's findings here)."""

    start: int
    end: int
    pending: np.ndarray  # bool per page

    def mark(self, lo: int, hi: int) -> None:
        lo, hi = max(lo, self.start), min(hi, self.end)
        if lo < hi:
            self.pending[(lo - self.start) // PAGE : (hi - self.start) // PAGE] = True


@dataclass
class _Tracked:
    ptr: int
    nbytes: int
    start: int  # the whole pages holding it, registered
    end: int
    trusted: bool = False  # registered before the last committed save hashed it


@dataclass
class Scan:
    """What the kernel reported for one save, on this rank."""

    pages: int = 0  # pending pages of the arrays scanned (written, or zeroed without a write)
    seconds: float = 0.0
    calls: int = 0


@dataclass
class WriteTracker:
    """The arrays of a state, registered so that their written pages can be listed.

    ``track(path, array)`` registers (and write-protects) an array before it is hashed;
    ``candidate_blocks(path, array, step)`` gives the blocks that may have changed since
    the last :meth:`committed` save, or None when the array cannot be trusted (hash it
    all). Pages found written stay pending until :meth:`committed`: a failed save loses
    nothing.
    """

    baseline: str | None = None  # uid of the checkpoint whose hashes the tracking matches
    scan: Scan = field(default_factory=Scan)
    _fd: int = -1
    _pagemap: int = -1
    _regions: list[_Region] = field(default_factory=list)
    _arrays: dict[str, _Tracked] = field(default_factory=dict)
    # Arrays refused for their memory (shared, file-backed), at their address and size:
    # not looked up in /proc/self/maps again (4 ms in an MPI process) while they stay.
    _refused: dict[str, tuple[tuple[int, int], str]] = field(default_factory=dict)
    _vec: ctypes.Array | None = None
    _closer: weakref.finalize | None = None

    def _open(self) -> None:
        if self._fd < 0:
            self._fd = _open_uffd()
            self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            self._vec = (ctypes.c_uint64 * 3 * _VEC)()
            # Closing the userfaultfd unregisters all its memory: a tracker dropped
            # without close() must not leave memory nobody else can register.
            self._closer = weakref.finalize(self, _close_fds, self._fd, self._pagemap)

    @property
    def tracked(self) -> set[str]:
        return set(self._arrays)

    def registered(self, path: str, array: np.ndarray) -> bool:
        """Whether ``array`` is registered under ``path``, at its address and size."""
        t = self._arrays.get(path)
        return t is not None and (t.ptr, t.nbytes) == _span(array)

    def trusted(self, path: str, array: np.ndarray) -> bool:
        """Registered since before the last committed save hashed it."""
        return self.registered(path, array) and self._arrays[path].trusted

    def why_not(self, path: str, array: Any, block_step: int) -> str | None:
        """Why ``array`` is not tracked, as far as known without reading /proc/self/maps
        (its type, layout, size, or memory refused at this address before); None when it
        is registered already or its memory must be looked up."""
        if self.registered(path, array):
            return None
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            return "not a C-contiguous numpy array"
        if array.nbytes < max(block_step, PAGE):
            return "smaller than one block"
        span, why = self._refused.get(path, (None, None))
        return why if span == _span(array) else None

    def track(
        self,
        path: str,
        array: np.ndarray,
        block_step: int,
        maps: list[procfs.MemoryArea] | None = None,
    ) -> str | None:
        """Register ``array`` (kept if it already is, at the same address); None when
        tracked, else why not. ``maps``: /proc/self/maps, read once per save."""
        if self.registered(path, array):
            return None
        self._arrays.pop(path, None)
        why = self.why_not(path, array, block_step)
        if why is not None:
            return why
        ptr, nbytes = _span(array)
        # The whole pages holding it: a write to a neighbour sharing its first or last
        # page marks that block too, which costs a hash, never a missed change.
        start, end = ptr // PAGE * PAGE, -(-(ptr + nbytes) // PAGE) * PAGE
        why = _not_private_anonymous(start, end, maps if maps is not None else procfs.memory_maps())
        if why:
            self._refused[path] = ((ptr, nbytes), why)
            return why
        self._open()
        try:
            for lo, hi in self._gaps(start, end):
                _register(self._fd, lo, hi)
                self._regions.append(_Region(lo, hi, np.zeros((hi - lo) // PAGE, dtype=bool)))
                self._regions.sort(key=lambda r: r.start)
        except TrackingError as exc:
            return f"cannot register it ({exc.strerror})"
        self._arrays[path] = _Tracked(ptr, nbytes, start, end)
        return None

    def _gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` no region covers yet."""
        gaps, at = [], start
        for r in self._regions:
            if r.end <= at or r.start >= end:
                continue
            if r.start > at:
                gaps.append((at, r.start))
            at = max(at, r.end)
        if at < end:
            gaps.append((at, end))
        return gaps

    def _overlapping(self, start: int, end: int) -> list[_Region]:
        return [r for r in self._regions if r.start < end and r.end > start]

    def candidate_blocks(self, path: str, array: np.ndarray, block_step: int) -> np.ndarray | None:
        """Sorted indices of the blocks of ``block_step`` bytes that may differ from the
        baseline's, or None: not tracked since the baseline, or its memory was replaced."""
        if not self.trusted(path, array):
            return None
        t = self._arrays[path]
        t0 = time.perf_counter()
        try:
            assert self._vec is not None
            for written in (True, False):
                found, calls = _scan(self._pagemap, t.start, t.end, self._vec, written=written)
                self.scan.calls += calls
                for lo, hi in found:
                    for r in self._overlapping(lo, hi):
                        r.mark(lo, hi)
        except TrackingError:
            self._drop(t.start, t.end)
            return None
        finally:
            self.scan.seconds += time.perf_counter() - t0
        pages = []
        for r in self._overlapping(t.start, t.end):
            lo, hi = max(r.start, t.start), min(r.end, t.end)
            idx = np.flatnonzero(r.pending[(lo - r.start) // PAGE : (hi - r.start) // PAGE])
            pages.append(lo + idx.astype(np.int64) * PAGE)
        addrs = np.concatenate(pages) if pages else np.zeros(0, dtype=np.int64)
        self.scan.pages += int(addrs.size)
        nblocks = -(-t.nbytes // block_step)
        first = np.maximum(addrs - t.ptr, 0) // block_step
        last = np.minimum((addrs - t.ptr + PAGE - 1) // block_step, nblocks - 1)
        span = int((last - first).max()) if addrs.size else 0
        out = [np.minimum(first + k, last) for k in range(span + 1)]
        found = np.sort(np.concatenate(out).astype(np.int64))
        return found[np.concatenate(([True], found[1:] != found[:-1]))] if found.size else found

    def _drop(self, start: int, end: int) -> None:
        """Forget the regions overlapping ``[start, end)`` and every array on them."""
        gone = self._overlapping(start, end)
        for r in gone:
            _unregister(self._fd, r.start, r.end)
            self._regions.remove(r)
        for path, t in list(self._arrays.items()):
            if any(r.start < t.end and r.end > t.start for r in gone):
                del self._arrays[path]

    def keep_only(self, paths: set[str]) -> None:
        """Stop tracking arrays not in ``paths`` and the regions no array uses any more."""
        for path in set(self._arrays) - paths:
            del self._arrays[path]
        for path in set(self._refused) - paths:
            del self._refused[path]
        for r in list(self._regions):
            if not any(r.start < t.end and r.end > t.start for t in self._arrays.values()):
                _unregister(self._fd, r.start, r.end)
                self._regions.remove(r)

    def committed(self, uid: str) -> None:
        """The save that scanned and hashed every tracked array committed as ``uid``."""
        for r in self._regions:
            r.pending[:] = False
        for t in self._arrays.values():
            t.trusted = True
        self.baseline = uid

    def reset(self) -> None:
        """Unregister everything and forget the baseline (a restore rewrote the arrays)."""
        for r in self._regions:
            _unregister(self._fd, r.start, r.end)
        self._regions.clear()
        self._arrays.clear()
        self._refused.clear()
        self.baseline = None

    def close(self) -> None:
        self.reset()
        if self._closer is not None:
            self._closer()  # once: the numbers may belong to other files afterwards
        self._fd = self._pagemap = -1


def _close_fds(*fds: int) -> None:
    for f in fds:
        if f >= 0:
            try:
                os.close(f)
            except OSError:
                pass  # closed already


def _span(array: np.ndarray) -> tuple[int, int]:
    return int(array.__array_interface__["data"][0]), int(array.nbytes)


def _not_private_anonymous(start: int, end: int, maps: list[procfs.MemoryArea]) -> str | None:
    """None when ``[start, end)`` lies wholly in private anonymous memory, else why not."""
    at = start
    for area in maps:
        if area.end <= at or area.start >= end:
            continue
        if area.start > at:
            break
        if not area.private_anonymous:
            shared = "shared" if area.perms[3:4] == "s" else "private"
            backing = "file-backed" if area.inode or area.path.startswith("/") else "special"
            if not area.inode and not area.path:
                backing = "anonymous"
            return f"its memory is {shared} and {backing} ({area.path or 'no file'})"
        at = area.end
        if at >= end:
            return None
    return "its memory is not (wholly) mapped"
