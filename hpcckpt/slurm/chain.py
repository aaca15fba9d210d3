"""Continue a computation as a new job: ``sbatch --dependency=afterany:<this job>``.

For sites that forbid ``scontrol requeue`` (or have no ``scontrol`` inside containers),
``hpcckpt run/srun --chain`` submits the same batch script again; the new job starts
once this one has ended, whatever its state, and resumes from the checkpoint directory.

What is resubmitted (first source that answers):

- the script: ``$HPCCKPT_CHAIN_SCRIPT`` (the templates set it to ``$0``, Slurm's copy of
  the script, readable while the job runs), else ``Command=`` of ``scontrol show job``;
- its arguments: ``$HPCCKPT_CHAIN_ARGS`` (shell-quoted, the templates set it with bash's
  ``${*@Q}``), else the words after the script in ``Command=`` (lossy: Slurm joins them
  with spaces);
- sbatch options given on the command line (``#SBATCH`` lines travel with the script):
  ``$HPCCKPT_SBATCH_ARGS`` (shell-quoted; ``hpcckpt submit`` records it), else the
  resources ``scontrol show job`` reports (time limit, nodes, tasks, partition, name,
  working directory). ``--signal`` is not reported by scontrol: put it in the script.

The new job's environment is this one minus Slurm's own ``SLURM_*`` variables (a stale
``SLURM_RESTART_COUNT`` would mislead it; ``SLURM_CONF`` is kept), with
``HPCCKPT_CHAIN_COUNT`` one higher and ``HPCCKPT_DIR`` set, handed over by
``--export=ALL`` (set in sbatch's environment rather than ``--export=ALL,VAR=value``,
which cannot carry values containing commas).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpcckpt.rundir.env import (
    ATTEMPT_ENV,
    CHAIN_ARGS_ENV,
    CHAIN_COUNT_ENV,
    CHAIN_SCRIPT_ENV,
    DIR_ENV,
    SBATCH_ARGS_ENV,
    chain_count,
)
from hpcckpt.slurm import commands
from hpcckpt.slurm.env import is_slurm_variable
from hpcckpt.slurm.jobid import identity
from hpcckpt.slurm.runner import QUERY_TIMEOUT, SUBMIT_TIMEOUT, SlurmError, check_job_id

#: scontrol's key -> the sbatch option carrying it.
_CARRIED = (
    ("JobName", "--job-name"),
    ("TimeLimit", "--time"),
    ("NumNodes", "--nodes"),
    ("NumTasks", "--ntasks"),
    ("Partition", "--partition"),
    ("WorkDir", "--chdir"),
)
_NO_VALUE = {"", "(null)", "n/a", "none", "unlimited", "partition_limit", "unknown"}
#: Options never carried to the next link: ours replace them.
_DROPPED = ("--dependency", "-d", "--export", "--parsable", "--array", "-a")


class ChainError(RuntimeError):
    """The next job could not be described or submitted; the message says what to do."""


@dataclass
class ChainSpec:
    script: str
    script_args: list[str] = field(default_factory=list)
    sbatch_args: list[str] = field(default_factory=list)
    source: str = ""  # where the script came from, for the log


def _drop_options(args: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _DROPPED:
            skip = "=" not in arg and name in ("--dependency", "-d", "--export", "--array", "-a")
            continue
        out.append(arg)
    return out


def carried_options(info: Mapping[str, str]) -> list[str]:
    """sbatch options reproducing the resources ``scontrol show job`` reports."""
    out = []
    for key, option in _CARRIED:
        value = info.get(key, "").strip()
        if value.lower() in _NO_VALUE:
            continue
        if key in ("NumNodes", "NumTasks") and not value.replace("-", "").isdigit():
            continue
        out.append(f"{option}={value}")
    return out


def find_spec(job: str, environ: Mapping[str, str], *, timeout: float = QUERY_TIMEOUT) -> ChainSpec:
    """What to submit as the next link (see the module doc); ChainError if unknown."""
    info: dict[str, str] | None = None
    info_error = ""

    def job_info() -> dict[str, str] | None:
        nonlocal info, info_error
        if info is None and not info_error:
            try:
                info = commands.show_job(job, timeout=timeout, environ=environ)
            except (SlurmError, ValueError) as exc:
                info_error = str(exc)
        return info

    script = (environ.get(CHAIN_SCRIPT_ENV) or "").strip()
    if script:
        spec = ChainSpec(script, shlex.split(environ.get(CHAIN_ARGS_ENV) or ""), source="env")
    else:
        got = job_info()
        command = (got or {}).get("Command", "")
        if not command or command == "(null)":
            why = info_error or "scontrol shows no batch script (Command=(null))"
            raise ChainError(
                f"cannot find the batch script to submit again: {why}; set "
                f'{CHAIN_SCRIPT_ENV}="$0" and {CHAIN_ARGS_ENV}="${{*@Q}}" in the batch '
                "script before `exec hpcckpt ...` (sbatch-templates/chain.sbatch does)"
            )
        words = command.split(" ")
        spec = ChainSpec(words[0], [w for w in words[1:] if w], source="scontrol")
    recorded = environ.get(SBATCH_ARGS_ENV)
    if recorded is not None:
        spec.sbatch_args = _drop_options(shlex.split(recorded))
    else:
        got = job_info()
        spec.sbatch_args = carried_options(got) if got else []
    if not Path(spec.script).is_file():
        raise ChainError(f"the batch script {spec.script} ({spec.source}) does not exist")
    return spec


def next_environment(
    environ: Mapping[str, str], *, ckpt_dir: str, next_count: int, sbatch_args: Sequence[str]
) -> dict[str, str]:
    """The environment sbatch runs with (and, by --export=ALL, the next job starts with)."""
    env = {k: v for k, v in environ.items() if not is_slurm_variable(k) and k != ATTEMPT_ENV}
    env[CHAIN_COUNT_ENV] = str(next_count)
    env[DIR_ENV] = ckpt_dir
    env[SBATCH_ARGS_ENV] = shlex.join(sbatch_args)
    return env


def submit_argv(spec: ChainSpec, job: str) -> list[str]:
    """sbatch's arguments (without ``sbatch --parsable``) for the next link."""
    return [
        f"--dependency=afterany:{check_job_id(job)}",
        *spec.sbatch_args,
        "--export=ALL",
        spec.script,
        *spec.script_args,
    ]


def submit_next(
    job: str,
    environ: Mapping[str, str],
    *,
    ckpt_dir: str,
    timeout: float = SUBMIT_TIMEOUT,
) -> tuple[str, ChainSpec, int]:
    """Submit the next link; returns (new job id, what was submitted, its chain count)."""
    spec = find_spec(job, environ, timeout=min(timeout, QUERY_TIMEOUT))
    count = chain_count(environ) + 1
    env = next_environment(
        environ, ckpt_dir=ckpt_dir, next_count=count, sbatch_args=spec.sbatch_args
    )
    argv = submit_argv(spec, job)
    ident = identity(environ)
    if ident.is_array_task:  # exactly this index: the script's #SBATCH --array is overridden
        argv[0] = f"--dependency=afterany:{ident.target}"
        argv.insert(1, f"--array={ident.array_task_id}")
    new = commands.submit(argv, timeout=timeout, environ=environ, env=env)
    return new, spec, count
