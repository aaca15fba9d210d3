"""The wrapper's stop sources (hpcckpt/job/stops.py), through a real wrapper process."""

from __future__ import annotations

import sys
import time
from datetime import datetime

from hpcckpt.rundir.events import read_events
from tests.job.test_appmode import WRITER
from tests.job.test_wrapper import Wrapped, clean_env, fake


def test_the_end_time_is_read_once_for_the_interval_and_the_end_time_stop(tmp_path):
    """HPCCKPT_INTERVAL is fitted to the end time read before the step starts; the
    end-time stop is planned from that same reading: a busy controller is asked once."""
    ckpt, work = tmp_path / "ck", tmp_path / "work"
    work.mkdir()
    calls = tmp_path / "squeue.calls"
    end = datetime.fromtimestamp(int(time.time()) + 3600).strftime("%Y-%m-%dT%H:%M:%S")
    squeue = fake(tmp_path, "squeue", f'echo "$@" >> {calls}\necho {end}')
    scontrol = fake(tmp_path, "scontrol", "exit 0")
    env = clean_env(SLURM_JOB_ID="700", HPCCKPT_SQUEUE=squeue, HPCCKPT_SCONTROL=scontrol)
    cmd = [sys.executable, "-c", WRITER, str(work), "100"]
    w = Wrapped(ckpt, cmd, "--app-signal", "USR2", "--app-ready", "0", "--restart-files",
                str(work / "state"), "--ckpt-every", "60", env=env)  # fmt: skip
    assert w.wait() == 0, w.stderr
    w.wait_line("end-time stop armed")
    assert len(calls.read_text().splitlines()) == 1, calls.read_text()
    assert [e["event"] for e in read_events(ckpt)][-1] == "finished"
