"""Is the stop signal early enough for a checkpoint? (hpcckpt/job/leadtime.py)"""

from __future__ import annotations

import shlex
import signal
import time
from datetime import datetime

from hpcckpt.job import leadtime
from hpcckpt.rundir.events import append_event, read_events
from tests.job.test_wrapper import Wrapped, app, clean_env, fake, wait_state


def test_lead_time_check():
    evs = [{"event": "checkpoint", "seconds": 30.0}, {"event": "checkpoint", "seconds": 10.0}]
    cost = leadtime.measured_cost(evs)
    assert cost == 30.0
    check = leadtime.check_lead(cost, lead=40)
    assert check.too_short and check.needed == 65 and check.suggested == 70
    assert "--signal=B:USR1@70" in leadtime.warning_text(check, "USR1")
    assert not leadtime.check_lead(cost, lead=600).too_short


def test_lead_time_warning_in_the_job_log(tmp_path):
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    append_event(ckpt, "checkpoint", seconds=40.0, step=3)
    end = datetime.fromtimestamp(int(time.time()) + 30).strftime("%Y-%m-%dT%H:%M:%S")
    squeue = fake(tmp_path, "squeue", f"echo {shlex.quote(end)}")
    scontrol = fake(tmp_path, "scontrol", "exit 0")
    env = clean_env(SLURM_JOB_ID="700", HPCCKPT_SQUEUE=squeue, HPCCKPT_SCONTROL=scontrol)
    w = Wrapped(ckpt, app("stop"), env=env)
    wait_state(ckpt, "running")
    w.send(signal.SIGUSR1)
    assert w.wait() == 0, w.stderr
    assert "--signal=B:USR1@80" in w.wait_line("warning: the stop signal came")
    warn = [e for e in read_events(ckpt) if e["event"] == "lead_time_warning"]
    assert warn and warn[0]["suggested_signal"] == "B:USR1@80"


def test_no_lead_time_warning_for_a_cancelled_job(tmp_path):
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    append_event(ckpt, "checkpoint", seconds=40.0, step=3)
    end = datetime.fromtimestamp(int(time.time())).strftime("%Y-%m-%dT%H:%M:%S")
    squeue = fake(tmp_path, "squeue", f"echo {shlex.quote(end)}")
    scontrol = fake(tmp_path, "scontrol", "echo JobId=700 JobState=COMPLETING Reason=None")
    env = clean_env(SLURM_JOB_ID="700", HPCCKPT_SQUEUE=squeue, HPCCKPT_SCONTROL=scontrol)
    w = Wrapped(ckpt, app("stop"), env=env)
    wait_state(ckpt, "running")
    w.send(signal.SIGUSR1)
    w.wait()
    assert "the stop signal came" not in w.stderr
    assert not [e for e in read_events(ckpt) if e["event"] == "lead_time_warning"]
