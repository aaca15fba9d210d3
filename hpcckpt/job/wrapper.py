"""The job wrapper: start the step, hold and forward stop signals, then finish, requeue or fail.

``hpcckpt srun`` and ``hpcckpt run`` are thin click commands over :class:`Wrapper`.
The wrapper knows nothing of HDF5: it talks to the application only through the
environment (``HPCCKPT_DIR``, ``HPCCKPT_ATTEMPT``) and the checkpoint directory
(``hpcckpt-status.json`` to read, ``events.jsonl`` to append). See ``docs/wrapper.md``.

Process model
-------------
The step (``srun``/``mpirun``/any command) is a direct child and stays in the wrapper's
process group. Reasons: with ``ProctrackType=proctrack/pgid`` Slurm finds a job's
processes by process group, so a child in a group of its own could escape the cleanup at
the end of the job or at a requeue; a launcher in the terminal's foreground group keeps
job control (stdin, Ctrl-Z) working when run by hand. Slurm's ``B:`` signal goes to the
batch shell's process only, so the launcher still hears of a stop request only through
us. Because the child shares our group we never ``killpg`` it; on an unexpected error we
send SIGTERM to the launcher (srun and mpirun then take their tasks down), SIGKILL after
a grace period. If the wrapper itself is SIGKILLed, the child gets SIGTERM from the kernel
(``PR_SET_PDEATHSIG``), and inside Slurm proctrack cleans up anyway.
"""

from __future__ import annotations

import enum
import os
import secrets
import select
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from hpcckpt import signames
from hpcckpt.job import early_signals, events, slurm
from hpcckpt.job.status import (
    ATTEMPT_ENV,
    DIR_ENV,
    FINISHED,
    RUNNING,
    STOPPED,
    RunStatus,
    read_status,
)

#: The stop signal's name (``USR1``) for the application, which may choose to listen to it.
SIGNAL_ENV = "HPCCKPT_SIGNAL"
#: Override the ``srun`` that ``hpcckpt srun`` runs (tests; unusual installs).
SRUN_ENV = "HPCCKPT_SRUN"
#: Open MPI's MPI-IO component. Its default, ``ompio``, made collective HDF5 writes about
#: ten times slower than ``romio321`` on this kind of machine (0.27 vs 3.4 GB/s, 2 ranks);
#: so the step gets ``romio321`` unless the user chose a component.
MPI_IO_ENV = "OMPI_MCA_io"
MPI_IO_DEFAULT = "romio321"

EXIT_OK = 0
EXIT_NO_FINISH = 1  # the step exited 0 but never reported finished
EXIT_USAGE = 2
EXIT_REQUEUE_FAILED = 3
EXIT_INTERNAL = 70  # the wrapper itself failed (EX_SOFTWARE)
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

#: Grace between SIGTERM and SIGKILL when the wrapper must take the step down itself.
KILL_GRACE = 10.0

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


class WrapperError(Exception):
    """A configuration problem found before the step starts (exit status 2)."""


class Outcome(enum.Enum):
    """How a step ended, from the wrapper's point of view."""

    FINISHED = "finished"  # the application reported finished: the work is done
    STOPPED = "stopped"  # it checkpointed on a stop request: resume it later
    CRASHED = "crashed"  # anything else


@dataclass(frozen=True)
class StepResult:
    outcome: Outcome
    returncode: int  # as Popen reports it: negative = killed by that signal
    status: RunStatus | None  # the last status of *this* attempt, None if none
    reason: str


