"""Structural validation: crafted or damaged metadata is a clear CorruptCheckpoint, never a
huge allocation, and restore falls back to the previous good checkpoint."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store import layout
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.reader import CheckpointReader
from hpcckpt.store.store import CheckpointStore
from tests.format_helpers import as_version_3, described, redescribe


def state(k: float) -> dict:
    return {"u": np.arange(100.0) * k, "s": np.array(k), "k": k}


@pytest.fixture
def two(tmp_path):
    """A store with good checkpoints of steps 1 and 2; returns (store, newest path)."""
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    store.save(1, state(1))
    store.save(2, state(2))
    return store, store.directory / layout.checkpoint_name(2)


def huge_dataset(f):
    del f["state/u"]
    f.create_dataset("state/u", shape=(10**12,), dtype="f8")  # never written: no storage
    redescribe(f, "u", layout="rows", rank_offsets=[0, 10**12], rank_shapes=[[10**12]])


CRAFTED = {
    "nranks_huge": (lambda f: f["meta"].attrs.__setitem__("nranks", 2**40), "nranks"),
    "nranks_wrong": (lambda f: f["meta"].attrs.__setitem__("nranks", 2), "checksum table"),
    "nranks_zero": (lambda f: f["meta"].attrs.__setitem__("nranks", 0), "nranks"),
    "offsets_huge": (
        lambda f: redescribe(f, "u", rank_offsets=[0, 10**15]),
        "offsets",
    ),
    "offsets_negative": (
        lambda f: redescribe(f, "u", rank_offsets=[-5, 100]),
        "offsets",
    ),
    "offsets_short": (
        lambda f: redescribe(f, "u", rank_offsets=[0]),
        "offsets",
    ),
    "shape_huge": (
        lambda f: redescribe(f, "u", rank_shapes=[[10**15]]),
        "shape",
    ),
    "shape_negative": (
        lambda f: redescribe(f, "s", rank_shapes=[[-1, -1]]),
        "outside",
    ),
    "tree_offsets": (
        lambda f: f["meta/rank_tree"].attrs.__setitem__("offsets", np.array([0, 2**40])),
        "rank_tree",
    ),
    "dataset_huge": (huge_dataset, "claims"),
    "arrays_not_json": (lambda f: f["meta"].attrs.__setitem__("arrays", "{"), "Expecting"),
    "array_missing": (lambda f: f.__delitem__("state/u"), "missing"),
    "layout_unknown": (lambda f: redescribe(f, "u", layout="spiral"), "layout"),
    "array_info_not_json": (lambda f: f["meta"].attrs.__setitem__("array_info", "["), "array_info"),
    "array_info_short": (lambda f: f["meta"].attrs.__setitem__("array_info", "[{}]"), "array_info"),
    "array_info_missing": (lambda f: f["meta"].attrs.__delitem__("array_info"), "array_info"),
    "offsets_not_integers": (lambda f: redescribe(f, "u", rank_offsets=[0.0, 100.0]), "offsets"),
    "offsets_too_big_for_int64": (lambda f: redescribe(f, "u", rank_offsets=[0, 2**70]), "offsets"),
    "shapes_not_a_list": (lambda f: redescribe(f, "u", rank_shapes="[[100]]"), "rank_shapes"),
    "shape_a_bool": (lambda f: redescribe(f, "u", rank_shapes=[[True]]), "not an integer"),
    "shape_a_float": (lambda f: redescribe(f, "u", rank_shapes=[[100.0]]), "not an integer"),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_metadata_is_corrupt_and_restore_falls_back(two, name):
    store, newest = two
    craft, fragment = CRAFTED[name]
    with h5py.File(newest, "r+") as f:
        craft(f)
    with pytest.raises(CorruptCheckpoint, match=fragment):
        CheckpointReader(newest)
    target = state(0)
    got = store.restore(target)
    assert got.step == 1 and got.skipped[0][0] == 2
    assert np.array_equal(target["u"], np.arange(100.0)) and target["k"] == 1
    assert newest.exists() and (newest.parent / (newest.name + layout.BAD)).exists()


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("rank_offsets", np.array([0, 10**15]), "offsets"),
        ("rank_shapes", json.dumps([[-1]]), "shape"),
        ("rank_shapes", "[[", "rank_shapes"),
        ("layout", "spiral", "layout"),
    ],
)
def test_crafted_attributes_of_a_format_3_file_are_corrupt(two, key, value, fragment):
    """Files of an older hpcckpt describe each array on its dataset: checked as before."""
    store, newest = two
    with h5py.File(newest, "r+") as f:
        as_version_3(f)
    with CheckpointReader(newest) as r:
        assert r.format_version == 3 and r.arrays["u"].rank_offsets == (0, 100)
        assert r.rank_array("u", 0).tobytes() == state(2)["u"].tobytes() and not r.verify()
    with h5py.File(newest, "r+") as f:
        f["state/u"].attrs[key] = value
    with pytest.raises(CorruptCheckpoint, match=fragment):
        CheckpointReader(newest)


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
