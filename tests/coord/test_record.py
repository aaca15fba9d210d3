"""What the Checkpointer leaves in its directory for the wrapper (hpcckpt/coord/record.py):
rank 0's status file, events and lock; the store's reports as their events."""

from __future__ import annotations

import pytest
from mpi4py import MPI

from hpcckpt.coord.record import STORE_EVENTS, RunRecord
from hpcckpt.rundir import events as job_events
from hpcckpt.rundir import status as job_status
from hpcckpt.store.agreement import Agreement
from hpcckpt.store.io.lock import LOCK_NAME, read_owner
from hpcckpt.store.store import MIRROR_FAILED, MIRROR_PRUNED, MIRRORED, STAGING_REFUSED


def test_rank_0_writes_the_status_and_the_events_the_others_nothing(tmp_path):
    other = RunRecord(tmp_path, 1, 2, "a1")
    other.status(job_status.RUNNING)
    other.event(job_events.START, pid=1)
    other.store_report(MIRRORED, {"step": 3})
    assert list(tmp_path.iterdir()) == []
    record = RunRecord(tmp_path, 0, 2, "a1")
    record.status(job_status.STOPPED, 3, "signal USR1")
    got = job_status.read_status(tmp_path)
    assert (got.state, got.attempt, got.step, got.reason) == ("stopped", "a1", 3, "signal USR1")
    record.event(job_events.CHECKPOINT, step=3)
    record.store_report(STAGING_REFUSED, {"step": 4, "reason": "rank 1: short"})
    events = list(job_events.read_events(tmp_path))
    assert [(e["event"], e["step"]) for e in events] == [
        (job_events.CHECKPOINT, 3),
        (job_events.STAGING_REFUSED, 4),
    ]
    assert all(e["source"] == "checkpointer" and e["nranks"] == 2 for e in events)


def test_every_kind_the_store_reports_has_its_event():
    assert STORE_EVENTS == {
        MIRRORED: job_events.MIRRORED,
        MIRROR_FAILED: job_events.MIRROR_FAILED,
        MIRROR_PRUNED: job_events.MIRROR_PRUNED,
        STAGING_REFUSED: job_events.STAGING_REFUSED,
    }


def test_rank_0_creates_the_directory_and_locks_it_until_released(tmp_path):
    directory = tmp_path / "ck"
    record = RunRecord(directory, 0, 1, None)
    record.lock(Agreement(MPI.COMM_SELF), 0o700, 0o600, "111")
    assert directory.is_dir() and (directory.stat().st_mode & 0o777) == 0o700
    lock = directory / LOCK_NAME
    assert read_owner(lock)["job_id"] == "111" and (lock.stat().st_mode & 0o777) == 0o600
    record.release()
    assert not lock.exists()
    record.release()  # again: nothing


def test_a_path_that_is_not_a_directory_is_explained(tmp_path):
    taken = tmp_path / "ck"
    taken.write_text("not a directory")
    with pytest.raises(OSError, match="checkpoint directory"):
        RunRecord(taken, 0, 1, None).lock(Agreement(MPI.COMM_SELF), 0o700, 0o600, None)
