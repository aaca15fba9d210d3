"""Reading a checkpoint into the application's state (hpcckpt/store/load.py), in one
process (MPI.COMM_SELF): straight into its arrays (views and aliases included), past the
page cache on a cold restore, and nothing overwritten when the state does not fit."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.store import CheckpointStore


def test_shape_or_dtype_mismatch_with_the_application_is_named(store, make_state):
    store.save(1, make_state(1))
    wrong = {"u": np.zeros(1000, dtype=np.int32), "meta": {}}
    with pytest.raises(CheckpointError, match=r"'u'.*float64\[1000\].*int32\[1000\]"):
        store.restore(wrong)
    assert not wrong["u"].any() and wrong["meta"] == {}, "nothing is overwritten on a mismatch"
    with pytest.raises(CheckpointError, match=r"float64\[1000\].*float64\[999\]"):
        store.restore({"u": np.zeros(999)})


def test_restore_reads_into_the_applications_arrays(store, make_state):
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
    res = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, fs_tuning=tuning).save(1, {"x": big})
    uncached(res.path)
    state = {"x": np.zeros_like(big)}
    restarted = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, fs_tuning=tuning)
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
