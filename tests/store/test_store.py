"""The store in one process (MPI.COMM_SELF): commit protocol, discovery, fallback."""

from __future__ import annotations

import json
import os
import stat

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store import layout
from hpcckpt.store.checkpoint_file import CheckpointError
from hpcckpt.store.store import CheckpointStore


def make_state(k: float) -> dict:
    return {"u": np.arange(1000.0) * k, "meta": {"k": k, "name": "run"}}


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)


def test_save_commits_atomically_and_restore_takes_newest(store):
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


def test_file_is_readable_with_plain_h5py(store):
    store.save(3, make_state(3))
    with h5py.File(store.directory / layout.checkpoint_name(3), "r") as f:
        assert f["meta"].attrs["format"] == "hpcckpt" and f["meta"].attrs["step"] == 3
        assert np.array_equal(f["state/u"][:], np.arange(1000.0) * 3)
        offs = f["meta/rank_tree"].attrs["offsets"]
        tree = json.loads(f["meta/rank_tree"][offs[0] : offs[1]].tobytes())
        assert tree["v"]["meta"]["v"]["k"] == 3


def test_partial_leftover_is_ignored_then_cleaned(store):
    store.save(1, make_state(1))
    leftover = store.directory / (layout.checkpoint_name(2) + layout.PARTIAL)
    leftover.write_bytes(b"half a checkpoint")
    state = make_state(0)
    assert store.restore(state).step == 1
    store.save(3, make_state(3))
    assert not leftover.exists()


def test_a_directory_named_like_the_partial_fails_that_save_alone_and_is_kept(store):
    store.save(1, make_state(1))
    blocker = store.directory / (layout.checkpoint_name(2) + layout.PARTIAL)
    blocker.mkdir()  # not hpcckpt's: the save of step 2 cannot create its file, says so
    with pytest.raises(CheckpointError, match="step 2"):
        store.save(2, make_state(2))
    assert blocker.is_dir()
    store.save(3, make_state(3))
    assert [e.step for e in layout.scan(store.directory)] == [3, 1]


@pytest.mark.parametrize("damage", ["flip_data", "truncate", "garbage"])
def test_corrupt_newest_falls_back_and_is_marked_not_deleted(store, damage):
    store.save(1, make_state(1))
    store.save(2, make_state(2))
    newest = store.directory / layout.checkpoint_name(2)
    raw = bytearray(newest.read_bytes())
    if damage == "flip_data":
        with h5py.File(newest, "r") as f:
            off = f["state/u"].id.get_offset()
        raw[off + 100] ^= 0x01
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw = bytearray(b"not hdf5 at all" * 10)
    newest.write_bytes(bytes(raw))
    state = make_state(0)
    got = store.restore(state)
    assert got.step == 1 and got.skipped and got.skipped[0][0] == 2
    assert np.array_equal(state["u"], np.arange(1000.0))
    assert newest.exists(), "a bad checkpoint is never deleted"
    assert layout.scan(store.directory)[0].bad_reason


def test_all_bad_is_an_error_not_a_silent_fresh_start(store):
    store.save(1, make_state(1))
    (store.directory / layout.checkpoint_name(1)).write_bytes(b"x" * 100)
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints"):
        store.restore(make_state(0))


def test_empty_directory_restores_nothing(store):
    assert store.restore(make_state(0)) is None


def test_shape_or_dtype_mismatch_with_the_application_is_named(store):
    store.save(1, make_state(1))
    wrong = {"u": np.zeros(1000, dtype=np.int32), "meta": {}}
    with pytest.raises(CheckpointError, match=r"'u'.*float64\[1000\].*int32\[1000\]"):
        store.restore(wrong)
    assert not wrong["u"].any() and wrong["meta"] == {}, "nothing is overwritten on a mismatch"
    with pytest.raises(CheckpointError, match=r"float64\[1000\].*float64\[999\]"):
        store.restore({"u": np.zeros(999)})


