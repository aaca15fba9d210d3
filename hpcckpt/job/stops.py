"""The wrapper's side of the stops Slurm does not announce to it.

:class:`WrapperStops` (one per wrapper run):

- **not exec'd** (:mod:`hpcckpt.job.batchshell`): said in the first lines of the job log,
  with the fix, and recorded as the ``not_batch_shell`` event;
- **the end-time stop** (:mod:`hpcckpt.job.endstop`): inside a Slurm job that continues
  (requeue or chain), the wrapper requests the stop itself before the end time, exactly
  as if the stop signal had arrived; when not exec'd, early enough to beat the signal that
  would kill the batch shell. For applications using the Checkpointer, whose own
  deadline normally stops them first, the wrapper's comes :data:`API_BACKSTOP` seconds
  later, as a backstop;
- **preemption**: Slurm signals a preempted job's tasks directly and would requeue the job
  by itself after ``GraceTime``; :meth:`WrapperStops.preempted` asks scontrol, and
  :meth:`WrapperStops.preempted_app_stop` turns the step's end into a stop. The wrapper
  then requeues at once (measured: Slurm does not requeue the job a second time).

:class:`OwnScheduleMode`: ``--restart-files`` without ``--app-signal``
(:mod:`hpcckpt.job.ownschedule`).

Both act through :class:`StopsContext`, the part of the wrapper they need.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from hpcckpt.job import batchshell, endstop, ownlead
from hpcckpt.job.appmode import AppMode
from hpcckpt.job.config import WrapperConfig
from hpcckpt.job.outcome import Outcome, StepResult, describe_returncode
from hpcckpt.job.periodic import AUTO, PeriodicSchedule
from hpcckpt.job.reporting import WARN, Reporter
from hpcckpt.job.stalled import RunFacts
from hpcckpt.job.stop import StopRequest
from hpcckpt.rundir import events
from hpcckpt.rundir.env import INTERVAL_ENV
from hpcckpt.signames import signal_name
from hpcckpt.slurm import commands, jobid
from hpcckpt.slurm.env import SlurmEnv
from hpcckpt.slurm.runner import SlurmError

#: Seconds the wrapper's end-time stop waits after the planned time for applications using
#: the Checkpointer (its own deadline, with the cost it tracks, stops them first); before a
#: checkpoint was measured the wrapper assumes no cost for them (the Checkpointer knows the
#: size of its state, the wrapper does not).
API_BACKSTOP = 5.0
#: ``scontrol show job`` values that mean "no time".
_NO_TIME = {"", "none", "unknown", "n/a", "(null)"}


class StopsContext(Reporter, Protocol):
    """What the stops need of the wrapper: its settings, the stop request, app mode, and
    the step to ask about or end."""

    environ: Mapping[str, str]
    config: WrapperConfig
    slurm_env: SlurmEnv
    stop: StopRequest
    app: AppMode
    child_started: float | None
    own: OwnScheduleMode | None

    def handle_signal(self, signum: int, t: float | None, heard: str | None = None) -> None: ...

    def step_alive(self) -> bool: ...

    def end_step(self, reason: str) -> None: ...


def died_by_signal(returncode: int) -> bool:
    """The step (or, as srun/mpirun report it, a task) was killed by a signal."""
    if returncode < 0:
        return True
    return returncode > 128 and returncode - 128 in signal.Signals._value2member_map_


class WrapperStops:
    """Not exec'd, the end-time stop, preemption: see the module doc."""

    def __init__(self, wrapper: StopsContext) -> None:
        self.w = wrapper
        self.end: endstop.EndStop | None = None
        self._armed_for: float | None = None  # the end time the last "armed" line named
        self._unarmed_noted = False  # said once that no end time could be read
        self._read_end: float | None = None  # by seconds_to_stop, for the end-time stop
        self._kill_wait_reader: threading.Thread | None = None  # own schedule: KillWait
        self.shell = batchshell.check(wrapper.environ, os.getpid())
        if self.shell is not None and not self.shell.exec_ok:
            wrapper.log(f"warning: {self.shell.problem()}", WARN)
            wrapper.log(f"fix: {self.shell.fix()}", WARN)

    def _history(self) -> list[dict[str, Any]]:
        """The run's events so far: the measured checkpoint costs the stop plans with."""
        try:
            return list(events.read_events(self.w.config.ckpt_dir))
        except OSError:
            return []

    def _signal_lead(self) -> float | None:
        """The script's ``--signal`` lead when that signal may kill a non-``exec``'d shell."""
        return self.shell.signal_lead if self.shell is not None and not self.shell.exec_ok else None

    def _own_rule(self) -> OwnScheduleMode | None:
        """The application takes no signal, and no ``B:`` signal may kill the shell first:
        the end-time stop follows its writes (job/ownlead.py)."""
        own = self.w.own
        return own if own is not None and self._signal_lead() is None else None

    def _default_cost(self) -> float:
        return endstop.DEFAULT_COST if self.w.config.app_mode else 0.0

    def seconds_to_stop(self, continues: bool) -> float | None:
        """Seconds from now to the end-time stop (one ``squeue`` now), None when there is
        none or Slurm cannot tell: what ``HPCCKPT_INTERVAL`` is fitted to."""
        w = self.w
        target = jobid.target(w.environ)
        if target is None or not continues:
            return None
        try:
            end = commands.end_time(target, environ=w.environ)
        except (SlurmError, ValueError):
            return None
        if end is None:
            return None
        self._read_end = end.timestamp()  # the end-time stop starts from this reading
        own = self._own_rule()
        if own is not None:
            return end.timestamp() - own.measured().lead() - time.time()
        got = endstop.plan(
            end.timestamp(),
            self._history(),
            signal_lead=self._signal_lead(),
            default_cost=self._default_cost(),
        )
        return got.stop_at - time.time()

    def arm(self, continues: bool) -> None:
        """After the step started: record the shell problem, start the end-time stop."""
        w = self.w
        lead = self._signal_lead()
        if self.shell is not None and not self.shell.exec_ok:
            w.event(
                events.NOT_BATCH_SHELL,
                parent=self.shell.parent,
                parent_pid=self.shell.parent_pid,
                script_signal=self.shell.signal_name,
                signal_lead=lead,
            )
        target = jobid.target(w.environ)
        if target is None or not continues:
            return

        own = self._own_rule()
        if own is not None and own.kill_wait is None:

            def read_kill_wait() -> None:
                try:
                    own.kill_wait = commands.kill_wait(environ=w.environ)
                except (SlurmError, ValueError):
                    pass  # the lead then counts no KillWait

            reader = threading.Thread(target=read_kill_wait, name="hpcckpt-killwait", daemon=True)
            self._kill_wait_reader = reader
            reader.start()

        def fetch_end() -> float | None:
            end = commands.end_time(target, environ=w.environ)
            return None if end is None else end.timestamp()

        if self.end is not None:
            self.end.close()  # a relaunched step: the previous step's reader stops
        known, self._read_end = self._read_end, None  # a relaunched step reads again
        self.end = endstop.EndStop(
            fetch_end,
            self._history,
            signal_lead=lead,
            default_cost=self._default_cost(),
            known_end=known,
        )
        self.end.start()

    def tick(self) -> None:
        """In the main loop: request the stop once the end-time stop is due."""
        end = self.end
        if end is None or end.fired:
            return
        plan = end.plan  # the background reader may replace it at any moment
        if plan is None:
            error = end.error
            if error is not None and not self._unarmed_noted:
                self.w.log(
                    f"note: no end-time stop: {error}; reading the end time again every "
                    f"{end.refresh:.0f} s"
                )
                self._unarmed_noted = True
            return
        own = self._own_rule()
        reader = self._kill_wait_reader
        if own is not None and reader is not None and reader.is_alive():
            return  # the lead counts KillWait: plan once it is read (one scontrol)
        words = own.describe_rule() if own is not None else plan.describe()
        if self._armed_for is None:
            self.w.log(f"end-time stop armed: {words}")
        elif abs(plan.end - self._armed_for) >= 1.0:
            moved = plan.end - self._armed_for
            self.w.log(
                f"the job's end time moved {'later' if moved > 0 else 'earlier'} by "
                f"{abs(moved):.0f} s (its time limit was changed): end-time stop now "
                f"{words}"
            )
            self.w.event(events.END_TIME_MOVED, end_time=round(plan.end, 3), by=round(moved, 3))
        self._armed_for = plan.end
        if own is not None:
            decision = own.decide(plan.end)
            if decision is not None and (own.deferred or not self.w.stop.requested):
                end.fired = True
                end.close()
                own.fire(decision)
            return
        stop = plan.stop_at + (0.0 if self.w.config.app_mode else API_BACKSTOP)
        if time.time() < stop:
            return
        end.fired = True
        end.close()
        left = plan.end - time.time()
        self.w.event(
            events.END_TIME_STOP,
            end_time=round(plan.end, 3),
            left=round(left, 3),
            cost=round(plan.cost, 3),
            measured=plan.measured,
        )
        self.w.handle_signal(
            int(self.w.config.stop_signal),
            time.monotonic(),
            heard=f"end-time stop ({left:.0f} s before the job's end time)",
        )

    def preempted(self, target: str) -> bool:
        """Was this job preempted (``PreemptTime`` set)? False when scontrol cannot tell."""
        try:
            info = commands.show_job(target, environ=self.w.environ)
        except (SlurmError, ValueError):
            return False
        return info.get("PreemptTime", "").strip().lower() not in _NO_TIME

    def preempted_app_stop(self, rc: int) -> bool:
        """After an ``--app-signal`` step ended non-zero without a stop from the wrapper: was
        the job preempted, its tasks given Slurm's TERM directly, and are the restart files
        all rewritten since the step started (and settled)? Then it is a stop: True, and the
        wrapper's state says so (the files are registered as the stop's set)."""
        w = self.w
        target = jobid.target(w.environ)
        files = w.app.files
        if target is None or files is None or w.child_started is None or died_by_signal(rc):
            return False
        if not self.preempted(target):
            return False
        since_ns = int((time.time() - (time.monotonic() - w.child_started)) * 1e9)
        from hpcckpt.job.ownschedule import snapshot  # xxhash only with restart files

        snap = snapshot(files)
        time.sleep(w.config.settle)
        fresh = snap and all(m >= since_ns for _, m in snap.values())
        if not fresh or snapshot(files) != snap:
            w.log("the job was preempted, but its restart files were not rewritten since the start")
            return False
        w.log(
            "the job was preempted: Slurm sent the tasks its TERM directly; their restart files "
            f"were all rewritten since the start ({describe_returncode(rc)}): a stop, not a crash"
        )
        w.event(events.PREEMPTED, exit_code=rc, files=len(snap))
        w.stop.forward()
        w.app.set_after_stop = True
        return True


