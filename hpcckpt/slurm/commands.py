"""The Slurm commands hpcckpt needs, each once: requeue, submit, ask, cancel.

Every command goes through :func:`hpcckpt.slurm.runner.run_command` (argument list,
timeout, its own session) and honours the ``HPCCKPT_<COMMAND>`` path overrides.
``environ`` is where the override is looked up (default ``os.environ``); ``env`` the
environment the command runs with (default: ours), e.g. a local cluster's
``SLURM_CONF``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from hpcckpt.slurm import parse
from hpcckpt.slurm.hostlist import expand_hostlist
from hpcckpt.slurm.runner import (
    QUERY_TIMEOUT,
    REQUEUE_TIMEOUT,
    SUBMIT_TIMEOUT,
    SlurmError,
    check_job_id,
    command_path,
    run_command,
)

Env = Mapping[str, str] | None


def _run(name: str, args: Sequence[str], timeout: float, environ: Env, env: Env) -> str:
    lookup = environ if environ is not None else env
    return run_command([command_path(name, environ=lookup), *args], timeout=timeout, env=env)


def requeue(
    job: str, *, timeout: float = REQUEUE_TIMEOUT, environ: Env = None, env: Env = None
) -> None:
    """``scontrol requeue JOB``: put the job back in the queue with the same id.

    Works only for a batch job submitted with ``--requeue`` (or under ``JobRequeue=1``).
    Slurm ends the running batch script soon after; the next start has
    ``SLURM_RESTART_COUNT`` one higher.
    """
    _run("scontrol", ["requeue", check_job_id(job)], timeout, environ, env)


def end_time(
    job: str, *, timeout: float = QUERY_TIMEOUT, environ: Env = None, env: Env = None
) -> datetime | None:
    """The job's end time as Slurm plans it now (naive local time), or None if unknown."""
    out = _run("squeue", ["-h", "-j", check_job_id(job), "-o", "%e"], timeout, environ, env)
    try:
        return parse.parse_end_time(out)
    except ValueError as exc:
        raise SlurmError(str(exc)) from None


def show_job(
    job: str, *, timeout: float = QUERY_TIMEOUT, environ: Env = None, env: Env = None
) -> dict[str, str]:
    """``scontrol show job -o JOB`` as a dict (``Command``, ``TimeLimit``, ``NumTasks``...)."""
    out = _run("scontrol", ["show", "job", "-o", check_job_id(str(job))], timeout, environ, env)
    return parse.parse_show_job(out)


def kill_wait(
    *, timeout: float = QUERY_TIMEOUT, environ: Env = None, env: Env = None
) -> float | None:
    """Slurm's ``KillWait`` (``scontrol show config``): seconds from the TERM at the time
    limit to the SIGKILL. None when scontrol does not say."""
    out = _run("scontrol", ["show", "config"], timeout, environ, env)
    return parse.config_seconds(out, "KillWait")


def requeue_allowed(
    job: str, *, timeout: float = QUERY_TIMEOUT, environ: Env = None, env: Env = None
) -> bool | None:
    """May ``scontrol requeue`` requeue the job (``Requeue=`` of ``scontrol show job``)?
    None when scontrol does not say."""
    return parse.requeue_allowed(show_job(job, timeout=timeout, environ=environ, env=env))


def submit(
    args: Sequence[str], *, timeout: float = SUBMIT_TIMEOUT, environ: Env = None, env: Env = None
) -> str:
    """``sbatch --parsable ARGS`` (``$HPCCKPT_SBATCH`` or sbatch); returns the new job id.

    ``environ`` is where the command's path is looked up, ``env`` the environment sbatch
    runs with (what ``--export=ALL`` hands to the new job).
    """
    out = _run("sbatch", ["--parsable", *map(str, args)], timeout, environ, env)
    job = out.strip().splitlines()[-1].split(";")[0].strip() if out.strip() else ""
    try:
        return check_job_id(job)
    except ValueError:
        raise SlurmError(f"sbatch did not print a job id (output: {out.strip()!r})") from None


