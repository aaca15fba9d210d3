"""The one way hpcckpt runs a Slurm command: an argument list, a timeout, clear errors.

Never through a shell. A missing, failing or hanging command raises a
:class:`SlurmError` subclass whose message says what happened and what to do. On a
timeout the command's whole session is killed, so a hung wrapper script's children
cannot keep our pipes open.

The command paths can be overridden for sites that keep Slurm's clients elsewhere and
for tests: ``HPCCKPT_SCONTROL``, ``HPCCKPT_SQUEUE``, ``HPCCKPT_SBATCH``,
``HPCCKPT_SINFO``, ``HPCCKPT_SCANCEL``, ``HPCCKPT_SRUN`` (:mod:`hpcckpt.rundir.env`).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence

from hpcckpt.rundir.env import (
    SBATCH_ENV,
    SCANCEL_ENV,
    SCONTROL_ENV,
    SINFO_ENV,
    SQUEUE_ENV,
    SRUN_ENV,
)
from hpcckpt.signames import signal_name

#: The variable overriding each Slurm client's path.
OVERRIDES = {
    "scontrol": SCONTROL_ENV,
    "squeue": SQUEUE_ENV,
    "sbatch": SBATCH_ENV,
    "sinfo": SINFO_ENV,
    "scancel": SCANCEL_ENV,
    "srun": SRUN_ENV,
}

#: ``scontrol requeue`` may wait on a busy slurmctld; submitit uses 60 s as well.
REQUEUE_TIMEOUT = 60.0
#: A read-only query should answer quickly; it is never worth waiting a minute for.
QUERY_TIMEOUT = 15.0
#: sbatch talks to slurmctld once; as patient as a requeue.
SUBMIT_TIMEOUT = 60.0

# A job id as scontrol accepts it: 1234, an array task 1234_7, a het component 1234+1.
_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?(\+[0-9]+)?$")


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


def command_path(
    name: str, env_var: str | None = None, environ: Mapping[str, str] | None = None
) -> str:
    """The path to run for a Slurm command: its override (``$HPCCKPT_SQUEUE`` for squeue)
    if set, else ``name`` from PATH."""
    env = os.environ if environ is None else environ
    var = env_var if env_var is not None else OVERRIDES.get(name)
    return (env.get(var) if var else None) or name


def _override_of(path: str) -> str:
    return OVERRIDES.get(os.path.basename(path), " / ".join(OVERRIDES.values()))


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
            f"(set {_override_of(argv[0])} to the command's full path)"
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
            f"killed by signal SIG{signal_name(-proc.returncode)}"
            if proc.returncode < 0
            else f"exit status {proc.returncode}"
        )
        raise SlurmCommandFailed(f"`{shown}` failed ({how}): {detail}", proc.returncode, err)
    return out


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
