"""Staging for saves that finish in the background: copy+hash, reused buffers, the writer."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from hpcckpt.store.io import blocks, direct_io, faults
from hpcckpt.store.save.staging import BackgroundWrite, Extent, HostBuffers, copy_and_hash

BLOCK = 4096


def random_array(shape, dtype, seed: int = 0) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads included for floats); 0/1 for bool."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        return (rng.integers(0, 2, count) == 1).reshape(shape)
    raw = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def c_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


# -- copy_and_hash -------------------------------------------------------------------------
SOURCES = {
    "f8-3-blocks-and-a-bit": lambda: random_array((3 * 512 + 100,), "f8", 1),
    "f4-2d": lambda: random_array((77, 129), "f4", 2),
    "i2-exact-blocks": lambda: random_array((2 * 2048,), "i2", 3),
    "c16-transposed": lambda: random_array((40, 33), "c16", 4).T,
    "u1-strided": lambda: random_array((50, 300), "u1", 5)[::3, 7:-5],
    "i8-reversed": lambda: random_array((5000,), "i8", 6)[::-1],
    "bool-fortran": lambda: np.asfortranarray(random_array((90, 111), "?", 7)),
    "f8-one-element": lambda: random_array((1,), "f8", 8),
    "f8-0d": lambda: np.array(3.25),
    "f8-empty": lambda: np.empty((0,), "f8"),
    "i4-empty-2d": lambda: np.empty((4, 0), "i4"),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_copy_and_hash_copies_bit_exactly_and_hashes_like_block_hashes(name):
    src = SOURCES[name]()
    before = c_bytes(src)
    dst = np.empty(src.shape, dtype=src.dtype)
    hashes = copy_and_hash(src, dst, BLOCK)
    assert dst.flags.c_contiguous
    assert dst.tobytes() == before  # C-order bytes, bit for bit
    assert c_bytes(src) == before  # the source is untouched
    expected = blocks.block_hashes(src, BLOCK)
    assert hashes.dtype == np.uint64
    assert hashes.shape == expected.shape
    assert np.array_equal(hashes, expected)
    nbytes = src.size * src.dtype.itemsize
    step = blocks.block_elems(src.dtype.itemsize, BLOCK) * src.dtype.itemsize
    assert len(hashes) == -(-nbytes // step)


@pytest.mark.parametrize("block_size", [4096, 4096 + 16, 65536])
def test_copy_and_hash_block_sizes(block_size):
    src = random_array((3 * 65536 // 8 + 3,), "f8", 9)
    dst = np.empty_like(src)
    hashes = copy_and_hash(src, dst, block_size)
    assert np.array_equal(hashes, blocks.block_hashes(src, block_size))
    assert dst.tobytes() == src.tobytes()


def test_copy_and_hash_detects_one_changed_element():
    src = random_array((4 * 512,), "f8", 10)
    dst = np.empty_like(src)
    first = copy_and_hash(src, dst, BLOCK)
    src[512 * 2 + 5] += 1.0
    second = copy_and_hash(src, dst, BLOCK)
    assert [j for j in range(4) if first[j] != second[j]] == [2]


# -- HostBuffers ---------------------------------------------------------------------------
def test_host_buffers_reuse_the_same_buffer_while_shape_and_dtype_stay():
    hb = HostBuffers()
    u = random_array((1000,), "f8", 11)
    v = random_array((30, 40), "i4", 12)
    copies, hashes = hb.stage({"u": u, "g/v": v}, BLOCK)
    assert set(copies) == set(hashes) == {"u", "g/v"}
    assert copies["u"] is not u and copies["u"].tobytes() == u.tobytes()
    assert copies["g/v"].tobytes() == v.tobytes()
    assert np.array_equal(hashes["u"], blocks.block_hashes(u, BLOCK))
    assert hb.nbytes == u.nbytes + v.nbytes
    first_u, first_v = copies["u"], copies["g/v"]

    u[:] += 1.0  # the application goes on: the staged copy must not follow
    assert first_u.tobytes() != u.tobytes()

    copies, hashes = hb.stage({"u": u, "g/v": v}, BLOCK)
    assert copies["u"] is first_u and copies["g/v"] is first_v  # reused, not reallocated
    assert copies["u"].tobytes() == u.tobytes()
    assert np.array_equal(hashes["u"], blocks.block_hashes(u, BLOCK))
    assert hb.nbytes == u.nbytes + v.nbytes


@pytest.mark.parametrize(
    "new",
    [
        lambda: random_array((1001,), "f8", 13),  # other shape
        lambda: random_array((1000,), "f4", 14),  # other dtype, other size
        lambda: random_array((1000,), "c8", 15),  # same bytes, other dtype
        lambda: random_array((10, 100), "f8", 16),  # same size, other shape
    ],
)
def test_host_buffers_replace_a_buffer_whose_shape_or_dtype_changed(new):
    hb = HostBuffers()
    u = random_array((1000,), "f8", 17)
    old = hb.stage({"u": u}, BLOCK)[0]["u"]
    src = new()
    copies, hashes = hb.stage({"u": src}, BLOCK)
    assert copies["u"] is not old
    assert copies["u"].shape == src.shape and copies["u"].dtype == src.dtype
    assert copies["u"].tobytes() == src.tobytes()
    assert np.array_equal(hashes["u"], blocks.block_hashes(src, BLOCK))
    assert hb.nbytes == src.nbytes  # the old buffer is not kept beside the new one


def test_host_buffers_drop_arrays_that_disappear_and_release():
    hb = HostBuffers()
    a, b = random_array((100,), "f8", 18), random_array((200,), "i2", 19)
    hb.stage({"a": a, "b": b}, BLOCK)
    copies, hashes = hb.stage({"a": a}, BLOCK)
    assert set(copies) == set(hashes) == {"a"}
    assert hb.nbytes == a.nbytes
    again = hb.stage({"a": a, "b": b}, BLOCK)[0]
    assert again["b"].tobytes() == b.tobytes()
    assert hb.nbytes == a.nbytes + b.nbytes
    hb.release()
    assert hb.nbytes == 0
    assert hb.stage({}, BLOCK) == ({}, {})


# -- BackgroundWrite -----------------------------------------------------------------------
def test_background_write_writes_extents_at_their_offsets_and_fsyncs(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.partial"
    path.write_bytes(b"\xee" * 20000)
    u = random_array((100,), "f8", 20)  # 800 bytes, format "d"
    g = random_array((7, 9), "i2", 21)  # 2-d: cast to bytes by the writer
    raw = bytes(range(256)) * 3
    extents = [
        Extent(100, memoryview(u)),
        Extent(5000, memoryview(g)),
        Extent(19000, memoryview(raw)),
        Extent(21000, memoryview(b"tail")),  # past the end: the file grows
    ]
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    writer = BackgroundWrite(path, extents)
    assert writer.done()  # not started: nothing under way
    writer.start()
    writer.wait()
    assert writer.done()
    assert writer.error is None
    assert writer.bytes == u.nbytes + g.nbytes + len(raw) + 4
    assert writer.seconds > 0
    assert synced == [path.stat().st_ino]

    data = path.read_bytes()
    assert len(data) == 21004
    assert data[100:900] == u.tobytes()
    assert data[5000 : 5000 + g.nbytes] == g.tobytes()
    assert data[19000 : 19000 + len(raw)] == raw
    assert data[21000:] == b"tail"
    # Bytes between the extents are left as they were (not zeroed, not moved).
    assert data[:100] == b"\xee" * 100
    assert data[900:5000] == b"\xee" * 4100
    assert data[20000:21000] == b"\0" * 1000


def test_background_write_loops_over_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_io, "WRITE_CHUNK", 1000)  # each extent takes several pwrites
    path = tmp_path / "f"
    path.write_bytes(b"")
    u = random_array((1234,), "f8", 22)
    writer = BackgroundWrite(path, [Extent(4096, memoryview(u))]).start()
    writer.wait()
    assert writer.error is None and writer.bytes == u.nbytes
    assert path.read_bytes()[4096:] == u.tobytes()


def test_background_write_records_a_missing_file_and_does_not_raise(tmp_path):
    path = tmp_path / "no-such-dir" / "ckpt.partial"
    writer = BackgroundWrite(path, [Extent(0, memoryview(b"x" * 10))]).start()
    writer.wait()  # would re-raise nothing: the thread never raises
    assert writer.done()
    assert isinstance(writer.error, FileNotFoundError)
    assert writer.bytes == 0
    assert not path.parent.exists()


def test_background_write_records_an_io_error_in_the_middle(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 100)
    monkeypatch.setattr(faults, "_FAULTS", [("drain.eio", None, None)])
    writer = BackgroundWrite(path, [Extent(0, memoryview(b"a" * 10))]).start()
    writer.wait()
    assert isinstance(writer.error, OSError) and writer.error.errno == errno.EIO
    assert writer.bytes == 0
    assert path.read_bytes() == b"\0" * 100


def test_background_write_with_nothing_to_write(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"keep")
    writer = BackgroundWrite(path, []).start()
    writer.wait()
    assert writer.error is None and writer.bytes == 0
    assert path.read_bytes() == b"keep"
