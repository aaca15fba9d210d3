"""The global heap check of ``hpcckpt.store.file.heap_check``: sound collections pass, damaged
ones are named (HDF5 1.10 hangs on some damaged ones, so they must never reach it)."""

from __future__ import annotations

import struct

import h5py
import numpy as np
import pytest

from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.file.heap_check import check_collection, check_global_heaps, datasets

SIZE = 4096


def collection(objects: list[bytes], *, tail: int | None = None, free: int | None = None) -> bytes:
    """A global heap collection of SIZE bytes holding ``objects`` (indices 1, 2, ...);
    the rest is a free-space object (index 0) of ``free`` bytes (its true size unless
    given), or, when ``tail`` is given, the objects are padded so that only ``tail``
    bytes (too few for an object header) are left, with no free-space object."""
    body = b"".join(
        struct.pack("<HHIQ", i, 0, 0, len(o)) + o + b"\0" * (-len(o) % 8)
        for i, o in enumerate(objects, 1)
    )
    raw = b"GCOL" + bytes([1, 0, 0, 0]) + struct.pack("<Q", SIZE) + body
    left = SIZE - len(raw)
    if tail is not None:
        pad = left - tail - 16  # one last object fills the collection up to the tail
        raw += struct.pack("<HHIQ", len(objects) + 1, 0, 0, pad) + b"x" * pad
        return raw + b"\0" * tail
    raw += struct.pack("<HHIQ", 0, 0, 0, left if free is None else free)
    return raw + b"\0" * (SIZE - len(raw))


def test_a_collection_ending_in_free_space_is_sound():
    check_collection(collection([b"rows", b"[[3], [3], [3]]"]), 0, "f.h5")


@pytest.mark.parametrize("tail", [0, 8])
def test_a_collection_filled_to_within_an_object_header_is_sound(tail):
    """HDF5 writes no free-space object when fewer than 16 bytes are left (seen in a
    file of 3 ranks x 3,000 arrays: 8 bytes left); HDF5 reads such a collection."""
    raw = collection([b"rows"] * 50, tail=tail)
    assert len(raw) == SIZE
    check_collection(raw, 0, "f.h5")


def test_an_object_running_past_the_collection_is_damage():
    raw = bytearray(collection([b"rows", b"flat"]))
    struct.pack_into("<Q", raw, 16 + 8, SIZE)  # object 1 claims the whole collection
    with pytest.raises(CorruptCheckpoint, match=r"global heap at 0 is damaged \(object 1"):
        check_collection(bytes(raw), 0, "f.h5")


def test_an_object_index_twice_is_damage():
    raw = bytearray(collection([b"rows", b"flat"]))
    struct.pack_into("<H", raw, 16 + 24, 1)  # the second object says it is object 1
    with pytest.raises(CorruptCheckpoint, match=r"\(object 1, 4 bytes\)"):
        check_collection(bytes(raw), 0, "f.h5")


def test_free_space_of_the_wrong_size_is_damage():
    with pytest.raises(CorruptCheckpoint, match=r"damaged \(free space\)"):
        check_collection(collection([b"rows"], free=64), 0, "f.h5")


def test_the_heap_check_hands_back_every_dataset_opened(tmp_path):
    """The walk that skips the datasets' raw bytes opens each dataset once (hard links
    only), and the reader reuses them: every one is there, by its full path."""
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        f["a"] = np.arange(3)
        f["g/b/c"] = np.zeros((2, 2))
        f.create_group("empty")
        f["g"].attrs["text"] = "a variable-length string in a global heap"
        f["g/soft"] = h5py.SoftLink("/a")  # a link, not a second dataset
    with h5py.File(path, "r") as f:
        found = check_global_heaps(f, path, path.stat().st_size)
        assert sorted(found) == ["a", "g/b/c"]
        assert found["g/b/c"].shape == (2, 2) and found["a"].dtype == np.arange(3).dtype


def test_datasets_opens_every_dataset_once_by_its_full_path(tmp_path):
    """Hard links to one dataset are one object: the walk names it once."""
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        f["meta/checksums"] = np.zeros((2, 3), dtype=np.uint64)
        f["state/a/b"] = np.arange(4.0)
        f["again"] = f["state/a/b"]  # a hard link
    with h5py.File(path, "r") as f:
        found = datasets(f)
        assert set(found) in ({"meta/checksums", "state/a/b"}, {"meta/checksums", "again"})
        assert all(isinstance(d, h5py.h5d.DatasetID) for d in found.values())
        assert found["meta/checksums"].shape == (2, 3)
