"""Real node failures on the multi-node local cluster.

A node "loses power" (``LocalCluster.fail_node``: SIGKILL of its slurmd, slurmstepds and
tasks) while heat2d runs under ``hpcckpt srun``; the job must end COMPLETED with a field
bit-identical to an uninterrupted run. Slurm needs about 25-30 s to declare the node
down, which is most of each test's time.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.report import analyze
from hpcckpt.rundir.events import read_events
from tests.mpi_helpers import EXAMPLES, ROOT, mpirun
from tests.slurm_helpers import cluster_env, follow, sbatch, wait_for_event

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

STEPS = 200
HEAT = ["--nx", "64", "--ny", "64", "--steps", str(STEPS), "--every", "10"]
PAUSE_APP = ROOT / "tests" / "job" / "apps" / "heat_pause.py"


def reference(tmp_path: Path) -> bytes:
    ref = tmp_path / "reference.npy"
    r = mpirun(2, [EXAMPLES / "heat2d.py", *HEAT, "--ckpt-dir", tmp_path / "ref", "--out", ref])
    assert r.returncode == 0, r.stderr
    return np.load(ref).tobytes()


def script(tmp_path: Path, wrapper_args: str, app: Path = EXAMPLES / "heat2d.py") -> Path:
    heat = " ".join(HEAT)
    path = tmp_path / "heat.sbatch"
    path.write_text(
        "#!/bin/bash\n"
        f"exec hpcckpt srun {wrapper_args} -- --mpi=pmix python {app} {heat} --sleep 0.1 "
        f"--out {tmp_path}/out.npy\n"
    )
    path.chmod(0o755)
    return path


def log_of(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"


def checkpoint_at(ckpt: Path, step: int, job: str, env: dict[str, str]) -> None:
    wait_for_event(
        ckpt,
        lambda e: e.get("event") == "checkpoint" and e.get("step", 0) >= step,
        timeout=180,
        job=job,
        env=env,
    )


def test_node_fails_midrun_slurm_requeues_once_and_job_resumes(slurm_cluster_nodes, tmp_path):
    """2 nodes: n2 dies; the wrapper on n1 sees it, Slurm requeues by itself (once)."""
    ref = reference(tmp_path)
    cluster = slurm_cluster_nodes(2)
    env = cluster_env(cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    sb = script(tmp_path, f"--ckpt-dir {ckpt} --min-progress 3600")
    job = sbatch(["-N", "2", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  sb], env, cwd=str(ROOT))  # fmt: skip
    try:
        checkpoint_at(ckpt, 29, job, env)
        t = time.monotonic()
        cluster.fail_node("n2", timeout=90)
        seen_down = time.monotonic() - t
        cluster.restore_node("n2", timeout=60)  # the requeued job needs both nodes
        info = follow(job, env, timeout=300)
    finally:
        cluster.restore_node("n2", timeout=60)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED", text
    assert int(info["Restarts"]) == 1, text
    evs = list(read_events(ckpt))
    nf = [e for e in evs if e["event"] == "node_failure"]
    assert [(e["node"], e["action"]) for e in nf] == [("n2", "requeued_by_slurm")], text
    assert [(e["cause"], e.get("by")) for e in evs if e["event"] == "requeue"] == [
        ("node_failure", "slurm")
    ], text
    assert not any(e["event"] in ("requeue_failed", "give_up") for e in evs), text
    assert "Node failure on n2" in text
    restored = [e["step"] for e in evs if e["event"] == "restore" and e.get("restart") == 1]
    assert restored and restored[0] >= 29, text
    assert np.load(tmp_path / "out.npy").tobytes() == ref
    report = analyze(evs)
    (failure,) = report["node_failures"]
    assert failure["node"] == "n2" and failure["attempt"] == 1
    assert failure["lost_seconds"] is not None and failure["queue_seconds"] is not None
    print(f"n2 down after {seen_down:.0f} s; report: {failure}")


def test_batch_node_fails_in_the_middle_of_a_save(slurm_cluster_nodes, tmp_path):
    """3 nodes, job on n1+n2: rank 0 pauses inside a save (.partial written), n1 (the batch
    host, with the wrapper) dies; Slurm requeues onto n2+n3, the .partial is ignored."""
    ref = reference(tmp_path)
    cluster = slurm_cluster_nodes(3)
    env = cluster_env(cluster)
    ckpt, log, marker = tmp_path / "ckpt", tmp_path / "job.out", tmp_path / "paused"
    sb = script(tmp_path, f"--ckpt-dir {ckpt} --min-progress 3600", app=PAUSE_APP)
    pause = f"HPCCKPT_TEST_PAUSE=write.closed:0:30:{marker}"
    job = sbatch(["-N", "2", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  f"--export=ALL,{pause}", sb], env, cwd=str(ROOT))  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), log_of(log)
        partials = sorted(p.name for p in ckpt.glob("*.partial"))
        assert partials, "the save under way left no .partial"
        assert marker.read_text().split()[1] == "n1"
        cluster.fail_node("n1", timeout=90)
        info = follow(job, env, timeout=300)
        evs = list(read_events(ckpt))
    finally:
        cluster.restore_node("n1", timeout=60)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED", text
    assert int(info["Restarts"]) == 1, text
    committed = [e["step"] for e in evs if e["event"] == "checkpoint" and e.get("restart") == 0]
    restored = [e["step"] for e in evs if e["event"] == "restore" and e.get("restart") == 1]
    assert restored == [max(committed)], (restored, committed, partials)
    assert f"ckpt-{restored[0] + 10:010d}.h5.partial" in partials
    starts = [e for e in evs if e["event"] == "wrapper_start"]
    assert starts[1]["nodes"] != "n[1-2]" and "n1" not in starts[1]["nodes"], starts[1]
    nf = [e for e in evs if e["event"] == "node_failure"]
    assert [(e["node"], e["detected"]) for e in nf] == [("n1", "at_restart")], evs
    assert np.load(tmp_path / "out.npy").tobytes() == ref
    print(f"partials {partials}; restored {restored}; report: {analyze(evs)['node_failures']}")


def test_spare_node_relaunch_inside_the_allocation(slurm_cluster_nodes, tmp_path):
    """3 nodes, --no-kill, step on 2 with --spare-nodes 1: n2 dies, the step is relaunched
    on n1+n3 from the last checkpoint, the job never leaves the allocation (Restarts=0)."""
    ref = reference(tmp_path)
    cluster = slurm_cluster_nodes(3)
    env = cluster_env(cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    sb = script(tmp_path, f"--ckpt-dir {ckpt} --spare-nodes 1 --min-progress 3600")
    job = sbatch(["-N", "3", "--ntasks-per-node=1", "--no-kill", "--requeue",
                  "--open-mode=append", f"--output={log}", sb], env, cwd=str(ROOT))  # fmt: skip
    try:
        checkpoint_at(ckpt, 29, job, env)
        cluster.fail_node("n2", timeout=90)
        info = follow(job, env, timeout=300)
    finally:
        cluster.restore_node("n2", timeout=60)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED", text
    assert int(info["Restarts"]) == 0, text
    evs = list(read_events(ckpt))
    (rel,) = [e for e in evs if e["event"] == "relaunch"]
    assert rel["node"] == "n2" and rel["nodes"] == ["n1", "n3"] and rel["spare_left"] == 0, rel
    assert not any(e["event"] in ("requeue", "requeue_failed") for e in evs), text
    starts = [e for e in evs if e["event"] == "start" and e.get("source") == "checkpointer"]
    assert len(starts) == 2 and {e["nranks"] for e in starts} == {2}, starts
    restored = [e["step"] for e in evs if e["event"] == "restore" and e.get("step") is not None]
    assert restored and restored[0] >= 29, text
    assert np.load(tmp_path / "out.npy").tobytes() == ref
    (failure,) = analyze(evs)["node_failures"]
    assert failure["action"] == "relaunch" and failure["resume_seconds"] is not None
    print(f"relaunch {rel}; report: {failure}")
