"""Writing extents past the page cache: bytes land where they belong, whatever the path."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading

import numpy as np
import pytest

from hpcckpt.store.io import direct_io, filesystem
from hpcckpt.store.io.direct_io import ALIGN, Extent, write_extents

KiB = 1024


@pytest.fixture
def small(monkeypatch):
    """Bounce buffers and the direct threshold small enough for test-sized extents."""
    monkeypatch.setattr(direct_io, "BOUNCE_BYTES", 16 * KiB)
    monkeypatch.setattr(direct_io, "MIN_DIRECT_BYTES", 8 * KiB)


def data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def takes_direct(path) -> bool:
    return filesystem.detect(path).name in filesystem.DIRECT_IO_NAMES


def test_unaligned_extents_land_exactly_and_the_rest_is_left_alone(tmp_path, small):
    path = tmp_path / "f"
    path.write_bytes(b"\xee" * 300 * KiB)
    a = data(100 * KiB + 123, 1)  # starts unaligned, ends unaligned, spans several bounces
    b = data(40 * KiB, 2).view(np.float64).reshape(-1, 8)  # 2-d, other format
    c = data(5000, 3)  # below the threshold: page cache
    extents = [
        Extent(777, memoryview(a)),
        Extent(150 * KiB, memoryview(b)),
        Extent(250 * KiB + 1, memoryview(c)),
    ]
    out = write_extents(path, extents)
    got = path.read_bytes()
    assert len(got) == 300 * KiB
    assert got[777 : 777 + a.nbytes] == a.tobytes()
    assert got[150 * KiB : 150 * KiB + b.nbytes] == b.tobytes()
    assert got[250 * KiB + 1 : 250 * KiB + 1 + c.nbytes] == c.tobytes()
    assert got[:777] == b"\xee" * 777
    assert got[777 + a.nbytes : 150 * KiB] == b"\xee" * (150 * KiB - 777 - a.nbytes)
    assert out.bytes == a.nbytes + b.nbytes + c.nbytes
    if takes_direct(tmp_path):  # ext4 here: the aligned middles went past the cache
        head_a = ALIGN - 777
        head_b = ALIGN - 150 * KiB % ALIGN  # 150 KiB is half a page off
        body_a = (a.nbytes - head_a) // ALIGN * ALIGN
        body_b = (b.nbytes - head_b) // ALIGN * ALIGN
        assert out.direct_bytes == body_a + body_b
    else:
        assert out.direct_bytes in (0, out.bytes - c.nbytes)


def test_buffered_when_asked(tmp_path, small):
    path = tmp_path / "f"
    path.write_bytes(b"")
    a = data(64 * KiB, 4)
    out = write_extents(path, [Extent(ALIGN, memoryview(a))], direct=False)
    assert out.direct_bytes == 0 and path.read_bytes()[ALIGN:] == a.tobytes()


def test_a_file_system_refusing_o_direct_gets_buffered_writes(tmp_path, small, monkeypatch):
    real_open = os.open

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    path = tmp_path / "f"
    path.write_bytes(b"")
    a = data(64 * KiB, 5)
    out = write_extents(path, [Extent(0, memoryview(a))])
    assert out.direct_bytes == 0 and path.read_bytes() == a.tobytes()


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def test_a_refused_direct_write_is_redone_through_the_cache(tmp_path, small, monkeypatch):
    real_pwrite = os.pwrite
    refused = []

    def picky(fd, buf, offset):
        if _is_direct(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", picky)
    path = tmp_path / "f"
    path.write_bytes(b"")
    a = data(64 * KiB, 6)
    write_extents(path, [Extent(0, memoryview(a))])
    assert path.read_bytes() == a.tobytes()
    if takes_direct(tmp_path):
        assert refused == [0], "refused once, then the buffered descriptor for the rest"


def test_an_io_error_in_the_writer_thread_reaches_the_caller(tmp_path, small, monkeypatch):
    real_pwrite = os.pwrite

    def failing(fd, buf, offset):
        if _is_direct(fd) or offset >= 32 * KiB:
            raise OSError(errno.EIO, "Input/output error")
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", failing)
    path = tmp_path / "f"
    path.write_bytes(b"")
    with pytest.raises(OSError) as info:
        write_extents(path, [Extent(0, memoryview(data(64 * KiB, 7)))])
    assert info.value.errno == errno.EIO


def test_hooks_see_each_extent_written_and_one_fsync_ends_it(tmp_path, small, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"")
    a, b = data(64 * KiB, 8), data(20 * KiB, 9)
    seen = []
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))

    def after(i: int) -> None:
        ext = (a, b)[i]
        off = (0, 64 * KiB)[i]
        seen.append((i, path.read_bytes()[off : off + ext.nbytes] == ext.tobytes(), synced[:]))

    write_extents(path, [Extent(0, memoryview(a)), Extent(64 * KiB, memoryview(b))], after=after)
    assert seen == [(0, True, []), (1, True, [])]
    assert len(synced) == 1


def test_no_extents_still_fsyncs(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"x")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    assert write_extents(path, []) == direct_io.Outcome(0, 0)
    assert len(synced) == 1 and path.read_bytes() == b"x"


def test_a_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_extents(tmp_path / "nope", [Extent(0, memoryview(b"x"))])


@pytest.mark.parametrize(
    "name, kind, expected",
    [
        ("ext2/3/4", filesystem.LOCAL, True),
        ("xfs", filesystem.LOCAL, True),
        ("ext4", filesystem.LOCAL, True),  # the mountinfo name
        ("lustre", filesystem.LUSTRE, True),
        ("gpfs", filesystem.GPFS, True),
        ("tmpfs", filesystem.LOCAL, False),
        ("nfs", filesystem.NFS, False),
        ("beegfs", filesystem.BEEGFS, False),
        ("fuse", filesystem.LOCAL, False),
    ],
)
def test_the_plan_chooses_direct_io_by_file_system(tmp_path, name, kind, expected):
    fs = filesystem.FileSystem(kind, name, None, 4096)
    assert filesystem.plan(tmp_path, fs, 2, 1 << 30).direct_io is expected
    for forced in (True, False):
        opts = filesystem.TuningOptions(direct_io=forced)
        assert filesystem.plan(tmp_path, fs, 2, 1 << 30, opts).direct_io is forced


@pytest.mark.parametrize("nbytes", [0, 1, 4096, 100_000, 257 * KiB + 5])
def test_read_hashed_reads_and_hashes_like_block_hashes(tmp_path, monkeypatch, nbytes):
    from hpcckpt.store.io import blocks

    monkeypatch.setattr(direct_io, "READ_PIECE_BYTES", 32 * KiB)  # many pieces
    payload = data(nbytes, 10)
    path = tmp_path / "f"
    path.write_bytes(b"head" * 100 + payload.tobytes() + b"tail")
    out = np.zeros(nbytes, dtype=np.uint8)
    got = direct_io.read_hashed(path, 400, memoryview(out), 8 * KiB)
    assert out.tobytes() == payload.tobytes()
    assert np.array_equal(got, blocks.block_hashes(payload, 8 * KiB))


@pytest.fixture
def shifted_calls(monkeypatch):
    """Small direct reads, and the direct reads counted (the real function runs)."""
    monkeypatch.setattr(direct_io, "MIN_DIRECT_BYTES", 8 * KiB)
    monkeypatch.setattr(direct_io, "DIRECT_READ_PIECE_BYTES", 12 * KiB)  # many pieces
    calls = []
    real = direct_io._read_shifted

    def counted(*args, **kwargs):
        calls.append((args[3], None))
        direct = real(*args, **kwargs)
        calls.pop()
        calls.append((args[3], direct > len(args[2]) - 3 * ALIGN))  # offset, all but the edges
        return direct

    monkeypatch.setattr(direct_io, "_read_shifted", counted)
    return calls


@pytest.mark.parametrize("mem_shift", [0, 16, 64, 511, 4095])
@pytest.mark.parametrize("file_offset", [0, 400, 4096, 12288 + 7])
def test_a_direct_read_lands_exactly_for_any_alignment_of_memory_and_file(
    tmp_path, shifted_calls, uncached, mem_shift, file_offset
):
    from hpcckpt.store.io import blocks

    nbytes = 100 * KiB + 5
    payload = data(nbytes, 11)
    path = tmp_path / "f"
    path.write_bytes(b"h" * file_offset + payload.tobytes() + b"tail" * 1000)
    uncached(path)
    guard = np.full(nbytes + 8192, 0xA5, dtype=np.uint8)
    base = -guard.ctypes.data % ALIGN  # page-aligned, then shifted
    out = guard[base + mem_shift : base + mem_shift + nbytes]
    got = direct_io.read_hashed(path, file_offset, memoryview(out), 8 * KiB)
    assert out.tobytes() == payload.tobytes()
    assert np.array_equal(got, blocks.block_hashes(payload, 8 * KiB))
    # The pieces were moved in place: nothing outside the extent was written.
    assert (guard[: base + mem_shift] == 0xA5).all()
    assert (guard[base + mem_shift + nbytes :] == 0xA5).all()
    assert shifted_calls == ([(file_offset, True)] if takes_direct(tmp_path) else [])


def test_the_pieces_are_moved_in_place_by_the_hashing_thread(
    tmp_path, shifted_calls, uncached, monkeypatch
):
    """The reading thread goes on to the next direct read while the last piece is moved
    into place (and hashed) beside it."""
    from hpcckpt.store.io import blocks

    if not takes_direct(tmp_path):
        pytest.fail(f"{tmp_path} takes no direct reads: this test needs a file system that does")
    nbytes = 100 * KiB + 5
    payload = data(nbytes, 13)
    path = tmp_path / "f"
    path.write_bytes(b"h" * 400 + payload.tobytes() + b"tail" * 1000)
    uncached(path)
    guard = np.full(nbytes + 8192, 0xA5, dtype=np.uint8)
    base = -guard.ctypes.data % ALIGN
    out = guard[base + 64 : base + 64 + nbytes]  # as a torch tensor's memory: shifted
    movers = []
    real = direct_io.ctypes.memmove

    def memmove(*args):
        movers.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(direct_io.ctypes, "memmove", memmove)
    got = direct_io.read_hashed(path, 400, memoryview(out), 8 * KiB)
    assert out.tobytes() == payload.tobytes()
    assert np.array_equal(got, blocks.block_hashes(payload, 8 * KiB))
    assert (guard[: base + 64] == 0xA5).all() and (guard[base + 64 + nbytes :] == 0xA5).all()
    assert len(movers) >= 8 and set(movers) == {"hpcckpt-hash"}, movers  # 12 KiB pieces


def test_bytes_in_the_page_cache_are_read_through_it(tmp_path, shifted_calls, uncached):
    payload = data(64 * KiB, 12)
    path = tmp_path / "f"
    path.write_bytes(payload.tobytes())  # just written: in the cache
    out = np.zeros(payload.size, dtype=np.uint8)
    direct_io.read_hashed(path, 0, memoryview(out), 8 * KiB)
    assert out.tobytes() == payload.tobytes() and shifted_calls == []
    uncached(path)
    direct_io.read_hashed(path, 0, memoryview(out), 8 * KiB)
    assert out.tobytes() == payload.tobytes()
    assert shifted_calls == ([(0, True)] if takes_direct(tmp_path) else [])
    direct_io.read_hashed(path, 0, memoryview(out), 8 * KiB, direct=False)
    assert len(shifted_calls) == (1 if takes_direct(tmp_path) else 0)


def test_a_file_system_refusing_o_direct_gets_buffered_reads(
    tmp_path, shifted_calls, uncached, monkeypatch
):
    from hpcckpt.store.io import blocks

    real_open, real_preadv = os.open, os.preadv
    refused, mode = [], []

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT and mode == ["open"]:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def refusing_read(fd, buffers, offset, *flags):
        if _is_direct(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "preadv", refusing_read)
    payload = data(64 * KiB + 3, 14)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100 + payload.tobytes())
    for refusal in ("read", "open"):
        mode[:] = [refusal]
        uncached(path)
        out = np.zeros(payload.size, dtype=np.uint8)
        got = direct_io.read_hashed(path, 100, memoryview(out), 8 * KiB)
        assert out.tobytes() == payload.tobytes()
        assert np.array_equal(got, blocks.block_hashes(payload, 8 * KiB))
        refused.append(refusal)
    if takes_direct(tmp_path):  # refused at the first direct read, then at the open
        assert refused == [4096, "read", "open"]
        assert shifted_calls == [(100, False)]


def test_a_direct_read_of_a_file_that_ends_early_raises(tmp_path, shifted_calls, uncached):
    path = tmp_path / "f"
    path.write_bytes(data(50 * KiB + 100, 13).tobytes())
    uncached(path)
    with pytest.raises(OSError, match=f"ends at byte {50 * KiB + 100}"):
        direct_io.read_hashed(path, 0, memoryview(bytearray(80 * KiB)), 8 * KiB)
    assert shifted_calls == ([(0, None)] if takes_direct(tmp_path) else [])  # it raised


def test_read_hashed_raises_when_the_file_ends_early(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 1000)
    with pytest.raises(OSError, match="ends at byte 1000"):
        direct_io.read_hashed(path, 0, memoryview(bytearray(2000)), 4096)


@pytest.mark.parametrize("through_reads", [False, True])
def test_a_cold_buffered_read_has_its_own_sequential_descriptor(
    tmp_path, shifted_calls, uncached, monkeypatch, through_reads
):
    """With ``COLD_READ = "buffered"`` an extent not in the page cache is read through
    it on a descriptor of its own (its own readahead state), advised sequential, closed
    after; nothing is read past the cache, and the bytes and hashes are the file's."""
    from hpcckpt.store.io import blocks

    monkeypatch.setattr(direct_io, "COLD_READ", "buffered")
    monkeypatch.setattr(direct_io, "READ_PIECE_BYTES", 16 * KiB)  # many pieces
    payload = data(100 * KiB + 5, 40)
    path = tmp_path / "f"
    path.write_bytes(b"h" * 400 + payload.tobytes() + b"tail" * 1000)
    advised: list[tuple[int, int, int, int]] = []
    real = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((fd, offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    caller = os.open(path, os.O_RDONLY)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        for cold in (True, False):
            if cold:
                uncached(path)
            else:
                os.pread(caller, len(payload) + 400, 0)  # now in the page cache
            advised.clear()
            out = np.zeros(payload.size, dtype=np.uint8)
            if through_reads:
                with direct_io.HashedReads() as reads:
                    got = reads.read_hashed(path, 400, memoryview(out), 8 * KiB, fd=caller)
                assert reads.direct_opens == 0
            else:
                got = direct_io.read_hashed(path, 400, memoryview(out), 8 * KiB, fd=caller)
            assert out.tobytes() == payload.tobytes()
            assert np.array_equal(got, blocks.block_hashes(payload, 8 * KiB))
            sequential = [a for a in advised if a[3] == os.POSIX_FADV_SEQUENTIAL]
            if cold:
                assert [(o, n) for _, o, n, _ in sequential] == [(400, payload.size)]
                assert sequential[0][0] != caller
            else:
                assert sequential == []  # cached: read through the caller's descriptor
            assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        os.close(caller)
    assert shifted_calls == []


@pytest.mark.parametrize("direct", [True, False])
def test_a_streamed_write_lands_exactly_through_a_ring_smaller_than_the_data(
    tmp_path, small, direct
):
    path = tmp_path / "f"
    path.write_bytes(b"\xee" * 400 * KiB)
    a = data(250 * KiB + 11, 4)  # unaligned start and end, many times the ring
    b = data(5000, 5)  # below the threshold: page cache
    ring = direct_io.ring_buffers(32 * KiB, piece=8 * KiB)
    assert len(ring) == 4 and all(r.ctypes.data % ALIGN == 0 for r in ring)
    stream = direct_io.StreamedWrite(path, ring, direct=direct)
    stream.feed([Extent(1000, memoryview(a)), Extent(300 * KiB, memoryview(b))])
    a[:] = 0  # the caller's memory is free once feed returns
    b[:] = 0
    done = stream.finish()
    assert done.bytes == a.nbytes + b.nbytes
    assert (done.direct_bytes > 0) == (direct and takes_direct(path))
    raw = path.read_bytes()
    assert raw[1000 : 1000 + a.nbytes] == data(250 * KiB + 11, 4).tobytes()
    assert raw[300 * KiB : 300 * KiB + 5000] == data(5000, 5).tobytes()
    assert raw[:1000] == b"\xee" * 1000
    assert raw[1000 + a.nbytes : 300 * KiB] == b"\xee" * (300 * KiB - 1000 - a.nbytes)
    assert len(raw) == 400 * KiB


@pytest.mark.parametrize("direct", [True, False])
def test_a_streamed_write_raises_a_failed_write(tmp_path, small, direct):
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 200 * KiB)
    stream = direct_io.StreamedWrite(path, direct_io.ring_buffers(32 * KiB, 8 * KiB), direct=direct)
    with pytest.raises(OSError) as info:
        try:
            stream.feed([Extent(1 << 62, memoryview(data(64 * KiB, 6)))])  # past any file's end
        finally:
            stream.finish()
    assert info.value.errno in (errno.EFBIG, errno.EINVAL)


def test_the_cache_check_reads_nothing_and_never_sees_a_dropped_page(tmp_path, uncached):
    """``mincore`` tells what is cached without reading: a ``RWF_NOWAIT`` probe started
    reading the page it asked about and saw it cached in about 1 of 150 dropped files."""
    path = tmp_path / "f"
    path.write_bytes(data(100 * KiB, 13).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = -(-100 * KiB // mmap.PAGESIZE)
        assert direct_io.resident_pages(fd, 0, 100 * KiB) == pages  # just written: cached
        seen = 0
        for _ in range(300):
            uncached(path)
            seen += direct_io._cached(fd, 0, 100 * KiB)
            assert direct_io.resident_pages(fd, 0, 100 * KiB) == 0  # the check read nothing
        assert seen == 0
        os.pread(fd, 100 * KiB, 0)
        assert direct_io._cached(fd, 0, 100 * KiB)
    finally:
        os.close(fd)


def test_a_restores_reads_share_one_direct_descriptor_and_one_hashing_thread(
    tmp_path, shifted_calls, uncached, monkeypatch
):
    """Arrays read one after another through one HashedReads: the file's direct
    descriptor is opened once and the one hashing thread does every array's moves."""
    from hpcckpt.store.io import blocks

    if not takes_direct(tmp_path):
        pytest.fail(f"{tmp_path} takes no direct reads: this test needs a file system that does")
    n, count = 100 * KiB + 5, 5
    payloads = [data(n, 20 + i) for i in range(count)]
    path = tmp_path / "f"
    path.write_bytes(b"h" * 400 + b"".join(p.tobytes() for p in payloads) + b"tail" * 1000)
    uncached(path)
    movers = []
    real = direct_io.ctypes.memmove

    def memmove(*args):
        movers.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(direct_io.ctypes, "memmove", memmove)
    fds_before = len(os.listdir("/proc/self/fd"))
    with direct_io.HashedReads() as reads:
        for i, payload in enumerate(payloads):
            guard = np.full(n + 8192, 0xA5, dtype=np.uint8)
            base = -guard.ctypes.data % ALIGN
            out = guard[base + 64 : base + 64 + n]  # shifted, as a torch tensor's memory
            got = reads.read_hashed(path, 400 + i * n, memoryview(out), 8 * KiB)
            assert out.tobytes() == payload.tobytes(), i
            assert np.array_equal(got, blocks.block_hashes(payload, 8 * KiB)), i
            assert (guard[: base + 64] == 0xA5).all() and (guard[base + 64 + n :] == 0xA5).all()
        assert reads.direct_opens == 1
        assert [t.name for t in reads.threads] == ["hpcckpt-hash-0"]
        assert len(os.listdir("/proc/self/fd")) == fds_before + 1  # the direct descriptor
    assert [ok for _, ok in shifted_calls] == [True] * count
    assert len(movers) >= 8 * count and set(movers) == {"hpcckpt-hash-0"}
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert not [t for t in threading.enumerate() if t.name.startswith("hpcckpt-hash")]


def test_a_started_read_returns_before_its_last_pieces_are_hashed(
    tmp_path, shifted_calls, uncached, monkeypatch
):
    """The reading thread is free for its next read once every byte is read; the bytes
    and hashes are whole once the function it returned has returned."""
    from types import SimpleNamespace

    from hpcckpt.store.io import blocks

    if not takes_direct(tmp_path):
        pytest.fail(f"{tmp_path} takes no direct reads: this test needs a file system that does")
    n = 100 * KiB + 5
    payload = data(n, 31)
    path = tmp_path / "f"
    path.write_bytes(b"h" * 400 + payload.tobytes() + b"tail" * 1000)
    uncached(path)
    gate = threading.Event()
    real = direct_io.xxhash.xxh3_64_intdigest

    def digest(buf):
        gate.wait()
        return real(buf)

    monkeypatch.setattr(direct_io, "xxhash", SimpleNamespace(xxh3_64_intdigest=digest))
    guard = np.full(n + 8192, 0xA5, dtype=np.uint8)
    base = -guard.ctypes.data % ALIGN
    out = guard[base + 64 : base + 64 + n]
    started = []
    with direct_io.HashedReads() as reads:
        reader = threading.Thread(
            target=lambda: started.append(reads.start(path, 400, memoryview(out), 8 * KiB))
        )
        reader.start()
        reader.join(timeout=30)
        assert not reader.is_alive() and len(started) == 1  # returned with no hash made
        gate.set()
        got = started[0]()
    assert out.tobytes() == payload.tobytes()
    assert np.array_equal(got, blocks.block_hashes(payload, 8 * KiB))
    assert (guard[: base + 64] == 0xA5).all() and (guard[base + 64 + n :] == 0xA5).all()
    assert shifted_calls == [(400, True)]


def test_a_failed_hashing_job_is_raised_by_its_waiter():
    with direct_io.HashedReads() as reads:

        def job():
            raise ValueError("boom")

        wait = reads.hash(job)
        with pytest.raises(ValueError, match="boom"):
            wait()
        reads.hash(lambda: None)()  # the thread is still there, and reused
        assert len(reads.threads) == 1


def test_a_read_whose_own_hashing_thread_fails_raises_its_error(
    tmp_path, shifted_calls, uncached, monkeypatch
):
    """A read with a hashing thread of its own (no HashedReads) raises what stopped the
    thread, at the reader's next piece, instead of returning hashes never made."""
    from types import SimpleNamespace

    if not takes_direct(tmp_path):
        pytest.fail(f"{tmp_path} takes no direct reads: this test needs a file system that does")
    payload = data(100 * KiB + 5, 14)
    path = tmp_path / "f"
    path.write_bytes(b"h" * 400 + payload.tobytes() + b"tail" * 1000)
    uncached(path)
    calls = []

    def digest(buf):
        calls.append(len(buf))
        raise ValueError("hashing failed")

    monkeypatch.setattr(direct_io, "xxhash", SimpleNamespace(xxh3_64_intdigest=digest))
    out = np.zeros(len(payload), dtype=np.uint8)
    with pytest.raises(ValueError, match="hashing failed"):
        direct_io.read_hashed(path, 400, memoryview(out), 8 * KiB)
    assert calls == [8 * KiB]  # the first block, then no more
    assert not [t for t in threading.enumerate() if t.name == "hpcckpt-hash"]
