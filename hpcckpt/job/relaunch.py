"""Node failures: tell them from crashes, relaunch on spare nodes, or let Slurm requeue.

The wrapper (:mod:`hpcckpt.job.wrapper`) holds one :class:`NodeFailures`, built on a
narrow view of itself (:class:`RelaunchContext`), and calls it three times:
:meth:`NodeFailures.before_start` gives the command of the first launch (on N-K nodes
with ``--spare-nodes``), :meth:`NodeFailures.tick` from the main loop, and
:meth:`NodeFailures.after_step` when the step has ended, which returns a decision the
wrapper acts on: :class:`Relaunch` (start the step again on these nodes),
:class:`Continued` (Slurm requeued the job, or the wrapper did: exit with this status)
or :data:`NO_FAILURE` (decide as for any step). See docs/wrapper.md, "Node failures".

What Slurm does when a node of a running job dies (Slurm 22.05, measured on the local
cluster, ``SlurmdTimeout=10``):

- about 25-30 s later the controller marks the node ``down*``; ``srun`` prints
  ``Node failure on nX`` and ends the step (exit 137 or 143);
- a job *without* ``--no-kill`` is cancelled ``DUE TO NODE FAILURE``; with
  ``--requeue`` (and ``JobRequeue=1``) Slurm requeues it by itself at once
  (``Restarts`` + 1, ``JobState=COMPLETING`` then ``PENDING/BeginTime``). The batch
  script, if it runs on a surviving node, gets SIGTERM and SIGKILL after ``KillWait``.
  A ``scontrol requeue`` at that point fails (``Job is pending execution``): the wrapper
  must not requeue again. If the batch script ran on the failed node it died with it;
  the next run finds the previous attempt cut off and records the node from ``sinfo -R``;
- a job *with* ``--no-kill`` keeps running: Slurm removes the failed node from the
  allocation (``NodeList`` shrinks) and new steps may run on the nodes left. That is
  what ``--spare-nodes K`` uses: the step runs on N-K nodes, and after a node failure
  it is relaunched on healthy nodes of the allocation from the last good checkpoint,
  without going back to the queue. When no spare is left, the job is requeued.

Every relaunch and every requeue after a node failure counts against the restart
budget (``--max-restarts``; :mod:`hpcckpt.job.budget`).

About 500 lines: the decisions after a node failure and the Slurm facts they rest on
(measured, above) belong together.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hpcckpt import slurm
from hpcckpt.job import budget
from hpcckpt.job.budget import NODE_FAILURE_CAUSE
from hpcckpt.job.config import WrapperConfig
from hpcckpt.job.outcome import EXIT_OK, Outcome, classify
from hpcckpt.job.reporting import Reporter
from hpcckpt.rundir import events
from hpcckpt.rundir.env import SRUN_ENV
from hpcckpt.rundir.status import RunStatus, read_status
from hpcckpt.slurm import srun_options
from hpcckpt.slurm.env import SlurmEnv

#: How long to wait for Slurm's own requeue once a node failure is seen.
REQUEUE_WAIT = 15.0
#: srun options the wrapper sets itself with --spare-nodes.
_PLACEMENT = ("nodes", "nodelist", "exclude", "nodefile")
_REQUEUED_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}


class RelaunchError(ValueError):
    """--spare-nodes cannot work with this job or command (a usage error)."""


def is_srun(command: Sequence[str], environ: Mapping[str, str]) -> bool:
    """True if the step's launcher is srun (or ``$HPCCKPT_SRUN``)."""
    if not command:
        return False
    alt = environ.get(SRUN_ENV)
    return os.path.basename(command[0]) == "srun" or (bool(alt) and command[0] == alt)


def placement_args(args: Sequence[str]) -> list[str]:
    """srun's options among ``args`` that choose nodes (the wrapper sets those itself),
    as given; the program's own arguments are never taken for them."""
    return [" ".join(o.words) for o in srun_options.given(args, *_PLACEMENT)]


