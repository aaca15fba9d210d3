"""The run-status file (hpcckpt/rundir/status.py): atomic writes, tolerant reads."""

from __future__ import annotations

import pytest

from hpcckpt.rundir.status import (
    RUNNING,
    STOPPED,
    RunStatus,
    read_status,
    status_path,
    write_status,
)


def test_round_trip_and_replace(tmp_path):
    assert read_status(tmp_path) is None
    write_status(tmp_path, RunStatus(RUNNING, attempt="a", step=3))
    write_status(tmp_path, RunStatus(STOPPED, attempt="a", step=5, reason="signal"))
    got = read_status(tmp_path)
    assert got is not None and (got.state, got.step, got.reason) == (STOPPED, 5, "signal")
    assert [p.name for p in tmp_path.iterdir()] == [status_path(tmp_path).name]


def test_garbage_reads_as_none_and_bad_states_are_refused(tmp_path):
    status_path(tmp_path).write_text("{not json")
    assert read_status(tmp_path) is None
    with pytest.raises(ValueError, match="state must be one of"):
        RunStatus("paused")
