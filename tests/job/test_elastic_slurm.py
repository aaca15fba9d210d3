"""``hpcckpt srun -- torchrun --nnodes=2`` on the local 2-node Slurm: the stop reaches
every worker on both nodes (never an agent), the job is requeued and finishes.

The application is the torchrun stand-in of ``tests/job/apps/elastic_app.py`` (the
wrapper's contract, no torch.distributed): what is tested is the launch, the signal's way
to each node's workers and the requeue. The stop is the batch shell's USR1, as Slurm's
``--signal=B:USR1@...`` sends it (``scancel --batch --signal=USR1``, at once rather than at
a time limit's whim).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcckpt.rundir.events import read_events
from hpcckpt.rundir.status import RUNNING, read_status
from tests.job.test_node_failure_slurm import log_of
from tests.mpi_helpers import ROOT
from tests.slurm_helpers import cluster_env, follow, sbatch

pytestmark = [pytest.mark.slurm]

APP = ROOT / "tests" / "job" / "apps" / "elastic_app.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_script(path: Path, ckpt: Path, program: str) -> Path:
    """A batch script: ``hpcckpt srun -- torchrun --nnodes=2 ... PROGRAM``, one agent per
    node, c10d rendezvous at this machine (every "node" of the local cluster is localhost)."""
    if not TORCHRUN.exists():
        pytest.fail(f"{TORCHRUN} not found: install torch (make setup does)")
    path.write_text(
        "#!/bin/bash\n"
        "trap '' USR1 USR2\n"
        f"exec hpcckpt srun --ckpt-dir {ckpt} -- --ntasks-per-node=1 "
        f"{TORCHRUN} --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "
        f"--rdzv-endpoint=127.0.0.1:{free_port()} --rdzv-id=$SLURM_JOB_ID "
        f"--monitor-interval=0.5 {program}\n"
    )
    path.chmod(0o755)
    return path


def wait_running(ckpt: Path, job: str, env: dict[str, str], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = read_status(ckpt)
        if status is not None and status.state == RUNNING:
            return
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env, timeout=30)
    raise AssertionError(f"the workers never reported running; status {read_status(ckpt)}")


def forwarded_line(text: str) -> str:
    """The log line saying where the stop went (at once, or once the workers were running)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("hpcckpt: ") and "forwarded" in ln]
    assert len(lines) == 1, text
    return lines[0]


def received(ckpt: Path, rank: int) -> list[str]:
    return json.loads((ckpt / f"signals.rank{rank}.restart0.json").read_text())["received"]


def test_torchrun_on_two_nodes_stop_reaches_every_worker_then_requeue(
    slurm_cluster_nodes, tmp_path
):
    cluster = slurm_cluster_nodes(2)
    env = cluster_env(cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    script = torchrun_script(tmp_path / "tr.sbatch", ckpt, f"{APP} --steps-after-requeue 10")
    job = sbatch(["-N", "2", "--ntasks-per-node=1", "--time=5", "--requeue",
                  "--open-mode=append", f"--output={log}", str(script)], env,
                 cwd=str(ROOT))  # fmt: skip
    wait_running(ckpt, job, env)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True, timeout=30)
    info = follow(job, env, timeout=300)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED", (info, text)
    assert int(info["Restarts"]) == 1, (info, text)
    # one USR1 to each worker, on its own node, by that node's signaller
    assert received(ckpt, 0) == ["SIGUSR1"] and received(ckpt, 1) == ["SIGUSR1"], text
    line = forwarded_line(text)
    assert "by a signaller on every node (n1: rank " in line and "; n2: rank " in line, line
    delivered = [e for e in read_events(ckpt) if e["event"] == "signal_delivered"]
    assert [d["path"] for d in delivered] == ["nodes"], delivered
    assert sorted(r["node"] for r in delivered[0]["nodes"]) == ["n1", "n2"]
    assert sorted(r for n in delivered[0]["nodes"] for r in n["ranks"]) == [0, 1]
    kinds = [e["event"] for e in read_events(ckpt)]
    assert kinds.count("requeue") == 1 and kinds[-1] == "finished", kinds
    assert "User defined signal" not in text and "exitcode: -10" not in text, text


def test_torchrun_slurms_term_to_the_tasks_reaches_the_workers_through_the_agents(
    slurm_cluster_nodes, tmp_path
):
    """Slurm's own TERM to the job's tasks (preemption without the user signal; here
    ``scancel --signal=TERM JOB``) goes to torchrun's agents, which pass it to their
    workers: they checkpoint and report stopped, the agents exit 1, the wrapper (which
    heard nothing) sees the stop and requeues."""
    cluster = slurm_cluster_nodes(2)
    env = cluster_env(cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    script = torchrun_script(tmp_path / "tr.sbatch", ckpt, f"{APP} --steps-after-requeue 10")
    job = sbatch(["-N", "2", "--ntasks-per-node=1", "--time=5", "--requeue",
                  "--open-mode=append", f"--output={log}", str(script)], env,
                 cwd=str(ROOT))  # fmt: skip
    wait_running(ckpt, job, env)
    subprocess.run(["scancel", "--signal=TERM", job], env=env, check=True, timeout=30)
    info = follow(job, env, timeout=300)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, (info, text)
    assert received(ckpt, 0) == ["SIGTERM"] and received(ckpt, 1) == ["SIGTERM"], text
    assert "a stop, not a crash" in text, text  # the agents exited 1 after the checkpoint
    kinds = [e["event"] for e in read_events(ckpt)]
    assert "signal" not in kinds and kinds.count("requeue") == 1, kinds
