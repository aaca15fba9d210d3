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

This module keeps the process: the main loop, the child, the run's sequence and the
decision after the step. What becomes of each stop signal (held, forwarded, a duplicate,
the third interrupt) is :mod:`hpcckpt.job.forwarding`'s; everything else that decides
lives in the modules imported below, each with a narrow view of the wrapper.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from hpcckpt import procfs
from hpcckpt.job import hang, poison, relaunch, stalled, step
from hpcckpt.job.appmode import AppMode
from hpcckpt.job.config import (
    EXIT_INTERNAL,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    WrapperConfig,
    WrapperError,
    new_attempt_token,
    prepare_ckpt_dir,
    step_environment,
)
from hpcckpt.job.continuation import Continuation
from hpcckpt.job.elastic import ElasticWatch
from hpcckpt.job.forwarding import Forwarding, forward_signal
from hpcckpt.job.outcome import (
    EXIT_OK,
    Outcome,
    StepResult,
    classify,
    describe_returncode,
)
from hpcckpt.job.reporting import DETAIL, WARN
from hpcckpt.job.signal_queue import SignalQueue
from hpcckpt.job.stop import StopRequest
from hpcckpt.job.stops import OwnScheduleMode, WrapperStops, died_by_signal
from hpcckpt.rundir import events, verbosity
from hpcckpt.rundir.env import LOG_LEVEL_ENV
from hpcckpt.rundir.status import RunStatus, read_status
from hpcckpt.signames import signal_name
from hpcckpt.slurm import env as slurm_env

__all__ = ["Wrapper", "run_wrapper"]


