"""The node-local fast tier under Slurm: a rank killed in the middle of a background drain.

heat2d runs under the wrapper with ``HPCCKPT_CACHE=/dev/shm/...``: every save goes to
the node-local tier and drains to the checkpoint directory in the background. Rank 1
is killed (``HPCCKPT_FAULT=drain.writing``) while the checkpoint of step 49 drains; the
wrapper requeues the job, which lands on the same (only) node, finds every rank's part
of step 49 there, whole and verified, resumes from it (``tier: "cache"``) instead of
step 39, drains it to the directory, and finishes bit-identical to an uninterrupted
run; ``finish()`` frees /dev/shm.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from hpcckpt.rundir.events import read_events
from hpcckpt.store.file import layout
from tests.job.test_wrapper_slurm import heat_reference, heat_script, log_of
from tests.mpi_helpers import ROOT
from tests.slurm_helpers import cluster_env, follow, sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.mpi]


def test_killed_mid_drain_resumes_from_the_node_local_copy(slurm_cluster, tmp_path):
    steps = 120
    reference = heat_reference(tmp_path, steps)
    env = cluster_env(slurm_cluster)
    cache_root = f"/dev/shm/hpcckpt-test-{tmp_path.name}"
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    script = heat_script(tmp_path, f"--ckpt-dir {ckpt} --min-progress 3600", steps)
    body = script.read_text().replace(
        "exec hpcckpt",
        f'export HPCCKPT_CACHE="{cache_root}-$SLURM_JOB_ID"\n'
        # only the first run: the run after the requeue drains step 49 again
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then export HPCCKPT_FAULT=drain.writing:1:49; fi\n'
        "exec hpcckpt",
        1,
    )
    script.write_text(body)
    job = sbatch(["--time=5", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(ROOT))  # fmt: skip
    try:
        info = follow(job, env, timeout=300)
        cache_left = os.path.exists(f"{cache_root}-{job}")
    finally:
        shutil.rmtree(f"{cache_root}-{job}", ignore_errors=True)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED", text
    assert int(info["Restarts"]) == 1, text
    assert "injected fault drain.writing (step 49)" in text, text
    evs = list(read_events(ckpt))
    assert [e["cause"] for e in evs if e["event"] == "requeue"] == ["crash"], text
    restores = [e for e in evs if e["event"] == "restore" and e.get("restart") == 1]
    assert restores and restores[0]["step"] == 49 and restores[0]["tier"] == "cache", restores
    staged = [e for e in evs if e["event"] == "checkpoint_staged"]
    assert staged and all(e["staging"] == "cache" for e in staged)
    assert np.load(tmp_path / "out.npy").tobytes() == reference.tobytes()
    # Step 49 reached the directory by the drain after the restore; finish() removed
    # the node-local copies.
    redrain = [e for e in evs if e["event"] == "checkpoint" and e.get("reason") == "restored"]
    assert [e["step"] for e in redrain] == [49], redrain
    steps_on_disk = [e.step for e in layout.scan(ckpt)]
    assert max(steps_on_disk) == steps - 1, steps_on_disk
    assert not cache_left, "finish() leaves no node-local copy behind"
