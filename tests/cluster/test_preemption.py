"""hpcckpt.cluster.preemption: the preemptible local cluster's slurm.conf."""

from pathlib import Path

import pytest

from hpcckpt.cluster import ClusterConfig, ClusterError, preemption, render_slurm_conf


def test_off_adds_nothing():
    text = render_slurm_conf(Path("/s"), ClusterConfig())
    assert "Preempt" not in text and "PartitionName=high" not in text


@pytest.mark.parametrize("mode", ["requeue", "requeue-signal"])
def test_preemptible_setup(mode):
    text = render_slurm_conf(Path("/s"), ClusterConfig(nodes=2, preempt=mode, grace_time=45))
    assert "PreemptType=preempt/partition_prio\nPreemptMode=REQUEUE" in text
    assert "PartitionName=debug Nodes=n1,n2 Default=YES" in text
    assert "PriorityTier=1 PreemptMode=REQUEUE GraceTime=45" in text
    assert "PartitionName=high Nodes=n1,n2 Default=NO" in text and "PriorityTier=2" in text
    assert ("preempt_send_user_signal" in text) == (mode == "requeue-signal")


def test_unknown_mode():
    with pytest.raises(ClusterError, match="--preempt must be one of"):
        ClusterConfig(preempt="suspend")
    with pytest.raises(ValueError):
        preemption.global_lines("suspend")
