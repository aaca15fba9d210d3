"""The job's end time, and when to stop computing to checkpoint before it.

Slurm kills a job at its end time (``scontrol show job`` prints ``EndTime=``, and
``squeue -o %e`` the same). A job that notices the limit only when the warning
signal arrives may not have time to save; the :class:`Deadline` lets the
Checkpointer stop on its own while a checkpoint still fits.
"""

from __future__ import annotations

import math
import time
from datetime import datetime

from hpcckpt.policy.durations import parse_duration

__all__ = [
    "DEFAULT_MARGIN",
    "DEFAULT_SAFETY",
    "END_SLACK",
    "INTERVAL_SLACK",
    "REQUEUE",
    "TAKEDOWN",
    "Deadline",
    "fit_interval",
    "parse_end_time",
    "requeue_lead",
]

DEFAULT_SAFETY: float = 1.5
"""The last checkpoint is assumed to take up to 1.5x the tracked cost.

File systems are busiest exactly when many jobs hit their limits together (before a
maintenance reservation, at the end of a job array); a 50 % allowance covers such
slowdowns without stopping absurdly early.
"""

DEFAULT_MARGIN: float = 20.0
"""Seconds kept free after the last checkpoint for the wrapper's own work.

After the application stops, the wrapper writes its events and asks slurmctld to
requeue the job; one such RPC can take up to Slurm's default ``MessageTimeout`` of
10 s on a busy controller, and 20 s leaves room for it and the rest.
"""

INTERVAL_SLACK: float = 0.1
"""Share of the time left that :func:`fit_interval` keeps free after the last write.

The application's clock starts after the launcher's start-up, and codes that count in
steps rather than seconds drift; a write planned to end exactly at the stop would come
too late and take the whole run's work with it.
"""

TAKEDOWN: float = 2.0
"""Seconds to take a step down once its ranks are done (TERM ends them at once)."""

REQUEUE: float = 5.0
"""Seconds the wrapper needs to requeue the job (``scontrol requeue``; it cannot time it,
Slurm ends the run as it returns)."""

END_SLACK: float = 5.0
"""End times come in whole seconds and the wrapper looks once a second."""


def requeue_lead(kill_wait: float | None = None, requeue: float = REQUEUE) -> float:
    """Seconds before the job's end time by which a step must be over for the wrapper to
    take it down and requeue the job: the take-down and the requeue that Slurm's
    ``KillWait`` after its own TERM at the limit does not already give (None: not known,
    none counted), plus :data:`END_SLACK`. The wrapper places its latest stop with it
    (:mod:`hpcckpt.job.ownlead`), the Checkpointer bounds a stop's mirror wait with it."""
    return max(0.0, TAKEDOWN + requeue - (kill_wait or 0.0)) + END_SLACK


_UNKNOWN = {"", "unknown", "n/a", "none", "(null)", "null", "unlimited", "infinite"}
_EARLIEST_UNIX = 1e8  # 1973-03-03: smaller numbers are durations, not Unix times


def parse_end_time(text: str | float | None, now: float | None = None) -> float | None:
    """Unix seconds from an end time as Slurm prints it, or None when there is none.

    Accepts Unix seconds (``"1795320900"``), ISO 8601 local time as in
    ``EndTime=2026-11-22T04:15:00`` (an explicit UTC offset is honoured), or
    ``+DURATION`` relative to *now* (default: the current time), e.g. ``+1:30:00``
    from ``squeue -o %L``. ``Unknown``, ``N/A``, ``UNLIMITED`` and ``""`` give None.
    """
    if text is None:
        return None
    if isinstance(text, bool):
        raise ValueError(f"invalid end time {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = str(text).strip()
        if s.lower() in _UNKNOWN:
            return None
        if s.startswith("+"):
            base = time.time() if now is None else float(now)
            return base + parse_duration(s[1:])
        try:
            value = float(s)
        except ValueError:
            try:
                parsed = datetime.fromisoformat(s)
            except ValueError:
                raise ValueError(
                    f"invalid end time {text!r}: expected Unix seconds, ISO 8601 local time "
                    "like 2026-11-22T04:15:00, +DURATION, or Unknown"
                ) from None
            return parsed.timestamp()  # naive datetimes are taken as local time
    if not math.isfinite(value) or value < _EARLIEST_UNIX:
        raise ValueError(
            f"invalid end time {text!r}: not a Unix time (for a time from now, write +{text})"
        )
    return value


class Deadline:
    """When the job must stop computing so that a last checkpoint ends before *end_time*.

    *end_time* is Unix seconds, or None for no limit (``must_stop`` is then always
    False). The checkpoint is assumed to take ``cost * safety``, and *margin*
    seconds stay free afterwards for the wrapper's requeue (see
    :data:`DEFAULT_SAFETY` and :data:`DEFAULT_MARGIN`).
    """

    def __init__(
        self,
        end_time: float | None,
        safety: float = DEFAULT_SAFETY,
        margin: float = DEFAULT_MARGIN,
    ) -> None:
        if end_time is not None and not math.isfinite(float(end_time)):
            raise ValueError(f"end time must be finite Unix seconds or None, got {end_time!r}")
        if not math.isfinite(safety) or safety < 1:
            raise ValueError(f"safety must be a factor >= 1, got {safety!r}")
        if not math.isfinite(margin) or margin < 0:
            raise ValueError(f"margin must be seconds >= 0, got {margin!r}")
        self.end_time = None if end_time is None else float(end_time)
        self.safety = float(safety)
        self.margin = float(margin)

    def stop_at(self, cost_estimate: float | None) -> float | None:
        """The Unix time from which :meth:`must_stop` is true, or None without a limit."""
        if self.end_time is None:
            return None
        cost = 0.0 if cost_estimate is None else max(0.0, float(cost_estimate))
        return self.end_time - cost * self.safety - self.margin

    def must_stop(self, now: float, cost_estimate: float | None) -> bool:
        """True when ``now + cost*safety + margin >= end_time``: checkpoint and stop now.

        A None *cost_estimate* counts as zero; pass :func:`initial_cost_estimate`
        before the first save was measured.
        """
        stop = self.stop_at(cost_estimate)
        return stop is not None and now >= stop

    def remaining(self, now: float, cost_estimate: float | None = None) -> float:
        """Seconds of computing left before :meth:`must_stop` turns true (inf without a limit)."""
        stop = self.stop_at(cost_estimate)
        return math.inf if stop is None else stop - now

    def __repr__(self) -> str:
        return (
            f"Deadline(end_time={self.end_time!r}, safety={self.safety!r}, margin={self.margin!r})"
        )


def fit_interval(interval: float, left: float | None, cost: float = 0.0) -> float:
    """The checkpoint interval for a run that must stop in ``left`` seconds.

    An interval longer than what remains protects nothing: the run would be stopped
    before its first write and lose all its work. So the usable time, ``left`` less
    :data:`INTERVAL_SLACK` of it and one write's ``cost``, is split into equal parts no
    longer than ``interval``; the last write then ends shortly before the stop. Without
    a limit (``left`` None or infinite) ``interval`` is returned unchanged; when no write
    fits any more, ``min(interval, left)`` (at least 1 s).
    """
    interval = float(interval)
    if not math.isfinite(interval) or interval <= 0:
        raise ValueError(f"interval must be seconds > 0, got {interval!r}")
    if left is None or not math.isfinite(left):
        return interval
    usable = left * (1.0 - INTERVAL_SLACK) - max(0.0, cost)
    if usable <= 1.0:
        return max(1.0, min(interval, left))
    return usable / math.ceil(usable / interval)
