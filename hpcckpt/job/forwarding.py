"""A stop request's way to the step: a duplicate, held, dropped, or forwarded once.

:mod:`.stop` remembers where a request stands (requested -> held -> forwarded); this
module decides, for each stop signal (or the wrapper's own end-time stop) and while one
is held, what becomes of it: forwarded when the application can take it (its status says
``running``; with ``--app-signal``, once ``--app-ready`` has passed), held until then,
dropped when the application already stopped or finished; the third interrupt takes the
step down. The signal goes by the launcher's safe path (:mod:`.delivery`), and whether
Slurm's warning came early enough is checked in the background (:mod:`.leadtime`). It
sees the wrapper only through :class:`ForwardingContext`.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import Protocol

from hpcckpt.job import delivery, leadtime, step
from hpcckpt.job.appmode import AppMode
from hpcckpt.job.config import WrapperConfig
from hpcckpt.job.continuation import Continuation
from hpcckpt.job.reporting import WARN, Reporter
from hpcckpt.job.stop import StopRequest, wall_time
from hpcckpt.job.stops import OwnScheduleMode
from hpcckpt.rundir import events
from hpcckpt.rundir.status import FINISHED, RUNNING, STOPPED, RunStatus
from hpcckpt.signames import signal_name
from hpcckpt.slurm import jobid
from hpcckpt.slurm.env import SlurmEnv
from hpcckpt.slurm.runner import SlurmError

__all__ = ["Forwarding", "ForwardingContext", "forward_signal"]

#: Seconds past ``--app-ready`` a stop is held while a rank process on this node has no
#: handler for the application's signal yet (mpirun steps): the signal would kill it
#: before it could write anything. Then it is sent all the same: held longer, it would eat
#: into the time the checkpoint needs before the limit (a rank it kills costs only its
#: start: a stop that kept nothing new, continued).
HANDLER_WAIT = 30.0


def forward_signal(config: WrapperConfig) -> signal.Signals:
    """What a stop request becomes for the step: --app-signal, else --signal."""
    return config.app_signal or config.stop_signal


class ForwardingContext(Reporter, Protocol):
    """What forwarding needs of the wrapper: its settings, the stop request, the step and
    its start, the application's status, and the modes that stop it their own way."""

    config: WrapperConfig
    environ: Mapping[str, str]
    slurm_env: SlurmEnv
    t0: float  # the wrapper's start (monotonic)
    stop: StopRequest
    app: AppMode
    own: OwnScheduleMode | None
    continuing: Continuation  # told when TERM (scancel?) was heard
    command: list[str]
    child: subprocess.Popen[bytes] | None
    child_started: float | None

    def elapsed(self, t: float | None = None) -> float: ...

    def own_status(self) -> RunStatus | None:
        """The status file, if this attempt wrote it."""
        ...


