"""The one Slurm command runner (hpcckpt/slurm/runner.py): job ids, missing, failing and
hanging commands (fake commands through the HPCCKPT_* overrides)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hpcckpt import slurm
from hpcckpt.rundir.env import SCONTROL_ENV
from tests.slurm.fake_commands import fake_command


@pytest.mark.parametrize("good", ["1", "123456", "123_4", "77+1"])
def test_check_job_id_accepts(good):
    assert slurm.check_job_id(good) == good


@pytest.mark.parametrize("bad", ["", "-h", "12 34", "abc", "1;rm"])
def test_check_job_id_rejects(bad):
    with pytest.raises(ValueError):
        slurm.check_job_id(bad)


def test_requeue_missing_scontrol(tmp_path):
    env = {SCONTROL_ENV: str(tmp_path / "no-such-scontrol")}
    with pytest.raises(slurm.SlurmCommandNotFound, match="not found.*HPCCKPT_SCONTROL"):
        slurm.requeue("1", environ=env)


def test_requeue_not_executable(tmp_path):
    path = tmp_path / "scontrol"
    path.write_text("#!/bin/sh\n")
    path.chmod(0o644)
    if os.access(path, os.X_OK):  # pragma: no cover - root on some file systems
        pytest.skip("this user can execute a 0644 file here")
    with pytest.raises(slurm.SlurmCommandNotFound, match="cannot be executed"):
        slurm.requeue("1", environ={SCONTROL_ENV: str(path)})


def test_requeue_failing_scontrol_reports_stderr(tmp_path):
    scontrol = fake_command(
        tmp_path,
        "scontrol",
        'echo "Requested operation is presently disabled for job 1" >&2; exit 1',
    )
    with pytest.raises(slurm.SlurmCommandFailed, match="presently disabled") as info:
        slurm.requeue("1", environ={SCONTROL_ENV: scontrol})
    assert info.value.returncode == 1
    assert "exit status 1" in str(info.value)


def test_requeue_hanging_scontrol_times_out_and_is_killed(tmp_path):
    # The sleep is a grandchild holding our pipes open: it must be killed with the script.
    pidfile = tmp_path / "pid"
    scontrol = fake_command(tmp_path, "scontrol", f"sleep 30 & echo $! > {pidfile}; wait")
    t0 = time.monotonic()
    with pytest.raises(slurm.SlurmCommandTimeout, match=r"did not finish within 0\.5 s"):
        slurm.requeue("1", timeout=0.5, environ={SCONTROL_ENV: scontrol})
    assert time.monotonic() - t0 < 5
    sleeper = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{sleeper}").exists() and time.monotonic() < deadline:
        stat = Path(f"/proc/{sleeper}/stat").read_text(errors="replace")
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    else:
        assert not Path(f"/proc/{sleeper}").exists()
