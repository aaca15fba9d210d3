"""When to end the step of an application that takes no signal: a lead that fits it.

Such a code writes restart files on its own schedule and dies on TERM. Ending its step
early saves nothing it has not written: the work since its last complete write is lost
however the step ends. So the wrapper ends the step only

- **right after a complete write, when the next one could not end in time**: the next
  write is expected ``period x 1.25`` after the last one ended, and known complete
  ``settle`` seconds and one poll later; if that is past the latest stop, the step ends
  now and loses (almost) nothing;
- **at the latest stop**, ``lead`` seconds before the job's end time, where ``lead =
  max(0, take-down + requeue - KillWait) + 5 s``: the time to take the step down (TERM
  ends such a code at once: 2 s) and to requeue (``scontrol requeue``: 5 s; the wrapper
  cannot time it, Slurm ends the run as it returns) that Slurm's ``KillWait`` after its
  own TERM at the limit does not already give, plus 5 s for end times in whole seconds
  and a poll. A write under way then may finish when its measured duration says it ends
  before the end time (and it has not yet taken three times that long). These margins
  live in :func:`hpcckpt.policy.requeue_lead`, which a stop's mirror wait shares.

Never before the application's first write when there is time for it: with no write seen
in a run, only the latest stop ends it. The numbers: the write period (median of the last
few starts-to-start within one run) and duration (the longest recent write) from the
``restart_set`` events and this run's writes, KillWait from ``scontrol show config``.

Pure functions: no I/O here.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcckpt.policy import requeue_lead
from hpcckpt.policy.deadline import END_SLACK as SLACK
from hpcckpt.policy.deadline import REQUEUE as DEFAULT_REQUEUE
from hpcckpt.policy.deadline import TAKEDOWN
from hpcckpt.rundir import events as ev

__all__ = ["DEFAULT_REQUEUE", "SLACK", "TAKEDOWN", "EndDecision", "Measured", "decide", "measured"]

#: The next write is expected this many periods after the last one.
PERIOD_SAFETY = 1.25
#: A write under way this many measured durations long is not waited for any more.
OVERRUN = 3.0
#: One pass of the wrapper's main loop.
POLL = 1.0
#: How many recent writes the numbers come from.
RECENT = 5


@dataclass(frozen=True)
class Measured:
    """What the wrapper knows of the application's writes and of Slurm (None: not known)."""

    period: float | None = None  # seconds from one write's start to the next's
    duration: float | None = None  # the longest recent write
    requeue: float = DEFAULT_REQUEUE  # seconds for scontrol requeue
    kill_wait: float | None = None  # Slurm's KillWait

    def lead(self) -> float:
        """Seconds before the end time of the latest stop (see the module doc)."""
        return requeue_lead(self.kill_wait, self.requeue)

    def describe(self) -> str:
        """The numbers used, in words."""
        kw = "unknown" if self.kill_wait is None else f"{self.kill_wait:g} s"
        rq = f"{self.requeue:g} s"
        if self.period is None and self.duration is None:
            writes = "no write period measured yet"
        else:
            period = "unknown" if self.period is None else f"{self.period:.1f} s"
            dur = "unknown" if self.duration is None else f"{self.duration:.1f} s"
            writes = f"write period {period}, write duration {dur}, measured"
        return f"KillWait {kw}, requeue {rq}, take-down {TAKEDOWN:g} s; {writes}"


def measured(
    history: Iterable[Mapping[str, Any]],
    spans: Sequence[tuple[float, float]] = (),
    *,
    kill_wait: float | None = None,
) -> Measured:
    """The numbers from the event log and this run's writes (``spans``: (began, ended),
    Unix seconds, in order)."""
    by_attempt: dict[Any, list[tuple[float, float]]] = {}
    for record in history:
        if record.get("event") == ev.RESTART_SET and isinstance(record.get("began"), (int, float)):
            ended = record.get("ended", record["began"])
            by_attempt.setdefault(record.get("attempt"), []).append(
                (float(record["began"]), float(ended))
            )
    runs = [*by_attempt.values(), list(spans)]
    periods: list[float] = []
    durations: list[float] = []
    for run in runs:
        durations.extend(max(0.0, e - b) for b, e in run)
        periods.extend(b2 - b1 for (b1, _), (b2, _) in zip(run, run[1:], strict=False))
    recent = [p for p in periods if p > 0][-RECENT:]
    return Measured(
        period=statistics.median(recent) if recent else None,
        duration=max(durations[-RECENT:]) if durations else None,
        kill_wait=kill_wait,
    )


@dataclass(frozen=True)
class EndDecision:
    why: str  # the log line's reason, with the numbers it used
    lost: float  # seconds of work since the last complete write (or the step's start)


def decide(
    now: float,
    end: float,
    m: Measured,
    *,
    settle: float,
    step_started: float,
    last_write_end: float | None,
    writing_since: float | None,
) -> EndDecision | None:
    """End the step now? None: not yet. All times are Unix seconds."""
    latest = end - m.lead()
    since = now - (last_write_end if last_write_end is not None else step_started)
    if writing_since is not None:
        if now < latest:
            return None
        expected = None if m.duration is None else writing_since + m.duration + settle
        overrun = expected is not None and now > writing_since + OVERRUN * m.duration + settle
        if expected is not None and expected <= end and not overrun:
            return None  # it ends before the job does: it will be kept
        return EndDecision(
            f"{end - now:.0f} s before the job's end time, the latest stop ({m.lead():.0f} s "
            f"lead: {m.describe()}); a write under way since "
            f"{now - writing_since:.0f} s "
            + (
                "is far longer than the writes measured"
                if overrun
                else "cannot end before the end time"
            ),
            since,
        )
    if now >= latest:
        return EndDecision(
            f"{end - now:.0f} s before the job's end time, the latest stop ({m.lead():.0f} s "
            f"lead: {m.describe()}); no write under way",
            since,
        )
    if last_write_end is None or m.period is None:
        return None
    next_known = last_write_end + m.period * PERIOD_SAFETY + settle + POLL
    if next_known <= latest:
        return None
    return EndDecision(
        f"right after a complete write ({since:.0f} s ago): the next one (every "
        f"{m.period:.1f} s) would be complete {next_known - now:.0f} s from now, after the "
        f"latest stop {latest - now:.0f} s from now ({m.lead():.0f} s before the job's end "
        f"time: {m.describe()})",
        since,
    )