def step_ranks(ntasks: int | None, job_nodes: int, step_nodes: int) -> int | None:
    """Ranks of the step on ``step_nodes`` of ``job_nodes``: same tasks per node as the job.

    ``sbatch -N 3 -n 3`` with one spare gives 2; None when the job's tasks do not split
    evenly over its nodes (then pass ``-n`` to srun yourself).
    """
    if not ntasks or job_nodes <= 0 or ntasks % job_nodes:
        return None
    return ntasks // job_nodes * step_nodes


def srun_command(base: Sequence[str], step_nodes: list[str], ranks: int | None = None) -> list[str]:
    """``srun --nodes=M --nodelist=a,b [--ntasks=R] <the user's srun arguments>``.

    The user's arguments come after ours: an explicit ``-n`` of theirs wins.
    """
    ours = [f"--nodes={len(step_nodes)}", f"--nodelist={','.join(step_nodes)}"]
    if ranks:
        ours.append(f"--ntasks={ranks}")
    return [base[0], *ours, *base[1:]]


def choose_nodes(candidates: Sequence[str], bad: Sequence[str], need: int) -> list[str] | None:
    """The first ``need`` of ``candidates`` not in ``bad``, or None if too few are left."""
    good = [n for n in candidates if n not in set(bad)]
    return good[:need] if len(good) >= need else None


def cut_off_attempt(log: Sequence[Mapping[str, Any]], current: str) -> dict[str, Any] | None:
    """The ``wrapper_start`` of the previous attempt if it left no end event, else None."""
    starts = [e for e in log if e.get("event") == "wrapper_start" and e.get("attempt") != current]
    if not starts:
        return None
    prev = starts[-1]
    token = prev.get("attempt")
    ended = any(e.get("attempt") == token and e.get("event") in events.END_EVENTS for e in log)
    return None if ended else dict(prev)


class RelaunchContext(Reporter, Protocol):
    """What node-failure handling needs to know of the wrapper, and may ask of it."""

    config: WrapperConfig
    slurm_env: SlurmEnv
    environ: Mapping[str, str]
    attempt: str
    restart: int

    @property
    def stop_requested(self) -> bool:
        """A stop request (signal) has arrived in this attempt."""
        ...

    @property
    def stop_forwarded(self) -> bool:
        """A stop request has reached the step."""
        ...

    @property
    def continuation(self) -> str | None: ...

    def elapsed(self, t: float | None = None) -> float: ...

    def own_status(self) -> RunStatus | None: ...

    def continue_job(self, cause: str, step: int | None) -> int: ...


@dataclass(frozen=True)
class Relaunch:
    """Start the step again on ``nodes`` (``command`` places it there)."""

    nodes: list[str]
    command: list[str]


@dataclass(frozen=True)
class Continued:
    """The job continues elsewhere (requeued by Slurm or by the wrapper): exit with this."""

    exit_code: int


@dataclass(frozen=True)
class NoFailure:
    """No node failure to handle: decide as for any step."""


NO_FAILURE = NoFailure()
Decision = Relaunch | Continued | NoFailure


