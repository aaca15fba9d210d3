"""The wrapper's configuration, its exit statuses and the step's environment.

What ``hpcckpt run``/``srun`` parse their options into (:class:`WrapperConfig`), the
usage errors found before the step starts (:class:`WrapperError`, exit status 2), and
the pure helpers that build the step's command and environment.
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpcckpt import signames
from hpcckpt.job.budget import DEFAULT_MAX_RESTARTS, DEFAULT_MIN_PROGRESS
from hpcckpt.job.outcome import EXIT_NO_FINISH, EXIT_OK
from hpcckpt.rundir import directory
from hpcckpt.rundir.env import ATTEMPT_ENV, DIR_ENV, SIGNAL_ENV, SRUN_ENV
from hpcckpt.rundir.verbosity import NORMAL
from hpcckpt.signames import signal_name
from hpcckpt.slurm import srun_options
from hpcckpt.slurm.env import SlurmEnv, kill_on_bad_exit_set
from hpcckpt.slurm.runner import REQUEUE_TIMEOUT

__all__ = [
    "EXIT_CONTINUE_FAILED",
    "EXIT_INTERNAL",
    "EXIT_NO_PROGRESS",
    "EXIT_NOT_EXECUTABLE",
    "EXIT_NOT_FOUND",
    "EXIT_NO_FINISH",
    "EXIT_OK",
    "EXIT_USAGE",
    "WrapperConfig",
    "WrapperError",
    "new_attempt_token",
    "parse_signal",
    "prepare_ckpt_dir",
    "resolve_ckpt_dir",
    "srun_command",
    "step_environment",
]

EXIT_USAGE = 2
EXIT_CONTINUE_FAILED = 3  # requeue or chain submission failed (the checkpoint is safe)
EXIT_NO_PROGRESS = 4  # runs in a row stopped before keeping anything new: not continued
EXIT_INTERNAL = 70  # the wrapper itself failed (EX_SOFTWARE)
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


class WrapperError(Exception):
    """A configuration problem found before the step starts (exit status 2)."""


def parse_signal(value: str | int) -> signal.Signals:
    """``USR1``, ``SIGUSR1``, ``usr1`` or ``10`` → ``signal.SIGUSR1``; ValueError otherwise."""
    sig = signames.parse_signal(value)
    if sig in _UNCATCHABLE or sig == signal.SIGCHLD:
        raise ValueError(f"{sig.name} cannot serve as the stop signal")
    return sig


def resolve_ckpt_dir(option: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> Path:
    """``--ckpt-dir``, else ``$HPCCKPT_DIR``, made absolute; WrapperError if neither is set."""
    value = option if option not in (None, "") else environ.get(DIR_ENV)
    if not value:
        raise WrapperError(
            f"no checkpoint directory: pass --ckpt-dir DIR or set {DIR_ENV} "
            "(a directory on a file system every node can reach)"
        )
    return Path(os.path.abspath(os.path.expanduser(os.fspath(value))))


def prepare_ckpt_dir(path: Path) -> None:
    """Create the directory owner-only (0700) if missing; WrapperError saying what is wrong
    with it and the fix when it is not a directory or this user cannot write it."""
    try:
        if not path.is_dir():
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.chmod(0o700)
        directory.probe(path)
    except OSError as exc:
        raise WrapperError(directory.explain(path, exc, option="--ckpt-dir")) from None


def new_attempt_token(env: SlurmEnv, restart: int | None = None) -> str:
    """Fresh per wrapper start: ``<job id or 'local'>.<restart number>.<random>``."""
    n = env.restart_count if restart is None else restart
    return f"{env.job_id or 'local'}.{n}.{secrets.token_hex(6)}"


def step_environment(
    base: Mapping[str, str],
    ckpt_dir: Path,
    attempt: str,
    stop_signal: signal.Signals,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The step's environment: ours plus the contract variables (no MPI-IO component:
    hpcckpt's store does no MPI-IO, and the application's own choice stays its own)."""
    env = dict(base)
    env[DIR_ENV] = str(ckpt_dir)
    env[ATTEMPT_ENV] = attempt
    env[SIGNAL_ENV] = signal_name(stop_signal)
    env.update(extra or {})
    return env


