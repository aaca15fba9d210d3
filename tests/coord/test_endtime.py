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
    tmp_path, monkeypatch, capfd, caplog
):
    """``mirror_wait`` is 300 s, the job ends in 18 s: finish() waits about 6 s, says so in
    the user's numbers, and leaves the checkpoint in the directory."""
    for name in ("SLURM_JOB_ID", "HPCCKPT_MIRROR", "HPCCKPT_MIRROR_WAIT", "HPCCKPT_END_TIME"):
        monkeypatch.delenv(name, raising=False)
    ck_dir = tmp_path / "ck"
    end = time.time() + 18
    ck = Checkpointer(
        ck_dir,
        comm=MPI.COMM_SELF,
        interval=3600,
        mirror=str(tmp_path / "not-mounted"),
        end_time=end,
    )
    try:
        ck.save(7, {"u": np.arange(10.0)})
        t0, before = time.monotonic(), time.time()
        ck.finish()
        took = time.monotonic() - t0
    finally:
        ck.close()
    # the wait ends 12 s before the job's end, counted from when finish() began (a loaded
    # machine may take seconds to get there: the bound follows the clock, not the test)
    left = end - 12 - before
    assert left > 0.5, f"the save took {6 - left:.1f} s: too slow to test a cut wait"
    assert abs(took - left) < 2.0, (took, left)
    (waited,) = [e for e in read_events(ck_dir) if e["event"] == "mirror_wait"]
    assert waited["done"] is False and waited["step"] == 7 and waited["reason"] == "finish"
    assert abs(waited["cut_to"] - left) < 1.0 and abs(waited["job_end"] - end) < 1.0, waited
    text = capfd.readouterr().err + caplog.text  # wherever the hpcckpt handler writes
    line = (
        r"mirror: step 7 did not reach the mirror within (\d+) s \(finish; mirror_wait 300 s "
        r"cut for the time limit: the job ends in (\d+) s and the wrapper needs 12 s after the "
        r"ranks to end the job\); the mirror holds nothing yet from this run; last failure: .*"
        r"; the checkpoint directory keeps it \(" + re.escape(str(ck_dir)) + r"\) and a run "
        r"started on it with this mirror copies it"
    )
    found = re.search(line, text)
    assert found, text
    within, ends_in = int(found.group(1)), int(found.group(2))
    assert abs(within - left) <= 1.5 and abs(ends_in - 12 - left) <= 1.5, (within, ends_in, left)
    assert (ck_dir / "ckpt-0000000007.h5").exists(), list(ck_dir.iterdir())
