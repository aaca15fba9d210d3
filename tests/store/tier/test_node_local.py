"""The node-local tier (hpcckpt/store/tier/node_local.py) in one process (MPI.COMM_SELF):
checkpoints saved there only, restored from there when newer than the directory's, set
aside when damaged, held for a drain, and freed at the end. The tier across ranks and
nodes (redundancy, moves, rebuilds) is tested under mpirun in test_local_tier_mpi.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.store import CheckpointStore
from hpcckpt.store.tier import copies as fast_tier


def state_of(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"u": rng.random(3000), "n": np.arange(step, step + 40, dtype=np.int32), "k": step}


def blank() -> dict:
    return {"u": np.zeros(3000), "n": np.zeros(40, np.int32), "k": None}


def same(a: dict, b: dict) -> bool:
    return (
        a["u"].tobytes() == b["u"].tobytes()
        and a["n"].tobytes() == b["n"].tobytes()
        and a["k"] == b["k"]
    )


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def tiered(tmp_path, cache, **keywords) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=cache, **keywords)


def test_save_local_writes_the_tier_only_and_a_restart_restores_from_it(tmp_path, cache):
    store = tiered(tmp_path, cache)
    assert store.tier.path == cache and store.tier.newest_step is None
    assert not store.tier.holds_newest
    state = state_of(4)
    result = store.save_local(4, state)
    assert (result.step, result.tier, result.kind) == (4, "cache", "full")
    assert result.path == cache / fast_tier.manifest_name(4, 0)
    assert result.bytes_written == state["u"].nbytes + state["n"].nbytes
    assert store.tier.newest_step == 4 and store.tier.holds_newest
    assert layout.scan(store.directory) == [], "nothing in the directory"
    restarted = tiered(tmp_path, cache)
    back = blank()
    got = restarted.restore(back)
    assert (got.step, got.source, got.path) == (4, "cache", result.path)
    assert same(back, state)
    assert restarted.tier.newest_step == 4 and restarted.tier.holds_newest


def test_a_copy_no_newer_than_the_directory_is_not_taken(tmp_path, cache):
    store = tiered(tmp_path, cache)
    store.save_local(3, state_of(3))
    store.save(5, state_of(5))
    back = blank()
    got = tiered(tmp_path, cache).restore(back)
    assert (got.step, got.source) == (5, "directory") and same(back, state_of(5))


def test_a_newer_save_local_replaces_the_older_copy(tmp_path, cache):
    store = tiered(tmp_path, cache, node_name="n7")
    store.save_local(1, state_of(1))
    store.save_local(2, state_of(2))
    (copy,) = fast_tier.scan(cache, store.directory, 0, 1)
    assert (copy.step, copy.node) == (2, "n7")
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [fast_tier.manifest_name(2, 0), fast_tier.data_name(2, 0)]
    )


def test_a_damaged_copy_is_set_aside_once_and_the_directory_restored(tmp_path, cache):
    store = tiered(tmp_path, cache)
    store.save(1, state_of(1))
    store.save_local(2, state_of(2))
    data = cache / fast_tier.data_name(2, 0)
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01
    data.write_bytes(bytes(raw))
    restarted = tiered(tmp_path, cache)
    back = blank()
    got = restarted.restore(back)
    assert (got.step, got.source) == (1, "directory") and same(back, state_of(1))
    assert [s for s, _ in got.local_skipped] == [2]
    (aside,) = restarted.tier.take_set_aside()
    step, node, name, why = aside
    assert (step, node, name) == (2, fast_tier.host(), fast_tier.manifest_name(2, 0))
    assert "rank 0" in why
    assert restarted.tier.take_set_aside() == [], "taken: the list is emptied"
    assert not (cache / fast_tier.manifest_name(2, 0)).exists()
    again = tiered(tmp_path, cache).restore(blank())  # never tried again
    assert again.step == 1 and again.local_skipped == ()


def test_hold_for_drain_keeps_a_copy_every_rank_holds(tmp_path, cache):
    store = tiered(tmp_path, cache)
    assert not store.tier.hold_for_drain(3), "no copy at all"
    state = state_of(3)
    store.save_local(3, state)
    assert not store.tier.hold_for_drain(4), "not a step the tier holds"
    with pytest.raises(ValueError, match="nothing to drain again: step 3"):
        store.tier.drain_copy(3)
    assert store.tier.hold_for_drain(3)
    assert store.tier.drain_copy(3).step == 3
    result = store.finish_save(store.begin_save(3, None, redrain=True))  # the scavenge
    assert result.step == 3 and not store.tier.holds_newest
    back = blank()
    assert CheckpointStore(store.directory, MPI.COMM_SELF).restore(back).step == 3
    assert same(back, state)


def test_what_the_directory_commits_decides_whether_the_copy_is_newest(tmp_path, cache):
    tier = tiered(tmp_path, cache).tier
    tier.committed(1)
    assert not tier.holds_newest, "no copy"
    tier.drain_failed()
    assert tier.holds_newest
    tier.save_local(5, state_of(5))
    tier.committed(4)
    assert tier.holds_newest, "sealed after step 4"
    tier.committed(5)
    assert not tier.holds_newest


def test_free_removes_the_files_and_the_directory(tmp_path, cache):
    store = tiered(tmp_path, cache)
    store.save_local(1, state_of(1))
    assert any(cache.iterdir())
    store.tier.free()
    assert not cache.exists()
    store.tier.free()  # nothing left: nothing to do
    assert tiered(tmp_path, cache).restore(blank()) is None


def test_a_renamed_key_stops_a_restore_from_the_tier_rather_than_falling_back(tmp_path, cache):
    """The newest checkpoint is node-local only: a state whose keys differ from it is an
    error, not a fall back to the directory (here: to nothing, a silent fresh start)."""
    tiered(tmp_path, cache).save_local(4, state_of(4))
    renamed = {"v": np.zeros(3000), "n": np.zeros(40, np.int32), "k": None}
    with pytest.raises(CheckpointError, match=r"step 4 holds keys \['u'\] .* \['v'\]"):
        tiered(tmp_path, cache).restore(renamed)
    assert not renamed["v"].any() and renamed["k"] is None
    got = tiered(tmp_path, cache).restore(renamed, strict=False)
    assert (got.step, got.source) == (4, "cache")
    assert (got.skipped_keys, got.added_keys) == (("v",), ("u",)) and renamed["k"] == 4


def test_staged_saves_reuse_the_data_file_of_the_copy_the_directory_holds(tmp_path, cache):
    """A staged save through the tier writes into the pages of the previous copy's data
    file (drained and committed: the directory holds it) rather than a new file; each
    copy is sealed with its own checksums and restores bit for bit."""
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=cache, incremental=False)
    inodes = []
    for step in (1, 2, 3):
        state = {"u": np.arange(300000.0) * step, "v": np.full(7, step)}
        store.finish_save(store.begin_save(step, state))
        inodes.append(os.stat(cache / fast_tier.data_name(step, 0)).st_ino)
        assert sorted(os.listdir(cache)) == [
            fast_tier.data_name(step, 0),
            fast_tier.manifest_name(step, 0),
        ]
        (copy,) = fast_tier.scan(cache, store.directory, 0, 1)
        assert copy.step == step and store.tier.newest_step == step
        assert np.array_equal(fast_tier.load(copy)["u"], state["u"])
    assert inodes[0] == inodes[1] == inodes[2]


def test_on_tmpfs_staged_saves_write_the_copy_through_one_mapping_and_keep_save_values(tmp_path):
    """On a memory file system the tier keeps its data file mapped: each staged save
    copies into the same pages through the same mapping (no pwrite), the values are
    those at begin_save although the state changes right after, and each copy restores
    bit for bit from the tier after the process is gone."""
    import shutil
    import uuid
    from pathlib import Path

    cache = Path("/dev/shm") / f"hpcckpt-test-{uuid.uuid4().hex[:8]}"
    try:
        store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=cache, incremental=False)
        areas = []
        for step in (1, 2, 3):
            state = {"u": np.arange(300000.0) * step, "v": np.full(7, step)}
            saved = state["u"].copy()
            pending = store.begin_save(step, state)
            state["u"] *= -2.0  # every array changes right after the save returns
            store.finish_save(pending)
            areas.append(store.tier._data_map._area)
            (copy,) = fast_tier.scan(cache, store.directory, 0, 1)
            assert copy.step == step
            assert fast_tier.load(copy)["u"].tobytes() == saved.tobytes()
        assert areas[0] is areas[1] is areas[2]
        store.close()
        again = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=cache)
        restored = {"u": np.zeros(300000), "v": np.zeros(7, dtype=int)}
        assert again.restore(restored).step == 3
        assert restored["u"].tobytes() == (np.arange(300000.0) * 3).tobytes()
        again.close()
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def test_a_reserved_data_file_becomes_the_first_copy_in_the_same_mapping(tmp_path):
    """reserve (a restore with nothing on the tier) makes this rank's data file of the
    state's size on tmpfs, its pages allocated in the background; the first staged save
    recycles that very file (same inode, same mapping) and its copy restores bit for bit.
    Nothing is reserved when a data file is there to recycle, or off a memory file system."""
    import shutil
    import uuid
    from pathlib import Path

    from hpcckpt.store.tier.data_map import RESERVE_STEP, maps_well

    cache = Path("/dev/shm") / f"hpcckpt-test-{uuid.uuid4().hex[:8]}"
    try:
        store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=cache, incremental=False)
        state = {"u": np.arange(300001.0), "v": np.full(7, 3), "k": 1}
        size = store.tier.reserve(state)
        assert size == -(-2400008 // 4096) * 4096 + 4096  # each array rounded up to 4 KiB
        reserved = cache / fast_tier.data_name(RESERVE_STEP, 0)
        assert os.stat(reserved).st_size == size
        inode, area = os.stat(reserved).st_ino, store.tier._data_map._area
        store.finish_save(store.begin_save(4, state))
        assert sorted(os.listdir(cache)) == [
            fast_tier.data_name(4, 0),
            fast_tier.manifest_name(4, 0),
        ]
        assert os.stat(cache / fast_tier.data_name(4, 0)).st_ino == inode
        assert store.tier._data_map._area is area
        (copy,) = fast_tier.scan(cache, store.directory, 0, 1)
        assert fast_tier.load(copy)["u"].tobytes() == state["u"].tobytes()
        assert store.tier.reserve(state) == 0  # a data file to recycle already
        store.close()
        disk = CheckpointStore(tmp_path / "ck2", MPI.COMM_SELF, cache=tmp_path / "c2")
        assert disk.tier.reserve(state) == (size if maps_well(tmp_path) else 0)
        disk.close()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