#: srun's option that ends the whole step as soon as one task exits non-zero or is killed.
KILL_ON_BAD_EXIT = "--kill-on-bad-exit=1"


def srun_command(
    args: Sequence[str],
    environ: Mapping[str, str] | None = None,
    *,
    kill_on_bad_exit: bool = False,
) -> list[str]:
    """``srun`` (or ``$HPCCKPT_SRUN``) followed by the user's arguments.

    With ``kill_on_bad_exit``, :data:`KILL_ON_BAD_EXIT` comes first unless the user chose
    (``-K``, ``--kill-on-bad-exit`` among srun's options, not the program's;
    ``$SLURM_KILL_BAD_EXIT``): without it (Slurm's
    default) MPI ranks whose peer died wait for it in their next collective, and srun
    waits for them until the job's time limit.
    """
    env = os.environ if environ is None else environ
    chosen = kill_on_bad_exit_set(env) or any(srun_options.given(args, "kill-on-bad-exit"))
    extra = [KILL_ON_BAD_EXIT] if kill_on_bad_exit and not chosen else []
    return [env.get(SRUN_ENV) or "srun", *extra, *args]


@dataclass
class WrapperConfig:
    command: list[str]
    ckpt_dir: Path
    stop_signal: signal.Signals = signal.SIGUSR1
    requeue: bool | None = None  # None: requeue when inside a Slurm job (unless chain)
    requeue_timeout: float = REQUEUE_TIMEOUT
    poll_interval: float = 0.25  # status/file polling while something is pending
    environ: Mapping[str, str] | None = None  # default: os.environ
    # continuing
    chain: bool = False
    max_restarts: int = DEFAULT_MAX_RESTARTS
    min_progress: float = DEFAULT_MIN_PROGRESS
    # applications without the Python API
    app_signal: signal.Signals | None = None
    app_ready: float = 5.0  # seconds after the start before a signal may reach the app
    restart_files: list[str] = field(default_factory=list)
    restart_marker: str | None = None
    settle: float = 2.0
    keep_sets: int = 2
    restart_timeout: float = 600.0
    ckpt_every: str | None = None
    mtbf: str | None = None
    # hang detection (hpcckpt/job/hang.py)
    hang_timeout: float | None = None
    hang_save_timeout: float | None = None
    progress_files: list[str] = field(default_factory=list)
    # node failures (hpcckpt/job/relaunch.py): step on N-K nodes, relaunch on the K spares
    spare_nodes: int = 0
    # how much to say: verbosity.QUIET, NORMAL or VERBOSE (--quiet / --verbose)
    verbosity: int = NORMAL

    @property
    def app_mode(self) -> bool:
        return self.app_signal is not None or bool(self.restart_files)

    @property
    def own_schedule(self) -> bool:
        """Restart files without a signal: the application writes them when it wants."""
        return self.app_signal is None and bool(self.restart_files)

    def check(self) -> None:
        if self.app_signal is None:
            for name, value in (
                ("--ckpt-every", self.ckpt_every),
                ("--restart-marker", self.restart_marker),
            ):
                if value:
                    raise WrapperError(
                        f"{name} needs a signal the application checkpoints on: add "
                        "--app-signal SIG (the Checkpointer schedules its own checkpoints; "
                        "with --restart-files alone the application writes on its own schedule)"
                    )
        if self.restart_marker and not self.restart_files:
            raise WrapperError("--restart-marker needs --restart-files GLOB")
        if self.chain and self.requeue:
            raise WrapperError("--chain and --requeue exclude each other: choose one")
        if self.max_restarts < 0:
            raise WrapperError("--max-restarts must be 0 or more")
