"""Direct reads through huge-page buffers: every byte lands in place, the buffers are
reused, and a read the file system refuses or cuts short stops where the page cache
takes over. The ring holds no more than its cap however slow the copies, and no read
is left waiting: a consumer that fails, or a ring closed, ends it with an error (each
such test fails at a deadline instead of hanging)."""

from __future__ import annotations

import errno
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from hpcckpt.store.io import blocks, bounce, direct_io, filesystem
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
        # hashing thread lags behind the reads: 5 on a loaded machine), up to the cap
        assert 1 <= ring.made <= bounce.RING_BUFFERS and ring.held == 0
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


#: How long a test waits for a thread that should end at once before it calls it hung.
DEADLINE = 30.0


def direct_fd(path) -> int:
    """An ``O_DIRECT`` descriptor on ``path``: these tests need real direct reads."""
    if filesystem.detect(path.parent).name not in filesystem.DIRECT_IO_NAMES:
        pytest.fail(f"{path} takes no direct reads: this test needs a file system that does")
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


def run_until(target, *args) -> tuple[threading.Thread, list]:
    """``target(*args)`` on a thread of its own; what it returned or raised goes into the
    list returned with the thread."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(target(*args))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def joined(thread: threading.Thread) -> None:
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"{thread.name} still runs after {DEADLINE} s: hung"


def slow_consumer(out: np.ndarray, handoff: bounce.Handoff, ring, seen: list, fail_at=-1):
    """What the hashing thread does with each piece, slowly (the machine's load made
    long): copy it in place, give its buffer back; raises at item ``fail_at``."""

    def work() -> None:
        while (item := handoff.get()) is not None:
            at, n, buf, _ = item
            seen.append(ring.held)
            try:
                if len(seen) == fail_at:
                    raise ValueError("the copy failed")
                time.sleep(0.004)
                out[at : at + n] = buf[:n]
            finally:
                ring.give(buf)

    return lambda: handoff.consume(work)


def test_a_ring_holds_no_more_than_its_cap_while_its_consumer_lags(tmp_path):
    """Reads far ahead of a slow consumer wait for a buffer given back instead of
    making more: the ring holds its cap (3 here) at most, the bytes land exactly."""
    path = tmp_path / "f"
    payload = np.random.default_rng(7).integers(0, 256, 640 * KiB, dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    ring = bounce.BounceRing(16 * KiB, limit=3)
    out = np.zeros_like(payload)
    handoff, seen = bounce.Handoff(), []
    consumer, _ = run_until(slow_consumer(out, handoff, ring, seen))
    fd = direct_fd(path)
    try:
        start = time.perf_counter()
        done = bounce.read_pieces(fd, 0, 0, len(payload), ring, handoff.put)
        took = time.perf_counter() - start
    finally:
        os.close(fd)
        handoff.end()
    joined(consumer)
    assert done == len(payload) and out.tobytes() == payload.tobytes()
    assert len(seen) == 40 and ring.made == 3 and max(seen) <= 3  # the cap reached, not passed
    assert took >= 37 * 0.004  # the reader kept pace with the consumer: it waited
    assert ring.held == 0


def test_readers_sharing_a_ring_each_get_their_minimum_and_all_finish(tmp_path):
    """A cap below what the readers need (1 for 3 readers) grows to PER_READER each:
    no reader is starved by the others' buffers, every one finishes, exactly."""
    path = tmp_path / "f"
    payload = np.random.default_rng(8).integers(0, 256, 3 * 256 * KiB, dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    ring = bounce.BounceRing(16 * KiB, limit=1)
    outs = [np.zeros(256 * KiB, dtype=np.uint8) for _ in range(3)]
    fd = direct_fd(path)
    try:
        readers, consumers, handoffs = [], [], []
        for i, out in enumerate(outs):
            handoff = bounce.Handoff()
            handoffs.append(handoff)
            consumers.append(run_until(slow_consumer(out, handoff, ring, []))[0])
            readers.append(run_until(read_one, fd, i * len(out), len(out), ring, handoff))
        for thread, outcome in readers:
            joined(thread)
            assert outcome == [256 * KiB]
    finally:
        for handoff in handoffs:
            handoff.end()
        os.close(fd)
    for thread in consumers:
        joined(thread)
    for i, out in enumerate(outs):
        assert out.tobytes() == payload[i * len(out) : (i + 1) * len(out)].tobytes(), i
    assert ring.made <= bounce.PER_READER * 3 and ring.held == 0


def test_the_cap_grows_to_per_reader_buffers_for_each_reader_reading_at_once():
    ring = bounce.BounceRing(16 * KiB, limit=1)
    with ring.reading(), ring.reading(), ring.reading():
        assert ring.cap() == 3 * bounce.PER_READER
        taker, bufs = run_until(lambda: [ring.take() for _ in range(3 * bounce.PER_READER)])
        joined(taker)  # none waited
        waiter, more = run_until(ring.take)
        time.sleep(0.05)
        assert waiter.is_alive() and ring.made == 3 * bounce.PER_READER
        ring.give(bufs[0][0])
        joined(waiter)
        assert more[0] is bufs[0][0]  # the buffer given back, no new one
    assert ring.cap() == 1


def test_takers_past_the_cap_get_the_buffers_given_back_in_the_order_they_came():
    assert bounce.BounceRing(bounce.HUGE_PAGE).cap() == 8  # docs/performance.md: 16 MiB
    ring = bounce.BounceRing(16 * KiB, limit=2)
    held = [ring.take(), ring.take()]
    waiters = []
    for i in range(3):
        waiters.append(run_until(ring.take))
        wait_for(lambda i=i: ring.waiting == i + 1)
    for i, buf in enumerate(held):
        ring.give(buf)
        joined(waiters[i][0])
        assert waiters[i][1][0] is buf and ring.waiting == 2 - i  # the first in line
    assert waiters[2][0].is_alive() and ring.made == 2
    ring.close()
    joined(waiters[2][0])


def test_two_buffers_given_back_at_once_reach_both_takers_waiting():
    """The first in line, served, wakes the next: a buffer freed meanwhile is not left
    unclaimed while a taker sleeps."""
    for _ in range(20):
        ring = bounce.BounceRing(16 * KiB, limit=2)
        held = [ring.take(), ring.take()]
        waiters = [run_until(ring.take) for _ in range(2)]
        wait_for(lambda ring=ring: ring.waiting == 2)
        for buf in held:
            ring.give(buf)
        for thread, _ in waiters:
            joined(thread)


def wait_for(condition) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.001)