def job_ids(*, timeout: float = QUERY_TIMEOUT, environ: Env = None, env: Env = None) -> list[str]:
    """Ids of every job squeue lists (pending, running, completing)."""
    return parse.parse_job_ids(_run("squeue", ["-h", "-o", "%i"], timeout, environ, env))


def job_steps(
    job: str, *, timeout: float = QUERY_TIMEOUT, environ: Env = None, env: Env = None
) -> list[str]:
    """The job's running steps (``JOB.N``; not ``batch``/``extern``), via ``squeue -s``."""
    args = ["-h", "-s", "-j", check_job_id(job), "-o", "%i"]
    steps = []
    for word in parse.parse_job_ids(_run("squeue", args, timeout, environ, env)):
        _, _, step = word.partition(".")
        if step.isdigit():
            steps.append(word)
    return steps


def cancel(
    ids: Iterable[str],
    *,
    signal: str | None = None,
    timeout: float = QUERY_TIMEOUT,
    environ: Env = None,
    env: Env = None,
) -> None:
    """``scancel [--signal=SIG] ID...`` (jobs, or steps as ``JOB.STEP``)."""
    wanted = [str(i) for i in ids]
    if not wanted:
        return
    args = ([f"--signal={signal}"] if signal else []) + wanted
    _run("scancel", args, timeout, environ, env)


def node_states(
    nodes: Iterable[str] | None = None,
    *,
    timeout: float = QUERY_TIMEOUT,
    environ: Env = None,
    env: Env = None,
) -> dict[str, str]:
    """``{node: state}`` from sinfo, for ``nodes`` (all nodes if None)."""
    args = ["-h", "-N", "-o", "%N %T"]
    wanted = list(nodes) if nodes is not None else None
    if wanted:
        args += ["-n", ",".join(wanted)]
    states = parse.parse_sinfo(_run("sinfo", args, timeout, environ, env))
    return states if wanted is None else {n: s for n, s in states.items() if n in wanted}


def down_since(
    nodes: Iterable[str], *, timeout: float = QUERY_TIMEOUT, environ: Env = None, env: Env = None
) -> dict[str, tuple[str, float | None]]:
    """``sinfo -R``: ``{node: (reason, when it was set as Unix time or None)}`` for ``nodes``."""
    wanted = list(nodes)
    if not wanted:
        return {}
    args = ["-h", "-R", "-N", "-n", ",".join(wanted), "-o", "%N|%H|%E"]
    reasons = parse.parse_sinfo_reasons(_run("sinfo", args, timeout, environ, env))
    return {n: r for n, r in reasons.items() if n in wanted}


@dataclass(frozen=True)
class JobNodes:
    """The job's nodes as ``scontrol show job`` sees them now."""

    nodes: list[str]  # NodeList now (Slurm removes a failed node from a --no-kill job)
    state: str
    restarts: int
    requeue: bool  # Requeue=1: Slurm requeues it by itself after a node failure


def job_nodes(
    job: str, *, timeout: float = QUERY_TIMEOUT, environ: Env = None, env: Env = None
) -> JobNodes:
    """Where the job runs now, its state, restarts and requeue flag (``scontrol show job``)."""
    info = show_job(job, timeout=timeout, environ=environ, env=env)
    try:
        restarts = int(info.get("Restarts", "0") or 0)
    except ValueError:
        restarts = 0
    return JobNodes(
        nodes=expand_hostlist(info.get("NodeList", "")),
        state=info.get("JobState", ""),
        restarts=restarts,
        requeue=info.get("Requeue", "0") == "1",
    )


def run_on_nodes(
    job: str,
    nodes: int,
    command: Sequence[str],
    *,
    timeout: float = QUERY_TIMEOUT,
    environ: Env = None,
    env: Env = None,
) -> str:
    """``srun --jobid=JOB --overlap -N NODES --ntasks-per-node=1 -- COMMAND``: one copy of
    ``command`` on every node of the running job, beside its steps; their output."""
    args = [
        f"--jobid={check_job_id(job)}",
        "--overlap",
        f"--nodes={int(nodes)}",
        f"--ntasks={int(nodes)}",
        "--ntasks-per-node=1",
        "--mpi=none",
        "--quiet",
        "--",
        *command,
    ]
    return _run("srun", args, timeout, environ, env)
