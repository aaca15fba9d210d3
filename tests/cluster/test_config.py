"""The local cluster's configuration (hpcckpt/cluster/config.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcckpt.cluster import ClusterConfig, ClusterError, LocalCluster, render_slurm_conf
from hpcckpt.cluster import config as cl


def test_slurm_conf_has_the_keys_the_tests_rely_on(tmp_path: Path) -> None:
    text = render_slurm_conf(tmp_path, ClusterConfig(nodes=3, port=40000))
    for key in (
        "SlurmctldPort=40000",
        "JobRequeue=1",
        "ReturnToService=2",
        "SlurmdTimeout=10",
        "MpiDefault=pmix",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",
        "KillWait=10",
        "AccountingStorageType=accounting_storage/none",
        f"TmpFS={tmp_path}/tmp-%n",
        f"SlurmdSpoolDir={tmp_path}/spool/%n",
    ):
        assert key in text.splitlines(), key
    assert "NodeName=n3 NodeHostname=localhost NodeAddr=127.0.0.1 Port=40003 CPUs=2" in text
    assert "PartitionName=debug Nodes=n1,n2,n3 Default=YES" in text


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ClusterError):
        ClusterConfig(nodes=0)
    with pytest.raises(ClusterError):
        ClusterConfig(port=80)


def test_slurm_env_drops_inherited_job_variables() -> None:
    env = cl.slurm_env("/x/slurm.conf", {"PATH": "/bin", "SLURM_JOB_ID": "7", "SLURM_CONF": "y"})
    assert env == {"PATH": "/bin", "SLURM_CONF": "/x/slurm.conf"}


def test_state_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(cl.DIR_ENV, str(tmp_path / "c"))
    assert LocalCluster().state_dir == tmp_path / "c"
    monkeypatch.delenv(cl.DIR_ENV)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert LocalCluster().state_dir == tmp_path / "xdg" / "hpcckpt" / "cluster"


def test_clusters_on_other_ports_number_their_jobs_apart(tmp_path: Path) -> None:
    """Open MPI names shared-memory segments after the job id: two local clusters (the
    tests', a user's) must never hand out the same ids."""
    ports = [16817, 26817, 26825, 27817, 40000]
    firsts = [cl.first_job_id(p) for p in ports]
    assert len(set(firsts)) == len(firsts)
    assert all(1 <= f < 67_043_328 - 10_000 for f in firsts)  # below Slurm's MaxJobId
    assert sorted(abs(a - b) for a in firsts for b in firsts if a != b)[0] >= 10_000
    text = render_slurm_conf(tmp_path, ClusterConfig(port=26817))
    assert f"FirstJobId={cl.first_job_id(26817)}" in text.splitlines()
