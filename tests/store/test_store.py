"""The store's front (hpcckpt/store/store.py) in one process (MPI.COMM_SELF): how it is
set up, what it refuses, and a save and restore through it end to end.

The rooms behind it have their own modules: test_commit.py (the commit protocol),
test_restore.py (which checkpoint), test_load.py (reading into the application's arrays)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.file import layout
from hpcckpt.store.options import IncrementalOptions, StoreOptions
from hpcckpt.store.save.staging import HostBuffers
from hpcckpt.store.store import CheckpointStore


def test_save_commits_atomically_and_restore_takes_newest(store, make_state):
    for step in (10, 20):
        res = store.save(step, make_state(step))
        assert res.path.name == layout.checkpoint_name(step) and res.bytes_written >= 8000
    assert [e.step for e in layout.scan(store.directory)] == [20, 10]
    assert layout.partials(store.directory) == []
    state = make_state(0)
    buf = state["u"]
    got = store.restore(state)
    assert got.step == 20 and state["u"] is buf
    assert np.array_equal(buf, np.arange(1000.0) * 20) and state["meta"]["k"] == 20


def test_file_is_readable_with_plain_h5py(store, make_state):
    store.save(3, make_state(3))
    with h5py.File(store.directory / layout.checkpoint_name(3), "r") as f:
        assert f["meta"].attrs["format"] == "hpcckpt" and f["meta"].attrs["step"] == 3
        assert np.array_equal(f["state/u"][:], np.arange(1000.0) * 3)
        offs = f["meta/rank_tree"].attrs["offsets"]
        tree = json.loads(f["meta/rank_tree"][offs[0] : offs[1]].tobytes())
        assert tree["v"]["meta"]["v"]["k"] == 3


@pytest.mark.parametrize("count", [90, 350])
def test_a_model_sized_state_of_many_arrays_restores(tmp_path, count):
    """90 (or 350) arrays named like a model's layers, one in three of 1024 float32 and
    the rest of 64: their attribute strings fill an HDF5 global heap collection to within
    8 bytes of its end. Restore used to take that sound file for damaged and mark it bad."""
    state = {f"layer{i}": np.full(64 if i % 3 else 1024, i, np.float32) for i in range(count)}
    CheckpointStore(tmp_path, MPI.COMM_SELF).save(1, state)
    out = {k: np.empty_like(v) for k, v in state.items()}
    result = CheckpointStore(tmp_path, MPI.COMM_SELF).restore(out)
    assert result is not None and result.step == 1
    assert all(np.array_equal(out[k], state[k]) for k in state)
    assert not list(tmp_path.glob("*.bad"))


# -- how the store is set up -----------------------------------------------------------------
def test_keywords_set_the_options_and_options_are_taken_whole(tmp_path):
    keyworded = CheckpointStore(tmp_path / "a", MPI.COMM_SELF, block_size=8192, incremental=False)
    assert keyworded.options.incremental == IncrementalOptions(block_size=8192, incremental=False)
    assert keyworded.saver.block_size == 8192 and keyworded.tier is None
    options = StoreOptions(incremental=IncrementalOptions(max_chain=2))
    given = CheckpointStore(tmp_path / "b", MPI.COMM_SELF, options)
    assert given.options is options and given.saver.chain_policy.max_chain == 2
    assert given.directory == (tmp_path / "b").absolute()
    assert given.saver.agreement is given.agreement is given.restorer.agreement


def test_options_and_keywords_together_are_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="options or keywords, not both"):
        CheckpointStore(tmp_path, MPI.COMM_SELF, StoreOptions(), block_size=8192)


def test_a_misspelt_keyword_is_named_with_the_nearest_one(tmp_path):
    with pytest.raises(TypeError) as got:
        CheckpointStore(tmp_path, MPI.COMM_SELF, blok_size=4096)
    message = str(got.value)
    assert "CheckpointStore() got an unexpected keyword argument 'blok_size'" in message
    assert "did you mean 'block_size'?" in message
    with pytest.raises(TypeError, match="'no_such_option'$"):  # nothing near: no guess
        CheckpointStore(tmp_path, MPI.COMM_SELF, no_such_option=1)


def test_save_local_without_a_cache_names_cache(store, make_state):
    with pytest.raises(ValueError, match="cache"):
        store.save_local(1, make_state(1))
    assert not store.directory.exists(), "nothing was written"


def test_a_staged_save_needs_exactly_one_staging_area(tmp_path, store, make_state):
    with pytest.raises(ValueError, match="exactly one staging area"):
        store.begin_save(1, make_state(1))  # neither buffers nor a cache
    cached = CheckpointStore(tmp_path / "ck2", MPI.COMM_SELF, cache=tmp_path / "cache")
    with pytest.raises(ValueError, match="exactly one staging area"):
        cached.begin_save(1, make_state(1), buffers=HostBuffers())  # both
    assert not store.directory.exists() and not cached.directory.exists()
    assert not (tmp_path / "cache").exists(), "nothing was staged"


def test_restore_takes_a_dict_and_only_by_key(store, make_state):
    store.save(1, make_state(1))
    with pytest.raises(TypeError, match="state must be a dict, not list"):
        store.restore([np.zeros(1000)])
    state = make_state(0)
    assert store.restore(state, only="meta").step == 1
    assert state["meta"]["k"] == 1 and not state["u"].any(), "only 'meta' was read"
