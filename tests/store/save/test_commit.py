"""The commit protocol (hpcckpt/store/save/commit.py) in one process (MPI.COMM_SELF): leftovers
of interrupted saves, a save that cannot create its file, the fsyncs a save costs, and
saves written through many small writes."""

from __future__ import annotations

import errno
import os
import stat

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.save.commit import StagingRefused
from hpcckpt.store.save.staging import HostBuffers
from hpcckpt.store.store import CheckpointStore


def test_partial_leftover_is_ignored_then_cleaned(store, make_state):
    store.save(1, make_state(1))
    leftover = store.directory / (layout.checkpoint_name(2) + layout.PARTIAL)
    leftover.write_bytes(b"half a checkpoint")
    state = make_state(0)
    assert store.restore(state).step == 1
    store.save(3, make_state(3))
    assert not leftover.exists()


def test_a_directory_named_like_the_partial_fails_that_save_alone_and_is_kept(store, make_state):
    store.save(1, make_state(1))
    blocker = store.directory / (layout.checkpoint_name(2) + layout.PARTIAL)
    blocker.mkdir()  # not hpcckpt's: the save of step 2 cannot create its file, says so
    with pytest.raises(CheckpointError, match="step 2"):
        store.save(2, make_state(2))
    assert blocker.is_dir()
    store.save(3, make_state(3))
    assert [e.step for e in layout.scan(store.directory)] == [3, 1]


def test_save_and_restore_through_small_writes(tmp_path, monkeypatch):
    """Slices longer than one write call (1 GiB) go in several: shrink the call to see it."""
    from hpcckpt.store.io import direct_io

    monkeypatch.setattr(direct_io, "WRITE_CHUNK", 4096)
    monkeypatch.setattr(direct_io, "MIN_DIRECT_BYTES", 8192)
    monkeypatch.setattr(direct_io, "BOUNCE_BYTES", 16384)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    state = {"u": np.random.default_rng(3).random((1000, 9)), "v": np.arange(50_000)}
    store.save(1, state)
    target = {"u": np.zeros((1000, 9)), "v": np.zeros(50_000, dtype=state["v"].dtype)}
    assert store.restore(target).step == 1
    assert np.array_equal(target["u"], state["u"]) and np.array_equal(target["v"], state["v"])


def test_a_save_fsyncs_its_file_once_with_its_final_mode_then_the_directory(
    store, make_state, monkeypatch
):
    """Durability costs one fsync per rank and the directory's: the file's mode is set
    before the rank's fsync, so the commit only renames (docs/format.md)."""
    calls = []
    real_fsync = os.fsync

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        calls.append((os.path.basename(target), stat.S_IMODE(os.fstat(fd).st_mode)))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    res = store.save(7, make_state(7))
    partial = res.path.name + layout.PARTIAL
    assert calls == [(partial, store.file_mode), (store.directory.name, store.dir_mode)]
    assert stat.S_IMODE(res.path.stat().st_mode) == store.file_mode


# -- what the saver remembers between saves, and staged saves that cannot go on ------------
def incremental_store(tmp_path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, block_size=4096, min_delta_saving=0)


@pytest.mark.parametrize("how", ["marked_bad", "removed"])
def test_a_delta_is_written_only_while_its_chain_is_intact(tmp_path, how):
    """Rank 0 checks the chain the next delta extends: a file of it moved away or marked
    bad since makes the next save full."""
    store = incremental_store(tmp_path)
    state = {"u": np.arange(8192.0)}
    assert store.save(1, state).kind == "full"
    state["u"][:5] = -1.0
    assert store.save(2, state).kind == "incremental"
    first = store.directory / layout.checkpoint_name(1)
    if how == "marked_bad":
        layout.mark_bad(first, "inspected by hand")
    else:
        first.rename(tmp_path / first.name)
    state["u"][:5] = -2.0
    third = store.save(3, state)
    assert third.kind == "full" and third.full_reason
    back = {"u": np.zeros(8192)}
    assert CheckpointStore(store.directory, MPI.COMM_SELF).restore(back).step == 3
    assert np.array_equal(back["u"], state["u"])


