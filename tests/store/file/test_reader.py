"""Structural validation: crafted or damaged metadata is a clear CorruptCheckpoint, never a
huge allocation, and restore falls back to the previous good checkpoint."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from tests.format_helpers import (
    crafted_falls_back,
    described,
    redescribe,
    small_state,
    two_checkpoints,
)

state = small_state


@pytest.fixture
def two(tmp_path):
    """A store with good checkpoints of steps 1 and 2; returns (store, newest path)."""
    return two_checkpoints(tmp_path / "ck")


def huge_dataset(f):
    del f["state/u"]
    f.create_dataset("state/u", shape=(10**12,), dtype="f8")  # never written: no storage
    redescribe(f, "u", layout="rows", rank_offsets=[0, 10**12], rank_shapes=[[10**12]])


CRAFTED = {
    "nranks_huge": (lambda f: f["meta"].attrs.__setitem__("nranks", 2**40), "nranks"),
    "nranks_wrong": (lambda f: f["meta"].attrs.__setitem__("nranks", 2), "checksum table"),
    "nranks_zero": (lambda f: f["meta"].attrs.__setitem__("nranks", 0), "nranks"),
    "tree_offsets": (
        lambda f: f["meta/rank_tree"].attrs.__setitem__("offsets", np.array([0, 2**40])),
        "rank_tree",
    ),
    "dataset_huge": (huge_dataset, "claims"),
    "arrays_not_json": (lambda f: f["meta"].attrs.__setitem__("arrays", "{"), "Expecting"),
    "array_missing": (lambda f: f.__delitem__("state/u"), "missing"),
    "hash_counts": (
        lambda f: f["meta/block_hashes"].attrs.__setitem__("offsets", np.array([0, 2, 2])),
        r"meta/block_hashes holds 2 hashes for array '[us]' of rank 0, which has 1 blocks",
    ),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_metadata_is_corrupt_and_restore_falls_back(two, name):
    crafted_falls_back(*two, *CRAFTED[name])


def test_tree_naming_other_arrays_is_corrupt(two):
    _, newest = two
    with h5py.File(newest, "r+") as f:
        s_info = described(f, "s")
        f["meta"].attrs.__setitem__("arrays", json.dumps(["s"]))
        f["meta"].attrs.__setitem__("array_info", json.dumps([s_info]))
        del f["meta/checksums"]
        f["meta"].create_dataset("checksums", data=np.zeros((1, 2), dtype=np.uint64))
    # Format 2 sees it on opening (the block hash table lists other arrays); either way
    # it is corrupt, never restored.
    with pytest.raises(CorruptCheckpoint, match="checksum|block_hashes"):
        with CheckpointReader(newest) as r:
            r.tree(0)


def test_newer_format_version_is_an_error_not_a_bad_checkpoint(two):
    store, newest = two
    with h5py.File(newest, "r+") as f:
        f["meta"].attrs.__setitem__("format_version", 99)
    with pytest.raises(CheckpointError, match="format version 99 is newer"):
        store.restore(state(0))
    assert layout.scan(store.directory)[0].good_candidate, "not marked bad: upgrade instead"


def test_verify_reports_each_damaged_array(two):
    _, newest = two
    with h5py.File(newest, "r+") as f:
        f["state/u"][5] = -1.0
    with CheckpointReader(newest) as r:
        problems = r.verify()
    assert len(problems) == 1 and "'u'" in problems[0] and "checksum" in problems[0]


def test_the_files_start_is_asked_for_in_one_request_before_hdf5_reads_it(tmp_path):
    """A cold open: the kernel is asked for the first METADATA_PREFETCH bytes at once
    (the writer's metadata block and the tables after it), not HDF5's dozens of small
    reads one disk access each; the array bytes after it stay on disk."""
    import os
    import time

    from hpcckpt.store.file import reader
    from hpcckpt.store.io.direct_io import resident_pages

    path = tmp_path / "data"
    path.write_bytes(os.urandom(4 * reader.METADATA_PREFETCH))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        pages = reader.METADATA_PREFETCH // os.sysconf("SC_PAGE_SIZE")
        assert resident_pages(fd, 0, 4 * reader.METADATA_PREFETCH) == 0, "not evicted"
        reader.prefetch_metadata(fd, 4 * reader.METADATA_PREFETCH)
        deadline = time.monotonic() + 10
        while resident_pages(fd, 0, reader.METADATA_PREFETCH) < pages:
            assert time.monotonic() < deadline, "the file's start was not read"
            time.sleep(0.01)
        after = resident_pages(fd, reader.METADATA_PREFETCH, 3 * reader.METADATA_PREFETCH)
        assert after < pages  # the start only (the kernel may read a little beyond)
    finally:
        os.close(fd)
