"""One task of a multi-node step fails: the step ends at once, not at the time limit.

Slurm's default lets the other tasks of a step run when one exits non-zero or is killed;
an MPI code's other ranks then wait in their next collective forever, and srun waits for
them until the job's time limit. ``hpcckpt srun`` passes ``--kill-on-bad-exit=1`` (unless
the user chose), so the step ends and the wrapper decides at once.
"""

from __future__ import annotations

import time

import pytest

from hpcckpt.rundir.events import read_events
from tests.job.test_node_failure_slurm import log_of
from tests.mpi_helpers import ROOT
from tests.slurm_helpers import cluster_env, follow, sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]

APP = ROOT / "tests" / "job" / "apps" / "rank_fails.py"


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_failing_task_ends_the_multinode_step_at_once(slurm_cluster_nodes, tmp_path, how):
    cluster = slurm_cluster_nodes(3)
    env = cluster_env(cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    sb = tmp_path / "fails.sbatch"
    sb.write_text(
        "#!/bin/bash\n"
        f"exec hpcckpt srun --ckpt-dir {ckpt} --min-progress 3600 -- --mpi=pmix "
        f"python {APP} {ckpt} 1 {how}\n"
    )
    sb.chmod(0o755)
    t0 = time.monotonic()
    job = sbatch(["-N", "3", "-n", "3", "--time=10", f"--output={log}", str(sb)], env,
                 cwd=str(ROOT))  # fmt: skip
    info = follow(job, env, timeout=240)  # the time limit is 600 s: a hang fails here
    took = time.monotonic() - t0
    text = log_of(log)
    assert "--kill-on-bad-exit=1 --mpi=pmix" in text, text  # the "started step" line
    assert f"rank 1: failing ({how})" in text, text
    assert info["JobState"] == "FAILED", (info, text)
    assert "step crashed" in text, text
    events = [e["event"] for e in read_events(ckpt)]
    assert "give_up" in events, events  # no checkpoint yet: the wrapper gave up at once
    print(f"{how}: the job ended {took:.0f} s after sbatch")
