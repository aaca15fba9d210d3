"""Continuing as a new job (hpcckpt/slurm/chain.py): what is submitted again."""

from __future__ import annotations

import pytest

from hpcckpt.rundir.env import SCONTROL_ENV
from hpcckpt.slurm import chain


def test_chain_spec_from_the_environment(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n")
    env = {
        chain.CHAIN_SCRIPT_ENV: str(script),
        chain.CHAIN_ARGS_ENV: "'a b' c",
        chain.SBATCH_ARGS_ENV: "--qos=long --dependency=afterok:1 --time=5",
        "HPCCKPT_CHAIN_COUNT": "3",
        "SLURM_JOB_ID": "77",
        "SLURM_RESTART_COUNT": "1",
        "SLURM_CONF": "/etc/slurm.conf",
        "HPCCKPT_ATTEMPT": "x",
    }
    spec = chain.find_spec("77", env)
    assert spec.script_args == ["a b", "c"] and spec.sbatch_args == ["--qos=long", "--time=5"]
    argv = chain.submit_argv(spec, "77")
    assert argv[0] == "--dependency=afterany:77" and argv[-3:] == [str(script), "a b", "c"]
    nxt = chain.next_environment(env, ckpt_dir="/ck", next_count=4, sbatch_args=spec.sbatch_args)
    assert "SLURM_JOB_ID" not in nxt and "SLURM_RESTART_COUNT" not in nxt
    assert nxt["SLURM_CONF"] == "/etc/slurm.conf" and "HPCCKPT_ATTEMPT" not in nxt
    assert nxt["HPCCKPT_CHAIN_COUNT"] == "4" and nxt["HPCCKPT_DIR"] == "/ck"


def test_chain_without_script_or_scontrol_fails_clearly(tmp_path):
    env = {SCONTROL_ENV: str(tmp_path / "missing")}
    with pytest.raises(chain.ChainError, match="HPCCKPT_CHAIN_SCRIPT"):
        chain.find_spec("77", env)
