"""Slurm's output parsed (hpcckpt/slurm/parse.py)."""

from __future__ import annotations

from datetime import datetime

import pytest

from hpcckpt import slurm
from hpcckpt import slurm as nodes
from hpcckpt.slurm import chain, parse

SHOW = (
    "JobId=77 JobName=sim Restarts=0 TimeLimit=00:30:00 Partition=debug NumNodes=2 "
    "NumTasks=8 Command=/home/u/run.sbatch a b WorkDir=/home/u StdOut=/home/u/o.txt Power="
)


def test_parse_show_job_keeps_command_with_spaces():
    info = slurm.parse_show_job(SHOW)
    assert info["Command"] == "/home/u/run.sbatch a b"
    assert info["WorkDir"] == "/home/u" and info["NumTasks"] == "8"
    assert chain.carried_options(info) == [
        "--job-name=sim", "--time=00:30:00", "--nodes=2", "--ntasks=8", "--partition=debug",
        "--chdir=/home/u",
    ]  # fmt: skip


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


def test_failed_states():
    assert all(map(nodes.is_failed, ["down*", "down", "idle*", "fail", "down+drain"]))
    assert not any(map(nodes.is_failed, ["idle", "mixed", "allocated", "completing", ""]))
    assert nodes.parse_sinfo("n1 mixed\nn2 down*\n") == {"n1": "mixed", "n2": "down*"}


@pytest.mark.parametrize(
    ("state", "reason", "cancelled"),
    [
        ("CANCELLED", "None", True),
        ("COMPLETING", "None", True),
        ("COMPLETING", "", True),
        ("COMPLETING", "TimeLimit", False),
        ("RUNNING", "None", False),
        ("TIMEOUT", "TimeLimit", False),
    ],
)
def test_is_cancelled(state, reason, cancelled):
    assert slurm.parse.is_cancelled({"JobState": state, "Reason": reason}) is cancelled


@pytest.mark.parametrize(
    ("fields", "allowed"),
    [({"Requeue": "1"}, True), ({"Requeue": "0"}, False), ({}, None), ({"Requeue": "?"}, None)],
)
def test_requeue_allowed(fields, allowed):
    assert parse.requeue_allowed({"JobId": "7", **fields}) is allowed


def test_config_seconds_reads_killwait_from_scontrol_show_config():
    text = "Configuration data as of 2026-11-26T05:00:00\nInactiveLimit           = 0 sec\n"
    text += "KillWait                = 30 sec\nKillOnBadExit           = 0\n"
    assert parse.config_seconds(text, "KillWait") == 30.0
    assert parse.config_seconds(text, "MessageTimeout") is None
    assert parse.config_seconds("KillWait = (null)\n", "KillWait") is None
