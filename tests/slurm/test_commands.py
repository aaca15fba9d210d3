"""The Slurm commands (hpcckpt/slurm/commands.py), run as fake commands through the
HPCCKPT_* overrides: their argument lists and how their output is read."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from hpcckpt import slurm
from hpcckpt.rundir.env import SCONTROL_ENV, SQUEUE_ENV
from hpcckpt.slurm import commands
from tests.slurm.fake_commands import fake_command


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


def test_requeue_runs_scontrol_with_an_argument_list(tmp_path):
    args_file = tmp_path / "args"
    scontrol = fake_command(tmp_path, "scontrol", f'printf "%s\\n" "$@" > {args_file}')
    slurm.requeue("4242", environ={SCONTROL_ENV: scontrol})
    assert args_file.read_text().splitlines() == ["requeue", "4242"]


def test_requeue_rejects_a_strange_job_id(tmp_path):
    scontrol = fake_command(tmp_path, "scontrol", "exit 0")
    with pytest.raises(ValueError):
        slurm.requeue("--help", environ={SCONTROL_ENV: scontrol})


def test_requeue_allowed_asks_scontrol_show_job(tmp_path):
    args_file = tmp_path / "args"
    for flag, allowed in (("0", False), ("1", True)):
        scontrol = fake_command(
            tmp_path,
            f"scontrol{flag}",
            f'printf "%s\\n" "$@" > {args_file}; echo "JobId=5 Requeue={flag} Restarts=0"',
        )
        assert commands.requeue_allowed("5", environ={SCONTROL_ENV: scontrol}) is allowed
        assert args_file.read_text().splitlines() == ["show", "job", "-o", "5"]
    silent = fake_command(tmp_path, "scontrol-silent", "exit 0")
    assert commands.requeue_allowed("5", environ={SCONTROL_ENV: silent}) is None
