"""Which job to name in Slurm commands: this job, or exactly this task of a job array.

An array task has its own ``SLURM_JOB_ID``, but the first task's equals the array's
``SLURM_ARRAY_JOB_ID``, and for that id scontrol and scancel act on the *whole array*.
``<array job id>_<task id>`` always names one task; requeue, signal and chain use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hpcckpt.slurm.env import job_id


@dataclass(frozen=True)
class JobIdentity:
    job_id: str | None  # SLURM_JOB_ID
    array_job_id: str | None = None  # SLURM_ARRAY_JOB_ID
    array_task_id: str | None = None  # SLURM_ARRAY_TASK_ID

    @property
    def is_array_task(self) -> bool:
        return self.array_job_id is not None and self.array_task_id is not None

    @property
    def target(self) -> str | None:
        """The id for scontrol/scancel: ``A_T`` for an array task, else the job id."""
        if self.is_array_task:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    def describe(self) -> str:
        """``job 12`` or ``job 12 (array task 10_2)``, for log lines."""
        if self.is_array_task:
            return f"job {self.job_id} (array task {self.target})"
        return f"job {self.job_id}"


def _value(environ: Mapping[str, str], key: str) -> str | None:
    value = (environ.get(key) or "").strip()
    return value if value.isdigit() else None


def identity(environ: Mapping[str, str]) -> JobIdentity:
    """This job's identity from Slurm's environment variables."""
    return JobIdentity(
        job_id(environ),
        _value(environ, "SLURM_ARRAY_JOB_ID"),
        _value(environ, "SLURM_ARRAY_TASK_ID"),
    )


def target(environ: Mapping[str, str]) -> str | None:
    """Shorthand: ``identity(environ).target``."""
    return identity(environ).target
