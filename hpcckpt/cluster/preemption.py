"""A preemptible local cluster: the slurm.conf lines, and what a preemption looks like.

``hpcckpt cluster up --preempt requeue`` (or ``requeue-signal``) adds a second partition
``high`` over the same nodes with a higher ``PriorityTier``; a job submitted there
preempts jobs of the default partition, which Slurm then requeues
(``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``) after ``GraceTime``
seconds. Measured here (Slurm 22.05): at the preemption every task of the preempted job's
steps gets SIGTERM (then SIGCONT) directly, the batch shell nothing; about GraceTime +
20 s later Slurm requeues the job by itself. With ``requeue-signal``
(``SlurmctldParameters=preempt_send_user_signal``; newer Slurm:
``PreemptParameters=send_user_signal``) the job's ``--signal`` signal is sent at the
preemption instead, to the batch shell for ``B:``.
"""

from __future__ import annotations

MODES = ("off", "requeue", "requeue-signal")
HIGH_PARTITION = "high"
DEFAULT_GRACE_TIME = 30


def global_lines(mode: str) -> list[str]:
    """The cluster-wide keys for ``mode`` (none for ``off``)."""
    if mode not in MODES:
        raise ValueError(f"unknown preemption mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "off":
        return []
    lines = ["PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE"]
    if mode == "requeue-signal":
        lines.append("SlurmctldParameters=preempt_send_user_signal")  # Slurm 22.05 spelling
    return lines


def partition_suffix(mode: str, grace_time: int) -> str:
    """Extra keys of the default (preemptible) partition's line."""
    if mode == "off":
        return ""
    return f" PriorityTier=1 PreemptMode=REQUEUE GraceTime={int(grace_time)}"


def high_partition_line(mode: str, nodelist: str) -> str | None:
    """The high-priority partition that preempts the default one (None for ``off``)."""
    if mode == "off":
        return None
    return (
        f"PartitionName={HIGH_PARTITION} Nodes={nodelist} Default=NO MaxTime=INFINITE "
        "OverSubscribe=NO State=UP PriorityTier=2 PreemptMode=OFF"
    )
