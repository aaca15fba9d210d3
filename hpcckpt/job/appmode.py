"""The mode for applications without the Python API (``--app-signal``).

Such an application writes its own restart files on a signal and never writes the
status file. The wrapper then: sends it the signal periodically (``--ckpt-every``,
:mod:`hpcckpt.job.periodic`), watches its restart files until a complete set appears
(``--restart-files``, :mod:`hpcckpt.job.restart_files`), keeps each complete set aside
with checksums, ends the step itself once the set written after a stop request is
complete, and decides the outcome from what it did and saw
(:func:`hpcckpt.job.outcome.classify_app`). See docs/wrapper.md.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from hpcckpt.job.config import WrapperConfig, WrapperError
from hpcckpt.job.outcome import StepResult, classify_app
from hpcckpt.job.periodic import PeriodicSchedule
from hpcckpt.job.reporting import WARN, Reporter
from hpcckpt.rundir import events
from hpcckpt.rundir.env import INTERVAL_ENV, RESTART_ENV

#: Seconds a step has to exit by itself once the restart files written on a stop look
#: complete (a code that checkpoints on TERM exits after its write). Ending it at once
#: cut the files of a write that paused longer than ``--settle`` (an fsync stalled on a
#: busy disk), and that cut set was then kept; the set is kept once the step has ended.
STOP_EXIT_GRACE = 10.0


class AppContext(Reporter, Protocol):
    """What app mode needs of the wrapper: its log, and the step to signal or end."""

    def elapsed(self, t: float | None = None) -> float: ...

    def signal_step(self) -> bool:
        """Send the step the application's signal; False if the step is gone."""
        ...

    def end_step(self, reason: str) -> None:
        """Take the step down (its stop checkpoint is complete)."""
        ...


