"""An FSDP2 training (tests/coord/apps/teardown_app.py: ``fully_shard`` over gloo, staged
saves, ``finish()`` then ``destroy_process_group()``, the interpreter's own exit) as a
real batch job on the local Slurm under ``hpcckpt srun``, beside another MPI job: the job
ends COMPLETED with exit code 0:0, never requeued. An abort at the ranks' exit would make
the step fail and the wrapper requeue the job.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.rundir.events import read_events
from tests.coord.test_teardown_mpi import LOAD
from tests.mpi_helpers import ROOT, mpi_env, mpirun_cmd
from tests.slurm_helpers import cluster_env, follow, sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

APP = ROOT / "tests" / "coord" / "apps" / "teardown_app.py"
VENV_BIN = str(Path(sys.executable).parent)


def test_an_fsdp_job_under_the_wrapper_completes(slurm_cluster, tmp_path):
    env = cluster_env(slurm_cluster)
    ckpt, joblog, stop = tmp_path / "ckpt", tmp_path / "job.out", tmp_path / "stop-load"
    app = [sys.executable, APP, ckpt, "--steps", "6", "--every", "2", "--async-save"]
    wrapper = [f"{VENV_BIN}/hpcckpt", "srun", "--ckpt-dir", ckpt, "--", "--mpi=pmix", "-n", "2",
               *app]  # fmt: skip
    script = tmp_path / "job.sbatch"
    wrapper_line = shlex.join(map(str, wrapper))
    script.write_text(f"#!/bin/bash\ntrap '' USR1 USR2\nexec {wrapper_line}\n")
    load = subprocess.Popen(
        mpirun_cmd(2, ["-c", LOAD, stop]),
        env=mpi_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        job = sbatch(["--time=10", "-n", "2", "--requeue", "--open-mode=append",
                      f"--output={joblog}", script], env, cwd=str(tmp_path))  # fmt: skip
        info = follow(job, env, timeout=600)
    finally:
        stop.touch()
        try:
            load.wait(timeout=60)
        except subprocess.TimeoutExpired:
            load.kill()
    text = joblog.read_text(errors="replace") if joblog.exists() else "(no log)"
    assert info["JobState"] == "COMPLETED", text[-4000:]
    assert info["ExitCode"] == "0:0" and int(info["Restarts"]) == 0, (info, text[-4000:])
    assert "terminate called" not in text, text[-4000:]
    assert all((ckpt / f"done-{r}").exists() for r in (0, 1)), text[-4000:]
    assert any(e["event"] == "finish" for e in read_events(ckpt))
