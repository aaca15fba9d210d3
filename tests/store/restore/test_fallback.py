"""Which checkpoint a restore takes (hpcckpt/store/restore/fallback.py), in one process
(MPI.COMM_SELF): the newest that verifies, falling back past damaged ones (marked bad,
never deleted), an error when none is good, and nothing marked for what is not damage."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.restore.fallback import READ_CRASH, reading_marker
from hpcckpt.store.store import CheckpointStore


@pytest.mark.parametrize("damage", ["flip_data", "truncate", "garbage"])
def test_corrupt_newest_falls_back_and_is_marked_not_deleted(store, make_state, damage):
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


def test_all_bad_is_an_error_not_a_silent_fresh_start(store, make_state):
    store.save(1, make_state(1))
    (store.directory / layout.checkpoint_name(1)).write_bytes(b"x" * 100)
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints"):
        store.restore(make_state(0))


def test_empty_directory_restores_nothing(store, make_state):
    assert store.restore(make_state(0)) is None


def test_an_unexpected_error_while_planning_stops_the_restore_and_marks_nothing_bad(
    store, make_state, monkeypatch
):
    """Only damage the reader recognizes marks a checkpoint bad and falls back; anything
    else (a bug, a passing fault) stops the restore with the checkpoints left as they are."""
    from hpcckpt.store.restore import read_plan

    store.save(1, make_state(1))
    store.save(2, make_state(2))

    def broken(reader):
        raise RuntimeError("a bug in planning")

    monkeypatch.setattr(read_plan, "plans", broken)
    with pytest.raises(CheckpointError, match="reading ckpt-0000000002.h5: RuntimeError"):
        store.restore(make_state(0))
    assert all(e.good_candidate for e in layout.scan(store.directory))


def test_a_completed_restore_leaves_no_reading_marker(store, make_state):
    store.save(1, make_state(1))
    assert store.restore(make_state(0)).step == 1
    assert not list(store.directory.glob("*" + layout.READING))


def test_a_restore_that_died_reading_the_newest_skips_it_from_then_on(store, make_state):
    """The marker of a read that never completed (HDF5 crashed, the job was killed): the
    next restore marks that checkpoint bad with the reason, keeps it, and falls back."""
    store.save(1, make_state(1))
    store.save(2, make_state(2))
    newest = store.directory / layout.checkpoint_name(2)
    reading_marker(newest).write_text("4242\n")
    state = make_state(0)
    got = store.restore(state)
    assert got.step == 1 and got.skipped == [(2, READ_CRASH)]
    assert state["meta"]["k"] == 1 and np.array_equal(state["u"], np.arange(1000.0))
    assert newest.exists() and layout.read_bad(newest) == READ_CRASH
    assert not list(store.directory.glob("*" + layout.READING))
    again = store.restore(make_state(0))  # marked bad: skipped without being read
    assert again.step == 1 and again.skipped == [(2, f"marked bad earlier: {READ_CRASH}")]


def test_damage_in_the_file_an_incremental_is_built_on_marks_that_file(tmp_path, make_state):
    """A delta needs its chain: damage in the full checkpoint under it marks that file (the
    culprit) bad, not the delta, and says which restore found it."""
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, block_size=4096, min_delta_saving=0)
    state = {"u": np.arange(4096.0)}
    store.save(1, state)
    state["u"][:10] = -1.0
    assert store.save(2, state).kind == "incremental"
    full = store.directory / layout.checkpoint_name(1)
    with h5py.File(full, "r") as f:
        off = f["state/u"].id.get_offset()
    raw = bytearray(full.read_bytes())
    raw[off + 8 * 4000] ^= 0x01  # a block the delta did not rewrite
    full.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="none of the 2 checkpoints"):
        CheckpointStore(tmp_path / "ck", MPI.COMM_SELF).restore({"u": np.zeros(4096)})
    assert layout.read_bad(full).startswith(
        f"found while restoring {layout.checkpoint_name(2)}: {full.name}: array 'u'"
    )
    assert layout.read_bad(store.directory / layout.checkpoint_name(2)) is None


def flip_byte(path, dataset: str = "state/u") -> None:
    """Flip one byte of an array's data in place: its checksum no longer matches."""
    with h5py.File(path, "r") as f:
        off = f[dataset].id.get_offset()
    raw = bytearray(path.read_bytes())
    raw[off + 100] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_new_file_of_a_step_marked_bad_is_restored_not_skipped(store, make_state):
    """Step 2 found bad, the run falls back to step 1 and writes a new step 2: the mark
    judged the old file; the commit clears it and says so, and the next restore takes
    the new step 2, even if the old mark came back (a crash before it was removed)."""
    store.save(1, make_state(1))
    store.save(2, make_state(2))
    second = store.directory / layout.checkpoint_name(2)
    flip_byte(second)
    assert store.restore(make_state(0)).step == 1
    old_mark = second.with_name(second.name + layout.BAD).read_text()
    assert "fails its checksum" in old_mark
    saved = store.save(2, make_state(22))
    assert saved.cleared_bad_mark is not None and "fails its checksum" in saved.cleared_bad_mark
    assert not second.with_name(second.name + layout.BAD).exists()
    assert store.save(3, make_state(3)).cleared_bad_mark is None
    (store.directory / layout.checkpoint_name(3)).unlink()
    second.with_name(second.name + layout.BAD).write_text(old_mark)  # a stale mark
    state = make_state(0)
    got = CheckpointStore(store.directory, MPI.COMM_SELF).restore(state)
    assert got.step == 2 and got.skipped == [] and state["meta"]["k"] == 22


def test_a_delta_built_on_a_file_that_was_written_again_is_bad_and_the_new_file_good(tmp_path):
    """Steps 1 (full), 2 and 3 (deltas); damage in step 2 marks it and the restore takes
    step 1; the run writes a new step 2 and dies before step 3. The old step 3 needs the
    old step 2: it is marked bad now (its chain is broken), and the new step 2 is taken."""
    directory = tmp_path / "ck"
    store = CheckpointStore(directory, MPI.COMM_SELF, block_size=4096, min_delta_saving=0)
    state = {"u": np.arange(4096.0)}
    store.save(1, state)
    state["u"][600:610] = 2.0  # the second block of 4 KiB
    assert store.save(2, state).kind == "incremental"
    state["u"][:10] = 3.0  # the first: step 3 needs step 2's block
    assert store.save(3, state).kind == "incremental"
    second, third = (directory / layout.checkpoint_name(s) for s in (2, 3))
    flip_byte(second, "delta/u")
    again = CheckpointStore(directory, MPI.COMM_SELF, block_size=4096, min_delta_saving=0)
    state = {"u": np.zeros(4096)}
    assert again.restore(state).step == 1
    assert layout.read_bad(second) and layout.read_bad(third) is None
    state["u"][:10] = 22.0
    assert again.save(2, state).cleared_bad_mark is not None
    state = {"u": np.zeros(4096)}
    got = CheckpointStore(directory, MPI.COMM_SELF).restore(state)
    assert got.step == 2 and state["u"][0] == 22.0 and state["u"][600] == 600.0  # from step 1
    assert [s for s, _ in got.skipped] == [3] and "now another checkpoint" in got.skipped[0][1]
    assert "now another checkpoint of that step" in layout.read_bad(third)
    assert layout.read_bad(second) is None
