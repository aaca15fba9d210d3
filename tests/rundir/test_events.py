"""The event log (hpcckpt/rundir/events.py): append, the one reader, the context, the costs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpcckpt.rundir import events
from hpcckpt.rundir.env import ATTEMPT_ENV, CHAIN_COUNT_ENV


def test_append_and_read_back_skipping_a_torn_line(tmp_path):
    events.append_event(tmp_path, "start", step=1)
    with (tmp_path / events.EVENTS_FILE).open("a") as f:
        f.write('{"event": "checkpoint", "ti')  # a crash in the middle of a line
    got = list(events.read_events(tmp_path))
    assert [e["event"] for e in got] == ["start"] and got[0]["step"] == 1
    assert list(events.read_events(tmp_path / "absent")) == []
    with pytest.raises(FileNotFoundError):
        list(events.read_log(tmp_path / "absent" / events.EVENTS_FILE))


def test_job_context_from_slurm_and_the_wrapper():
    environ = {
        "SLURM_JOB_ID": "77",
        "SLURM_RESTART_COUNT": "2",
        CHAIN_COUNT_ENV: "1",
        ATTEMPT_ENV: "77.3.abc",
        "SLURM_NTASKS": "4",
    }
    assert events.job_context(environ) == {
        "job_id": "77",
        "restart_count": 2,
        "chain_count": 1,
        "restart": 3,
        "attempt": "77.3.abc",
        "nranks": 4,
    }
    assert events.job_context({}) == {"restart_count": 0, "restart": 0}
    assert events.restart_number(environ) == 3


def test_restart_of_an_old_record():
    assert events.restart_of({"restart": 4}) == 4
    assert events.restart_of({"restart_count": 1, "chain_count": 2}) == 3
    assert events.restart_of({}) == 0


def test_checkpoint_costs_is_the_one_reading_of_the_cost():
    log = [
        {"event": "checkpoint", "seconds": 4.5},
        {"event": "restart_set", "seconds": 7},
        {"event": "checkpoint"},  # no measurement
        {"event": "checkpoint_begin", "seconds": 99},
    ]
    assert events.checkpoint_costs(log) == [4.5, 7.0]
    assert events.checkpoint_costs(log, kinds=(events.RESTART_SET,)) == [7.0]


def test_every_end_event_is_a_wrapper_event_name():
    names = {v for k, v in vars(events).items() if k.isupper() and isinstance(v, str)}
    assert events.END_EVENTS <= names
    assert {events.STEP_END, events.REQUEUE, events.CHAIN, events.GIVE_UP} <= events.END_EVENTS


def test_a_line_is_one_json_object(tmp_path):
    record = events.append_event(tmp_path, "signal", name="USR1")
    line = (tmp_path / events.EVENTS_FILE).read_text()
    assert line.endswith("\n") and json.loads(line) == record


def _fds_on(path):
    fds = Path("/proc/self/fd")
    return [fd for fd in fds.iterdir() if os.path.realpath(fd) == str(path.resolve())]


def test_an_event_log_keeps_one_descriptor_and_writers_interleave_whole_lines(tmp_path):
    log = events.EventLog(tmp_path)
    assert _fds_on(tmp_path / events.EVENTS_FILE) == []  # opened at the first event
    for i in range(100):
        log.append("checkpoint_begin", step=i)
        events.append_event(tmp_path, "wrapper_decision", step=i)  # another writer
    assert len(_fds_on(tmp_path / events.EVENTS_FILE)) == 1
    got = list(events.read_events(tmp_path))
    assert [(e["event"], e["step"]) for e in got] == [
        (kind, i) for i in range(100) for kind in ("checkpoint_begin", "wrapper_decision")
    ]
    log.close()
    assert _fds_on(tmp_path / events.EVENTS_FILE) == []
    log.append("finish")  # after close: opened again
    assert [e["event"] for e in events.read_events(tmp_path)][-1] == "finish"
    log.close()
