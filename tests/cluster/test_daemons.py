"""The local Slurm cluster (hpcckpt/cluster/daemons.py): real daemons, real jobs, node
failures and recovery."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcckpt import procfs
from hpcckpt.cli.cluster import COMMANDS
from hpcckpt.cluster import ClusterError, LocalCluster
from hpcckpt.cluster import config as cl

RANK_SCRIPT = (
    "from mpi4py import MPI; import os; c = MPI.COMM_WORLD; "
    "print('rank', c.Get_rank(), c.Get_size(), os.environ.get('SLURMD_NODENAME'), flush=True)"
)


def _ranks(output: str) -> dict[int, tuple[int, str]]:
    ranks = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "rank":
            ranks[int(parts[1])] = (int(parts[2]), parts[3])
    return ranks


def _srun(cluster: LocalCluster, args: list[str], timeout: float = 120) -> str:
    proc = subprocess.run(
        ["srun", *args],
        env=cluster.slurm_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"srun {args} exited {proc.returncode}:\n{proc.stderr}"
    return proc.stdout


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def test_missing_binaries_name_the_debian_packages(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cl, "find_binary", lambda name: None)
    with pytest.raises(ClusterError, match="apt-get install slurm-wlm munge"):
        LocalCluster(tmp_path).up()
    result = CliRunner().invoke(COMMANDS[0], ["up", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "apt-get install slurm-wlm munge" in result.output


def test_down_and_status_of_nothing_are_harmless(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(COMMANDS[0], ["down", "--state-dir", str(tmp_path)]).exit_code == 0
    result = runner.invoke(COMMANDS[0], ["status", "--json", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0
    assert json.loads(result.output)["running"] is False
    result = runner.invoke(COMMANDS[0], ["fail-node", "n1", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1 and "no cluster configured" in result.output
    result = runner.invoke(
        COMMANDS[0], ["fail-node", "n1", "--wipe", str(tmp_path), "--state-dir", str(tmp_path)]
    )
    assert result.exit_code == 1 and "put %n where the node's name goes" in result.output
    assert tmp_path.exists()


@pytest.mark.slurm
def test_batch_job_runs_and_completes(slurm_cluster: LocalCluster, tmp_path: Path) -> None:
    script = _script(tmp_path / "job.sh", 'echo "hello from $SLURMD_NODENAME"\n')
    out = tmp_path / "job.out"
    job = slurm_cluster.sbatch(["-o", str(out), "-D", str(tmp_path), str(script)])
    info = slurm_cluster.wait_job(job, timeout=60)
    assert info["JobState"] == "COMPLETED", info
    assert out.read_text().strip() == "hello from n1"


@pytest.mark.slurm
def test_srun_pmix_two_ranks(slurm_cluster: LocalCluster) -> None:
    out = _srun(slurm_cluster, ["--mpi=pmix", "-n", "2", sys.executable, "-c", RANK_SCRIPT])
    assert _ranks(out) == {0: (2, "n1"), 1: (2, "n1")}, out


@pytest.mark.slurm
def test_up_again_is_idempotent(slurm_cluster: LocalCluster) -> None:
    pid = slurm_cluster.ctld_pid()
    assert slurm_cluster.up(nodes=1) is False
    assert slurm_cluster.ctld_pid() == pid
    runner = CliRunner()
    state = ["--state-dir", str(slurm_cluster.state_dir)]
    result = runner.invoke(COMMANDS[0], ["up", *state])
    assert result.exit_code == 0, result.output
    assert "already running" in result.output
    assert f"export SLURM_CONF={slurm_cluster.slurm_conf}" in result.output
    status = json.loads(runner.invoke(COMMANDS[0], ["status", "--json", *state]).output)
    assert status["running"] and status["munge"]
    assert [n["name"] for n in status["nodes"]] == ["n1"]
    assert all(d["pid"] for d in status["daemons"])


@pytest.mark.slurm
def test_fail_node_needs_several_nodes(slurm_cluster: LocalCluster) -> None:
    with pytest.raises(ClusterError, match="single node"):
        slurm_cluster.fail_node("n1")
    with pytest.raises(ClusterError, match="unknown node"):
        slurm_cluster.fail_node("n9")


@pytest.mark.slurm
def test_two_ranks_span_two_nodes(slurm_cluster_nodes) -> None:
    cluster = slurm_cluster_nodes(2)
    assert set(cluster.node_states()) == {"n1", "n2"}
    args = ["--mpi=pmix", "-N", "2", "-n", "2", sys.executable, "-c", RANK_SCRIPT]
    out = _srun(cluster, args)
    assert _ranks(out) == {0: (2, "n1"), 1: (2, "n2")}, out


@pytest.mark.slurm
def test_reconfigure_to_three_nodes(slurm_cluster_nodes) -> None:
    cluster = slurm_cluster_nodes(3)
    assert cluster.node_states() == {"n1": "idle", "n2": "idle", "n3": "idle"}
    out = _srun(cluster, ["-N", "3", "hostname"], timeout=60)
    assert len(out.split()) == 3


@pytest.mark.slurm
def test_fail_node_and_restore(slurm_cluster_nodes, tmp_path: Path) -> None:
    cluster = slurm_cluster_nodes(2)
    script = _script(
        tmp_path / "long.sh",
        f"srun --mpi=pmix -N 2 -n 2 {sys.executable} -c 'import time; time.sleep(600)'\n",
    )
    job = cluster.sbatch(
        ["-N", "2", "-n", "2", "--requeue", "-o", str(tmp_path / "long.out"), str(script)]
    )
    cluster.wait_job(job, ("RUNNING",), timeout=60)
    deadline = time.monotonic() + 30  # wait until the step's tasks run on n2
    while len(cluster.node_pids("n2")) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    victims = cluster.node_pids("n2")
    assert len(victims) >= 3, victims  # slurmd, slurmstepd, the task

    for node in ("n1", "n2"):  # their node-local directories
        (tmp_path / "local" / node).mkdir(parents=True)
    waited = cluster.fail_node("n2", timeout=90, wipe=[f"{tmp_path}/local/%n"])
    assert not (tmp_path / "local" / "n2").exists() and (tmp_path / "local" / "n1").exists()
    assert cluster.node_states()["n2"].startswith("down")
    assert cluster.slurmd_pid("n2") is None
    assert not any(procfs.pid_alive(p) for p in victims)
    assert waited < 60
    info = cluster.wait_job(job, ("PENDING", "REQUEUED", "NODE_FAIL"), timeout=60)
    assert int(info.get("Restarts", "0")) >= 1 or info["JobState"] == "NODE_FAIL", info

    cluster.restore_node("n2", timeout=60)
    assert cluster.slurmd_pid("n2") is not None
    assert not cluster.node_states()["n2"].startswith("down")
    subprocess.run(["scancel", str(job)], env=cluster.slurm_env(), timeout=15, check=True)


@pytest.mark.slurm
def test_up_recovers_from_killed_daemons(slurm_cluster_nodes) -> None:
    """A crashed session leaves stale pid files (and maybe daemons): up starts clean."""
    cluster = slurm_cluster_nodes(2)
    pids = [cluster.ctld_pid(), cluster.slurmd_pid("n1"), cluster.slurmd_pid("n2")]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(procfs.pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not cluster.is_running()
    cluster = slurm_cluster_nodes(2)
    assert cluster.is_running()
    assert cluster.node_states() == {"n1": "idle", "n2": "idle"}


#: Two ranks exchanging messages through Open MPI's shared memory, the same count on both.
SENDRECV_SCRIPT = (
    "from mpi4py import MPI; import numpy as np; c = MPI.COMM_WORLD; "
    "a = np.zeros(1 << 14); b = np.empty_like(a); other = 1 - c.Get_rank()\n"
    "for _ in range(20000):\n"
    "    c.Sendrecv(a, other, 0, b, other, 0); a += 1\n"
    "print('done', c.Get_rank(), int(a[0]), flush=True)"
)


@pytest.mark.slurm
def test_two_fresh_clusters_run_mpi_jobs_side_by_side() -> None:
    """Two local clusters on one machine (a user trying two things, tests side by side):
    their first jobs run MPI over shared memory at the same time and both finish, because
    their job ids differ (Open MPI's segment names carry the job id)."""
    from tests.conftest import SLURM_TEST_PORT

    # Short state directories: PMIx's socket paths under TmpFS must fit in 108 bytes.
    roots = [Path(tempfile.mkdtemp(prefix=f"hpcckpt-c{i}-", dir="/tmp")) for i in range(2)]
    clusters = [LocalCluster(r, port=SLURM_TEST_PORT + 20 + 10 * i) for i, r in enumerate(roots)]
    try:
        for c in clusters:
            c.up(nodes=1, cpus_per_node=2, kill_wait=10, timeout=90)
        procs = [
            subprocess.Popen(
                ["srun", "--mpi=pmix", "-n", "2", sys.executable, "-c", SENDRECV_SCRIPT],
                env=c.slurm_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for c in clusters
        ]
        outs = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0 and out.count("done") == 2, (out, err)
        ids = [c.sbatch(["--wrap", "true", "-o", "/dev/null"]) for c in clusters]
        assert ids[0] != ids[1] and abs(int(ids[0]) - int(ids[1])) >= 10_000, ids
    finally:
        for c in clusters:
            c.down(stop_munge=False)
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
