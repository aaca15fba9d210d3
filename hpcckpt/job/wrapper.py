"""The job wrapper: start the step, hold and forward stop signals, then finish or continue.

``hpcckpt srun`` and ``hpcckpt run`` are thin click commands over :class:`Wrapper`.
The wrapper knows nothing of HDF5: it talks to the application only through the
environment (``HPCCKPT_DIR``, ``HPCCKPT_ATTEMPT``, ...) and the checkpoint directory
(``hpcckpt-status.json`` to read, ``events.jsonl`` to append, ``restart-sets/`` for
applications without the Python API). See ``docs/wrapper.md``.

After the step: finished -> exit 0; stopped after a checkpoint -> continue the job
(``scontrol requeue``, or ``--chain``: a new job depending on this one); crashed ->
continue from the last checkpoint if the restart budget allows and the attempt made
progress (:mod:`hpcckpt.job.budget`), else give up with a message and a non-zero exit.

Process model
-------------
The step (``srun``/``mpirun``/any command) is a direct child and stays in the wrapper's
process group. Reasons: with ``ProctrackType=proctrack/pgid`` Slurm finds a job's
processes by process group, so a child in a group of its own could escape the cleanup at
the end of the job or at a requeue; a launcher in the terminal's foreground group keeps
job control (stdin, Ctrl-Z) working when run by hand. Slurm's ``B:`` signal goes to the
batch shell's process only, so the launcher still hears of a stop request only through
us. Because the child shares our group we never ``killpg`` it; to end the step we send
SIGTERM to the launcher (srun and mpirun then take their tasks down), SIGKILL after a
grace period. If the wrapper itself is SIGKILLed, the child gets SIGTERM from the kernel
(``PR_SET_PDEATHSIG``), and inside Slurm proctrack cleans up anyway.
"""

from __future__ import annotations

import os
import secrets
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hpcckpt import signames
from hpcckpt.job import budget, early_signals, events, hang, leadtime, poison, slurm, verbosity
from hpcckpt.job.outcome import (
    EXIT_NO_FINISH,
    EXIT_OK,
    Outcome,
    StepResult,
    classify,
    classify_app,
    crash_exit_code,
    describe_returncode,
    signal_name,
)
from hpcckpt.job.status import (
    ATTEMPT_ENV,
    DIR_ENV,
    FINISHED,
    RUNNING,
    STOPPED,
    RunStatus,
    read_status,
)

__all__ = [
    "EXIT_CONTINUE_FAILED",
    "EXIT_INTERNAL",
    "EXIT_NOT_EXECUTABLE",
    "EXIT_NOT_FOUND",
    "EXIT_NO_FINISH",
    "EXIT_OK",
    "EXIT_REQUEUE_FAILED",
    "EXIT_USAGE",
    "Outcome",
    "StepResult",
    "Wrapper",
    "WrapperConfig",
    "WrapperError",
    "classify",
    "classify_app",
    "crash_exit_code",
    "describe_returncode",
    "parse_signal",
    "run_wrapper",
    "signal_name",
]

#: The stop signal's name (``USR1``) for the application, which may choose to listen to it.
SIGNAL_ENV = "HPCCKPT_SIGNAL"
#: ``1`` when the step resumes (a restart set exists, or this is a restart), else ``0``.
RESTART_ENV = "HPCCKPT_RESTART"
#: The periodic checkpoint interval in whole seconds (``--ckpt-every``), for the app's flags.
INTERVAL_ENV = "HPCCKPT_INTERVAL"
#: Override the ``srun`` that ``hpcckpt srun`` runs (tests; unusual installs).
SRUN_ENV = "HPCCKPT_SRUN"
#: Open MPI's MPI-IO component. Its default, ``ompio``, made collective HDF5 writes about
#: ten times slower than ``romio321`` on this kind of machine (0.27 vs 3.4 GB/s, 2 ranks);
#: so the step gets ``romio321`` unless the user chose a component.
MPI_IO_ENV = "OMPI_MCA_io"
MPI_IO_DEFAULT = "romio321"

EXIT_USAGE = 2
EXIT_CONTINUE_FAILED = 3  # requeue or chain submission failed (the checkpoint is safe)
EXIT_REQUEUE_FAILED = EXIT_CONTINUE_FAILED
EXIT_INTERNAL = 70  # the wrapper itself failed (EX_SOFTWARE)
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