class NodeFailures:
    """Node-failure handling for one wrapper run (see the module docstring)."""

    def __init__(self, ctx: RelaunchContext) -> None:
        self.w = ctx
        self.spare = int(ctx.config.spare_nodes or 0)
        self.base = list(ctx.config.command)
        self.alloc: list[str] = []
        self.need = 0
        self.ranks: int | None = None
        self.lost: list[str] = []  # nodes that failed under this run
        self.relaunches = 0
        self._signal_check: threading.Thread | None = None
        self._requeued_by_slurm: dict[str, Any] | None = None  # seen at the stop signal

    @property
    def environ(self) -> Mapping[str, str]:
        return self.w.environ

    # -- before the first launch -------------------------------------------------------------
    def before_start(self) -> list[str]:
        """Record a node failure that killed the previous run; set up --spare-nodes.

        Returns the command of the first launch (the user's, or placed on N-K nodes).
        """
        if self.w.slurm_env.in_job and self.w.restart > 0:
            try:
                self._previous_run()
            except (slurm.SlurmError, OSError, ValueError) as exc:
                self.w.log(f"note: cannot check the previous run's nodes: {exc}")
        return self._setup_spares() if self.spare else list(self.base)

    def _setup_spares(self) -> list[str]:
        w = self.w
        if not w.slurm_env.in_job:
            raise RelaunchError("--spare-nodes works inside a Slurm job only")
        if not is_srun(self.base, self.environ):
            raise RelaunchError("--spare-nodes needs srun as the launcher: use `hpcckpt srun`")
        if w.config.app_mode:
            raise RelaunchError("--spare-nodes is for applications using the Checkpointer")
        self.alloc = slurm.allocation(self.environ)
        total = len(self.alloc) or w.slurm_env.num_nodes
        self.need = total - self.spare
        if self.need < 1:
            raise RelaunchError(
                f"--spare-nodes {self.spare} leaves no node for the step: the job has "
                f"{total} node(s); ask for more (#SBATCH -N)"
            )
        placed = placement_args(self.base[1:])
        if placed:
            w.log(
                f"warning: --spare-nodes chooses the step's nodes itself; srun options "
                f"{' '.join(placed)} may override that"
            )
        self.ranks = step_ranks(w.slurm_env.ntasks, total, self.need)
        try:
            down = [
                n
                for n, s in slurm.node_states(self.alloc, environ=self.environ).items()
                if slurm.is_failed(s)
            ]
        except slurm.SlurmError as exc:
            w.log(f"note: cannot ask sinfo for node states: {exc}")
            down = []
        chosen = choose_nodes(self.alloc, down, self.need) or self.alloc[: self.need]
        ranks = f"{self.ranks} ranks" if self.ranks else "ranks as srun decides"
        w.log(
            f"spare nodes: the step runs on {len(chosen)} of {total} nodes "
            f"({','.join(chosen)}; {ranks}), {self.spare} kept spare for relaunches"
        )
        return srun_command(self.base, chosen, self.ranks)

    def _previous_run(self) -> None:
        w = self.w
        log = list(events.read_events(w.config.ckpt_dir))
        prev = cut_off_attempt(log, w.attempt)
        if prev is None or not prev.get("nodes"):
            return
        prev_nodes = slurm.expand_hostlist(str(prev["nodes"]))
        reasons = slurm.down_since(prev_nodes, environ=self.environ)
        started = prev.get("time") or 0.0
        hits = {n: r for n, r in reasons.items() if r[1] is None or r[1] >= started - 1}
        if not hits:
            return
        node = sorted(hits, key=lambda n: hits[n][1] or 0.0)[0]
        reason, when = hits[node]
        w.log(
            f"the previous run (attempt {prev.get('attempt')}) ended without a trace: node "
            f"{node} failed ({reason}); Slurm requeued the job"
        )
        w.event(
            events.NODE_FAILURE,
            node=node,
            nodes=sorted(hits),
            reason=reason,
            failed_at=when,
            previous_attempt=prev.get("attempt"),
            detected="at_restart",
            action="requeued_by_slurm",
        )

    # -- while the step runs --------------------------------------------------------------------
    def tick(self) -> None:
        """Called from the wrapper's main loop: after a stop signal, check for a node failure.

        Without --no-kill, Slurm cancels the whole job at a node failure: the batch script
        gets SIGTERM and SIGKILL ``KillWait`` later, while srun may wait 12 s more for the
        step. So the events are written now, in the background, not after the step.
        """
        w = self.w
        if self._signal_check is not None or not w.stop_requested or self.spare:
            return
        if not w.slurm_env.in_job:
            return
        self._signal_check = threading.Thread(
            target=self._check_at_signal, name="hpcckpt-nodes", daemon=True
        )
        self._signal_check.start()

    def _check_at_signal(self) -> None:
        w = self.w
        try:
            failed = self.failed_nodes()
            if not failed:
                return
            info = slurm.job_nodes(w.slurm_env.job_id, environ=self.environ)
        except (slurm.SlurmError, OSError, ValueError) as exc:
            w.log(f"note: cannot check for a node failure: {exc}")
            return
        if info.restarts <= w.slurm_env.restart_count and info.state not in _REQUEUED_STATES:
            return
        self.lost += sorted(failed)
        status = w.own_status()
        node = sorted(failed)[0]
        fields = dict(
            node=node,
            nodes=sorted(failed),
            state=failed[node],
            step=status.step if status is not None else None,
            detected="signal",
        )
        w.log(
            f"node failure: {', '.join(f'{n} ({s})' for n, s in sorted(failed.items()))}; "
            f"Slurm cancelled and requeued job {w.slurm_env.job_id} itself (Restarts="
            f"{info.restarts}): not requeueing again"
        )
        w.event(events.NODE_FAILURE, action="requeued_by_slurm", **fields)
        w.event(
            events.REQUEUE,
            job_id=w.slurm_env.job_id,
            step=fields["step"],
            cause=NODE_FAILURE_CAUSE,
            by="slurm",
            restarts=info.restarts,
        )
        self._requeued_by_slurm = fields

    # -- after the step ----------------------------------------------------------------------
    def _crashed(self, rc: int) -> bool:
        if rc == 0:
            return False
        if self.w.config.app_mode:
            return not self.w.stop_forwarded
        result = classify(rc, read_status(self.w.config.ckpt_dir), self.w.attempt)
        return result.outcome is Outcome.CRASHED

    def failed_nodes(self) -> dict[str, str]:
        """``{node: state}`` of the allocation's nodes that sinfo shows failed."""
        candidates = slurm.allocation(self.environ)
        if not candidates:
            return {}
        states = slurm.node_states(candidates, environ=self.environ)
        return {n: s for n, s in states.items() if slurm.is_failed(s)}

    def after_step(self, rc: int) -> Decision:
        """Was the step lost with a node? What to do about it (see the module docstring)."""
        w = self.w
        if self._signal_check is not None:
            self._signal_check.join(timeout=10.0)
        if self._requeued_by_slurm is not None:  # events written at the signal
            self._step_end(rc, self._requeued_by_slurm["step"], self._requeued_by_slurm["node"])
            return Continued(EXIT_OK)
        if not (w.slurm_env.in_job and self._crashed(rc)):
            return NO_FAILURE
        try:
            failed = {n: s for n, s in self.failed_nodes().items() if n not in self.lost}
        except slurm.SlurmError as exc:
            w.log(f"note: cannot ask sinfo whether a node failed: {exc}")
            return NO_FAILURE
        if not failed:
            return NO_FAILURE
        self.lost += sorted(failed)
        status = w.own_status()
        step = status.step if status is not None else None
        node = sorted(failed)[0]
        which = ", ".join(f"{n} ({s})" for n, s in sorted(failed.items()))
        w.log(f"node failure: {which}; the step ended with exit status {rc}")
        fields = dict(
            node=node,
            nodes=sorted(failed),
            state=failed[node],
            step=step,
            exit_code=rc,
            detected="step_end",
        )
        if not self.spare:
            return self._slurm_requeues(rc, step, fields)
        what = self._relaunch(step, fields)
        if what == "requeue":
            return self._requeue_myself(rc, step, fields)
        if isinstance(what, Relaunch):
            return what
        return NO_FAILURE  # restart budget spent: the wrapper's crash path gives up

    def _budget_left(self) -> tuple[bool, int]:
        try:
            log = list(events.read_events(self.w.config.ckpt_dir))
        except OSError:
            return self.w.restart < self.w.config.max_restarts, self.w.restart
        used = budget.crash_restarts_used(log)
        return used < self.w.config.max_restarts, used

    def _relaunch(self, step: int | None, fields: dict[str, Any]) -> Relaunch | str:
        """Where to relaunch: a :class:`Relaunch`, ``"requeue"`` (no spare left, or a stop
        request under way) or ``"decide"`` (restart budget spent)."""
        w = self.w
        if w.stop_requested:
            w.log("a stop request is under way: not relaunching; requeueing instead")
            return "requeue"
        try:
            current = slurm.job_nodes(w.slurm_env.job_id, environ=self.environ).nodes
        except slurm.SlurmError:
            current = []
        candidates = [n for n in (current or self.alloc) if n not in self.lost]
        chosen = choose_nodes(candidates, self.lost, self.need)
        if chosen is None:
            w.log(
                f"no spare node left ({len(candidates)} healthy, the step needs {self.need}): "
                "requeueing the job"
            )
            return "requeue"
        ok, used = self._budget_left()
        if not ok:
            w.event(events.NODE_FAILURE, action="give_up", **fields)
            w.log(
                f"not relaunching: {used} restart(s) after failures already "
                f"(--max-restarts {w.config.max_restarts})"
            )
            return "decide"
        spare_left = len(candidates) - self.need
        self.relaunches += 1
        w.event(events.NODE_FAILURE, action="relaunch", **fields)
        w.event(
            events.RELAUNCH,
            node=fields["node"],
            reason=f"node failure: {fields['node']} {fields['state']}",
            cause=NODE_FAILURE_CAUSE,
            nodes=chosen,
            excluded=list(self.lost),
            spare_left=spare_left,
            relaunch=self.relaunches,
            step=step,
            max_restarts=w.config.max_restarts,
        )
        at = f" from the checkpoint at step {step}" if step is not None else ""
        w.log(
            f"relaunching the step on {','.join(chosen)}{at} (without {', '.join(self.lost)}; "
            f"{spare_left} spare node(s) left; restart {used + 1} of {w.config.max_restarts})"
        )
        return Relaunch(chosen, srun_command(self.base, chosen, self.ranks))

    def _requeue_myself(self, rc: int, step: int | None, fields: dict[str, Any]) -> Decision:
        """--no-kill job without a spare: Slurm will not requeue it, so the wrapper does."""
        w = self.w
        w.event(events.NODE_FAILURE, action="requeue", **fields)
        if w.continuation is None or not self._budget_left()[0]:
            return NO_FAILURE  # the wrapper's crash path says why it does not continue
        self._step_end(rc, step, fields["node"])
        return Continued(w.continue_job(NODE_FAILURE_CAUSE, step))

    def _step_end(self, rc: int, step: int | None, node: Any) -> None:
        """The wrapper's ``step_end`` event for a step lost with a node."""
        self.w.event(
            events.STEP_END,
            exit_code=rc,
            outcome="crashed",
            state=None,
            step=step,
            elapsed=round(self.w.elapsed(), 3),
            node_failure=node,
        )

    def _slurm_requeues(self, rc: int, step: int | None, fields: dict[str, Any]) -> Decision:
        """Without --no-kill Slurm requeues a --requeue job itself: do not requeue twice."""
        w = self.w
        job = w.slurm_env.job_id
        deadline = time.monotonic() + REQUEUE_WAIT
        info = None
        while True:
            try:
                info = slurm.job_nodes(job, environ=self.environ)
            except slurm.SlurmError as exc:
                w.log(f"note: cannot ask scontrol about job {job}: {exc}")
                info = None
            requeued = info is not None and (
                info.restarts > w.slurm_env.restart_count or info.state in _REQUEUED_STATES
            )
            if requeued or info is None or not info.requeue or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        if requeued:
            assert info is not None
            self._step_end(rc, step, fields["node"])
            w.event(events.NODE_FAILURE, action="requeued_by_slurm", **fields)
            w.event(
                events.REQUEUE,
                job_id=job,
                step=step,
                cause=NODE_FAILURE_CAUSE,
                by="slurm",
                restarts=info.restarts,
            )
            w.log(
                f"Slurm requeued job {job} itself after the node failure (Restarts="
                f"{info.restarts}); not requeueing again. The next run resumes from the last "
                "good checkpoint"
            )
            return Continued(EXIT_OK)
        w.event(events.NODE_FAILURE, action="none", **fields)
        if info is not None and not info.requeue:
            w.log(
                f"job {job} is not requeueable (submit it with --requeue): Slurm ends it "
                "NODE_FAIL; resubmit the same batch script to resume from the last checkpoint"
            )
        return NO_FAILURE
