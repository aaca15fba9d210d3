"""The Slurm client: the only code that runs Slurm commands or reads ``SLURM_*``.

- :mod:`~hpcckpt.slurm.env` — ``SlurmEnv``: what the environment says about the job;
- :mod:`~hpcckpt.slurm.runner` — one runner (argument lists, timeouts, overrides, errors);
- :mod:`~hpcckpt.slurm.commands` — requeue, sbatch, squeue, sinfo, scontrol, scancel;
- :mod:`~hpcckpt.slurm.parse` — their output, parsed once;
- :mod:`~hpcckpt.slurm.hostlist` — ``n[1-3]`` node lists;
- :mod:`~hpcckpt.slurm.chain` — continuing as a new job; :mod:`~hpcckpt.slurm.templates`.

Stdlib only. The names below are the client's API, re-exported for ``from hpcckpt
import slurm``; each is defined in the module named above.
"""

from __future__ import annotations

from hpcckpt.slurm.commands import (
    JobNodes,
    cancel,
    down_since,
    end_time,
    job_ids,
    job_nodes,
    job_steps,
    node_states,
    requeue,
    show_job,
    submit,
)
from hpcckpt.slurm.env import (
    SlurmEnv,
    allocation,
    job_id,
    node_count,
    node_name,
    ntasks,
    restart_count,
)
from hpcckpt.slurm.hostlist import expand_hostlist
from hpcckpt.slurm.parse import is_failed, parse_end_time, parse_show_job, parse_sinfo
from hpcckpt.slurm.runner import (
    QUERY_TIMEOUT,
    REQUEUE_TIMEOUT,
    SUBMIT_TIMEOUT,
    SlurmCommandFailed,
    SlurmCommandNotFound,
    SlurmCommandTimeout,
    SlurmError,
    check_job_id,
    command_path,
    run_command,
)

__all__ = [
    "QUERY_TIMEOUT",
    "REQUEUE_TIMEOUT",
    "SUBMIT_TIMEOUT",
    "JobNodes",
    "SlurmCommandFailed",
    "SlurmCommandNotFound",
    "SlurmCommandTimeout",
    "SlurmEnv",
    "SlurmError",
    "allocation",
    "cancel",
    "check_job_id",
    "command_path",
    "down_since",
    "end_time",
    "expand_hostlist",
    "is_failed",
    "job_id",
    "job_ids",
    "node_name",
    "job_nodes",
    "job_steps",
    "node_count",
    "node_states",
    "ntasks",
    "parse_end_time",
    "parse_show_job",
    "parse_sinfo",
    "requeue",
    "restart_count",
    "run_command",
    "show_job",
    "submit",
]
