"""DDP and FSDP2 training (gloo, CPU, no MPI) through hpcckpt's Checkpointer on the local
2-node Slurm, launched as PyTorch users launch it, by the templates that show it:
``hpcckpt srun -- torchrun --nnodes=2 ...`` (``sbatch-templates/torchrun.sbatch``) and
``hpcckpt srun -- python train.py``, ranks from ``SLURM_*`` (``srun-torch.sbatch``).

Slurm's time-limit warning (``--signal=B:USR1@55``) or a worker's crash stops the first
run; the checkpoint commits, the job is requeued and resumes; every step's loss on both
ranks, the parameters and AdamW's moments (gathered whole and each rank's shards), each
rank's random generators and data position are bit-identical to an uninterrupted torchrun
run outside Slurm.
The first run sleeps 0.5 s per step (only the first: no number changes), so the warning
always finds it training; once the job was requeued the test raises its limit to 10
minutes, so the second run finishes.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.rundir.events import read_events
from hpcckpt.slurm import templates
from tests.job.test_elastic_slurm import forwarded_line
from tests.job.test_node_failure_slurm import log_of
from tests.mpi_helpers import ROOT
from tests.slurm_helpers import cluster_env, follow, sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

APP = ROOT / "tests" / "job" / "apps" / "torch_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS, EVERY = 120, 50
TRAIN = f"{APP} --steps {STEPS} --every {EVERY}"


def torchrun_reference(root: Path, *extra: str) -> dict:
    """The uninterrupted run: torchrun, 2 workers, outside Slurm."""
    if not TORCHRUN.exists():
        pytest.fail(f"{TORCHRUN} not found: install torch (make setup does)")
    r = subprocess.run(
        [str(TORCHRUN), "--nproc-per-node=2", *TRAIN.split(), *extra, "--ckpt-dir",
         str(root / "ck"), "--out", str(root / "ref.json")],
        env=cluster_env_free(), capture_output=True, text=True, timeout=300, cwd=str(root),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((root / "ref.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted DDP run."""
    return torchrun_reference(tmp_path_factory.mktemp("torch-ref"))


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory) -> dict:
    """The uninterrupted FSDP2 run."""
    return torchrun_reference(tmp_path_factory.mktemp("fsdp-ref"), "--fsdp")


def cluster_env_free() -> dict[str, str]:
    """Our environment outside Slurm, the checkout on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCCKPT_"))}
    env["PYTHONPATH"] = str(ROOT)
    return env


def run_job(
    slurm_cluster_nodes,
    tmp_path: Path,
    template: str,
    app: tuple[str, ...] = ("--first-run-sleep", "0.5"),
    time: str = "1",
    **settings: str,
) -> tuple[dict, str, Path]:
    """Submit ``sbatch-templates/TEMPLATE.sbatch`` as ``hpcckpt submit`` renders it (one
    CPU per task, a ``time``-minute limit, USR1 55 s before it), training TRAIN (and
    ``app``) on 2 nodes; ``settings``: more of the template's ``NAME=`` lines."""
    cluster = slurm_cluster_nodes(2)
    env = cluster_env(cluster)
    env["MASTER_ADDR"] = "127.0.0.1"  # every node of the local cluster is this machine
    ckpt, log, out = tmp_path / "ckpt", tmp_path / "job.out", tmp_path / "resumed.json"
    script = tmp_path / f"{template}.sbatch"
    script.write_text(
        templates.render(
            templates.find(template).read_text(),
            sbatch={"time": time, "signal": "B:USR1@55", "cpus-per-task": "1", "output": str(log)},
            settings={
                "HPCCKPT_DIR": shlex.quote(str(ckpt)),
                "STOP_SIGNAL": "USR1",
                "APP": templates.bash_array(["python", *TRAIN.split(), *app, "--out", str(out)]),
                **settings,
            },
        )  # fmt: skip
    )
    job = sbatch([str(script)], env, cwd=str(ROOT))
    raised: list[bool] = []

    def raise_the_limit_once_requeued(info: dict[str, str]) -> None:
        if not raised and int(info.get("Restarts", "0")) >= 1:
            raised.append(True)
            subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"], env=env,
                           capture_output=True, timeout=30)  # fmt: skip

    info = follow(job, env, timeout=600, on_poll=raise_the_limit_once_requeued)
    return info, log_of(log), out


def check_resumed_bit_identically(
    info: dict, text: str, out: Path, ckpt: Path, ref: dict, resumed_at: int | None = None
):
    """Requeued after a stop (``resumed_at`` None: at the stop's step) and finished, every
    number as in the uninterrupted run."""
    assert info["JobState"] == "COMPLETED", (info, text[-5000:])
    events = list(read_events(ckpt))
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "finished", kinds
    if resumed_at is None:
        assert int(info["Restarts"]) >= 1, f"never requeued:\n{text[-5000:]}"
        assert "stop" in kinds and "requeue" in kinds, kinds
        resumed_at = [e["step"] for e in events if e["event"] == "stop"][-1]
    got = json.loads(out.read_text())
    assert got["resumed_at"] == resumed_at, (got["resumed_at"], resumed_at)
    assert [len(h) for h in got["losses"]] == [STEPS, STEPS]
    assert got["losses"] == ref["losses"]  # every step, both ranks, bit for bit
    assert got["params"] == ref["params"]
    assert got["each_moment"] == ref["each_moment"]  # which, if one differs
    assert got["moments"] == ref["moments"]
    assert got["local"] == ref["local"]  # each rank's parameters and moments (its shards)
    assert got["rng"] == ref["rng"]  # each rank's torch, numpy and Python generators
    assert got["data"] == ref["data"]  # each rank's sampler: epoch and position
    return got