#: Grace between SIGTERM and SIGKILL when the wrapper must take the step down itself.
KILL_GRACE = 10.0

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
    """Create the directory owner-only (0700) if missing; fail clearly if unusable."""
    try:
        if not path.is_dir():
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.chmod(0o700)
    except OSError as exc:
        raise WrapperError(f"cannot create the checkpoint directory {path}: {exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise WrapperError(f"the checkpoint directory {path} is not writable by this user")


def restart_number(env: slurm.SlurmEnv, environ: Mapping[str, str]) -> int:
    """``SLURM_RESTART_COUNT`` + ``HPCCKPT_CHAIN_COUNT``: how many runs came before."""
    from hpcckpt.job.chain import chain_count

    return env.restart_count + chain_count(environ)


def new_attempt_token(env: slurm.SlurmEnv, restart: int | None = None) -> str:
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
    """The step's environment: ours plus the contract variables and the MPI-IO default."""
    env = dict(base)
    env[DIR_ENV] = str(ckpt_dir)
    env[ATTEMPT_ENV] = attempt
    env[SIGNAL_ENV] = signal_name(stop_signal)
    env.setdefault(MPI_IO_ENV, MPI_IO_DEFAULT)
    env.update(extra or {})
    return env


def srun_command(args: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """``srun`` (or ``$HPCCKPT_SRUN``) followed by the user's arguments, untouched."""
    env = os.environ if environ is None else environ
    return [env.get(SRUN_ENV) or "srun", *args]


@dataclass
class WrapperConfig:
    command: list[str]
    ckpt_dir: Path
    stop_signal: signal.Signals = signal.SIGUSR1
    requeue: bool | None = None  # None: requeue when inside a Slurm job (unless chain)
    requeue_timeout: float = slurm.REQUEUE_TIMEOUT
    poll_interval: float = 0.25  # status/file polling while something is pending
    environ: Mapping[str, str] | None = None  # default: os.environ
    # continuing
    chain: bool = False
    max_restarts: int = budget.DEFAULT_MAX_RESTARTS
    min_progress: float = budget.DEFAULT_MIN_PROGRESS
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
    # hang detection (job/hang.py)
    hang_timeout: float | None = None
    hang_save_timeout: float | None = None
    progress_files: list[str] = field(default_factory=list)
    # node failures (job/relaunch.py): step on N-K nodes, relaunch on the K spares
    spare_nodes: int = 0
    # how much to say: verbosity.QUIET, NORMAL or VERBOSE (--quiet / --verbose)
    verbosity: int = verbosity.NORMAL

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


def _pdeathsig_setter() -> Callable[[], None] | None:
    """A preexec function asking the kernel to SIGTERM the child if the wrapper dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def setup() -> None:  # runs in the child between fork and exec
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the wrapper died before prctl took effect
            os._exit(EXIT_INTERNAL)

    return setup


def process_start_monotonic() -> float:
    """When this process was exec'd, on the ``time.monotonic()`` clock (Linux; else now).

    Elapsed times in the log then count from the wrapper's exec, which is what matters
    when judging how early Slurm's signal came.
    """
    now = time.monotonic()
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, IndexError, ValueError, AttributeError):
        return now
    return now - age if 0 <= age < 86400 * 365 else now


#: Levels of :meth:`Wrapper.log` lines: shown even with --quiet, or only with --verbose.
WARN, DETAIL = verbosity.QUIET, verbosity.VERBOSE


class Wrapper:
    """One wrapper run: ``Wrapper(config).run()`` returns the process exit status."""

    def __init__(self, config: WrapperConfig, *, log: TextIO | None = None) -> None:
        self.config = config
        self.environ: Mapping[str, str] = os.environ if config.environ is None else config.environ
        self.log_stream = log if log is not None else sys.stderr
        self.verbosity = config.verbosity
        self.slurm_env = slurm.SlurmEnv.from_environ(self.environ)
        self.restart = restart_number(self.slurm_env, self.environ)
        self.attempt = new_attempt_token(self.slurm_env, self.restart)
        self.t0 = process_start_monotonic()
        self.child: subprocess.Popen[bytes] | None = None
        self.child_started: float | None = None
        self._queue: deque[tuple[int, float | None]] = deque()
        self._wake_r = self._wake_w = -1
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup = -1
        # Stop-request state: requested -> (held) -> forwarded, at most once per attempt.
        self._requested_at: float | None = None
        self._requested_wall: float | None = None
        self._requested_name = ""
        self._forwarded_at: float | None = None
        self._held = False
        self._interrupts = 0
        # Applications without the API: restart files and the periodic signal.
        self.files: Any = None  # restart_files.RestartFiles when --restart-files is given
        self.schedule: Any = None  # periodic.PeriodicSchedule when --ckpt-every is given
        self._pending: Any = None  # restart_files.PendingSet being watched
        self._set_after_stop = False
        self._stop_set_registered = False
        self._stop_cost: float | None = None
        self._ended_by_wrapper = False
        self._lead_thread: threading.Thread | None = None
        self.hang: hang.HangWatch | None = None  # --hang-timeout (job/hang.py)
        self.stops: Any = None  # stops.WrapperStops: not exec'd, end-time stop, preemption
        self.own: Any = None  # stops.OwnScheduleMode: --restart-files without --app-signal
        self.node_failures: Any = None  # relaunch.NodeFailures (issue 11)

    # -- logging -------------------------------------------------------------------------
    def log(self, message: str, level: int = verbosity.NORMAL) -> None:
        """One line on stderr; ``level`` WARN lines show even with --quiet, DETAIL only with
        --verbose."""
        if level > self.verbosity:
            return
        try:
            print(f"hpcckpt: {message}", file=self.log_stream, flush=True)
        except (OSError, ValueError):  # stderr gone: keep running the job regardless
            pass

    def event(self, kind: str, **fields: Any) -> bool:
        ctx = events.job_context(self.environ)
        ctx.update(restart=self.restart, attempt=self.attempt)
        if self.slurm_env.ntasks:
            ctx["nranks"] = self.slurm_env.ntasks
        try:
            events.append_event(self.config.ckpt_dir, kind, **{**ctx, **fields})
        except OSError as exc:
            self.log(f"warning: cannot append to {events.EVENTS_FILE}: {exc}", WARN)
            return False
        return True

    def elapsed(self, t: float | None = None) -> float:
        return (time.monotonic() if t is None else t) - self.t0

    # -- signals -------------------------------------------------------------------------
    @property
    def stop_signals(self) -> list[signal.Signals]:
        """Every signal that means "stop": the configured one, TERM, INT, and USR1/USR2."""
        sigs = [self.config.stop_signal]
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            if sig not in sigs:
                sigs.append(sig)
        return sigs

    @property
    def forward_signal(self) -> signal.Signals:
        """What a stop request becomes for the step: --app-signal, else --signal."""
        return self.config.app_signal or self.config.stop_signal

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._queue.append((signum, time.monotonic()))

    def _on_child(self, _signum: int, _frame: object) -> None:
        pass  # the wakeup fd already woke the main loop

    def install_handlers(self) -> None:
        """Take over from early_signals: our handlers first, then adopt what it recorded."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in self.stop_signals:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        self._old_handlers[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, self._on_child)
        for sig in early_signals.take():  # arrived while Python was importing
            self._queue.append((sig, None))

    def restore_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
            except (TypeError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
        self._old_handlers.clear()
        signal.set_wakeup_fd(self._old_wakeup)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def own_status(self) -> RunStatus | None:
        status = read_status(self.config.ckpt_dir)
        return status if status is not None and status.attempt == self.attempt else None

    def _when(self, t: float | None) -> str:
        return "during start-up" if t is None else f"{self.elapsed(t):.1f} s after start"

    def app_ready(self) -> bool:
        """May a signal reach the application now? (--app-signal: --app-ready after start)"""
        if self.child is None or self.child.poll() is not None:
            return False
        if self.config.app_mode:
            assert self.child_started is not None
            return time.monotonic() - self.child_started >= self.config.app_ready
        status = self.own_status()
        return status is not None and status.state == RUNNING

    def handle_signal(self, signum: int, t: float | None, heard: str | None = None) -> None:
        """A stop request: a signal, or (``heard``) the wrapper's own end-time stop."""
        name = signal_name(signum) if heard is None else heard
        when = self._when(t)
        if heard is None:
            heard = f"signal {name} received"
        elapsed = None if t is None else round(self.elapsed(t), 3)
        note = ""
        if heard.startswith("signal") and signum not in (
            self.config.stop_signal,
            signal.SIGTERM,
            signal.SIGINT,
        ):
            note = f" (not the configured --signal {signal_name(self.config.stop_signal)})"
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts >= 3 and self.child is not None and self.child.poll() is None:
                hard = signal.SIGKILL if self._interrupts >= 4 else signal.SIGTERM
                self.log(
                    f"interrupt #{self._interrupts}: sending {signal_name(hard)} to the step "
                    f"(pid {self.child.pid}); no checkpoint will be taken"
                )
                self._kill_child(hard)
                self.event("signal", name=name, elapsed=elapsed, forwarded=False, killed=True)
                return
        if self._forwarded_at is not None or (self._requested_at is not None and not self._held):
            self.log(
                f"{heard} {when}{note}; a stop request is already under way; "
                "not forwarding it again"
            )
            self.event("signal", name=name, elapsed=elapsed, forwarded=False, duplicate=True)
            return
        if self._held:
            self.log(
                f"{heard} {when}{note}; a stop request is already held until "
                "the application is ready for it"
            )
            self.event("signal", name=name, elapsed=elapsed, forwarded=False, duplicate=True)
            return
        self._requested_at = time.monotonic() if t is None else t
        self._requested_wall = time.time() - (time.monotonic() - self._requested_at)
        self._requested_name = name
        if heard.startswith("signal"):  # the wrapper's own end-time stop has no lead to check
            self._start_lead_check()
        if self.child is None or self.child.poll() is not None:
            self._held = True
            self.log(f"{heard} {when}{note}; held until the step is running")
            self.event("signal", name=name, elapsed=elapsed, forwarded=False, held=True)
            return
        if self.config.app_mode:
            if self.app_ready():
                self._stop_app(f"{heard} {when}{note}")
                self.event(
                    "signal", name=name, elapsed=elapsed, forwarded=True, as_signal=self._fwd_name()
                )
            else:
                self._held = True
                self.log(
                    f"{heard} {when}{note}; held until the application has run "
                    f"{self.config.app_ready:g} s (--app-ready)"
                )
                self.event("signal", name=name, elapsed=elapsed, forwarded=False, held=True)
            return
        status = self.own_status()
        state = status.state if status is not None else None
        if state == RUNNING:
            self._forward(f"{heard} {when}{note}")
            self.event(
                "signal", name=name, elapsed=elapsed, forwarded=True, as_signal=self._fwd_name()
            )
        elif state in (STOPPED, FINISHED):
            self.log(
                f"{heard} {when}{note}; the application already reported {state}; not forwarding"
            )
            self.event("signal", name=name, elapsed=elapsed, forwarded=False, app_state=state)
        else:
            self._held = True
            self.log(
                f"{heard} {when}{note}; held: the application has not "
                "reported running yet (forwarding as soon as it does)"
            )
            self.event("signal", name=name, elapsed=elapsed, forwarded=False, held=True)

    def _fwd_name(self) -> str:
        return signal_name(self.forward_signal)

    def _send(self, what: str, subject: str = "", sig: signal.Signals | None = None) -> bool:
        """Send the step (launcher) ``sig`` (default: the forward signal); log it."""
        assert self.child is not None
        sig = self.forward_signal if sig is None else sig
        fwd = signal_name(sig)
        as_ = "" if fwd == self._requested_name else f" as {fwd}"
        subject = f"{subject} " if subject else ""
        try:
            got = self._deliver(sig)
        except ProcessLookupError:
            self.log(f"{what}; the step (pid {self.child.pid}) is already gone")
            return False
        self.log(f"{what}; {subject}forwarded{as_} {got.describe()}")
        return True

    def _deliver(self, sig: signal.Signals) -> Any:
        """Send ``sig`` to the step's ranks once, by the launcher's safe path (job/delivery)."""
        from hpcckpt.job import delivery, jobid

        assert self.child is not None
        kind = delivery.launcher_kind(self.config.command)
        try:
            got = delivery.deliver(
                kind, self.child.pid, sig, job=jobid.target(self.environ), environ=self.environ
            )
        except slurm.SlurmError as exc:  # scancel failed and no task found on this node
            self.log(
                f"warning: cannot deliver {signal_name(sig)} to the tasks: {exc}; not sending it "
                "to srun (srun kills its tasks on TERM); the application hears of the stop only "
                "from Slurm at the time limit",
                WARN,
            )
            self.event("signal_delivered", signal=signal_name(sig), path="none", error=str(exc))
            return delivery.Delivered("none", [str(self.child.pid)], str(exc))
        if got.note:
            self.log(f"note: {got.note}", WARN)
        if got.path != "launcher":  # a path other than kill(launcher): say which
            self.event(
                "signal_delivered", signal=signal_name(sig), path=got.path, targets=got.targets
            )
        return got

    def _forward(self, what: str, subject: str = "") -> None:
        self._held = False
        self._forwarded_at = time.monotonic()
        self._send(what, subject)

    def _stop_app(self, what: str, subject: str = "") -> None:
        """A stop request for an application without the API (see docs/wrapper.md)."""
        self._held = False
        self._forwarded_at = time.monotonic()
        if self.config.own_schedule:  # no signal to send: end the step once no write is under way
            self.log(f"{what}; {self.own.stop_text()}")
            return
        if self._pending is not None:
            self._pending.stop = True
            self.log(
                f"{what}; a checkpoint of the application is under way (signalled "
                f"{time.monotonic() - self._pending.signal_mono:.1f} s ago): stopping once "
                "its restart files are complete"
            )
            return
        if self._send(what, subject) and self.files is not None:
            self._pending = self.files.begin(stop=True)

    def _forwarded_event(self, held_for: float) -> None:
        """The event for a held stop request that has now reached the step."""
        self.event(
            "signal_forwarded",
            name=self._requested_name,
            as_signal=self._fwd_name(),
            elapsed=round(self.elapsed(), 3),
            held_for=round(held_for, 3),
        )

    def check_held(self) -> None:
        """While a stop request is held, forward it once the application is ready."""
        if not self._held or self.child is None:
            return
        if self.config.app_mode:
            if self.app_ready():
                held_for = time.monotonic() - (self._requested_at or self.t0)
                self._stop_app(
                    f"the application has run {self.config.app_ready:g} s",
                    f"{self._requested_name} held for {held_for:.1f} s",
                )
                self._forwarded_event(held_for)
            return
        status = self.own_status()
        if status is None:
            return
        if status.state == RUNNING:
            held_for = time.monotonic() - (self._requested_at or self.t0)
            step = f" (step {status.step})" if status.step is not None else ""
            self._forward(
                f"application reported running{step} {self.elapsed():.1f} s after start",
                f"{self._requested_name} held for {held_for:.1f} s",
            )
            self._forwarded_event(held_for)
        else:
            self._held = False
            self.log(
                f"the application reported {status.state} before the held "
                f"{self._requested_name} could be forwarded; not forwarding"
            )

    # -- lead time (issue 3) ---------------------------------------------------------------
    def _start_lead_check(self) -> None:
        job = self.slurm_env.job_id
        if job is None or self._lead_thread is not None or self._requested_wall is None:
            return
        arrived = self._requested_wall
        name = signal_name(self.config.stop_signal)

        def check() -> None:
            try:
                cost = leadtime.measured_cost(events.read_events(self.config.ckpt_dir))
                if cost is None:
                    return
                end = slurm.end_time(job, environ=self.environ)
                if end is None:
                    return
                result = leadtime.check_lead(cost, end.timestamp() - arrived)
                if result.too_short:
                    self.log(leadtime.warning_text(result, name), WARN)
                    self.event(
                        "lead_time_warning",
                        lead=round(result.lead, 1),
                        cost=round(result.cost, 3),
                        needed=round(result.needed, 1),
                        suggested_signal=f"B:{name}@{result.suggested}",
                    )
            except (slurm.SlurmError, OSError, ValueError) as exc:
                self.log(f"note: cannot check the signal's lead time: {exc}")

        self._lead_thread = threading.Thread(target=check, name="hpcckpt-lead", daemon=True)
        self._lead_thread.start()

    # -- applications without the API: periodic checkpoints, restart files ---------------
    def _tick_app(self) -> None:
        """One pass of the app-mode bookkeeping (periodic signal, watching restart files)."""
        if self.config.own_schedule:
            self.own.tick()
            return
        if self.files is not None and self._pending is not None:
            pending = self._pending
            if self.files.poll(pending):
                self._pending = None
                self._on_files_complete(pending)
            elif time.monotonic() - pending.signal_mono > self.config.restart_timeout:
                self._pending = None
                self.log(
                    f"warning: the restart files were not complete {self.config.restart_timeout:g}"
                    " s after the signal (--restart-timeout); not registering them"
                )
                self.event("restart_timeout", stop=pending.stop)
        if (
            self.schedule is not None
            and self._pending is None
            and self._forwarded_at is None
            and not self._held
            and self.app_ready()
            and self.schedule.due(time.monotonic())
        ):
            assert self.child is not None
            interval = self.schedule.interval()
            try:
                got = self._deliver(self.forward_signal)
            except ProcessLookupError:
                return
            self.log(
                f"periodic checkpoint: sent {self._fwd_name()} {got.describe()} "
                f"{self.elapsed():.1f} s after start (every {interval:.0f} s, "
                f"{self.schedule.describe()})"
            )
            self.event("checkpoint_request", signal=self._fwd_name(), interval=round(interval, 3))
            if self.files is not None:
                self._pending = self.files.begin(stop=False)
            else:
                self.schedule.checkpointed(time.monotonic(), None)

    def _on_files_complete(self, pending: Any) -> None:
        cost = self.files.cost(pending)
        if self.schedule is not None:
            self.schedule.checkpointed(time.monotonic(), cost)
        if pending.stop:
            self._set_after_stop = True
            self._stop_cost = cost
            self.log(f"restart files complete {cost:.1f} s after the stop signal; ending the step")
            self._end_step()
            return
        self._register(cost, stop=False)

    def _register(self, cost: float | None, stop: bool) -> bool:
        try:
            got = self.files.register(attempt=self.attempt, seconds=cost)
        except OSError as exc:
            self.log(f"warning: cannot keep the restart files aside: {exc}", WARN)
            self.event("restart_set_failed", error=str(exc), stop=stop)
            return False
        secs = "" if cost is None else f" written in {cost:.1f} s,"
        self.log(
            f"restart set {got.number}:{secs} {len(got.files)} file(s), {got.bytes} bytes, "
            f"checksummed and kept in {got.path}"
        )
        self.event(
            "restart_set",
            set=got.number,
            files=len(got.files),
            bytes=got.bytes,
            seconds=None if cost is None else round(cost, 6),
            stop=stop,
        )
        return True

    def _finish_pending(self) -> None:
        """The step exited while its restart files were watched: give them time to settle."""
        if self.files is None or self._pending is None:
            return
        pending, self._pending = self._pending, None
        deadline = time.monotonic() + self.config.settle * 2 + 1.0
        while time.monotonic() < deadline:
            if self.files.poll(pending):
                cost = self.files.cost(pending)
                if pending.stop:
                    self._set_after_stop = True
                    self._stop_cost = cost
                else:
                    self._register(cost, stop=False)
                return
            time.sleep(min(self.config.poll_interval, 0.1))

    def _end_step(self) -> None:
        """The stop checkpoint is complete and the step still runs: end it (TERM, KILL)."""
        self._ended_by_wrapper = True
        self._terminate_child(reason="its restart files are complete", log_it=False)

    def prepare_app(self) -> dict[str, str]:
        """Set up app mode; returns the extra environment for the step."""
        cfg = self.config
        extra: dict[str, str] = {}
        resuming = self.restart > 0
        if cfg.restart_files:
            from hpcckpt.job.restart_files import RestartFiles

            self.files = RestartFiles(
                cfg.restart_files,
                cfg.ckpt_dir,
                marker=cfg.restart_marker,
                settle=cfg.settle,
                keep=cfg.keep_sets,
            )
            try:
                number, wrong = self.files.ensure_good()
            except OSError as exc:
                raise WrapperError(f"cannot check the restart files: {exc}") from None
            for problem in wrong:
                self.log(f"restart files: {problem}")
            if number is not None:
                resuming = True
                restored = bool(wrong)
                self.log(
                    f"restart files: set {number} is good"
                    + ("; copied it back over the damaged live files" if restored else "")
                )
                self.event("restart_files_checked", set=number, restored=restored, problems=wrong)
        if cfg.ckpt_every:
            from hpcckpt.job.periodic import PeriodicSchedule

            try:
                history = list(events.read_events(cfg.ckpt_dir))
            except OSError:
                history = []
            try:
                self.schedule = PeriodicSchedule(
                    cfg.ckpt_every,
                    start=time.monotonic(),
                    nodes=self.slurm_env.num_nodes,
                    mtbf=cfg.mtbf,
                    history=history,
                )
            except ValueError as exc:
                raise WrapperError(f"--ckpt-every {cfg.ckpt_every}: {exc}") from None
            extra[INTERVAL_ENV] = str(max(1, round(self.schedule.interval())))
        extra[RESTART_ENV] = "1" if resuming else "0"
        return extra

    # -- ending the step -------------------------------------------------------------------
    def _kill_child(self, sig: signal.Signals) -> None:
        if self.child is None:
            return
        try:
            os.kill(self.child.pid, sig)
        except ProcessLookupError:
            pass

    def _terminate_child(self, reason: str = "", log_it: bool = True) -> None:
        """Take the step down: SIGTERM to the launcher, SIGKILL after a grace."""
        child = self.child
        if child is None or child.poll() is not None:
            return
        why = f" ({reason})" if reason else ""
        self.log(
            f"taking the step (pid {child.pid}) down{why}: SIGTERM, SIGKILL after {KILL_GRACE:g} s"
        )
        self._kill_child(signal.SIGTERM)
        try:
            child.wait(timeout=KILL_GRACE)
        except subprocess.TimeoutExpired:
            self._kill_child(signal.SIGKILL)
            child.wait()

    # -- the run -------------------------------------------------------------------------
    def start_child(self, extra: Mapping[str, str] | None = None) -> int | None:
        """Start the step; returns an exit status if it could not be started."""
        cmd = self.config.command
        env = step_environment(
            self.environ, self.config.ckpt_dir, self.attempt, self.forward_signal, extra
        )
        if self.verbosity != verbosity.NORMAL:
            env[verbosity.LOG_LEVEL_ENV] = verbosity.level_name(self.verbosity)
        self.log(
            "step environment: "
            + " ".join(
                f"{k}={env[k]}" for k in sorted(env) if k.startswith(("HPCCKPT_", "OMPI_MCA_io"))
            ),
            DETAIL,
        )
        try:
            self.child = subprocess.Popen(cmd, env=env, preexec_fn=_pdeathsig_setter())
        except FileNotFoundError:
            self.log(f"cannot start the step: command not found: {cmd[0]}", WARN)
            return EXIT_NOT_FOUND
        except PermissionError as exc:
            self.log(f"cannot start the step: {cmd[0]} is not executable ({exc})", WARN)
            return EXIT_NOT_EXECUTABLE
        except OSError as exc:
            self.log(f"cannot start the step {cmd[0]}: {exc}", WARN)
            return EXIT_NOT_EXECUTABLE
        self.child_started = time.monotonic()
        self.log(
            f"started step (pid {self.child.pid}) {self.elapsed():.2f} s after start: "
            f"{shlex.join(cmd)}"
        )
        return None

    def wait_child(self) -> int:
        """The main loop: handle signals, forward held requests, until the step exits."""
        assert self.child is not None
        while True:
            self._drain_wakeup()
            while self._queue:
                self.handle_signal(*self._queue.popleft())
            if self.stops is not None:
                self.stops.tick()  # the wrapper's own end-time stop (job/stops.py)
            self.check_held()
            if self.config.app_mode:
                self._tick_app()
            hang.tick(self)  # --hang-timeout: a silent step is taken down
            if self.node_failures is not None:
                self.node_failures.tick()  # issue 11: a stop signal may mean a node failed
            rc = self.child.poll()
            if rc is not None:
                return rc
            busy = self._held or self._pending is not None
            timeout = self.config.poll_interval if busy else 1.0
            if self.schedule is not None:
                timeout = min(timeout, max(0.05, self.schedule.next_at() - time.monotonic()))
            try:
                select.select([self._wake_r], [], [], timeout)
            except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                pass

    def run(self) -> int:
        """Run the step to its end and decide; returns the wrapper's exit status."""
        self.install_handlers()
        try:
            return self._run()
        except WrapperError as exc:
            self.log(f"error: {exc}", WARN)
            return EXIT_USAGE
        except BaseException as exc:
            self.log(f"internal error: {exc!r}", WARN)
            self._terminate_child()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return EXIT_INTERNAL
        finally:
            self.restore_handlers()

    @property
    def continuation(self) -> str | None:
        """How this job continues: "chain", "requeue", or None (outside Slurm / disabled)."""
        if not self.slurm_env.in_job:
            return None
        if self.config.chain:
            return "chain"
        requeue = True if self.config.requeue is None else self.config.requeue
        return "requeue" if requeue else None

    def _run(self) -> int:
        cfg = self.config
        cfg.check()
        from hpcckpt.job.stops import OwnScheduleMode, WrapperStops

        self.stops = WrapperStops(self)  # not exec'd? (first lines of the log); end-time stop
        prepare_ckpt_dir(cfg.ckpt_dir)
        self.own = OwnScheduleMode(self) if cfg.own_schedule else None
        where = f"Slurm job {self.slurm_env.job_id}" if self.slurm_env.in_job else "outside Slurm"
        cont = self.continuation or "off"
        mode = f"; application signal {self._fwd_name()}" if cfg.app_mode else ""
        self.log(
            f"attempt {self.attempt} ({where}, restart {self.restart}); "
            f"checkpoints in {cfg.ckpt_dir}; stop signal {signal_name(cfg.stop_signal)}{mode}; "
            f"continue by {cont}"
        )
        self.event(
            "wrapper_start",
            command=list(cfg.command),
            signal=signal_name(cfg.stop_signal),
            app_signal=signal_name(cfg.app_signal) if cfg.app_signal else None,
            requeue=self.continuation == "requeue",
            chain=self.continuation == "chain",
            max_restarts=cfg.max_restarts,
            pid=os.getpid(),
            nodes=self.environ.get("SLURM_JOB_NODELIST"),  # issue 11: which node failed
        )
        from hpcckpt.job import relaunch  # issue 11: node failures, --spare-nodes

        node_failures = self.node_failures = relaunch.NodeFailures(self)
        try:
            node_failures.before_start()
        except relaunch.RelaunchError as exc:
            raise WrapperError(str(exc)) from None
        extra = self.prepare_app() if cfg.app_mode else {}
        if cfg.own_schedule:
            extra.update(self.own.prepare())
        self.hang = hang.start_watch(self)  # clears the heartbeats of earlier attempts
        failed = self.start_child(extra)
        self.stops.arm(self.continuation is not None)
        if failed is not None:
            self.event("crashed", exit_code=failed, reason="the step could not be started")
            return failed
        rc = self.wait_child()
        rc, code = node_failures.after_step(rc, extra)  # None: no node failure to handle
        code = self.finish(rc) if code is None else code
        while self._queue:  # e.g. Slurm's TERM while scontrol requeue ran
            signum, t = self._queue.popleft()
            self.log(f"signal {signal_name(signum)} received {self._when(t)}; step already ended")
        if self._lead_thread is not None:
            self._lead_thread.join(timeout=2.0)
        return code

    def _result(self, rc: int) -> StepResult:
        if not self.config.app_mode:
            return classify(rc, read_status(self.config.ckpt_dir), self.attempt)
        if self.config.own_schedule:
            return self.own.result(rc)
        from hpcckpt.job.stops import died_by_signal

        if self._pending is not None and died_by_signal(rc):  # its writer was killed mid-write
            self.log(f"the step was {describe_returncode(rc)}: its restart files may be cut")
            self._pending = None
        self._finish_pending()
        if self._forwarded_at is None and rc != 0 and self.stops is not None:
            self.stops.preempted_app_stop(rc)  # Slurm's TERM went to the tasks directly
        return classify_app(
            rc,
            stop_sent=self._forwarded_at is not None,
            watching_files=self.files is not None,
            set_after_stop=self._set_after_stop,
            ended_by_wrapper=self._ended_by_wrapper,
        )

    def finish(self, rc: int) -> int:
        if self._held:
            self.log(
                f"the held {self._requested_name} was never forwarded: the step exited "
                "before the application was ready for it"
            )
        result = poison.check(self, hang.adjust(self, self._result(rc)))  # issue 10
        st = result.status
        step = st.step if st is not None else None
        self.event(
            "step_end",
            exit_code=rc,
            outcome=result.outcome.value,
            state=st.state if st is not None else None,
            step=step,
            elapsed=round(self.elapsed(), 3),
        )
        if result.outcome is Outcome.FINISHED:
            last = f", last checkpoint at step {step}" if step is not None else ""
            self.log(f"application finished ({describe_returncode(rc)}{last}); done")
            self.event("finished", step=step)
            return EXIT_OK
        if result.outcome is Outcome.STOPPED:
            if self.files is not None and self._set_after_stop and not self._stop_set_registered:
                self._stop_set_registered = True
                self._register(self._stop_cost, stop=True)
            if rc != 0 and not self._ended_by_wrapper:
                what = "its restart files were" if self.config.app_mode else "the checkpoint was"
                self.log(
                    f"note: the step ended with {describe_returncode(rc)} after {what} "
                    "complete: a stop, not a crash"
                )
            return self.after_stop(step)
        if result.outcome is Outcome.POISONED:  # rejected state: never requeue into it
            return poison.after_poison(self, result, step)
        return self.after_crash(result, step)

    def after_crash(self, result: StepResult, step: int | None) -> int:
        rc = result.returncode
        code = crash_exit_code(rc)
        self.log(f"step crashed: {result.reason}", WARN)
        self.event("crashed", exit_code=rc, reason=result.reason, step=step, wrapper_exit=code)
        how = self.continuation
        if how is None:
            if self.slurm_env.in_job:
                self.log(
                    "not continuing: requeue disabled (--no-requeue); submit the batch script "
                    f"again to resume from the last checkpoint in {self.config.ckpt_dir}"
                )
            return code
        runtime = time.monotonic() - (self.child_started or self.t0)
        try:
            log = list(events.read_events(self.config.ckpt_dir))
        except OSError:
            log = None
        decision = budget.decide_after_crash(
            log,
            attempt=self.attempt,
            restart=self.restart,
            runtime=runtime,
            max_restarts=self.config.max_restarts,
            min_progress=self.config.min_progress,
        )
        if not decision.restart:
            self.log(decision.message, WARN)
            self.log(
                f"job {self.slurm_env.job_id}: restart {self.restart} of this computation, "
                f"{decision.used} after crashes (--max-restarts {self.config.max_restarts}); "
                f"the last good checkpoint stays in {self.config.ckpt_dir}. What to do: read "
                "the application's errors above, fix the cause, then submit the same batch "
                "script again (it resumes from that checkpoint with a fresh restart budget)",
                WARN,
            )
            self.event(
                "give_up",
                reason=decision.message,
                crash_restarts=decision.used,
                max_restarts=self.config.max_restarts,
                progress=decision.progress,
                wrapper_exit=code,
            )
            return code
        self.log(decision.message)
        cont = self.continue_job("crash", step)
        return EXIT_OK if cont == EXIT_OK else cont

    def after_stop(self, step: int | None) -> int:
        at_step = f" at step {step}" if step is not None else ""
        how = self.continuation
        if how is None:
            why = "requeue disabled (--no-requeue)" if self.slurm_env.in_job else "outside Slurm"
            self.log(f"stopped{at_step} after checkpoint; run again to resume ({why})")
            self.event("stopped", step=step, requeued=False, reason=why)
            return EXIT_OK
        self.log(f"stopped{at_step} after checkpoint")
        return self.continue_job("stop", step)

    def continue_job(self, cause: str, step: int | None) -> int:
        """Requeue this job or submit the next link of the chain; 0 or EXIT_CONTINUE_FAILED."""
        job = self.slurm_env.job_id
        assert job is not None
        at_step = f" at step {step}" if step is not None else ""
        if self.continuation == "chain":
            return self._chain(job, cause, step, at_step)
        from hpcckpt.job import jobid

        target = jobid.target(self.environ) or job  # an array task: <array job id>_<task id>
        self.log(f"requeueing job {target} (scontrol requeue)")
        if not self.event("requeue", job_id=job, step=step, cause=cause) and cause == "crash":
            self.log(
                "not requeueing after a crash: the restart could not be counted in the log", WARN
            )
            return EXIT_CONTINUE_FAILED
        try:
            slurm.requeue(target, timeout=self.config.requeue_timeout, environ=self.environ)
        except (slurm.SlurmError, ValueError) as exc:
            self.log(f"requeue failed: {exc}", WARN)
            self.log(
                f"the checkpoint{at_step} is safe in {self.config.ckpt_dir}: resubmit the same "
                "batch script (sbatch) to resume; make sure it has #SBATCH --requeue and that "
                f"scontrol works on the compute nodes (or set {slurm.SCONTROL_ENV}), or use "
                "--chain"
            )
            self.event("requeue_failed", job_id=job, error=str(exc), cause=cause)
            return EXIT_CONTINUE_FAILED
        self.log(
            f"job {job} requeued; Slurm ends this run now and starts it again "
            "(it may wait about two minutes in PENDING/BeginTime)"
        )
        return EXIT_OK

    def _chain(self, job: str, cause: str, step: int | None, at_step: str) -> int:
        from hpcckpt.job import chain

        self.log(f"submitting the next job of the chain (sbatch --dependency=afterany:{job})")
        if not self.event("chain", job_id=job, step=step, cause=cause) and cause == "crash":
            self.log(
                "not chaining after a crash: the restart could not be counted in the log", WARN
            )
            return EXIT_CONTINUE_FAILED
        try:
            new, spec, count = chain.submit_next(
                job,
                self.environ,
                ckpt_dir=str(self.config.ckpt_dir),
                timeout=self.config.requeue_timeout,
            )
        except (chain.ChainError, slurm.SlurmError, ValueError, OSError) as exc:
            self.log(f"chain failed: {exc}", WARN)
            self.log(
                f"the checkpoint{at_step} is safe in {self.config.ckpt_dir}: submit the same "
                "batch script again (with the same HPCCKPT_DIR) to resume"
            )
            self.event("chain_failed", job_id=job, error=str(exc), cause=cause)
            return EXIT_CONTINUE_FAILED
        self.log(
            f"submitted job {new} (chain link {count}): "
            f"{shlex.join([spec.script, *spec.script_args])}; it starts when job {job} has ended"
        )
        self.event("chain_submitted", job_id=job, next_job=new, chain_next=count, cause=cause)
        return EXIT_OK


def run_wrapper(config: WrapperConfig, *, log: TextIO | None = None) -> int:
    """Convenience: ``Wrapper(config, log=log).run()``."""
    return Wrapper(config, log=log).run()
