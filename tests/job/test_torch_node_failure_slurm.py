"""A node failure under ``hpcckpt srun -- torchrun --nnodes=2`` (DDP, gloo, CPU) on the
local 2-node Slurm, launched by ``sbatch-templates/torchrun.sbatch`` as users launch it.

Once the checkpoint of step 49 is committed, n2 "loses power" (``LocalCluster.fail_node``:
its slurmd, slurmstepd, torchrun agent and worker SIGKILLed). The worker on n1 loses its
gloo peer and fails, its agent (no restarts left) exits; about 25-30 s later Slurm
declares n2 down, cancels the job and requeues it by itself (``--requeue``); the wrapper
records the node failure and does not requeue again. The next run resumes at step 49
and ends bit-identical to an uninterrupted torchrun run outside Slurm.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import pytest

from hpcckpt.rundir.events import read_events
from hpcckpt.slurm import templates
from tests.job.test_node_failure_slurm import checkpoint_at, log_of
from tests.job.test_torch_launch_slurm import (  # noqa: F401 (reference: a fixture)
    EVERY,
    TRAIN,
    check_resumed_bit_identically,
    reference,
)
from tests.mpi_helpers import ROOT
from tests.slurm_helpers import cluster_env, follow, sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_torchrun_node_fails_slurm_requeues_and_training_resumes(
    slurm_cluster_nodes,
    tmp_path: Path,
    reference: dict,  # noqa: F811
) -> None:
    node_failure_job(slurm_cluster_nodes, tmp_path, reference)


def node_failure_job(
    slurm_cluster_nodes,
    tmp_path: Path,
    ref: dict,
    **settings: str,
) -> str:
    """The job of the test above (``settings``: more of the template's ``NAME=`` lines);
    its log."""
    cluster = slurm_cluster_nodes(2)
    env = cluster_env(cluster)
    env["MASTER_ADDR"] = "127.0.0.1"  # every node of the local cluster is this machine
    ckpt, log, out = tmp_path / "ckpt", tmp_path / "job.out", tmp_path / "resumed.json"
    script = tmp_path / "torchrun.sbatch"
    app = ["python", *TRAIN.split(), "--first-run-sleep", "0.5", "--out", str(out)]
    script.write_text(
        templates.render(
            templates.find("torchrun").read_text(),
            # The limit is never reached: the node failure is the only stop.
            sbatch={"time": "10", "signal": "B:USR1@55", "cpus-per-task": "1", "output": str(log)},
            settings={
                "HPCCKPT_DIR": shlex.quote(str(ckpt)),
                "STOP_SIGNAL": "USR1",
                "APP": templates.bash_array(app),
                **settings,
            },
        )  # fmt: skip
    )
    job = sbatch([str(script)], env, cwd=str(ROOT))
    try:
        # The first run sleeps 0.5 s per step: the next checkpoint (step 99) is 25 s away.
        checkpoint_at(ckpt, EVERY - 1, job, env)
        t = time.monotonic()
        cluster.fail_node("n2", timeout=90)
        seen_down = time.monotonic() - t
        cluster.restore_node("n2", timeout=60)  # the requeued job needs both nodes
        info = follow(job, env, timeout=400)
    finally:
        cluster.restore_node("n2", timeout=60)
    text = log_of(log)
    check_resumed_bit_identically(info, text, out, ckpt, ref, resumed_at=EVERY - 1)
    assert int(info["Restarts"]) == 1, text
    evs = list(read_events(ckpt))
    nf = [(e["node"], e["action"]) for e in evs if e["event"] == "node_failure"]
    assert nf == [("n2", "requeued_by_slurm")], (nf, text[-5000:])
    requeues = [(e["cause"], e.get("by")) for e in evs if e["event"] == "requeue"]
    assert requeues == [("node_failure", "slurm")], (requeues, text[-5000:])
    assert not any(e["event"] in ("requeue_failed", "give_up", "stop") for e in evs), text
    assert "Node failure on n2" in text, text[-5000:]
    print(f"n2 down after {seen_down:.0f} s")
    print("\n".join(ln for ln in text.splitlines() if ln.startswith(("hpcckpt", "slurmstepd"))))
    return text