class Wrapper:
    """One wrapper run: ``Wrapper(config).run()`` returns the process exit status."""

    def __init__(self, config: WrapperConfig, *, log: TextIO | None = None) -> None:
        self.config = config
        self.environ: Mapping[str, str] = os.environ if config.environ is None else config.environ
        self.log_stream = log if log is not None else sys.stderr
        self.verbosity = config.verbosity
        self.slurm_env = slurm_env.SlurmEnv.from_environ(self.environ)
        self.restart = events.restart_number(self.environ)
        self.attempt = new_attempt_token(self.slurm_env, self.restart)
        self.continuing = Continuation(
            self, config, self.slurm_env, self.environ, attempt=self.attempt, restart=self.restart
        )
        self.t0 = procfs.process_start_monotonic()
        self.child: subprocess.Popen[bytes] | None = None
        self.child_started: float | None = None
        self.signals = SignalQueue()
        # Stop-request state: requested -> (held) -> forwarded, at most once per attempt.
        self.stop = StopRequest()
        self.command: list[str] = list(config.command)  # placed on nodes by --spare-nodes
        # Applications without the API: restart files and the periodic signal.
        self.app = AppMode(self, config, attempt=self.attempt)  # used with --app-signal
        self.hang: hang.HangWatch | None = None  # --hang-timeout (job/hang.py)
        self.node_failures: relaunch.NodeFailures | None = None  # --spare-nodes, node failures
        self.stops: WrapperStops | None = None  # not exec'd, the end-time stop, preemption
        self.own: OwnScheduleMode | None = None  # --restart-files without --app-signal
        self.forwarding = Forwarding(self)  # each stop request's way to the step
        self.elastic: ElasticWatch | None = None  # torchrun's own restarts (job/elastic.py)

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
        return forward_signal(self.config)

    def own_status(self) -> RunStatus | None:
        status = read_status(self.config.ckpt_dir)
        return status if status is not None and status.attempt == self.attempt else None

    def handle_signal(self, signum: int, t: float | None, heard: str | None = None) -> None:
        """A stop request: a signal, or (``heard``) the wrapper's own end-time stop
        (job/forwarding.py decides what becomes of it)."""
        self.forwarding.handle(signum, t, heard)

    # -- applications without the API (job/appmode.py) --------------------------------------
    def signal_step(self) -> bool:
        """Send the step the application's signal (the periodic checkpoint request)."""
        if self.child is None:
            return False
        try:
            self.forwarding.deliver(self.forward_signal)
        except ProcessLookupError:
            return False
        return True

    def step_alive(self) -> bool:
        return self.child is not None and self.child.poll() is None

    def end_step(self, reason: str) -> None:
        self._terminate_child(reason=reason)

    # -- ending the step -------------------------------------------------------------------
    def _terminate_child(self, reason: str = "") -> dict[str, Any]:
        """Take the step down (:func:`hpcckpt.job.step.take_down`); what it took."""
        child = self.child
        if child is None or child.poll() is not None:
            return {}
        why = f" ({reason})" if reason else ""
        self.log(
            f"taking the step (pid {child.pid}) down{why}: SIGTERM, SIGKILL after "
            f"{step.KILL_GRACE:g} s"
        )
        job = self.slurm_env.job_id if self.slurm_env.in_job else None
        return step.take_down(child, log=self.log, slurm_job=job, environ=self.environ)

    # -- the run -------------------------------------------------------------------------
    def start_child(self, extra: Mapping[str, str] | None = None) -> int | None:
        """Start the step; returns an exit status if it could not be started."""
        cmd = self.command
        env = step_environment(
            self.environ, self.config.ckpt_dir, self.attempt, self.forward_signal, extra
        )
        if self.verbosity != verbosity.NORMAL:
            env[LOG_LEVEL_ENV] = verbosity.level_name(self.verbosity)
        self.log(
            "step environment: "
            + " ".join(
                f"{k}={env[k]}" for k in sorted(env) if k.startswith(("HPCCKPT_", "OMPI_MCA_io"))
            ),
            DETAIL,
        )
        try:
            self.child = step.start(cmd, env, exit_code_if_orphaned=EXIT_INTERNAL)
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
            while (got := self.signals.pop()) is not None:
                self.handle_signal(*got)
            if self.stops is not None:
                self.stops.tick()  # the wrapper's own end-time stop (job/stops.py)
            self.forwarding.check_held()
            if self.own is not None:
                self.own.tick()
            elif self.config.app_mode:
                assert self.child is not None
                self.app.tick(
                    may_signal=not (self.stop.forwarded or self.stop.held)
                    and self.forwarding.app_ready(),
                    signal=signal_name(self.forward_signal),
                    pid=self.child.pid,
                )
            self._check_hang()
            if self.elastic is not None:
                self.elastic.tick()
            if self.node_failures is not None:
                self.node_failures.tick()  # a stop signal may mean that a node failed
            rc = self.child.poll()
            if rc is not None:
                return rc
            busy = self.stop.held or self.app.busy
            timeout = self.config.poll_interval if busy else 1.0
            if self.app.schedule is not None:
                timeout = min(timeout, max(0.05, self.app.schedule.next_at() - time.monotonic()))
            self.signals.wait(timeout)

    def run(self) -> int:
        """Run the step to its end and decide; returns the wrapper's exit status."""
        self.signals.install(self.stop_signals)
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
            self.signals.restore()

    # -- hang and poison -------------------------------------------------------------------
    def _start_hang_watch(self) -> hang.HangWatch | None:
        cfg = self.config
        try:
            watch = hang.start_watch(
                ckpt_dir=cfg.ckpt_dir,
                timeout=cfg.hang_timeout,
                save_timeout=cfg.hang_save_timeout,
                progress_files=cfg.progress_files,
                app_mode=cfg.app_mode,
                nranks=self.slurm_env.ntasks or None,
            )
        except hang.HangConfigError as exc:
            raise WrapperError(str(exc)) from None
        if watch is not None:
            self.log(watch.describe())
        return watch

    def _check_hang(self) -> None:
        """--hang-timeout: take a step whose ranks went silent down (it ends as a crash)."""
        watch, child = self.hang, self.child
        if watch is None or child is None or child.poll() is not None:
            return
        verdict = watch.check()
        if verdict is None:
            return
        self.log(f"{verdict.message()}; taking the step (pid {child.pid}) down")
        self.event(
            events.HANG,
            **verdict.event_fields(),
            timeout=watch.timeout,
            save_timeout=watch.save_timeout,
            progress_files=watch.patterns or None,
            elapsed=round(self.elapsed(), 3),
        )
        t0 = time.monotonic()
        job = self.slurm_env.job_id if self.slurm_env.in_job else None
        taken = step.take_down(child, log=self.log, slurm_job=job, environ=self.environ)
        self.log(f"hung step taken down in {time.monotonic() - t0:.1f} s")
        self.event(events.HANG_KILLED, seconds=round(time.monotonic() - t0, 3), **taken)

    def _poisoned(self, result: StepResult) -> StepResult:
        """A crash after this attempt rejected its state is ``poisoned`` (job/poison.py)."""
        if result.outcome is not Outcome.CRASHED:
            return result
        try:
            log = list(events.read_events(self.config.ckpt_dir))
        except OSError:
            return result
        return poison.classify_poisoned(result, log, self.attempt)[0]

    @property
    def continuation(self) -> str | None:
        """How this job continues: "chain", "requeue", or None (outside Slurm / disabled)."""
        return self.continuing.how

    def continue_job(self, cause: str, step: int | None) -> int:
        """Requeue this job or submit the next link of the chain (job/continuation.py)."""
        return self.continuing.continue_job(cause, step)

    def _run(self) -> int:
        cfg = self.config
        cfg.check()
        self.stops = WrapperStops(self)  # not exec'd? (first lines of the log); end-time stop
        prepare_ckpt_dir(cfg.ckpt_dir)
        self.own = OwnScheduleMode(self) if cfg.own_schedule else None
        where = f"Slurm job {self.slurm_env.job_id}" if self.slurm_env.in_job else "outside Slurm"
        app_signal = signal_name(self.forward_signal)
        mode = f"; application signal {app_signal}" if cfg.app_mode else ""
        if self.own is not None:
            mode = "; the application takes no signal"
        self.log(
            f"attempt {self.attempt} ({where}, restart {self.restart}); "
            f"checkpoints in {cfg.ckpt_dir}; stop signal {signal_name(cfg.stop_signal)}{mode}; "
            f"{self.continuing.describe()}"
        )
        self.continuing.check_at_start()  # Requeue=0: said now, not at the first stop
        self.event(
            events.WRAPPER_START,
            command=list(cfg.command),
            signal=signal_name(cfg.stop_signal),
            app_signal=signal_name(cfg.app_signal) if cfg.app_signal else None,
            requeue=self.continuation == "requeue",
            chain=self.continuation == "chain",
            max_restarts=cfg.max_restarts,
            pid=os.getpid(),
            nodes=slurm_env.nodelist(self.environ),  # which node failed, at the next start
        )
        node_failures = self.node_failures = relaunch.NodeFailures(self)
        try:
            self.command = node_failures.before_start()
        except relaunch.RelaunchError as exc:
            raise WrapperError(str(exc)) from None
        stop_in = None  # what HPCCKPT_INTERVAL is fitted to
        if cfg.app_mode and (cfg.ckpt_every or self.own is not None):
            stop_in = self.stops.seconds_to_stop(self.continuation is not None)
        extra = (
            self.app.prepare(restart=self.restart, nodes=self.slurm_env.num_nodes, stop_in=stop_in)
            if cfg.app_mode
            else {}
        )
        if self.own is not None:
            extra.update(self.own.prepare(stop_in))
        self.hang = self._start_hang_watch()  # clears the heartbeats of earlier attempts
        self.elastic = ElasticWatch(self)
        failed = self.start_child(extra)
        self.stops.arm(self.continuation is not None)
        if failed is not None:
            self.event(events.CRASHED, exit_code=failed, reason="the step could not be started")
            return failed
        code = self._after_step(self.wait_child(), extra)
        while (got := self.signals.pop()) is not None:  # e.g. TERM while scontrol requeue ran
            signum, t = got
            when = self.forwarding.when(t)
            self.log(f"signal {signal_name(signum)} received {when}; step already ended")
        self.forwarding.join_lead_check(2.0)
        return code

    def _after_step(self, rc: int, extra: Mapping[str, str]) -> int:
        """Act on node failures (relaunch, or the job was requeued), else decide."""
        assert self.node_failures is not None
        while True:
            decision = self.node_failures.after_step(rc)
            if isinstance(decision, relaunch.Continued):
                return decision.exit_code
            if not isinstance(decision, relaunch.Relaunch):
                return self.finish(rc)
            self.command = decision.command
            self.child = None
            failed = self.start_child(extra)
            if failed is not None:
                self.event(
                    events.CRASHED, exit_code=failed, reason="the relaunched step could not start"
                )
                return failed
            rc = self.wait_child()

    @property
    def stop_requested(self) -> bool:
        return self.stop.requested

    @property
    def stop_forwarded(self) -> bool:
        return self.stop.forwarded

    def _result(self, rc: int) -> StepResult:
        if not self.config.app_mode:
            result = classify(rc, read_status(self.config.ckpt_dir), self.attempt)
            return result if self.elastic is None else self.elastic.adjust(result)
        if self.own is not None:
            return self.own.result(rc)
        pending = self.app.pending
        if pending is not None and (rc == 0 or died_by_signal(rc)):  # ended mid-write, or before
            if pending.stop and not self.app.files.written_since(pending):
                self.app.pending, self.app.killed_before_writing = None, True
                how = (
                    "exited 0 after the stop signal without writing a restart file (it "
                    "finished its work as the stop came, or stopped without one): the newest "
                    "kept set stands and the next run goes on from it"
                    if rc == 0
                    else f"was {describe_returncode(rc)} after the stop signal, before writing "
                    "any restart file (a rank with no handler for it yet?): the newest kept set "
                    "stands"
                )
                self.log(f"the step {how}")
            elif rc != 0:
                self.app.pending = None
                self.log(f"the step was {describe_returncode(rc)}: its restart files may be cut")
        self.app.finish_pending()
        if not self.stop.forwarded and rc != 0 and self.stops is not None:
            self.stops.preempted_app_stop(rc)  # Slurm's TERM went to the tasks directly
        return self.app.outcome(rc, stop_sent=self.stop.forwarded)

    def _run_facts(self) -> stalled.RunFacts:
        """What this run shows, for the no-progress decision (job/stalled.py)."""
        started = time.time() - self.elapsed()
        if self.own is not None:
            return self.own.facts(started)
        plan = self.stops.end.plan if self.stops is not None and self.stops.end else None
        end = None if plan is None else plan.end
        timing = {
            "run_seconds": None if end is None else end - started,
            "stop_before_end": None if end is None else end - time.time(),
        }
        if self.config.app_mode:  # --app-signal: seen only through --restart-files
            return stalled.RunFacts(observable=bool(self.config.restart_files), **timing)
        try:
            log = events.read_events(self.config.ckpt_dir)
            ran = any(
                e.get("event") == events.START and e.get("attempt") == self.attempt for e in log
            )
        except OSError:
            ran = False
        return stalled.RunFacts(restart_files=False, observable=ran, **timing)

    def finish(self, rc: int) -> int:
        if self.stop.held:
            self.log(
                f"the held {self.stop.name} was never forwarded: the step exited "
                "before the application was ready for it"
            )
        result = self._poisoned(hang.adjust(self.hang, self._result(rc)))
        st = result.status
        step = st.step if st is not None else None
        self.event(
            events.STEP_END,
            exit_code=rc,
            outcome=result.outcome.value,
            state=st.state if st is not None else None,
            step=step,
            elapsed=round(self.elapsed(), 3),
        )
        if result.outcome is Outcome.FINISHED:
            last = f", last checkpoint at step {step}" if step is not None else ""
            self.log(f"application finished ({describe_returncode(rc)}{last}); done")
            self.event(events.FINISHED, step=step)
            return EXIT_OK
        if result.outcome is Outcome.STOPPED:
            self.app.after_stop()
            if rc != 0 and not self.app.ended_by_wrapper and self.own is not None:
                self.log(
                    f"note: the step ended with {describe_returncode(rc)}: the application "
                    "takes no signal, so a stop ends it by a kill; it resumes from its newest "
                    "kept restart set: a stop, not a crash"
                )
            elif rc != 0 and not self.app.ended_by_wrapper and not self.app.killed_before_writing:
                what = "its restart files were" if self.config.app_mode else "the checkpoint was"
                self.log(
                    f"note: the step ended with {describe_returncode(rc)} after {what} "
                    "complete: a stop, not a crash"
                )
            return self.continuing.after_stop(step, self._run_facts())
        if result.outcome is Outcome.POISONED:  # rejected state: never requeue into it
            return self.continuing.after_poison(result, step)
        runtime = time.monotonic() - (self.child_started or self.t0)
        return self.continuing.after_crash(result, step, runtime)


def run_wrapper(config: WrapperConfig, *, log: TextIO | None = None) -> int:
    """Convenience: ``Wrapper(config, log=log).run()``."""
    return Wrapper(config, log=log).run()