def test_a_restore_makes_the_next_save_a_delta_of_what_it_restored(tmp_path):
    store = incremental_store(tmp_path)
    state = {"u": np.arange(8192.0)}
    store.save(1, state)
    restarted = incremental_store(tmp_path)
    restarted.restore(state)
    state["u"][:5] = -1.0
    assert restarted.save(2, state).kind == "incremental"


def test_staging_refused_when_memory_is_short_writes_nothing(store, make_state):
    buffers = HostBuffers(budget=1024)  # under the smallest ring: save synchronously
    with pytest.raises(StagingRefused, match=r"^rank 0: .* a staged save needs$"):
        store.begin_save(1, make_state(1), buffers=buffers)
    assert buffers.nbytes == 0 and layout.partials(store.directory) == []
    assert layout.scan(store.directory) == []
    assert store.save(1, make_state(1)).step == 1, "the synchronous save goes on"


@pytest.mark.parametrize("tier", [False, True])
def test_a_failed_background_write_commits_nothing(tmp_path, make_state, monkeypatch, tier):
    """finish_save agrees on every rank's background write: a failed one deletes the
    partial file and raises; a copy on the node-local tier is then the newest."""
    from hpcckpt.store.save import background

    cache = tmp_path / "cache" if tier else None
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=cache)
    store.save(1, make_state(1))

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(background, "write_extents", failing)
    buffers = None if tier else HostBuffers()
    pending = store.begin_save(2, make_state(2), buffers=buffers)
    with pytest.raises(
        CheckpointError,
        match=r"^writing checkpoint of step 2 in the background failed \(rank 0: OSError: "
        r"\[Errno 5\] Input/output error",
    ):
        store.finish_save(pending)
    assert not pending.partial.exists() and not pending.final.exists()
    assert [e.step for e in layout.scan(store.directory)] == [1]
    if tier:
        assert store.tier.holds_newest and store.tier.newest_step == 2
    monkeypatch.undo()
    back = make_state(0)
    got = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=cache).restore(back)
    assert (got.step, got.source) == ((2, "cache") if tier else (1, "directory"))
    assert back["meta"]["k"] == got.step


def test_after_prepare_the_first_staged_save_is_deferred_and_tuned_in_the_background(
    tmp_path, make_state
):
    """What a restore does before the first save (``prepare_deferred``): that save blocks
    for its copy only, the ranks' file creation and the directory's tuning run in the
    background thread; the checkpoint restores the values at ``save()``."""
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    buffers = HostBuffers()
    state = make_state(1)
    saved = state["u"].copy()
    try:
        assert store.saver.tuning is None
        store.prepare_saves(state, buffers)
        pending = store.saver.begin_save(1, state, buffers=buffers)
        assert pending.deferred, "the first save after a restore is deferred"
        state["u"][:] = 0.0  # the application goes on at once: the copy is its own
        result = store.saver.finish_save(pending)
        assert store.saver.tuning is not None, "the thread decided the tuning"
        assert result.step == 1 and result.path.is_file()
        back = make_state(0)
        assert store.restore(back).step == 1
        assert back["u"].tobytes() == saved.tobytes() and back["meta"] == state["meta"]
    finally:
        store.close()


def test_without_prepare_the_first_staged_save_runs_in_the_foreground(tmp_path, make_state):
    """No restore before it: the first staged save makes the background group as it
    creates its file in the foreground; the second is deferred."""
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    buffers = HostBuffers()
    try:
        first = store.saver.begin_save(1, make_state(1), buffers=buffers)
        assert not first.deferred and store.saver.tuning is not None
        store.saver.finish_save(first)
        second = store.saver.begin_save(2, make_state(2), buffers=buffers)
        assert second.deferred
        store.saver.finish_save(second)
    finally:
        store.close()
