"""The Slurm side of the job's life: environment variables and the two commands we need.

Everything here is plain stdlib. Slurm commands run as argument lists (never through a
shell) with a timeout; a missing, failing or hanging command raises a :class:`SlurmError`
subclass whose message says what happened and what to do.

The command paths can be overridden for sites that keep Slurm's clients elsewhere and for
tests: ``HPCCKPT_SCONTROL``, ``HPCCKPT_SQUEUE`` and ``HPCCKPT_SBATCH``.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

SCONTROL_ENV = "HPCCKPT_SCONTROL"
SQUEUE_ENV = "HPCCKPT_SQUEUE"
SBATCH_ENV = "HPCCKPT_SBATCH"

#: ``scontrol requeue`` may wait on a busy slurmctld; submitit uses 60 s as well.
REQUEUE_TIMEOUT = 60.0
#: A read-only query should answer quickly; it is never worth waiting a minute for.
QUERY_TIMEOUT = 15.0
#: sbatch talks to slurmctld once; as patient as a requeue.
SUBMIT_TIMEOUT = 60.0

# A job id as scontrol accepts it: 1234, an array task 1234_7, a het component 1234+1.
_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?(\+[0-9]+)?$")
# What squeue prints for %e when there is no end time.
_NO_TIME = {"", "unknown", "n/a", "none", "invalid"}


class SlurmError(RuntimeError):
    """A Slurm command could not do what was asked; the message says why and what to do."""


class SlurmCommandNotFound(SlurmError):
    """The command does not exist (or is not executable) at the path we tried."""


class SlurmCommandFailed(SlurmError):
    """The command ran and exited non-zero."""

    def __init__(self, message: str, returncode: int, stderr: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr


class SlurmCommandTimeout(SlurmError):
    """The command did not finish within its timeout and was killed."""


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
            ntasks=_int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS"), 0) or None,
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


def command_path(name: str, env_var: str, environ: Mapping[str, str] | None = None) -> str:
    """The path to run for a Slurm command: ``$env_var`` if set, else ``name`` from PATH."""
    env = os.environ if environ is None else environ
    return env.get(env_var) or name


def check_job_id(value: str) -> str:
    """Return ``value`` if it looks like a Slurm job id, else raise ValueError."""
    value = str(value).strip()
    if not _JOB_ID.match(value):
        raise ValueError(f"not a Slurm job id: {value!r}")
    return value


def run_command(
    argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
) -> str:
    """Run ``argv`` (no shell), return its stdout; raise a :class:`SlurmError` on any trouble.

    The command runs in its own session so that, on timeout, the whole process group is
    killed: a hung wrapper script's children cannot keep our pipes open.
    """
    argv = [str(a) for a in argv]
    shown = shlex.join(argv)
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=None if env is None else dict(env),
        )
    except FileNotFoundError:
        raise SlurmCommandNotFound(
            f"`{argv[0]}` not found: is Slurm's client installed on this node? "
            f"(set {SCONTROL_ENV} / {SQUEUE_ENV} / {SBATCH_ENV} to the command's full path)"
        ) from None
    except PermissionError as exc:
        raise SlurmCommandNotFound(f"`{argv[0]}` cannot be executed: {exc}") from None
    except OSError as exc:
        raise SlurmError(f"cannot run `{shown}`: {exc}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise SlurmCommandTimeout(
            f"`{shown}` did not finish within {timeout:g} s and was killed; "
            "slurmctld may be down or overloaded"
        ) from None
    if proc.returncode != 0:
        detail = (err or out).strip() or "no message"
        how = (
            f"killed by signal {_signame(-proc.returncode)}"
            if proc.returncode < 0
            else f"exit status {proc.returncode}"
        )
        raise SlurmCommandFailed(f"`{shown}` failed ({how}): {detail}", proc.returncode, err)
    return out


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process outside our group
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        proc.wait()


def requeue(
    job: str, *, timeout: float = REQUEUE_TIMEOUT, environ: Mapping[str, str] | None = None
) -> None:
    """``scontrol requeue JOB``: put the job back in the queue with the same id.

    Works only for a batch job submitted with ``--requeue`` (or under ``JobRequeue=1``).
    Slurm ends the running batch script soon after; the next start has
    ``SLURM_RESTART_COUNT`` one higher.
    """
    argv = [command_path("scontrol", SCONTROL_ENV, environ), "requeue", check_job_id(job)]
    run_command(argv, timeout=timeout)


def parse_end_time(text: str) -> datetime | None:
    """Parse squeue's ``%e`` (``2026-11-22T04:15:00``, local time); None for ``Unknown``/``N/A``.

    Only the first non-empty line counts (a heterogeneous job prints one per component).
    Raises ValueError for anything else.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if first.lower() in _NO_TIME:
        return None
    try:
        return datetime.strptime(first, "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        raise ValueError(f"unexpected end time from squeue: {first!r}") from None


def end_time(
    job: str, *, timeout: float = QUERY_TIMEOUT, environ: Mapping[str, str] | None = None
) -> datetime | None:
    """The job's end time as Slurm plans it now (naive local time), or None if unknown."""
    argv = [
        command_path("squeue", SQUEUE_ENV, environ),
        "-h",
        "-j",
        check_job_id(job),
        "-o",
        "%e",
    ]
    out = run_command(argv, timeout=timeout)
    try:
        return parse_end_time(out)
    except ValueError as exc:
        raise SlurmError(str(exc)) from None


def seconds_left(
    job: str,
    *,
    now: float | None = None,
    timeout: float = QUERY_TIMEOUT,
    environ: Mapping[str, str] | None = None,
) -> float | None:
    """Seconds until the job's end time (negative if past), or None if Slurm has none."""
    end = end_time(job, timeout=timeout, environ=environ)
    if end is None:
        return None
    return end.timestamp() - (time.time() if now is None else now)


# `scontrol show job -o` prints KEY=VALUE pairs separated by spaces; a value may contain
# spaces (Command= shows the script's arguments joined by spaces), so split before
# every " Key=" rather than at every space.
_PAIR_START = re.compile(r" (?=[A-Za-z][A-Za-z0-9_:/]*=)")


def parse_show_job(text: str) -> dict[str, str]:
    """``scontrol show job -o`` output (first line) as a dict of strings."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    info: dict[str, str] = {}
    for part in _PAIR_START.split(line):
        key, sep, value = part.partition("=")
        if sep and key not in info:
            info[key] = value.strip()
    return info


def show_job(
    job: str, *, timeout: float = QUERY_TIMEOUT, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``scontrol show job -o JOB`` as a dict (``Command``, ``TimeLimit``, ``NumTasks``...)."""
    argv = [command_path("scontrol", SCONTROL_ENV, environ), "show", "job", "-o", check_job_id(job)]
    return parse_show_job(run_command(argv, timeout=timeout))


def submit(
    args: Sequence[str],
    *,
    timeout: float = SUBMIT_TIMEOUT,
    environ: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """``sbatch --parsable ARGS`` (``$HPCCKPT_SBATCH`` or sbatch); returns the new job id.

    ``environ`` is where the command's path is looked up, ``env`` the environment sbatch
    runs with (what ``--export=ALL`` hands to the new job).
    """
    argv = [command_path("sbatch", SBATCH_ENV, environ), "--parsable", *map(str, args)]
    out = run_command(argv, timeout=timeout, env=env)
    job = out.strip().splitlines()[-1].split(";")[0].strip() if out.strip() else ""
    try:
        return check_job_id(job)
    except ValueError:
        raise SlurmError(f"sbatch did not print a job id (output: {out.strip()!r})") from None
