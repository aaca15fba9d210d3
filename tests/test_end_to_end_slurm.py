"""The mission end to end on the local Slurm: signalled, checkpointed, requeued, resumed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.rundir.events import read_events
from tests.mpi_helpers import EXAMPLES, mpirun
from tests.slurm_helpers import follow, sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

# 45 s of work against a 1-minute limit: USR1@55 arrives 5-35 s in (the controller checks
# about every 30 s), so the first run is always cut short and requeued.
HEAT = ["--nx", "64", "--ny", "64", "--steps", "450"]
SLOW = ["--sleep", "0.1"]


def test_time_limit_signal_checkpoint_requeue_resume(slurm_cluster, tmp_path):
    ref = tmp_path / "reference.npy"
    r = mpirun(2, [EXAMPLES / "heat2d.py", *HEAT, "--ckpt-dir", tmp_path / "ref", "--out", ref])
    assert r.returncode == 0, r.stderr

    env = dict(os.environ, **slurm_cluster.env())
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    ckpt, out, log = tmp_path / "ckpt", tmp_path / "resumed.npy", tmp_path / "job.out"
    job = sbatch(
        [
            "--time=1",
            "--signal=B:USR1@55",
            f"--output={log}",
            f"--export=ALL,HPCCKPT_DIR={ckpt}",
            EXAMPLES / "heat2d.sbatch",
            *HEAT,
            *SLOW,
            "--out",
            out,
        ],
        env,
        cwd=str(tmp_path),  # any directory: the script finds heat2d.py next to itself
    )
    info = follow(job, env, timeout=600)
    text = log.read_text() if log.exists() else "(no log)"
    assert info["JobState"] == "COMPLETED", text
    assert int(info["Restarts"]) >= 1, f"the job was never requeued:\n{text}"

    events = list(read_events(ckpt))
    kinds = [e["event"] for e in events]
    assert "requeue" in kinds and "stop" in kinds and "finish" in kinds, kinds
    restored = [e["step"] for e in events if e["event"] == "restore" and e.get("step") is not None]
    assert restored, "a requeued run must restore from its checkpoint"
    assert np.load(out).tobytes() == np.load(ref).tobytes(), (
        "resumed result differs from the reference"
    )
