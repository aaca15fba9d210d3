"""Is the wrapper the batch shell? (``exec hpcckpt ...`` in the batch script)

Slurm's ``--signal=B:SIG@T`` goes to the batch shell's process only. With ``exec`` the
wrapper *is* that process (its parent is ``slurmstepd``). Without it the batch script's
bash gets the signal: with no trap, USR1/USR2 kill it and the job ends with the
checkpoint never asked for; with a trap, bash runs it only after the wrapper returns.

:func:`check` tells which: in a batch step (``SLURM_JOB_ID`` set, ``SLURM_STEP_ID``
not; a ``slurmstepd`` among our ancestors) whose parent is not ``slurmstepd``. It also
reads ``#SBATCH --signal=`` from the batch script (the parent's last argument), so that
the wrapper's own end-time stop can come before that signal (:mod:`hpcckpt.job.endstop`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from hpcckpt import procfs
from hpcckpt.slurm.env import SlurmEnv

STEPD = "slurmstepd"
_SIGNAL = re.compile(r"--signal[= ]\s*(?:[A-Za-z]*:)?([A-Za-z0-9]+)(?:@(\d+))?")


@dataclass(frozen=True)
class ShellCheck:
    exec_ok: bool
    parent_pid: int
    parent: str  # the parent's command name
    script: str | None = None
    signal_name: str | None = None
    signal_lead: int | None = None  # seconds (Slurm's default is 60 when @T is left out)

    def problem(self) -> str:
        return (
            f"this wrapper is not the batch shell: its parent is the batch script's shell "
            f"({self.parent}, pid {self.parent_pid}), not slurmstepd. Slurm's "
            "--signal=B:... goes to that shell, which is killed by it (or runs its trap only "
            "after the wrapper returns), so the stop signal never reaches the wrapper"
        )

    def fix(self) -> str:
        return "write the wrapper line as `exec hpcckpt ...` (the last line of the script)"


def ancestors(pid: int) -> list[tuple[int, str]]:
    """[(pid, command name)] from ``pid``'s parent up to init."""
    out: list[tuple[int, str]] = []
    seen = {pid}
    parent = procfs.parent_of(pid)
    while parent is not None and parent > 1 and parent not in seen:
        seen.add(parent)
        name = procfs.command_name(parent)
        if name is None:
            break
        out.append((parent, name))
        parent = procfs.parent_of(parent)
    return out


def script_signal(path: str) -> tuple[str | None, int | None]:
    """The ``#SBATCH --signal=[B:]SIG[@T]`` of a batch script: (SIG, T) or (None, None)."""
    try:
        with open(path, errors="replace") as fh:
            lines = fh.read(1 << 20).splitlines()
    except OSError:
        return None, None
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            match = _SIGNAL.search(stripped)
            if match:
                return match.group(1).upper(), int(match.group(2) or 60)
        elif stripped and not stripped.startswith("#"):
            break  # sbatch reads #SBATCH lines only before the first command
    return None, None


def check(environ: Mapping[str, str], pid: int) -> ShellCheck | None:
    """None outside a batch step; else whether ``pid`` is the batch shell (see module doc)."""
    job = SlurmEnv.from_environ(environ)
    if not job.in_job:
        return None
    if job.step_id:
        return None  # inside an srun step, not the batch script
    chain = ancestors(pid)
    if not chain or not any(name == STEPD for _, name in chain):
        return None  # salloc, or something we do not recognise
    parent_pid, parent = chain[0]
    if parent == STEPD:
        return ShellCheck(True, parent_pid, parent)
    argv = procfs.cmdline(parent_pid)
    script = argv[-1] if len(argv) > 1 else None
    name, lead = script_signal(script) if script else (None, None)
    return ShellCheck(False, parent_pid, parent, script, name, lead)