class OwnScheduleMode:
    """``--restart-files`` without ``--app-signal``: see :mod:`hpcckpt.job.ownschedule`
    (which sets are kept) and :mod:`hpcckpt.job.ownlead` (when the step ends)."""

    def __init__(self, wrapper: StopsContext) -> None:
        self.w = wrapper
        self.watch: Any = None
        self.ended = False
        self.history: list[dict[str, Any]] = []
        self.step_started = time.time()
        self.kill_wait: float | None = None  # read by the end-time stop's reader thread
        self.end: float | None = None  # the job's end time, once known
        self.deferred = False  # a warning signal waits for the end-time rule
        self.rule_fired: Any = None  # ownlead.EndDecision that ended the step
        self.ended_at: float | None = None  # Unix seconds: when the wrapper ended the step

    def prepare(self, stop_in: float | None = None) -> dict[str, str]:
        """After ``prepare_app``: set cut files of a series aside, start watching; the
        step's ``HPCCKPT_INTERVAL``, fitted to the ``stop_in`` seconds left before the
        end-time stop."""
        from hpcckpt.job.ownschedule import OwnScheduleWatch  # xxhash only when needed

        w = self.w
        files = w.app.files
        try:
            moved = files.set_aside_cut()
        except OSError as exc:
            w.log(f"warning: cannot move cut restart files aside: {exc}", WARN)
            moved = []
        for src, dest in moved:
            w.log(
                f"restart files: {src} was being written when the last step ended and is in "
                f"no kept set: moved aside to {dest} (the application reads the newest "
                "complete file)"
            )
        if moved:
            w.event(events.RESTART_FILES_CUT, files=[src for src, _ in moved],
                    moved_to=[dest for _, dest in moved])  # fmt: skip
        newest = files.newest()
        members = None if newest is None else [e["path"] for e in newest[2].get("files", [])]
        self.step_started = time.time()
        self.watch = OwnScheduleWatch(files, time.time_ns(), w.config.settle, members)
        try:
            self.history = list(events.read_events(w.config.ckpt_dir))
        except OSError:
            self.history = []
        schedule = PeriodicSchedule(
            AUTO, start=0.0, nodes=w.slurm_env.num_nodes, mtbf=w.config.mtbf, history=self.history
        )
        interval = schedule.exported(stop_in)
        fitted = "" if stop_in is None else f", fitted to {stop_in:.0f} s before the end-time stop"
        w.log(
            f"restart files on the application's own schedule (no signal is sent); "
            f"{INTERVAL_ENV}={interval} ({schedule.describe()}: {schedule.interval():.0f} s"
            f"{fitted})"
        )
        return {INTERVAL_ENV: str(interval)}

    # -- the end-time rule (job/ownlead.py) ------------------------------------------------
    def measured(self) -> Any:
        spans = [] if self.watch is None else [(x.began, x.ended) for x in self.watch.writes]
        return ownlead.measured(self.history, spans, kill_wait=self.kill_wait)

    def describe_rule(self) -> str:
        """The armed line's words."""
        m = self.measured()
        return (
            "the application takes no signal: the step ends right after a complete restart "
            "write when the next one could not end in time, at the latest "
            f"{m.lead():.0f} s before the job's end time ({m.describe()})"
        )

    def decide(self, end: float, now: float | None = None) -> Any:
        """ownlead.EndDecision when the step should end now, else None."""
        self.end = end
        watch = self.watch
        if watch is None:
            return None
        last = watch.writes[-1].ended if watch.writes else None
        return ownlead.decide(
            time.time() if now is None else now,
            end,
            self.measured(),
            settle=self.w.config.settle,
            step_started=self.step_started,
            last_write_end=last,
            writing_since=watch.write_began,
        )

    def stop_text(self) -> str:
        name = self.w.stop.name
        warning = name not in ("TERM", "INT") and name in {
            signal_name(self.w.config.stop_signal),
            "USR1",
            "USR2",
        }
        if warning and self.end is not None and self.rule_fired is None:
            self.deferred = True
            return (
                "the application takes no signal, and ending it now would only lose the work "
                "since its last write: the step runs on until the end-time rule ends it "
                f"({self.describe_rule()})"
            )
        if self.watch is not None and self.watch.writing and self.rule_fired is None:
            return (
                "the application takes no signal: ending the step once the restart files "
                "being written are complete"
            )
        if self.rule_fired is not None:
            kept = self.watch is not None and self.watch.writes
            since = "its last complete write" if kept else "its start"
            return (
                "the application takes no signal: ending the step now "
                f"({self.rule_fired.lost:.0f} s of work since {since} is lost)"
            )
        return "the application takes no signal: ending the step now (no restart write under way)"

    def fire(self, decision: Any) -> None:
        """The end-time rule says: end the step now (one event, then the stop request)."""
        w = self.w
        self.rule_fired = decision
        left = (self.end or time.time()) - time.time()
        w.event(
            events.END_TIME_STOP,
            end_time=None if self.end is None else round(self.end, 3),
            left=round(left, 3),
            lost=round(decision.lost, 3),
            rule=decision.why,
            own_schedule=True,
        )
        if self.deferred:
            self.deferred = False
            w.log(f"end-time stop: {decision.why}; ending the step now")
            return
        w.handle_signal(
            int(w.config.stop_signal),
            time.monotonic(),
            heard=f"end-time stop ({decision.why})",  # the rule names the end time
        )

    def tick(self) -> None:
        w = self.w
        alive = w.step_alive()
        done = self.watch.tick(alive) if self.watch is not None else None
        if done is not None:
            span = self.watch.writes[-1]
            w.app.register(
                w.app.files.cost(done),
                stop=False,
                paths=sorted(done.seen),
                began=round(span.began, 3),
                ended=round(span.ended, 3),
                after_start=round(span.ended - self.step_started, 3),
            )
        forwarded = w.stop.forwarded_at
        if forwarded is None or self.ended or not alive:
            return
        if self.deferred:
            return  # the end-time rule (WrapperStops.tick) decides
        writing = self.watch is not None and self.watch.writing
        if (
            writing
            and self.rule_fired is None
            and time.monotonic() - forwarded < w.config.restart_timeout
        ):
            return
        self.ended = True
        self.ended_at = time.time()
        why = "the stop request" + (" (a restart write did not finish)" if writing else "")
        w.app.ended_by_wrapper = True
        w.end_step(why)

    def result(self, rc: int) -> StepResult:
        exited = describe_returncode(rc)
        w = self.w
        if self.watch is not None and w.app.files is not None:
            try:
                w.app.files.note_unfinished(self.watch.unfinished)
            except OSError as exc:
                w.log(f"warning: cannot record the restart write under way: {exc}", WARN)
        if self.ended_at is None:
            self.ended_at = time.time()
        # only a warning came (the B: signal), the rule never ended the step: an exit 0
        # is the application's own end
        warned_only = self.deferred and self.rule_fired is None and not w.app.ended_by_wrapper
        if w.stop.forwarded and not (rc == 0 and warned_only):
            how = "ended by the wrapper" if w.app.ended_by_wrapper else exited
            return StepResult(Outcome.STOPPED, rc, None, f"stopped on request; {how}")
        if rc == 0:
            return StepResult(Outcome.FINISHED, rc, None, f"{exited} without a stop request")
        return StepResult(Outcome.CRASHED, rc, None, exited)

    def facts(self, wrapper_started: float) -> Any:
        """The run's numbers for the no-progress decision (job/stalled.py)."""
        watch = self.watch
        first = None
        if watch is not None and watch.first_seen is not None:
            first = watch.first_seen - self.step_started
        ended = self.ended_at or time.time()
        return RunFacts(
            run_seconds=None if self.end is None else self.end - wrapper_started,
            stop_before_end=None if self.end is None else self.end - ended,
            first_write=first,
            write_cut=bool(watch is not None and watch.unfinished),
        )
