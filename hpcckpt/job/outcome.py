"""How a job step ended: finished, stopped after a checkpoint, or crashed.

Two deciders, one per kind of application (see docs/wrapper.md, "Outcomes"):

- :func:`classify` for applications using ``hpcckpt.Checkpointer``: the status file
  written by rank 0 decides, and only a status carrying this attempt's token counts;
- :func:`classify_app` for applications without the Python API (``--app-signal``),
  which never write the status file: the wrapper decides from what it did (did it ask
  for a stop?), what it saw (did a complete set of restart files appear after that?)
  and the exit status.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

from hpcckpt.rundir import events
from hpcckpt.rundir.status import FINISHED, STOPPED, RunStatus
from hpcckpt.signames import signal_name

EXIT_OK = 0
EXIT_NO_FINISH = 1  # the step exited 0 but never reported finished


class Outcome(enum.Enum):
    """How a step ended, from the wrapper's point of view."""

    FINISHED = events.OUTCOME_FINISHED  # the work is done
    STOPPED = events.OUTCOME_STOPPED  # it checkpointed on a stop request: continue later
    CRASHED = events.OUTCOME_CRASHED  # anything else
    POISONED = events.OUTCOME_POISONED  # crashed after rejecting its state: no restart


@dataclass(frozen=True)
class StepResult:
    outcome: Outcome
    returncode: int  # as Popen reports it: negative = killed by that signal
    status: RunStatus | None  # the last status of *this* attempt, None if none
    reason: str


def describe_returncode(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal SIG{signal_name(-returncode)}"
    if returncode > 128 and returncode - 128 in signal.Signals._value2member_map_:
        # srun and mpirun report a task killed by signal N as 128+N
        name = signal_name(returncode - 128)
        if name in ("TERM", "KILL"):
            # srun --kill-on-bad-exit and mpirun end the other tasks this way after one failed
            return (
                f"exit status {returncode} (a task killed by SIG{name}, or the launcher ending "
                "the step after one task failed: its error lines above name that task)"
            )
        return f"exit status {returncode} (a task killed by SIG{name}?)"
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


def classify_app(
    returncode: int,
    *,
    stop_sent: bool,
    watching_files: bool,
    set_after_stop: bool,
    ended_by_wrapper: bool = False,
    killed_before_writing: bool = False,
) -> StepResult:
    """The outcome of an application without the Python API (``--app-signal``).

    ``stop_sent``: the wrapper forwarded a stop request (time limit, preemption) to it.
    ``watching_files``: ``--restart-files`` was given. ``set_after_stop``: a complete
    restart set appeared after the stop request. ``ended_by_wrapper``: the wrapper ended
    the step itself after that set was complete. ``killed_before_writing``: a signal
    killed the step after the stop request and before any restart file was written (the
    signal reached a rank before its handler), or it exited 0 so (it finished as the stop
    came, or stopped without writing): a stop that kept nothing new, its newest kept set
    intact; continued like any such stop (job/stalled.py gives up on a streak).

    | stop sent | restart files | exit status    | outcome                      |
    |-----------|---------------|----------------|------------------------------|
    | yes       | complete set  | any            | stopped                      |
    | yes       | none written  | killed, 0      | stopped (nothing new kept)   |
    | yes       | not watched   | 0              | stopped                      |
    | yes       | incomplete    | any            | crashed (kept the older set) |
    | no        | -             | 0              | finished                     |
    | no        | -             | non-zero       | crashed                      |
    """
    exited = describe_returncode(returncode)
    if stop_sent:
        if watching_files and set_after_stop:
            how = "ended by the wrapper" if ended_by_wrapper else exited
            return StepResult(
                Outcome.STOPPED, returncode, None, f"restart files complete after the stop; {how}"
            )
        if not watching_files and returncode == 0:
            return StepResult(Outcome.STOPPED, returncode, None, f"{exited} after the stop signal")
        if watching_files and killed_before_writing:
            why = f"{exited} after the stop signal, before writing any restart file"
            return StepResult(Outcome.STOPPED, returncode, None, why)
        if watching_files:
            why = f"{exited} after the stop signal, before its restart files were complete"
        else:
            why = f"{exited} after the stop signal"
        return StepResult(Outcome.CRASHED, returncode, None, why)
    if returncode == 0:
        return StepResult(Outcome.FINISHED, returncode, None, f"{exited} without a stop request")
    return StepResult(Outcome.CRASHED, returncode, None, exited)


def crash_exit_code(returncode: int) -> int:
    """The wrapper's exit status for a crashed step: its status, 128+N for signal N, never 0."""
    if returncode < 0:
        return 128 + (-returncode)
    return returncode if returncode > 0 else EXIT_NO_FINISH
