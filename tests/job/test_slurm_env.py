"""hpcckpt.slurm: environment parsing and the scontrol/squeue calls (with fake commands)."""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path

import pytest

from hpcckpt import slurm
from hpcckpt.rundir.env import SCONTROL_ENV, SQUEUE_ENV


def fake_command(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


# -- environment -------------------------------------------------------------------------


def test_outside_slurm_defaults():
    env = slurm.SlurmEnv.from_environ({})
    assert env == slurm.SlurmEnv(job_id=None, restart_count=0, num_nodes=1, ntasks=None)
    assert not env.in_job


def test_inside_a_requeued_job():
    env = slurm.SlurmEnv.from_environ(
        {
            "SLURM_JOB_ID": "4242",
            "SLURM_RESTART_COUNT": "3",
            "SLURM_JOB_NUM_NODES": "8",
            "SLURM_NTASKS": "256",
        }
    )
    assert env.in_job
    assert (env.job_id, env.restart_count, env.num_nodes, env.ntasks) == ("4242", 3, 8, 256)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, 0),
        ({"SLURM_RESTART_COUNT": ""}, 0),
        ({"SLURM_RESTART_COUNT": "0"}, 0),
        ({"SLURM_RESTART_COUNT": "12"}, 12),
        ({"SLURM_RESTART_COUNT": " 2 "}, 2),
        ({"SLURM_RESTART_COUNT": "x"}, 0),
        ({"SLURM_RESTART_COUNT": "-1"}, 0),
    ],
)
def test_restart_count(environ, expected):
    assert slurm.restart_count(environ) == expected


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, 1),
        ({"SLURM_JOB_NUM_NODES": "4"}, 4),
        ({"SLURM_NNODES": "3"}, 3),
        ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "5"}, 2),
        ({"SLURM_JOB_NUM_NODES": "junk", "SLURM_NNODES": "5"}, 5),
        ({"SLURM_JOB_NUM_NODES": "0"}, 1),
    ],
)
def test_node_count(environ, expected):
    assert slurm.node_count(environ) == expected


def test_job_id_old_spelling_and_blank():
    assert slurm.job_id({"SLURM_JOBID": "77"}) == "77"
    assert slurm.job_id({"SLURM_JOB_ID": " "}) is None


@pytest.mark.parametrize("good", ["1", "123456", "123_4", "77+1"])
def test_check_job_id_accepts(good):
    assert slurm.check_job_id(good) == good


@pytest.mark.parametrize("bad", ["", "-h", "12 34", "abc", "1;rm"])
def test_check_job_id_rejects(bad):
    with pytest.raises(ValueError):
        slurm.check_job_id(bad)


# -- end time ----------------------------------------------------------------------------


def test_parse_end_time():
    assert slurm.parse_end_time("2026-11-22T04:15:00\n") == datetime(2026, 11, 22, 4, 15, 0)
    assert slurm.parse_end_time("2026-11-22T04:15:00\n2026-11-22T05:00:00\n") == datetime(
        2026, 11, 22, 4, 15
    )


@pytest.mark.parametrize("text", ["Unknown", "Unknown\n", "N/A", "NONE", "", "\n"])
def test_parse_end_time_unknown(text):
    assert slurm.parse_end_time(text) is None


def test_parse_end_time_garbage():
    with pytest.raises(ValueError, match="unexpected end time"):
        slurm.parse_end_time("tomorrow-ish")


def test_end_time_via_squeue(tmp_path):
    end = datetime.fromtimestamp(int(time.time()) + 600)
    stamp = end.strftime("%Y-%m-%dT%H:%M:%S")
    args_file = tmp_path / "args"
    squeue = fake_command(tmp_path, "squeue", f'echo "$@" > {args_file}; echo {stamp}')
    env = {SQUEUE_ENV: squeue}
    assert slurm.end_time("4242", environ=env) == end
    assert args_file.read_text().split() == ["-h", "-j", "4242", "-o", "%e"]


def test_end_time_unknown_and_garbage(tmp_path):
    env = {SQUEUE_ENV: fake_command(tmp_path, "squeue", "echo Unknown")}
    assert slurm.end_time("1", environ=env) is None
    env = {SQUEUE_ENV: fake_command(tmp_path, "squeue2", "echo soon")}
    with pytest.raises(slurm.SlurmError, match="unexpected end time"):
        slurm.end_time("1", environ=env)


# -- scontrol requeue --------------------------------------------------------------------


def test_requeue_runs_scontrol_with_an_argument_list(tmp_path):
    args_file = tmp_path / "args"
    scontrol = fake_command(tmp_path, "scontrol", f'printf "%s\\n" "$@" > {args_file}')
    slurm.requeue("4242", environ={SCONTROL_ENV: scontrol})
    assert args_file.read_text().splitlines() == ["requeue", "4242"]


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


def test_requeue_rejects_a_strange_job_id(tmp_path):
    scontrol = fake_command(tmp_path, "scontrol", "exit 0")
    with pytest.raises(ValueError):
        slurm.requeue("--help", environ={SCONTROL_ENV: scontrol})
