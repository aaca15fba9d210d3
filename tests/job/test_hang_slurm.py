"""Hang detection on the local Slurm cluster: a rank that sleeps forever in
the middle of the run is killed after --hang-timeout, the job is requeued and finishes
bit-identical to an uninterrupted run. Fails (never skips) when Slurm cannot run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpcckpt.rundir.events import read_events
from tests.job.test_wrapper_slurm import log_of, write_script
from tests.mpi_helpers import ROOT, mpirun
from tests.slurm_helpers import cluster_env, follow, sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.mpi]

GUARD_APP = Path(__file__).resolve().parent / "apps" / "guard_app.py"
APP_ARGS = ["--steps", "60", "--every", "10"]


@pytest.mark.mpi
def test_hung_rank_is_killed_requeued_and_the_run_finishes_bit_identical(slurm_cluster, tmp_path):
    ref = tmp_path / "reference.npy"
    r = mpirun(2, [GUARD_APP, *APP_ARGS, "--ckpt-dir", tmp_path / "ref", "--out", ref])
    assert r.returncode == 0, r.stderr
    env = cluster_env(slurm_cluster)
    ckpt, log, marker = tmp_path / "ckpt", tmp_path / "job.out", tmp_path / "hung-once"
    app = " ".join(map(str, [GUARD_APP, *APP_ARGS, "--sleep", "0.1", "--hang-at", "25",
                             "--marker", marker, "--out", tmp_path / "out.npy"]))  # fmt: skip
    script = write_script(
        tmp_path / "hang.sbatch",
        f"exec hpcckpt srun --ckpt-dir {ckpt} --hang-timeout 10 --min-progress 3600 "
        f"-- --mpi=pmix python {app}\n",
    )
    job = sbatch(["--time=5", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(ROOT))  # fmt: skip
    info = follow(job, env, timeout=400)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED", text
    assert int(info["Restarts"]) == 1, text
    assert marker.exists(), text
    evs = list(read_events(ckpt))
    (hung,) = [e for e in evs if e["event"] == "hang"]
    assert hung["restart"] == 0 and 1 in hung["ranks"], text
    assert min(hung["seconds_silent"]) >= 10, text
    assert "hang: rank" in text and "taking the step" in text, text
    crashed = [e for e in evs if e["event"] == "crashed"]
    assert len(crashed) == 1 and crashed[0]["reason"].startswith("hang: "), text
    assert [e["cause"] for e in evs if e["event"] == "requeue"] == ["crash"], text
    restored = [e["step"] for e in evs if e["event"] == "restore" and e.get("restart") == 1]
    assert restored == [19], text
    assert np.load(tmp_path / "out.npy").tobytes() == np.load(ref).tobytes()