class Forwarding:
    """The stop requests of one attempt, from the signal to the step."""

    def __init__(self, wrapper: ForwardingContext) -> None:
        self.w = wrapper
        #: The background check of Slurm's warning (one per attempt; job/leadtime.py).
        self.lead_thread: threading.Thread | None = None
        #: The step (pid) whose ranks on this node were all seen to take the signal.
        self._handlers_seen: int | None = None
        self._handler_wait_logged = False

    @property
    def forward_signal(self) -> signal.Signals:
        return forward_signal(self.w.config)

    def app_ready(self) -> bool:
        """May a signal reach the application now? (--app-signal: --app-ready after start)"""
        if self.w.child is None or self.w.child.poll() is not None:
            return False
        if self.w.config.app_mode:
            assert self.w.child_started is not None
            ran = time.monotonic() - self.w.child_started
            return ran >= self.w.config.app_ready and self._handlers_ready(ran)
        status = self.w.own_status()
        return status is not None and status.state == RUNNING

    def _rank_path(self) -> bool:
        """Does the signal go to the rank processes one by one (an mpirun step)?"""
        return delivery.launcher_kind(self.w.command) is delivery.Launcher.MPIRUN

    def _handlers_ready(self, ran: float) -> bool:
        """Do the step's ranks on this node take the signal (catch or ignore it)? A rank
        still starting would die of it, its restart files untouched; the stop waits for
        it up to :data:`HANDLER_WAIT` s past --app-ready, then goes all the same."""
        w = self.w
        assert w.child is not None
        if w.own is not None or self._handlers_seen == w.child.pid:
            return True  # own-schedule mode sends no signal
        if self._handler_wait_logged:
            return True  # waited HANDLER_WAIT already
        kind = delivery.launcher_kind(w.command)
        bare = delivery.without_handler(kind, w.child.pid, self.forward_signal, w.environ)
        if bare == []:
            self._handlers_seen = w.child.pid
            return True
        if ran < w.config.app_ready + HANDLER_WAIT:
            return False
        self._handler_wait_logged = True
        sig = self._fwd_name()
        what = (
            f"rank process(es) {', '.join(map(str, bare))} have no handler for {sig}"
            if bare
            else "no rank process found on this node"
        )
        w.log(
            f"warning: {what} {ran:.0f} s after the start; {sig} goes to them all the same "
            "(its default action ends a process)",
            WARN,
        )
        return True

    def handle(self, signum: int, t: float | None, heard: str | None = None) -> None:
        """A stop request: a signal, or (``heard``) the wrapper's own end-time stop."""
        w, stop = self.w, self.w.stop
        own = heard is not None  # the end-time stop: no signal, no lead time to check
        name = signal_name(signum) if heard is None else heard
        if heard is None:
            heard = f"signal {name} received"
        when = self.when(t)
        elapsed = None if t is None else round(w.elapsed(t), 3)
        note = ""
        if not own and signum not in (w.config.stop_signal, signal.SIGTERM, signal.SIGINT):
            note = f" (not the configured --signal {signal_name(w.config.stop_signal)})"
        if signum == signal.SIGTERM and not own:
            w.continuing.term_heard = True  # scancel? asked before continuing the job
        if signum == signal.SIGINT:
            stop.interrupts += 1
            if stop.interrupts >= 3 and w.child is not None and w.child.poll() is None:
                hard = signal.SIGKILL if stop.interrupts >= 4 else signal.SIGTERM
                w.log(
                    f"interrupt #{stop.interrupts}: sending {signal_name(hard)} to the step "
                    f"(pid {w.child.pid}); no checkpoint will be taken"
                )
                step.send(w.child, hard)
                w.event(events.SIGNAL, name=name, elapsed=elapsed, forwarded=False, killed=True)
                return
        if stop.under_way or stop.held:
            w.log(
                f"{heard} {when}{note}; a stop request is already "
                + (
                    "held until the application is ready for it"
                    if stop.held
                    else "under way; not forwarding it again"
                )
            )
            w.event(events.SIGNAL, name=name, elapsed=elapsed, forwarded=False, duplicate=True)
            if not own:  # Slurm's signal after the end-time stop: was it early enough?
                self._start_lead_check(wall_time(t))
            return
        stop.request(name, t)
        if not own:
            self._start_lead_check()
        if w.child is None or w.child.poll() is not None:
            stop.hold()
            w.log(f"{heard} {when}{note}; held until the step is running")
            w.event(events.SIGNAL, name=name, elapsed=elapsed, forwarded=False, held=True)
            return
        if w.config.app_mode:
            if self.app_ready():
                self._stop_app(f"{heard} {when}{note}")
                w.event(
                    events.SIGNAL,
                    name=name,
                    elapsed=elapsed,
                    forwarded=True,
                    as_signal=self._fwd_name(),
                )
            else:
                stop.hold()
                w.log(
                    f"{heard} {when}{note}; held until the application has run "
                    f"{w.config.app_ready:g} s (--app-ready)"
                    + (" and its ranks here take it" if self._rank_path() else "")
                )
                w.event(events.SIGNAL, name=name, elapsed=elapsed, forwarded=False, held=True)
            return
        status = w.own_status()
        state = status.state if status is not None else None
        if state == RUNNING:
            self._forward(f"{heard} {when}{note}")
            w.event(
                events.SIGNAL,
                name=name,
                elapsed=elapsed,
                forwarded=True,
                as_signal=self._fwd_name(),
            )
        elif state in (STOPPED, FINISHED):
            w.log(f"{heard} {when}{note}; the application already reported {state}; not forwarding")
            w.event(events.SIGNAL, name=name, elapsed=elapsed, forwarded=False, app_state=state)
        else:
            stop.hold()
            w.log(
                f"{heard} {when}{note}; held: the application has not "
                "reported running yet (forwarding as soon as it does)"
            )
            w.event(events.SIGNAL, name=name, elapsed=elapsed, forwarded=False, held=True)

    def check_held(self) -> None:
        """While a stop request is held, forward it once the application is ready."""
        w, stop = self.w, self.w.stop
        if not stop.held or w.child is None:
            return
        if w.config.app_mode:
            if self.app_ready():
                held_for = stop.held_for(w.t0)
                self._stop_app(
                    f"the application has run {w.config.app_ready:g} s",
                    f"{stop.name} held for {held_for:.1f} s",
                )
                self._forwarded_event(held_for)
            return
        status = w.own_status()
        if status is None:
            return
        if status.state == RUNNING:
            held_for = stop.held_for(w.t0)
            step = f" (step {status.step})" if status.step is not None else ""
            self._forward(
                f"application reported running{step} {w.elapsed():.1f} s after start",
                f"{stop.name} held for {held_for:.1f} s",
            )
            self._forwarded_event(held_for)
        else:
            stop.drop()
            w.log(
                f"the application reported {status.state} before the held "
                f"{stop.name} could be forwarded; not forwarding"
            )

    def when(self, t: float | None) -> str:
        return "during start-up" if t is None else f"{self.w.elapsed(t):.1f} s after start"

    def _fwd_name(self) -> str:
        return signal_name(self.forward_signal)

    def _forward(self, what: str, subject: str = "") -> None:
        self.w.stop.forward()
        self._send(what, subject)

    def _stop_app(self, what: str, subject: str = "") -> None:
        """A stop request for an application without the API (job/appmode.py)."""
        self.w.stop.forward()
        if self.w.own is not None:  # no signal to send: end the step once no write is under way
            self.w.log(f"{what}; {self.w.own.stop_text()}")
            return
        self.w.app.stop(what, lambda: self._send(what, subject))

    def _forwarded_event(self, held_for: float) -> None:
        """The event for a held stop request that has now reached the step."""
        self.w.event(
            events.SIGNAL_FORWARDED,
            name=self.w.stop.name,
            as_signal=self._fwd_name(),
            elapsed=round(self.w.elapsed(), 3),
            held_for=round(held_for, 3),
        )

    def _send(self, what: str, subject: str = "", sig: signal.Signals | None = None) -> bool:
        """Send the step (launcher) ``sig`` (default: the forward signal); log it."""
        assert self.w.child is not None
        sig = self.forward_signal if sig is None else sig
        fwd = signal_name(sig)
        as_ = "" if fwd == self.w.stop.name else f" as {fwd}"
        subject = f"{subject} " if subject else ""
        try:
            got = self.deliver(sig)
        except ProcessLookupError:
            self.w.log(f"{what}; the step (pid {self.w.child.pid}) is already gone")
            return False
        self.w.log(f"{what}; {subject}forwarded{as_} {got.describe()}")
        return True

    def deliver(self, sig: signal.Signals) -> delivery.Delivered:
        """Send ``sig`` to the step's ranks once, by the launcher's safe path (job/delivery)."""
        assert self.w.child is not None
        kind = delivery.launcher_kind(self.w.command)
        try:
            got = delivery.deliver(
                kind,
                self.w.child.pid,
                sig,
                job=jobid.target(self.w.environ),
                environ=self.w.environ,
            )
        except SlurmError as exc:  # scancel failed and no task found on this node
            self.w.log(
                f"warning: cannot deliver {signal_name(sig)} to the tasks: {exc}; not sending it "
                "to srun (srun kills its tasks on TERM); the application hears of the stop only "
                "from Slurm at the time limit",
                WARN,
            )
            self.w.event(
                events.SIGNAL_DELIVERED, signal=signal_name(sig), path="none", error=str(exc)
            )
            return delivery.Delivered("none", [str(self.w.child.pid)], str(exc))
        if got.note:
            self.w.log(f"note: {got.note}", WARN)
        if got.path != "launcher":  # a path other than kill(launcher): say which
            per_node = {"nodes": got.per_node} if got.per_node else {}  # each node's signaller
            self.w.event(
                events.SIGNAL_DELIVERED,
                signal=signal_name(sig),
                path=got.path,
                targets=got.targets,
                **per_node,
            )
        return got

    def _start_lead_check(self, arrived: float | None = None) -> None:
        """Check in the background whether Slurm's stop signal (which arrived at
        ``arrived``, Unix time; default: the stop request's) left time to checkpoint."""
        job = self.w.slurm_env.job_id
        arrived = self.w.stop.requested_wall if arrived is None else arrived
        if job is None or self.lead_thread is not None or arrived is None:
            return
        self.lead_thread = leadtime.start_check(
            self.w,
            job=job,
            arrived=arrived,
            signal_name=signal_name(self.w.config.stop_signal),
            ckpt_dir=self.w.config.ckpt_dir,
            environ=self.w.environ,
        )

    def join_lead_check(self, timeout: float) -> None:
        """Give the lead-time check ``timeout`` seconds to say what it found."""
        if self.lead_thread is not None:
            self.lead_thread.join(timeout=timeout)
