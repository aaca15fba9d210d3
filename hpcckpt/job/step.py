"""The step's life as a process: start it, signal it, take it down with no orphans.

The step (``srun``/``mpirun``/any command) is a direct child of the wrapper and stays in
the wrapper's process group (see :mod:`hpcckpt.job.wrapper`, "Process model"), so it is
never ``killpg``-ed: to end it, the launcher gets SIGTERM (srun and mpirun then take
their tasks down), SIGKILL after one grace period, :data:`KILL_GRACE`. Whatever was
below the launcher and survived it is SIGKILLed too, and inside a Slurm job every step
still running is cancelled (a step outlives a killed srun).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpcckpt import libc, procfs
from hpcckpt.slurm import commands
from hpcckpt.slurm.runner import SlurmError

#: Grace between the launcher's SIGTERM and the SIGKILLs, whoever takes the step down.
KILL_GRACE = 10.0
#: How long the launcher's own clean-up of its ranks may take before leftovers are killed.
CLEANUP_WAIT = 2.0


def pdeathsig_setter(exit_code: int) -> Callable[[], None] | None:
    """A preexec function asking the kernel to SIGTERM the child if the wrapper dies."""
    prctl = libc.function("prctl")  # None off Linux
    if prctl is None:
        return None
    parent = os.getpid()

    def setup() -> None:  # runs in the child between fork and exec
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the wrapper died before prctl took effect
            os._exit(exit_code)

    return setup


def start(
    command: Sequence[str], env: Mapping[str, str], *, exit_code_if_orphaned: int
) -> subprocess.Popen[bytes]:
    """Start the step as a direct child (OSError when it cannot be started)."""
    return subprocess.Popen(
        list(command), env=dict(env), preexec_fn=pdeathsig_setter(exit_code_if_orphaned)
    )


def send(child: subprocess.Popen[Any], sig: int) -> bool:
    """Send the launcher ``sig``; False if it is already gone."""
    try:
        os.kill(child.pid, sig)
    except ProcessLookupError:
        return False
    return True


def take_down(
    child: subprocess.Popen[Any],
    *,
    grace: float = KILL_GRACE,
    log: Callable[[str], None] = lambda _m: None,
    slurm_job: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Take the step down, all ranks, no orphans; returns what it took (for an event).

    1. remember every process below the launcher (mpirun's ranks; srun's are not ours);
    2. SIGTERM the launcher: srun then SIGKILLs every task of its step at once, mpirun
       sends its ranks SIGTERM and SIGKILL a second later;
    3. after ``grace`` seconds: SIGKILL the launcher if still there and, inside a Slurm
       job, ``scancel --signal=KILL JOB.STEP`` every running step of the job;
    4. SIGKILL every remembered process still alive (ranks orphaned by a dead mpirun).
    """
    taken: dict[str, Any] = {"launcher_signal": "TERM", "killed_launcher": False}
    if child.poll() is not None:
        taken["leftovers_killed"] = []
        return taken
    below = procfs.descendants(child.pid)
    send(child, signal.SIGTERM)
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        log(f"the step (pid {child.pid}) is still there {grace:g} s after SIGTERM: SIGKILL")
        below.update(procfs.descendants(child.pid))
        send(child, signal.SIGKILL)
        taken["killed_launcher"] = True
        if slurm_job:
            taken["scancelled"] = _cancel_steps(slurm_job, environ)
        child.wait()
    left = procfs.alive(below)
    deadline = time.monotonic() + CLEANUP_WAIT
    while left and time.monotonic() < deadline:  # the launcher's own clean-up, briefly
        time.sleep(0.1)
        left = procfs.alive(left)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if left:
        log(f"SIGKILLed {len(left)} leftover process(es) of the step: {sorted(left)}")
        deadline = time.monotonic() + 5.0
        while procfs.alive(left) and time.monotonic() < deadline:
            time.sleep(0.05)
    taken["leftovers_killed"] = sorted(left)
    return taken


def _cancel_steps(job: str, environ: Mapping[str, str] | None) -> list[str]:
    """``scancel --signal=KILL`` every running step of ``job``; the steps it found."""
    try:
        steps = commands.job_steps(job, timeout=20.0, env=environ)
    except (SlurmError, ValueError):
        return []
    for step in steps:
        try:
            commands.cancel([step], signal="KILL", timeout=20.0, env=environ)
        except SlurmError:
            pass  # the step ended meanwhile
    return steps
