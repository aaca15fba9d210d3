"""How long a stop or ``finish()`` may wait for the mirror before the job's end."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt import Checkpointer
from hpcckpt.coord.endtime import mirror_wait_bound
from hpcckpt.policy import requeue_lead
from hpcckpt.rundir.events import read_events


def test_the_wait_ends_in_time_for_the_requeue():
    lead = requeue_lead()
    assert lead == 12.0  # take-down 2 s + requeue 5 s + 5 s slack, KillWait not counted
    assert mirror_wait_bound(300.0, None, 1000.0) == 300.0  # no end time: mirror_wait
    assert mirror_wait_bound(300.0, 1000.0 + 3600, 1000.0) == 300.0  # far from the end
    assert mirror_wait_bound(300.0, 1000.0 + 45, 1000.0) == pytest.approx(45 - lead)
    assert mirror_wait_bound(5.0, 1000.0 + 45, 1000.0) == 5.0  # shorter than the time left
    assert mirror_wait_bound(300.0, 1000.0 + 10, 1000.0) == 0.0  # past the margin: no wait
    assert mirror_wait_bound(300.0, 900.0, 1000.0) == 0.0  # past the end


def test_finish_with_the_mirror_away_near_the_end_waits_only_the_time_left(
    tmp_path, monkeypatch, capfd
):
    """``mirror_wait`` is 300 s, the job ends in 15 s: finish() waits about 3 s, says so in
    the user's numbers, and leaves the checkpoint in the directory."""
    for name in ("SLURM_JOB_ID", "HPCCKPT_MIRROR", "HPCCKPT_MIRROR_WAIT", "HPCCKPT_END_TIME"):
        monkeypatch.delenv(name, raising=False)
    ck_dir = tmp_path / "ck"
    ck = Checkpointer(
        ck_dir,
        comm=MPI.COMM_SELF,
        interval=3600,
        mirror=str(tmp_path / "not-mounted"),
        end_time=time.time() + 15,
    )
    try:
        ck.save(7, {"u": np.arange(10.0)})
        t0 = time.monotonic()
        ck.finish()
        took = time.monotonic() - t0
    finally:
        ck.close()
    assert 1.0 < took < 10.0, took
    (waited,) = [e for e in read_events(ck_dir) if e["event"] == "mirror_wait"]
    assert waited["done"] is False and waited["step"] == 7 and waited["reason"] == "finish"
    assert 1.0 < waited["cut_to"] < 3.5 and waited["job_end"] > time.time() - 30
    text = capfd.readouterr().err
    line = (
        r"mirror: step 7 did not reach the mirror within [23] s \(finish; mirror_wait 300 s cut "
        r"for the time limit: the job ends in 1[45] s and the wrapper needs 12 s after the "
        r"ranks to end the job\); the mirror holds nothing yet from this run; last failure: .*"
        r"; the checkpoint directory keeps it \(" + re.escape(str(ck_dir)) + r"\) and a run "
        r"started on it with this mirror copies it"
    )
    assert re.search(line, text), text
    assert (ck_dir / "ckpt-0000000007.h5").exists(), list(ck_dir.iterdir())
