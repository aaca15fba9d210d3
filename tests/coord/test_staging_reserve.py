"""The first async save after restore(): its staging populated in the background meanwhile."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from hpcckpt.coord.checkpointer import Checkpointer
from hpcckpt.store.save import staging


def test_restore_reserves_the_first_saves_staging_and_the_save_keeps_its_values(
    tmp_path, monkeypatch
):
    """restore() with nothing to restore maps and populates the staging of the state it
    was given; the first save copies into it (no buffer mapped in the blocked window),
    the values at save() are what is committed although the state changes right after
    save() returns, and a restart restores them."""
    u = np.random.default_rng(1).random((4 << 20) // 8)
    state = {"u": u, "t": 0.0}
    common = {"every_steps": 1, "keep_last": None, "incremental": False, "validate": None}
    with Checkpointer(tmp_path, comm=MPI.COMM_SELF, async_save=True, **common) as ck:
        assert ck.restore(state) is None
        assert ck.buffers.nbytes == u.nbytes and ck.buffers.local_ranks == 1
        monkeypatch.setattr(
            staging, "new_buffer", lambda *a: (_ for _ in ()).throw(AssertionError("mapped"))
        )
        saved = u.copy()
        ck.save(0, state)
        u *= -2.0  # every array changes right after save() returns
        assert ck.buffers.peak == ck.buffers.nbytes == u.nbytes
        ck.wait()
        monkeypatch.undo()
        ck.finish()
    again = {"u": np.zeros_like(u), "t": 1.0}
    with Checkpointer(tmp_path, comm=MPI.COMM_SELF, async_save=True, **common) as ck:
        assert ck.restore(again) == 0
        assert again["u"].tobytes() == saved.tobytes() and again["t"] == 0.0
        ck.finish()


def test_restore_reserves_the_node_local_data_file_and_the_first_cache_save_fills_it(tmp_path):
    """With a cache on tmpfs, restore() with nothing to restore makes this rank's data file
    of the state's size (its pages allocated in the background); the first save copies
    into that file, and a restart restores the values at save() from the node-local copy."""
    import shutil
    import uuid
    from pathlib import Path

    from hpcckpt.store.tier import copies as fast_tier
    from hpcckpt.store.tier.data_map import RESERVE_STEP

    cache = Path("/dev/shm") / f"hpcckpt-test-{uuid.uuid4().hex[:8]}"
    u = np.random.default_rng(2).random((4 << 20) // 8)
    state = {"u": u}
    common = {"every_steps": 1, "keep_last": None, "incremental": False, "validate": None}
    try:
        with Checkpointer(tmp_path, comm=MPI.COMM_SELF, cache=cache, **common) as ck:
            assert ck.restore(state) is None
            reserved = cache / fast_tier.data_name(RESERVE_STEP, 0)
            inode = reserved.stat().st_ino
            saved = u.copy()
            ck.save(0, state)
            u *= -2.0  # every array changes right after save() returns
            ck.wait()  # the copy goes through host memory, the tier's file in the background
            assert (cache / fast_tier.data_name(0, 0)).stat().st_ino == inode
            assert not reserved.exists()
            (copy,) = fast_tier.scan(cache, tmp_path, 0, 1)
            assert fast_tier.load(copy)["u"].tobytes() == saved.tobytes()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