def test_restore_reads_into_the_applications_arrays(store):
    """No second buffer: the reader fills the application's array and returns it."""
    from hpcckpt.store.reader import CheckpointReader

    res = store.save(1, make_state(1))
    out = np.zeros(1000)
    with CheckpointReader(res.path) as reader:
        assert reader.rank_array("u", 0, out) is out
        assert np.array_equal(out, np.arange(1000.0))
        other = np.zeros(999)
        got = reader.rank_array("u", 0, other)  # does not fit: read into a new array
        assert got is not other and not other.any() and np.array_equal(got, out)


@pytest.mark.parametrize("direct", [None, False])
def test_a_cold_restore_reads_past_the_page_cache_where_saves_write_so(
    tmp_path, read_past, uncached, direct
):
    """By file system, as saves (ext4 here, where tmp_path is); never with
    ``TuningOptions(direct_io=False)``."""
    from hpcckpt.store import direct_io, filesystem

    tuning = filesystem.TuningOptions(direct_io=direct)
    big = np.random.default_rng(1).random(1 << 20)  # 8 MiB: more than MIN_DIRECT_BYTES
    res = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, tuning=tuning).save(1, {"x": big})
    uncached(res.path)
    state = {"x": np.zeros_like(big)}
    restarted = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, tuning=tuning)
    assert restarted.restore(state).step == 1
    assert np.array_equal(state["x"], big)
    takes = filesystem.detect(tmp_path).name in filesystem.DIRECT_IO_NAMES
    if direct is None and takes:
        assert len(read_past) == 1 and read_past[0] > big.nbytes - 3 * direct_io.ALIGN
    else:
        assert read_past == []


def test_mismatch_on_one_array_leaves_every_array_untouched(store):
    store.save(1, {"a": np.ones(100), "b": np.ones(100)})
    state = {"a": np.zeros(100), "b": np.zeros(50)}
    with pytest.raises(CheckpointError, match=r"'b'"):
        store.restore(state)
    assert not state["a"].any(), "'a' fits, but nothing is read before the whole state fits"


def test_restore_into_views_and_aliased_arrays(store):
    base = np.zeros(2000)
    shared = np.arange(10.0)
    store.save(1, {"strided": np.arange(1000.0), "x": shared, "y": shared * 2})
    state = {"strided": base[::2], "x": np.zeros(10), "y": None}
    state["y"] = state["x"]  # one array at two paths: read through a buffer, in order
    store.restore(state)
    assert np.array_equal(base[::2], np.arange(1000.0)) and not base[1::2].any()
    assert state["x"] is state["y"]
    assert np.array_equal(state["x"], shared * 2), "the later path wins, as before"


def test_save_and_restore_through_small_writes(tmp_path, monkeypatch):
    """Slices longer than one write call (1 GiB) go in several: shrink the call to see it."""
    from hpcckpt.store import direct_io

    monkeypatch.setattr(direct_io, "WRITE_CHUNK", 4096)
    monkeypatch.setattr(direct_io, "MIN_DIRECT_BYTES", 8192)
    monkeypatch.setattr(direct_io, "BOUNCE_BYTES", 16384)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    state = {"u": np.random.default_rng(3).random((1000, 9)), "v": np.arange(50_000)}
    store.save(1, state)
    target = {"u": np.zeros((1000, 9)), "v": np.zeros(50_000, dtype=state["v"].dtype)}
    assert store.restore(target).step == 1
    assert np.array_equal(target["u"], state["u"]) and np.array_equal(target["v"], state["v"])


def test_a_save_fsyncs_its_file_once_with_its_final_mode_then_the_directory(store, monkeypatch):
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


def test_an_unexpected_error_while_planning_stops_the_restore_and_marks_nothing_bad(
    store, monkeypatch
):
    """Only damage the reader recognizes marks a checkpoint bad and falls back; anything
    else (a bug, a passing fault) stops the restore with the checkpoints left as they are."""
    from hpcckpt.store import read_plan

    store.save(1, make_state(1))
    store.save(2, make_state(2))

    def broken(reader):
        raise RuntimeError("a bug in planning")

    monkeypatch.setattr(read_plan, "plans", broken)
    with pytest.raises(CheckpointError, match="reading ckpt-0000000002.h5: RuntimeError"):
        store.restore(make_state(0))
    assert all(e.good_candidate for e in layout.scan(store.directory))


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