def read_one(fd: int, offset: int, n: int, ring, handoff: bounce.Handoff) -> int:
    """:func:`bounce.read_pieces` of ``n`` bytes at ``offset``, handed to the consumer
    with the offset in its own array."""
    return bounce.read_pieces(fd, offset, 0, n, ring, handoff.put)


def test_a_consumer_that_fails_stops_its_reader_instead_of_leaving_it_waiting(tmp_path):
    """The consumer raises at its 3rd piece, while its reader waits for one of the two
    buffers of the ring: the reader is woken, raises the consumer's error, and every
    buffer is back in the ring (the pieces left were drained)."""
    path = tmp_path / "f"
    path.write_bytes(np.random.default_rng(9).integers(0, 256, 640 * KiB, np.uint8).tobytes())
    ring = bounce.BounceRing(16 * KiB, limit=2)
    handoff = bounce.Handoff()
    out = np.zeros(640 * KiB, dtype=np.uint8)
    consumer, _ = run_until(slow_consumer(out, handoff, ring, [], fail_at=3))
    fd = direct_fd(path)
    try:
        reader, outcome = run_until(read_one, fd, 0, 640 * KiB, ring, handoff)
        joined(reader)
    finally:
        handoff.end()
        os.close(fd)
    joined(consumer)
    assert len(outcome) == 1 and isinstance(outcome[0], ValueError), outcome
    assert str(outcome[0]) == "the copy failed" and handoff.error is outcome[0]
    assert ring.held == 0


def test_closing_a_ring_wakes_a_reader_waiting_for_a_buffer():
    ring = bounce.BounceRing(16 * KiB, limit=2)
    held = [ring.take(), ring.take()]
    waiter, outcome = run_until(ring.take)
    time.sleep(0.05)
    assert waiter.is_alive()  # waits: the cap is reached
    ring.close("the restore was aborted")
    joined(waiter)
    assert isinstance(outcome[0], bounce.RingClosed), outcome
    assert "aborted" in str(outcome[0])
    with pytest.raises(bounce.RingClosed):
        ring.take()
    ring.give(held[0])  # harmless after the close


