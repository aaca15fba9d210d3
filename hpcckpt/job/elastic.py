"""A torchrun step and its own restarts (``--max-restarts``) after a stop request.

torchrun's agent restarts its workers, within the same step, whenever one exits non-zero
while it has restarts left. After a stop request that must not go unseen:

- **the workers exited non-zero after their stop checkpoint** (a teardown abort at
  interpreter exit, as gloo's seen here): the restarted workers restore that checkpoint
  and train on, and their rank 0 reports ``running`` again (a new pid), overwriting
  ``stopped``. The wrapper remembers the ``stopped`` it saw, or finds the Checkpointer's
  ``stop`` event of this attempt in the log if the restart came between two of its
  polls (the checkpoint is committed: the outcome is a stop, whatever comes after), and
  ends the step: TERM to
  torchrun's agents, which pass it to their workers and end them (SIGKILL after 30 s),
  with no further restart; the step is taken down if still there after
  :data:`END_GRACE` seconds.
- **a worker crashed before the stop checkpoint**: the stop went to workers that are
  gone. Once the restarted rank 0 reports ``running`` the stop is delivered again.

Without a stop request a restart is torchrun's business (a worker crash within the
allocation); the wrapper only says so in its log. When the agent gives up (its restarts
spent) or a node fails, the step ends and the wrapper's own crash budget decides
(:mod:`hpcckpt.job.budget`).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Mapping
from typing import Protocol

from hpcckpt.job import delivery
from hpcckpt.job.config import WrapperConfig
from hpcckpt.job.outcome import Outcome, StepResult
from hpcckpt.job.reporting import Reporter
from hpcckpt.job.stop import StopRequest
from hpcckpt.rundir import events
from hpcckpt.rundir.status import RUNNING, STOPPED, RunStatus
from hpcckpt.slurm import jobid
from hpcckpt.slurm.runner import SlurmError

#: Seconds the agents get to end their workers after TERM (torchrun SIGKILLs them after
#: 30 s) before the wrapper takes the step down.
END_GRACE = 45.0


class ElasticContext(Reporter, Protocol):
    """What the watch needs of the wrapper."""

    config: WrapperConfig
    environ: Mapping[str, str]
    attempt: str
    stop: StopRequest
    command: list[str]
    child: subprocess.Popen[bytes] | None

    def own_status(self) -> RunStatus | None: ...

    def signal_step(self) -> bool: ...

    def step_alive(self) -> bool: ...

    def end_step(self, reason: str) -> None: ...


class ElasticWatch:
    """Watches a torchrun step's status for restarts of its workers (module doc)."""

    def __init__(self, wrapper: ElasticContext) -> None:
        self.w = wrapper
        self.torchrun = delivery.launcher_kind(wrapper.command) is delivery.Launcher.TORCHRUN
        self.active = self.torchrun
        self.stopped: RunStatus | None = None  # the stop checkpoint, once reported
        self.running_pid: int | None = None  # rank 0's pid in its last ``running``
        self.restarts = 0  # restarts seen (rank 0 reporting running from a new pid)
        self.ending_since: float | None = None

    def tick(self) -> None:
        if not self.active:
            return
        if self.ending_since is not None:
            if self.w.step_alive() and time.monotonic() - self.ending_since > END_GRACE:
                self.ending_since = None
                self.active = False
                self.w.end_step(f"torchrun's agents still there {END_GRACE:g} s after TERM")
            return
        status = self.w.own_status()
        if status is None:
            return
        if status.state == STOPPED and self.stopped is None:
            self.stopped = status
        if status.state != RUNNING:
            return
        first = self.running_pid is None
        if first or status.pid == self.running_pid:
            self.running_pid = status.pid
            return
        self.running_pid = status.pid
        self.restarts += 1
        if self.stopped is None and self.w.stop.forwarded:
            self.stopped = self._stop_event()
        what = (
            f"torchrun restarted its workers (rank 0 now pid {status.pid}; "
            f"restart {self.restarts} seen)"
        )
        if self.stopped is not None:
            at = f" at step {self.stopped.step}" if self.stopped.step is not None else ""
            self.w.log(
                f"{what} after their stop checkpoint{at} was committed: ending the step "
                "(TERM to torchrun's agents); the job continues from that checkpoint"
            )
            self._end()
        elif self.w.stop.forwarded:
            self.w.log(f"{what} before the stop checkpoint: delivering the stop again")
            self.w.signal_step()
        else:
            self.w.log(f"{what}; torchrun's --max-restarts acts, not the wrapper")

    def _end(self) -> None:
        """TERM to every agent: they end their workers and do not restart them."""
        if self.w.child is None:
            return
        pid = self.w.child.pid
        self.ending_since = time.monotonic()
        command = self.w.command
        try:
            if delivery.launcher_kind(command[:1]) is delivery.Launcher.SRUN:
                job = jobid.target(self.w.environ)
                delivery.deliver(
                    delivery.Launcher.SRUN, pid, signal.SIGTERM, job=job, environ=self.w.environ
                )
            else:
                delivery.deliver_to_launcher(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        except SlurmError as exc:
            self.ending_since = None
            self.active = False
            self.w.end_step(f"the agents could not be signalled: {exc}")

    def _stop_event(self) -> RunStatus | None:
        """The Checkpointer's ``stop`` event of this attempt with its checkpoint, as a status."""
        found = None
        for record in events.read_events(self.w.config.ckpt_dir):
            if record.get("event") != events.STOP or record.get("attempt") != self.w.attempt:
                continue
            if not record.get("checkpoint_failed"):
                step = record.get("step")
                reason = str(record.get("reason") or "")
                found = RunStatus(STOPPED, self.w.attempt, step, reason, pid=0)
        return found

    def adjust(self, result: StepResult) -> StepResult:
        """A crash after the stop checkpoint was reported is a stop (module doc)."""
        if result.outcome is not Outcome.CRASHED or not self.torchrun:
            return result
        if self.stopped is None and self.w.stop.forwarded:
            self.stopped = self._stop_event()
        if self.stopped is None:
            return result
        why = f" ({self.stopped.reason})" if self.stopped.reason else ""
        return StepResult(
            Outcome.STOPPED,
            result.returncode,
            self.stopped,
            f"reported stopped{why} before torchrun restarted its workers; {result.reason}",
        )
