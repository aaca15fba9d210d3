"""Retention: the pure keep-decision, and pruning a directory."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.file import layout
from hpcckpt.store.retention import BackgroundPrune, Candidate, prune_directory, steps_to_keep
from hpcckpt.store.store import CheckpointStore


def cands(steps, bad=(), dt=10.0):
    return [Candidate(s, 1000.0 + dt * s, s in bad) for s in steps]


def test_keep_last_keeps_the_newest_good_ones():
    assert steps_to_keep(cands(range(0, 100, 10)), keep_last=3) == {70, 80, 90}


def test_no_rule_keeps_everything():
    assert steps_to_keep(cands([1, 2, 3])) == {1, 2, 3}


def test_newest_good_is_always_kept_and_bad_ones_stay_unless_asked():
    c = cands([10, 20, 30, 40], bad={40})
    assert steps_to_keep(c, keep_every=1000) == {10, 30, 40}  # 30 newest good, 40 bad
    assert steps_to_keep(c, keep_last=1) == {30, 40}
    assert steps_to_keep(c, keep_last=1, delete_bad=True) == {30}


def test_bad_checkpoints_do_not_count_towards_keep_last():
    c = cands([10, 20, 30, 40], bad={30, 40})
    assert steps_to_keep(c, keep_last=2, delete_bad=True) == {10, 20}


def test_keep_every_keeps_the_oldest_per_window_and_is_stable():
    steps = [9, 19, 29, 39, 49, 59, 69]
    assert steps_to_keep(cands(steps), keep_every=25) == {9, 29, 59, 69}
    # A kept checkpoint stays kept when newer ones arrive.
    before = steps_to_keep(cands(steps[:4]), keep_every=25)
    after = steps_to_keep(cands(steps), keep_every=25)
    assert before - {39} <= after


def test_keep_every_seconds_uses_the_checkpoint_time():
    c = [Candidate(s, t) for s, t in [(1, 0.0), (2, 50.0), (3, 100.0), (4, 130.0), (5, 260.0)]]
    assert steps_to_keep(c, keep_every_seconds=100) == {1, 3, 5}


def test_rules_combine_as_a_union():
    c = cands(range(1, 11))
    assert steps_to_keep(c, keep_last=2, keep_every=5) == {1, 5, 10, 9}


@pytest.mark.parametrize("kw", [{"keep_last": 0}, {"keep_every": -1}, {"keep_every_seconds": 0}])
def test_nonsense_rules_are_rejected(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        steps_to_keep(cands([1]), **kw)


def test_store_prune_deletes_files_and_sidecars_but_not_partials(tmp_path):
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    for step in range(1, 7):
        store.save(step, {"x": np.full(3, step)})
    layout.mark_bad(store.directory / layout.checkpoint_name(2), "test")
    partial = store.directory / (layout.checkpoint_name(9) + layout.PARTIAL)
    partial.write_bytes(b"half")
    dry = store.prune(keep_last=2, dry_run=True)
    assert [p.name for p in dry] == [layout.checkpoint_name(s) for s in (1, 3, 4)]
    assert len(layout.scan(store.directory)) == 6
    deleted = store.prune(keep_last=2)
    assert deleted == dry
    assert [e.step for e in layout.scan(store.directory)] == [6, 5, 2]
    assert partial.exists()
    prune_directory(store.directory, keep_last=1, delete_bad=True)
    assert [e.step for e in layout.scan(store.directory)] == [6]
    assert not (store.directory / (layout.checkpoint_name(2) + layout.BAD)).exists()


def test_no_rule_prunes_nothing_and_opens_nothing(tmp_path):
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    for step in (1, 2):
        store.save(step, {"x": np.full(3, step)})
    # A file that is not HDF5 at all: any rule would have to open it (and count it bad).
    (store.directory / layout.checkpoint_name(3)).write_bytes(b"not a checkpoint")
    assert prune_directory(store.directory) == [] and store.prune() == []
    assert [e.step for e in layout.scan(store.directory)] == [3, 2, 1]


def test_a_background_prune_runs_one_at_a_time_and_wait_ends_it():
    prune = BackgroundPrune()
    gate, order = threading.Event(), []
    prune.start(lambda: (gate.wait(10), order.append("first")), "test")
    assert prune.running and order == []
    threading.Timer(0.2, gate.set).start()
    t0 = time.monotonic()
    prune.start(lambda: order.append("second"), "test")  # waits for the first
    assert order[0] == "first" and time.monotonic() - t0 >= 0.15
    prune.wait()
    assert order == ["first", "second"] and not prune.running
    prune.wait()  # nothing under way: returns at once


def test_a_background_prune_that_fails_says_so_and_raises_nothing(tmp_path, caplog):
    def fail() -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path))

    prune = BackgroundPrune()
    with caplog.at_level(logging.WARNING, logger="hpcckpt.store"):
        prune.start(fail, str(tmp_path))
        prune.wait()
    assert f"retention of {tmp_path} failed, the rest kept" in caplog.text
    assert "Permission denied" in caplog.text