@pytest.fixture
def slow_or_failing_hash(monkeypatch):
    """The restore's hashing made slow (the machine's load) and, once ``fail_after``
    is set, failing at that call (the real digest runs otherwise)."""
    real = direct_io.xxhash.xxh3_64_intdigest
    state = {"calls": 0, "fail_after": None}

    def digest(buf) -> int:
        state["calls"] += 1
        if state["fail_after"] is not None and state["calls"] > state["fail_after"]:
            raise ValueError("hashing failed")
        time.sleep(0.002)
        return real(buf)

    monkeypatch.setattr(direct_io, "xxhash", SimpleNamespace(xxh3_64_intdigest=digest))
    return state


def test_a_restores_lagging_hashing_keeps_the_ring_at_its_cap_and_exact(
    tmp_path, shifted_calls_through_ring, uncached, monkeypatch, slow_or_failing_hash
):
    """Two readers of one HashedReads, as a restore reads, hashing slower than the
    reads: the ring makes no more than its cap (4 = PER_READER x 2 readers, its limit
    set to 1), and every array and hash is exact."""
    monkeypatch.setattr(direct_io, "DIRECT_READ_PIECE_BYTES", 16 * KiB)
    monkeypatch.setattr(bounce, "RING_BUFFERS", 1)
    n, count = 300 * KiB + 5, 4
    payloads = [np.random.default_rng(60 + i).integers(0, 256, n, np.uint8) for i in range(count)]
    path = tmp_path / "f"
    path.write_bytes(b"h" * 400 + b"".join(p.tobytes() for p in payloads) + b"tail" * 1000)
    uncached(path)
    outs = [np.zeros(n, dtype=np.uint8) for _ in range(count)]
    with direct_io.HashedReads() as reads:
        started = [None] * count

        def read(i: int) -> None:
            started[i] = reads.start(path, 400 + i * n, memoryview(outs[i]), 8 * KiB)

        for pair in ((0, 1), (2, 3)):
            threads = [run_until(read, i)[0] for i in pair]
            for thread in threads:
                joined(thread)
        got = [finish() for finish in started]
        assert reads.ring().made <= 4 and reads.ring().held == 0
    for i, payload in enumerate(payloads):
        assert outs[i].tobytes() == payload.tobytes(), i
        assert np.array_equal(got[i], blocks.block_hashes(payload, 8 * KiB)), i
    assert shifted_calls_through_ring == [True] * count


def test_a_restores_hashing_that_fails_ends_its_read_with_the_error_not_a_hang(
    tmp_path, shifted_calls_through_ring, uncached, monkeypatch, slow_or_failing_hash
):
    """The hashing thread fails at its 3rd block while its reader is pieces ahead with
    the ring full (cap 2): the read raises that error within the deadline, the ring has
    every buffer back, and the next read through the same HashedReads is exact."""
    monkeypatch.setattr(direct_io, "DIRECT_READ_PIECE_BYTES", 16 * KiB)
    monkeypatch.setattr(bounce, "RING_BUFFERS", 2)
    n = 600 * KiB + 5
    payloads = [np.random.default_rng(70 + i).integers(0, 256, n, np.uint8) for i in range(2)]
    path = tmp_path / "f"
    path.write_bytes(b"h" * 400 + b"".join(p.tobytes() for p in payloads) + b"tail" * 1000)
    uncached(path)
    outs = [np.zeros(n, dtype=np.uint8) for _ in range(2)]
    with direct_io.HashedReads() as reads:
        slow_or_failing_hash["fail_after"] = 2
        reader, outcome = run_until(reads.read_hashed, path, 400, memoryview(outs[0]), 8 * KiB)
        joined(reader)
        assert len(outcome) == 1 and isinstance(outcome[0], ValueError), outcome
        assert str(outcome[0]) == "hashing failed"
        assert reads.ring().held == 0 and reads.ring().made <= 2
        slow_or_failing_hash["fail_after"] = None
        got = reads.read_hashed(path, 400 + n, memoryview(outs[1]), 8 * KiB)
    assert outs[1].tobytes() == payloads[1].tobytes()
    assert np.array_equal(got, blocks.block_hashes(payloads[1], 8 * KiB))
    assert shifted_calls_through_ring == [True]  # the failed read returned nothing