def describe_returncode(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal SIG{signal_name(-returncode)}"
    return f"exit status {returncode}"


def classify(returncode: int, status: RunStatus | None, attempt: str) -> StepResult:
    """Decide the outcome from the step's exit status and the last status file.

    The status file is authoritative: ``stopped`` and ``finished`` are written only after
    the checkpoint (or the work) is complete, so a launcher that exits non-zero afterwards
    (a rank killed at the time limit, an error in MPI_Finalize) does not undo them. A
    status carrying another attempt's token is stale and ignored.
    """
    own = status if status is not None and status.attempt == attempt else None
    exited = describe_returncode(returncode)
    if own is not None and own.state == FINISHED:
        return StepResult(Outcome.FINISHED, returncode, own, f"reported finished; {exited}")
    if own is not None and own.state == STOPPED:
        why = f" ({own.reason})" if own.reason else ""
        return StepResult(Outcome.STOPPED, returncode, own, f"reported stopped{why}; {exited}")
    if own is None:
        reason = f"{exited}; the application never reported running with this attempt's token"
    else:
        reason = f"{exited}; last report: running" + (
            f" at step {own.step}" if own.step is not None else ""
        )
    if returncode == 0:
        reason += " (it exited 0 without reporting finished: did it call finish()?)"
    return StepResult(Outcome.CRASHED, returncode, own, reason)


def crash_exit_code(returncode: int) -> int:
    """The wrapper's exit status for a crashed step: its status, 128+N for signal N, never 0."""
    if returncode < 0:
        return 128 + (-returncode)
    return returncode if returncode > 0 else EXIT_NO_FINISH


def parse_signal(value: str | int) -> signal.Signals:
    """``USR1``, ``SIGUSR1``, ``usr1`` or ``10`` → ``signal.SIGUSR1``; ValueError otherwise."""
    sig = signames.parse_signal(value)
    if sig in _UNCATCHABLE or sig == signal.SIGCHLD:
        raise ValueError(f"{sig.name} cannot serve as the stop signal")
    return sig


def signal_name(sig: int) -> str:
    """``USR1`` for SIGUSR1 (Slurm's spelling); the number if unknown."""
    try:
        return signames.short_name(sig)
    except ValueError:
        return str(sig)


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


def new_attempt_token(env: slurm.SlurmEnv) -> str:
    """Fresh per wrapper start: ``<job id or 'local'>.<restart count>.<random>``."""
    return f"{env.job_id or 'local'}.{env.restart_count}.{secrets.token_hex(6)}"


def step_environment(
    base: Mapping[str, str], ckpt_dir: Path, attempt: str, stop_signal: signal.Signals
) -> dict[str, str]:
    """The step's environment: ours plus the contract variables and the MPI-IO default."""
    env = dict(base)
    env[DIR_ENV] = str(ckpt_dir)
    env[ATTEMPT_ENV] = attempt
    env[SIGNAL_ENV] = signal_name(stop_signal)
    env.setdefault(MPI_IO_ENV, MPI_IO_DEFAULT)
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
    requeue: bool | None = None  # None: requeue when inside a Slurm job
    requeue_timeout: float = slurm.REQUEUE_TIMEOUT
    poll_interval: float = 0.25  # status polling while a stop request is held
    environ: Mapping[str, str] | None = None  # default: os.environ


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


class Wrapper:
    """One wrapper run: ``Wrapper(config).run()`` returns the process exit status."""

    def __init__(self, config: WrapperConfig, *, log: TextIO | None = None) -> None:
        self.config = config
        self.environ: Mapping[str, str] = os.environ if config.environ is None else config.environ
        self.log_stream = log if log is not None else sys.stderr
        self.slurm_env = slurm.SlurmEnv.from_environ(self.environ)
        self.attempt = new_attempt_token(self.slurm_env)
        self.t0 = process_start_monotonic()
        self.child: subprocess.Popen[bytes] | None = None
        self._queue: deque[tuple[int, float | None]] = deque()
        self._wake_r = self._wake_w = -1
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup = -1
        # Stop-request state: requested -> (held) -> forwarded, at most once per attempt.
        self._requested_at: float | None = None
        self._requested_name = ""
        self._forwarded_at: float | None = None
        self._held = False
        self._interrupts = 0

    # -- logging -------------------------------------------------------------------------
    def log(self, message: str) -> None:
        try:
            print(f"hpcckpt: {message}", file=self.log_stream, flush=True)
        except (OSError, ValueError):  # stderr gone: keep running the job regardless
            pass

    def event(self, kind: str, **fields: Any) -> None:
        try:
            events.append_event(self.config.ckpt_dir, kind, attempt=self.attempt, **fields)
        except OSError as exc:
            self.log(f"warning: cannot append to {events.EVENTS_FILE}: {exc}")

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

    def handle_signal(self, signum: int, t: float | None) -> None:
        name = signal_name(signum)
        when = self._when(t)
        elapsed = None if t is None else round(self.elapsed(t), 3)
        note = ""
        if signum not in (self.config.stop_signal, signal.SIGTERM, signal.SIGINT):
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
                f"signal {name} received {when}{note}; a stop request is already under way; "
                "not forwarding it again"
            )
            self.event("signal", name=name, elapsed=elapsed, forwarded=False, duplicate=True)
            return
        if self._held:
            self.log(
                f"signal {name} received {when}{note}; a stop request is already held until "
                "the application reports running"
            )
            self.event("signal", name=name, elapsed=elapsed, forwarded=False, duplicate=True)
            return
        self._requested_at = time.monotonic() if t is None else t
        self._requested_name = name
        if self.child is None or self.child.poll() is not None:
            self._held = True
            self.log(f"signal {name} received {when}{note}; held until the step is running")
            self.event("signal", name=name, elapsed=elapsed, forwarded=False, held=True)
            return
        status = self.own_status()
        state = status.state if status is not None else None
        if state == RUNNING:
            self._forward(f"signal {name} received {when}{note}")
            self.event(
                "signal", name=name, elapsed=elapsed, forwarded=True, as_signal=self._fwd_name()
            )
        elif state in (STOPPED, FINISHED):
            self.log(
                f"signal {name} received {when}{note}; the application already reported "
                f"{state}; not forwarding"
            )
            self.event("signal", name=name, elapsed=elapsed, forwarded=False, app_state=state)
        else:
            self._held = True
            self.log(
                f"signal {name} received {when}{note}; held: the application has not "
                "reported running yet (forwarding as soon as it does)"
            )
            self.event("signal", name=name, elapsed=elapsed, forwarded=False, held=True)

    def _fwd_name(self) -> str:
        return signal_name(self.config.stop_signal)

    def _forward(self, what: str, subject: str = "") -> None:
        assert self.child is not None
        self._held = False
        self._forwarded_at = time.monotonic()
        fwd = self._fwd_name()
        as_ = "" if fwd == self._requested_name else f" as {fwd}"
        subject = f"{subject} " if subject else ""
        try:
            os.kill(self.child.pid, self.config.stop_signal)
        except ProcessLookupError:
            self.log(f"{what}; the step (pid {self.child.pid}) is already gone")
            return
        self.log(f"{what}; {subject}forwarded{as_} to step (pid {self.child.pid})")

    def check_held(self) -> None:
        """While a stop request is held, forward it once the application reports running."""
        if not self._held or self.child is None:
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
            self.event(
                "signal_forwarded",
                name=self._requested_name,
                as_signal=self._fwd_name(),
                elapsed=round(self.elapsed(), 3),
                held_for=round(held_for, 3),
            )
        else:
            self._held = False
            self.log(
                f"the application reported {status.state} before the held "
                f"{self._requested_name} could be forwarded; not forwarding"
            )

    def _kill_child(self, sig: signal.Signals) -> None:
        if self.child is None:
            return
        try:
            os.kill(self.child.pid, sig)
        except ProcessLookupError:
            pass

    def _terminate_child(self) -> None:
        """Take the step down on the wrapper's own failure: TERM, then KILL after a grace."""
        child = self.child
        if child is None or child.poll() is not None:
            return
        self.log(f"taking the step (pid {child.pid}) down: SIGTERM, SIGKILL after {KILL_GRACE:g} s")
        self._kill_child(signal.SIGTERM)
        try:
            child.wait(timeout=KILL_GRACE)
        except subprocess.TimeoutExpired:
            self._kill_child(signal.SIGKILL)
            child.wait()

    # -- the run -------------------------------------------------------------------------
    def start_child(self) -> int | None:
        """Start the step; returns an exit status if it could not be started."""
        cmd = self.config.command
        env = step_environment(
            self.environ, self.config.ckpt_dir, self.attempt, self.config.stop_signal
        )
        try:
            self.child = subprocess.Popen(cmd, env=env, preexec_fn=_pdeathsig_setter())
        except FileNotFoundError:
            self.log(f"cannot start the step: command not found: {cmd[0]}")
            return EXIT_NOT_FOUND
        except PermissionError as exc:
            self.log(f"cannot start the step: {cmd[0]} is not executable ({exc})")
            return EXIT_NOT_EXECUTABLE
        except OSError as exc:
            self.log(f"cannot start the step {cmd[0]}: {exc}")
            return EXIT_NOT_EXECUTABLE
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
            self.check_held()
            rc = self.child.poll()
            if rc is not None:
                return rc
            timeout = self.config.poll_interval if self._held else 1.0
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
            self.log(f"error: {exc}")
            return EXIT_USAGE
        except BaseException as exc:
            self.log(f"internal error: {exc!r}")
            self._terminate_child()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return EXIT_INTERNAL
        finally:
            self.restore_handlers()

    def _run(self) -> int:
        cfg = self.config
        prepare_ckpt_dir(cfg.ckpt_dir)
        requeue = self.slurm_env.in_job if cfg.requeue is None else cfg.requeue
        where = f"Slurm job {self.slurm_env.job_id}" if self.slurm_env.in_job else "outside Slurm"
        self.log(
            f"attempt {self.attempt} ({where}, restart {self.slurm_env.restart_count}); "
            f"checkpoints in {cfg.ckpt_dir}; stop signal {self._fwd_name()}; "
            f"requeue {'on' if requeue else 'off'}"
        )
        self.event(
            "wrapper_start",
            command=list(cfg.command),
            signal=self._fwd_name(),
            requeue=requeue,
            pid=os.getpid(),
        )
        failed = self.start_child()
        if failed is not None:
            self.event("crashed", exit_code=failed, reason="the step could not be started")
            return failed
        rc = self.wait_child()
        code = self.finish(rc, requeue)
        while self._queue:  # e.g. Slurm's TERM while scontrol requeue ran
            signum, t = self._queue.popleft()
            self.log(f"signal {signal_name(signum)} received {self._when(t)}; step already ended")
        return code

    def finish(self, rc: int, requeue: bool) -> int:
        if self._held:
            self.log(
                f"the held {self._requested_name} was never forwarded: the step exited "
                "before reporting running"
            )
        result = classify(rc, read_status(self.config.ckpt_dir), self.attempt)
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
            if rc != 0:
                self.log(
                    f"note: the step ended with {describe_returncode(rc)} after reporting "
                    "stopped; the checkpoint was complete before that"
                )
            return self.after_stop(step, requeue)
        self.log(f"step crashed: {result.reason}")
        code = crash_exit_code(rc)
        self.event("crashed", exit_code=rc, reason=result.reason, step=step, wrapper_exit=code)
        return code

    def after_stop(self, step: int | None, requeue: bool) -> int:
        at_step = f" at step {step}" if step is not None else ""
        job = self.slurm_env.job_id
        if not requeue or job is None:
            why = "outside Slurm" if job is None else "requeue disabled (--no-requeue)"
            self.log(f"stopped{at_step} after checkpoint; run again to resume ({why})")
            self.event("stopped", step=step, requeued=False, reason=why)
            return EXIT_OK
        self.log(f"stopped{at_step} after checkpoint; requeueing job {job} (scontrol requeue)")
        self.event("requeue", job_id=job, step=step)
        try:
            slurm.requeue(job, timeout=self.config.requeue_timeout, environ=self.environ)
        except (slurm.SlurmError, ValueError) as exc:
            self.log(f"requeue failed: {exc}")
            self.log(
                f"the checkpoint{at_step} is safe in {self.config.ckpt_dir}: resubmit the same "
                "batch script (sbatch) to resume; make sure it has #SBATCH --requeue and that "
                f"scontrol works on the compute nodes (or set {slurm.SCONTROL_ENV})"
            )
            self.event("requeue_failed", job_id=job, error=str(exc))
            return EXIT_REQUEUE_FAILED
        self.log(
            f"job {job} requeued; Slurm ends this run now and starts it again "
            "(it may wait about two minutes in PENDING/BeginTime)"
        )
        return EXIT_OK


def run_wrapper(config: WrapperConfig, *, log: TextIO | None = None) -> int:
    """Convenience: ``Wrapper(config, log=log).run()``."""
    return Wrapper(config, log=log).run()