class AppMode:
    """Restart files and periodic signals of one attempt of an application without the API."""

    def __init__(self, ctx: AppContext, config: WrapperConfig, *, attempt: str) -> None:
        self.ctx = ctx
        self.config = config
        self.attempt = attempt
        self.files: Any = None  # restart_files.RestartFiles when --restart-files is given
        self.schedule: PeriodicSchedule | None = None  # when --ckpt-every is given
        self.pending: Any = None  # restart_files.PendingSet being watched
        self.set_after_stop = False  # a complete set appeared after the stop request
        #: The step was killed (by a signal) after the stop request, before writing any
        #: restart file (a rank without a handler yet), or exited 0 without writing one
        #: (it finished as the stop came): the newest kept set stands.
        self.killed_before_writing = False
        self.stop_cost: float | None = None
        self.stop_set_registered = False
        self.ended_by_wrapper = False
        #: After a stop's complete restart files: when the step is ended if still running.
        self.exit_by: float | None = None
        #: The stop's restart files that looked complete, watched until the step exits: a
        #: change means the application was still writing (a pause longer than --settle).
        self.settled: Any = None

    def prepare(self, *, restart: int, nodes: int, stop_in: float | None = None) -> dict[str, str]:
        """Check the restart files, set up the schedule; the extra environment of the step
        (``stop_in``: seconds left before the end-time stop, for ``HPCCKPT_INTERVAL``)."""
        cfg, ctx = self.config, self.ctx
        extra: dict[str, str] = {}
        resuming = restart > 0
        if cfg.restart_files:
            from hpcckpt.job.restart_files import RestartFiles  # xxhash only when needed

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
                ctx.log(f"restart files: {problem}")
            if number is not None:
                resuming = True
                restored = bool(wrong)
                ctx.log(
                    f"restart files: set {number} is good"
                    + ("; copied it back over the damaged live files" if restored else "")
                )
                ctx.event(
                    events.RESTART_FILES_CHECKED, set=number, restored=restored, problems=wrong
                )
            elif not self.files.sets():
                # no set was ever kept (the runs so far stopped or crashed before their
                # first write): a restart has nothing to resume from, the application
                # starts afresh rather than look for files that are not there
                resuming = False
        if cfg.ckpt_every:
            try:
                history = list(events.read_events(cfg.ckpt_dir))
            except OSError:
                history = []
            try:
                self.schedule = PeriodicSchedule(
                    cfg.ckpt_every,
                    start=time.monotonic(),
                    nodes=nodes,
                    mtbf=cfg.mtbf,
                    history=history,
                )
            except ValueError as exc:
                raise WrapperError(f"--ckpt-every {cfg.ckpt_every}: {exc}") from None
            extra[INTERVAL_ENV] = str(self.schedule.exported(stop_in))
        extra[RESTART_ENV] = "1" if resuming else "0"
        return extra

    @property
    def busy(self) -> bool:
        """A checkpoint of the application is being watched."""
        return self.pending is not None

    def stop(self, what: str, send: Any) -> None:
        """A stop request: signal the application (``send(what)``), or, if it is already
        writing a checkpoint, stop once that one is complete."""
        if self.pending is not None:
            self.pending.stop = True
            self.ctx.log(
                f"{what}; a checkpoint of the application is under way (signalled "
                f"{time.monotonic() - self.pending.signal_mono:.1f} s ago): stopping once "
                "its restart files are complete"
            )
            return
        if send() and self.files is not None:
            self.pending = self.files.begin(stop=True)

    def tick(self, *, may_signal: bool, signal: str, pid: int) -> None:
        """One pass from the main loop: watch the restart files, send the periodic signal
        (``may_signal``: no stop request, the application is ready; ``signal`` and ``pid``
        for the log: what is sent, to which launcher)."""
        ctx, cfg = self.ctx, self.config
        if self.settled is not None:
            self._check_settled()
        if self.exit_by is not None and time.monotonic() >= self.exit_by:
            self.exit_by = None
            self.ended_by_wrapper = True
            ctx.log(f"the step did not exit {STOP_EXIT_GRACE:g} s after its restart files")
            ctx.end_step("its restart files are complete")
        if self.files is not None and self.pending is not None:
            pending = self.pending
            if self.files.poll(pending):
                self.pending = None
                self._on_files_complete(pending)
            elif time.monotonic() - pending.signal_mono > cfg.restart_timeout:
                self.pending = None
                ctx.log(
                    f"warning: the restart files were not complete {cfg.restart_timeout:g}"
                    " s after the signal (--restart-timeout); not registering them"
                )
                ctx.event(events.RESTART_TIMEOUT, stop=pending.stop)
        schedule = self.schedule
        if (
            schedule is not None
            and self.pending is None
            and may_signal
            and schedule.due(time.monotonic())
        ):
            interval = schedule.interval()
            if not ctx.signal_step():
                return
            ctx.log(
                f"periodic checkpoint: sent {signal} to step (pid {pid}) {ctx.elapsed():.1f} s "
                f"after start (every {interval:.0f} s, {schedule.describe()})"
            )
            ctx.event(events.CHECKPOINT_REQUEST, signal=signal, interval=round(interval, 3))
            if self.files is not None:
                self.pending = self.files.begin(stop=False)
            else:
                schedule.checkpointed(time.monotonic(), None)

    def _on_files_complete(self, pending: Any) -> None:
        cost = self.files.cost(pending)
        if self.schedule is not None:
            self.schedule.checkpointed(time.monotonic(), cost)
        if pending.stop:
            self.set_after_stop = True
            self.stop_cost = cost
            self.exit_by = time.monotonic() + STOP_EXIT_GRACE
            self.settled = pending
            self.ctx.log(
                f"restart files complete {cost:.1f} s after the stop signal; the step has "
                f"{STOP_EXIT_GRACE:g} s to exit before it is ended"
            )
            return
        self.register(cost, stop=False)

    def _check_settled(self) -> None:
        """The stop's files changed after they looked complete: not complete; the step is
        not ended for them, and they are watched again until they settle."""
        pending = self.settled
        before, last = pending.seen, pending.last_change_mono
        self.files.poll(pending)
        if pending.seen == before:
            return
        pause = pending.last_change_mono - last
        pending.quiet = max(pending.quiet, 2 * pause)
        self.settled, self.exit_by = None, None
        self.set_after_stop, self.stop_cost = False, None
        self.pending = pending  # the same signal: --restart-timeout still counts from it
        self.ctx.log(
            f"the restart files changed again {time.monotonic() - pending.signal_mono:.1f} s "
            f"after the stop signal, after a pause of {pause:.1f} s (--settle "
            f"{self.config.settle:g} s): still being written; they count as complete once "
            f"unchanged for {pending.quiet:.1f} s (a --settle longer than the application's "
            "pauses between writes, or --restart-marker, avoids this)"
        )

    def register(
        self,
        cost: float | None,
        stop: bool,
        paths: list[str] | None = None,
        **fields: Any,
    ) -> bool:
        """Keep the complete set aside (checksummed; ``paths``: only these files, one
        write of a series); one log line and one event (``fields`` added to it)."""
        ctx = self.ctx
        try:
            got = self.files.register(attempt=self.attempt, seconds=cost, paths=paths)
        except OSError as exc:
            ctx.log(f"warning: cannot keep the restart files aside: {exc}", WARN)
            ctx.event(events.RESTART_SET_FAILED, error=str(exc), stop=stop)
            return False
        secs = "" if cost is None else f" written in {cost:.1f} s,"
        ctx.log(
            f"restart set {got.number}:{secs} {len(got.files)} file(s), {got.bytes} bytes, "
            f"checksummed and kept in {got.path}"
        )
        ctx.event(
            events.RESTART_SET,
            set=got.number,
            files=len(got.files),
            bytes=got.bytes,
            seconds=None if cost is None else round(cost, 6),
            stop=stop,
            **fields,
        )
        return True

    def finish_pending(self) -> None:
        """The step exited while its restart files were watched: give them time to settle."""
        if self.files is None or self.pending is None:
            return
        pending, self.pending = self.pending, None
        deadline = time.monotonic() + max(self.config.settle, pending.quiet) * 2 + 1.0
        while time.monotonic() < deadline:
            if self.files.poll(pending):
                cost = self.files.cost(pending)
                if pending.stop:
                    self.set_after_stop = True
                    self.stop_cost = cost
                else:
                    self.register(cost, stop=False)
                return
            time.sleep(min(self.config.poll_interval, 0.1))

    def outcome(self, rc: int, *, stop_sent: bool) -> StepResult:
        """How the step ended (:func:`~hpcckpt.job.outcome.classify_app`)."""
        self.finish_pending()
        return classify_app(
            rc,
            stop_sent=stop_sent,
            watching_files=self.files is not None,
            set_after_stop=self.set_after_stop,
            ended_by_wrapper=self.ended_by_wrapper,
            killed_before_writing=self.killed_before_writing,
        )

    def after_stop(self) -> None:
        """The step stopped: register the set written after the stop request (once)."""
        if self.files is not None and self.set_after_stop and not self.stop_set_registered:
            self.stop_set_registered = True
            self.register(self.stop_cost, stop=True)
