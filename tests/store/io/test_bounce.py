"""Direct reads through huge-page buffers: every byte lands in place, the buffers are
reused, and a read the file system refuses or cuts short stops where the page cache
takes over."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from hpcckpt.store.io import blocks, bounce, direct_io
from hpcckpt.store.io.direct_io import ALIGN

KiB = 1024


def test_a_buffer_of_a_huge_page_or_more_is_aligned_to_one_and_given_back_reused():
    ring = bounce.BounceRing(4 << 20)
    first = ring.take()
    assert first.size == 4 << 20 and first.ctypes.data % bounce.HUGE_PAGE == 0
    first[:] = 7  # writable, and the whole piece
    ring.give(first)
    again = ring.take()
    assert again.ctypes.data == first.ctypes.data and ring.made == 1
    second = ring.take()
    assert second.ctypes.data != again.ctypes.data and ring.made == 2
    small = bounce.BounceRing(12 * KiB).take()
    assert small.size == 12 * KiB and small.ctypes.data % bounce.PAGE == 0


def test_a_buffer_of_huge_page_size_is_backed_by_a_huge_page_where_the_kernel_has_them():
    """The point of the ring: where transparent huge pages are on (``madvise`` or
    ``always``), the buffers get them, and a direct read's requests are not cut at 4 KiB
    pages. Counted from /proc/self/smaps_rollup."""
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[never]" in mode:
        pytest.fail(f"transparent huge pages are off here ({mode.strip()}): this test needs them")

    def huge_kib() -> int:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
        return 0

    before = huge_kib()
    ring = bounce.BounceRing(8 << 20)
    bufs = [ring.take() for _ in range(2)]
    for buf in bufs:
        buf[:] = 1
    assert huge_kib() - before >= 8 << 10  # at least half of the 16 MiB


def test_no_memory_for_a_buffer_is_a_memory_error_not_a_read_error(monkeypatch):
    """A restore takes an OSError of its reads for a damaged file: a buffer that cannot
    be mapped must not look like one."""

    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(bounce.mmap, "mmap", no_memory)
    with pytest.raises(MemoryError, match="read buffer"):
        bounce.BounceRing(4 << 20).take()


def test_read_pieces_stops_at_a_short_read_and_at_a_refused_first_one(tmp_path, monkeypatch):
    path = tmp_path / "f"
    payload = np.random.default_rng(3).integers(0, 256, 40 * KiB + 100, dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    ring = bounce.BounceRing(16 * KiB)
    moved = []
    fd = os.open(path, os.O_RDONLY)
    try:  # buffered descriptor: the same reads, none refused; the file ends mid-piece
        done = bounce.read_pieces(fd, 0, 0, 48 * KiB, ring, moved.append)
        assert done == 40 * KiB + 100
        pieces = [(at, n) for at, n, _, _ in moved]
        assert pieces == [(0, 16 * KiB), (16 * KiB, 16 * KiB), (32 * KiB, 8 * KiB + 100)]
        for at, n, buf, _ in moved:
            assert buf[:n].tobytes() == payload[at : at + n].tobytes()
        real = os.preadv

        def refused(fd_, bufs, offset, *flags):
            raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(os, "preadv", refused)
        assert bounce.read_pieces(fd, 0, 4 * KiB, 32 * KiB, ring, moved.append) == 4 * KiB
        monkeypatch.setattr(os, "preadv", real)
    finally:
        os.close(fd)
    assert ring.made == 4
    ring.take()
    assert ring.made == 4  # the refused read gave its buffer back


def test_a_restores_direct_reads_land_exactly_through_a_few_reused_buffers(
    tmp_path, shifted_calls_through_ring, uncached, monkeypatch
):
    """Arrays of any alignment, in memory and in the file, read past the page cache
    through one HashedReads: exact bytes and hashes, the bytes either side untouched,
    and the ring's buffers reused from one piece and one array to the next."""
    monkeypatch.setattr(direct_io, "DIRECT_READ_PIECE_BYTES", 12 * KiB)
    n, count = 100 * KiB + 5, 4
    payloads = [
        np.random.default_rng(50 + i).integers(0, 256, n, dtype=np.uint8) for i in range(count)
    ]
    path = tmp_path / "f"
    path.write_bytes(b"h" * 400 + b"".join(p.tobytes() for p in payloads) + b"tail" * 1000)
    uncached(path)
    with direct_io.HashedReads() as reads:
        for i, payload in enumerate(payloads):
            guard = np.full(n + 3 * ALIGN, 0xA5, dtype=np.uint8)
            shift = (-guard.ctypes.data % ALIGN) + 16 * i + 64
            out = guard[shift : shift + n]
            got = reads.read_hashed(path, 400 + i * n, memoryview(out), 8 * KiB)
            assert out.tobytes() == payload.tobytes(), i
            assert np.array_equal(got, blocks.block_hashes(payload, 8 * KiB)), i
            assert (guard[:shift] == 0xA5).all() and (guard[shift + n :] == 0xA5).all()
        ring = reads.ring()
        # 9 pieces an array, 4 arrays: the buffers come back (more are made only while the
        # hashing thread lags behind the reads: 5 on a loaded machine)
        assert 1 <= ring.made <= 9
    assert shifted_calls_through_ring == [True] * count  # each read past the cache, whole


@pytest.fixture
def shifted_calls_through_ring(monkeypatch):
    """Whether each direct read of a restore went through a ring and past the page
    cache for all but its edges (the real function runs)."""
    calls = []
    real = direct_io._read_shifted

    def counted(*args, **kwargs):
        ring = args[7] if len(args) > 7 else kwargs.get("ring")
        direct = real(*args, **kwargs)
        calls.append(ring is not None and direct > len(args[2]) - 3 * ALIGN)
        return direct

    monkeypatch.setattr(direct_io, "MIN_DIRECT_BYTES", 8 * KiB)
    monkeypatch.setattr(direct_io, "_read_shifted", counted)
    return calls
