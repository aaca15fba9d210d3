"""Stops after which nothing new was kept: how many in a row, and when to give up.

A stop (time limit, the end-time stop, preemption) is progress only when the run kept
something new: a committed checkpoint (``checkpoint`` event) or a restart set
(``restart_set`` event) carrying the run's attempt token. A job whose runs all end before
the application's first write would otherwise be requeued for ever, each run repeating
the same work from the same place. So a requeue or chain after a stop that kept nothing
records ``progress: false``; the stops without progress since the last one with progress
are counted across requeues and ``--chain`` links, from the last fresh submission (a
``wrapper_start`` with restart number 0), as the crash budget is
(:mod:`hpcckpt.job.budget`). At :data:`MAX_STALLED_STOPS` in a row the wrapper gives up,
naming the numbers of the last run and the fix.

Pure functions over event records: no I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcckpt.job.budget import CONTINUE_EVENTS, PROGRESS_EVENTS, progress_of
from hpcckpt.rundir import events as ev

#: Runs in a row that stop without keeping anything new before the wrapper gives up: the
#: third such run in a row is the last one.
MAX_STALLED_STOPS = 3
#: The ``cause`` of the ``give_up`` event after those runs.
STALLED_CAUSE = "no_progress"


def stalled_stops(events: Iterable[Mapping[str, Any]]) -> int:
    """Stops without progress in a row, up to the end of ``events`` (continuations whose
    event says ``progress: false``; anything kept, or a continuation without that field,
    ends the streak; a fresh submission starts from zero)."""
    streak = 0
    for record in events:
        kind = record.get("event")
        if kind == ev.WRAPPER_START and ev.restart_of(record) == 0:
            streak = 0
        elif kind in PROGRESS_EVENTS:
            streak = 0
        elif kind in CONTINUE_EVENTS:
            streak = streak + 1 if record.get("progress") is False else 0
    return streak


@dataclass(frozen=True)
class RunFacts:
    """What the last run shows, in the user's numbers (None: not known)."""

    run_seconds: float | None = None  # from the run's start to the job's end time
    stop_before_end: float | None = None  # how long before the end time the step ended
    first_write: float | None = None  # seconds from the step's start to its first write
    write_cut: bool = False  # a write was under way when the step ended
    restart_files: bool = True  # --restart-files (else the Python API's checkpoints)
    #: Can the wrapper see what the run kept? (not for --app-signal without
    #: --restart-files, nor for an application that never started the Checkpointer)
    observable: bool = True

    def described(self) -> str:
        """The numbers, as one clause of the give-up line."""
        parts = []
        if self.run_seconds is not None:
            parts.append(f"the run had {self.run_seconds:.0f} s up to the job's end time")
        if self.stop_before_end is not None:
            parts.append(f"the step ended {self.stop_before_end:.0f} s before it")
        what = "restart write" if self.restart_files else "checkpoint"
        if self.first_write is not None:
            cut = ", cut by the stop" if self.write_cut else ""
            began = f"began after {self.first_write:.0f} s{cut}"
            parts.append(f"the application's first {what} {began}")
        else:
            parts.append(f"no {what} of the application was seen")
        return ", ".join(parts)


@dataclass(frozen=True)
class StallDecision:
    progress: bool  # this run kept something new
    kept: str  # what it kept, or what it did not
    stalled: int  # stops without progress in a row, this one included
    give_up: bool
    message: str  # the log line (the give-up line when give_up)


def decide_after_stop(
    events: Iterable[Mapping[str, Any]] | None,
    *,
    attempt: str,
    facts: RunFacts,
    max_stalled: int = MAX_STALLED_STOPS,
) -> StallDecision:
    """After a stop: did this run make progress, and may the job continue?

    ``events``: the log (None when unreadable: counted as progress, the wrapper cannot
    tell and never gives up on a guess)."""
    if events is None:
        return StallDecision(True, "the event log is unreadable", 0, False, "")
    if not facts.observable:
        return StallDecision(True, "what it kept cannot be seen", 0, False, "")
    log = list(events)
    what = "restart set" if facts.restart_files else "committed checkpoint"
    saved = progress_of(log, attempt)
    if saved is not None:
        number = saved.get("set", saved.get("step"))
        label = "restart set" if saved.get("event") == ev.RESTART_SET else "checkpoint"
        kept = f"{label} {number}" if number is not None else label
        return StallDecision(True, kept, 0, False, "")
    stalled = stalled_stops(log) + 1
    kept = f"no new {what}"
    if stalled < max_stalled:
        return StallDecision(
            False,
            kept,
            stalled,
            False,
            f"this run kept nothing new ({kept}: {facts.described()}); run {stalled} of "
            f"{max_stalled} in a row without progress; continuing",
        )
    fix = (
        "give the job a longer --time (each run must last past the application's first "
        "restart write plus its duration), or make the application write its restart "
        "files more often (its own interval option; HPCCKPT_INTERVAL says what fits)"
        if facts.restart_files
        else "give the job a longer --time, or checkpoint more often (a shorter interval, "
        "or a first checkpoint earlier in the run)"
    )
    return StallDecision(
        False,
        kept,
        stalled,
        True,
        f"giving up: {stalled} runs in a row ended before the application wrote a "
        f"{what} ({facts.described()}); requeueing again would repeat the same work from "
        f"the same place. What to do: {fix}, then submit the batch script again",
    )
