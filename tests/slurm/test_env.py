"""What the environment says about the Slurm job (hpcckpt/slurm/env.py)."""

from __future__ import annotations

import pytest

from hpcckpt import slurm
from hpcckpt.slurm.env import kill_on_bad_exit_set


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


def test_kill_on_bad_exit_set_only_when_the_variable_exists():
    assert kill_on_bad_exit_set({"SLURM_KILL_BAD_EXIT": "0"})
    assert not kill_on_bad_exit_set({"SLURM_JOB_ID": "1"})


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}, True),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "batch"}, False),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "extern"}, False),
        ({"SLURM_STEP_ID": "0"}, False),
        ({"SLURM_PROCID": "0"}, False),
    ],
)
def test_is_step_task(environ, expected):
    assert slurm.env.is_step_task(environ) is expected