def test_torchrun_two_nodes_time_limit_checkpoint_requeue_resume(
    slurm_cluster_nodes, tmp_path, reference
):
    info, text, out = run_job(slurm_cluster_nodes, tmp_path, "torchrun")
    got = check_resumed_bit_identically(info, text, out, tmp_path / "ckpt", reference)
    assert got["launched_by"] == "torchrun"
    line = forwarded_line(text)
    assert "by a signaller on every node (n1: rank " in line and "; n2: rank " in line, line
    print("\n".join(ln for ln in text.splitlines() if ln.startswith(("hpcckpt", "slurmstepd"))))


def test_srun_launched_ranks_time_limit_checkpoint_requeue_resume(
    slurm_cluster_nodes, tmp_path, reference
):
    info, text, out = run_job(slurm_cluster_nodes, tmp_path, "srun-torch")
    got = check_resumed_bit_identically(info, text, out, tmp_path / "ckpt", reference)
    assert got["launched_by"] == "srun"
    line = forwarded_line(text)
    assert "forwarded to step (pid" in line, line  # USR1 to srun: it forwards to its tasks


@pytest.mark.parametrize("max_restarts", [0, 1])
def test_torchrun_worker_crash_torchrun_restarts_or_hpcckpt_requeues(
    slurm_cluster_nodes, tmp_path, reference, max_restarts
):
    """Rank 1 dies at step 60 (the last checkpoint: step 49). With torchrun restarts left
    torchrun restarts both workers inside the run; without, the agent exits non-zero, srun
    ends the step and the wrapper requeues (a crash with progress, within its budget).
    Either way the training resumes at step 49 and ends bit-identical. Should torchrun's
    restart itself fail (its workers' gloo connect: it hung until the 8-minute limit in 3
    of 4 runs here before the template gave each restart a rendezvous store of its own,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE), its restarts are spent and the wrapper requeues,
    as it does without them."""
    info, text, out = run_job(slurm_cluster_nodes, tmp_path, "torchrun",
                              app=("--crash-at", "60", "1"), time="8",
                              MAX_RESTARTS=str(max_restarts))  # fmt: skip
    check_resumed_bit_identically(info, text, out, tmp_path / "ckpt", reference, resumed_at=49)
    assert "rank 1: crashing at step 60" in text, text
    requeues = [e for e in read_events(tmp_path / "ckpt") if e["event"] == "requeue"]
    if max_restarts and not requeues:  # torchrun's restart came through: no requeue
        assert "failed (exitcode: 3)" in text, text  # torchrun saw the crash, restarted
        assert int(info["Restarts"]) == 0, info
    elif max_restarts:  # torchrun restarted the workers, which failed again: hpcckpt acts
        assert "failed (exitcode: 3)" in text, text
        # failed, not hung until the limit (a restart reading the old rendezvous store)
        assert "DUE TO TIME LIMIT" not in text, text[-5000:]
        assert [e["cause"] for e in requeues] == ["crash"], requeues
    else:
        assert int(info["Restarts"]) == 1, (info, text[-5000:])
        assert [e["cause"] for e in requeues] == ["crash"], requeues
        assert "torchrun restarted its workers" not in text


def test_fsdp2_torchrun_two_nodes_time_limit_checkpoint_requeue_resume(
    slurm_cluster_nodes, tmp_path, fsdp_reference
):
    """FSDP2 (``fully_shard``: DTensor parameters and moments, each rank its rows) under
    the torchrun template: the warning stops it, each rank writes its own shards, the
    requeued run restores them into an optimizer that has not stepped yet."""
    info, text, out = run_job(slurm_cluster_nodes, tmp_path, "torchrun",
                              app=("--fsdp", "--first-run-sleep", "0.5"))  # fmt: skip
    got = check_resumed_bit_identically(info, text, out, tmp_path / "ckpt", fsdp_reference)
    assert got["launched_by"] == "torchrun"
    assert got["local"][0] != got["local"][1]  # sharded, not replicated
    line = forwarded_line(text)
    assert "by a signaller on every node (n1: rank " in line and "; n2: rank " in line, line


def test_fsdp2_srun_launched_ranks_worker_crash_requeue_resume(
    slurm_cluster_nodes, tmp_path, fsdp_reference
):
    """FSDP2 under the srun-torch template: rank 1 dies at step 60 (the last checkpoint:
    step 49); srun ends the step (``--kill-on-bad-exit``), the wrapper requeues (a crash
    with progress) and the training resumes at step 49, bit-identical."""
    info, text, out = run_job(slurm_cluster_nodes, tmp_path, "srun-torch",
                              app=("--fsdp", "--crash-at", "60", "1"), time="8")  # fmt: skip
    got = check_resumed_bit_identically(
        info, text, out, tmp_path / "ckpt", fsdp_reference, resumed_at=49
    )
    assert got["launched_by"] == "srun"
    assert "rank 1: crashing at step 60" in text, text
    assert int(info["Restarts"]) == 1, (info, text[-5000:])
    requeues = [e for e in read_events(tmp_path / "ckpt") if e["event"] == "requeue"]
    assert [e["cause"] for e in requeues] == ["crash"], requeues
