"""What the environment says about the Slurm job we are in: the only reader of ``SLURM_*``.

Plain stdlib; everything is empty (or 0/1) outside Slurm.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from hpcckpt.slurm.hostlist import expand_hostlist


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


@dataclass(frozen=True)
class SlurmEnv:
    """What the environment says about the Slurm job we are in (all empty outside Slurm)."""

    job_id: str | None = None
    restart_count: int = 0
    num_nodes: int = 1
    ntasks: int | None = None
    step_id: str | None = None

    @property
    def in_job(self) -> bool:
        """True inside a Slurm allocation (``SLURM_JOB_ID`` is set)."""
        return self.job_id is not None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SlurmEnv:
        env = os.environ if environ is None else environ
        return cls(
            job_id=job_id(env),
            restart_count=restart_count(env),
            num_nodes=node_count(env),
            ntasks=ntasks(env),
            step_id=env.get("SLURM_STEP_ID") or None,
        )


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """``SLURM_JOB_ID`` (``SLURM_JOBID`` on old releases), or None outside Slurm."""
    env = os.environ if environ is None else environ
    value = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
    return value or None


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times Slurm has requeued this job (``SLURM_RESTART_COUNT``; 0 if unset)."""
    env = os.environ if environ is None else environ
    return max(0, _int(env.get("SLURM_RESTART_COUNT", "").strip() or None, 0))


def node_name(environ: Mapping[str, str] | None = None) -> str | None:
    """The Slurm name of the node this process runs on (``SLURMD_NODENAME``), or None.

    Several slurmd instances on one machine (the local cluster) share a hostname but
    not a node name, so the node name is what tells nodes apart.
    """
    env = os.environ if environ is None else environ
    return (env.get("SLURMD_NODENAME") or "").strip() or None


def node_count(environ: Mapping[str, str] | None = None) -> int:
    """Nodes in the allocation (``SLURM_JOB_NUM_NODES``, else ``SLURM_NNODES``; 1 if unset)."""
    env = os.environ if environ is None else environ
    for key in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        n = _int((env.get(key) or "").strip() or None, 0)
        if n > 0:
            return n
    return 1


def ntasks(environ: Mapping[str, str] | None = None) -> int | None:
    """Tasks of the job (``SLURM_NTASKS``, else ``SLURM_NPROCS``); None if unset or 0."""
    env = os.environ if environ is None else environ
    value = (env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or "").strip()
    return _int(value or None, 0) or None


def nodelist(environ: Mapping[str, str] | None = None) -> str | None:
    """The job's nodes as Slurm writes them (``SLURM_JOB_NODELIST``, e.g. ``n[1-3]``)."""
    env = os.environ if environ is None else environ
    return env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or None


def allocation(environ: Mapping[str, str] | None = None) -> list[str]:
    """The nodes the job was given at its start (``SLURM_JOB_NODELIST``, expanded)."""
    return expand_hostlist(nodelist(environ) or "")


def kill_on_bad_exit_set(environ: Mapping[str, str] | None = None) -> bool:
    """True if ``SLURM_KILL_BAD_EXIT`` is set: the user chose srun's ``--kill-on-bad-exit``."""
    env = os.environ if environ is None else environ
    return "SLURM_KILL_BAD_EXIT" in env


#: Set in the environment of every task of a job step (its rank in the step).
TASK_RANK_ENV = "SLURM_PROCID"


def is_step_task(environ: Mapping[str, str]) -> bool:
    """True for a task of one of the job's steps (``SLURM_PROCID`` set), not the batch
    script or the extern step, judged from a process's environment."""
    step = environ.get("SLURM_STEP_ID")
    return TASK_RANK_ENV in environ and step not in (None, "batch", "extern")


def is_slurm_variable(name: str) -> bool:
    """Slurm's own per-job variables (``SLURM_*`` except ``SLURM_CONF``, which names the
    cluster): what a new job or a daemon must not inherit."""
    return name.startswith("SLURM_") and name != "SLURM_CONF"
