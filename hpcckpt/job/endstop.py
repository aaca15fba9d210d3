"""The wrapper's own stop before the job's end time, for jobs without ``--signal``.

A job submitted without ``#SBATCH --signal`` (or whose batch shell is not the wrapper,
so that the signal never reaches it) gets nothing from Slurm before its time limit but
TERM to everything and SIGKILL ``KillWait`` later. So the wrapper reads the job's end
time (``squeue -o %e``, as the Checkpointer's deadline does) and requests the stop itself
at :meth:`hpcckpt.policy.Deadline.stop_at`: ``end - cost x 1.5 - 20 s``, the cost being
the largest of the last measured checkpoints (``checkpoint`` and ``restart_set`` events,
:func:`hpcckpt.job.leadtime.measured_cost`), or :data:`DEFAULT_COST` before any was
measured. When the warning signal may kill the batch shell first (the wrapper was not
``exec``'d, :mod:`hpcckpt.job.batchshell`), the stop comes before that signal can:
``end - lead - SIGNAL_SLACK - cost x 1.5 - 20 s``.

End times move while a job runs (an administrator shortens or extends the limit with
``scontrol update JobId=... TimeLimit=...``), so the end time is read again every
:data:`REFRESH` seconds, and the plan follows it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcckpt.job import leadtime
from hpcckpt.policy import Deadline

#: Assumed cost of a checkpoint before one was measured: the stop comes
#: 20 x 1.5 + 20 = 50 s before the end time.
DEFAULT_COST = 20.0
#: Slurm may send the ``--signal`` signal up to a minute before its lead time.
SIGNAL_SLACK = 60.0
#: Seconds between two readings of the end time: one ``squeue`` a minute per job is the
#: load of a user watching the queue, and a limit shortened by minutes is still met.
REFRESH = 60.0


@dataclass(frozen=True)
class EndStopPlan:
    end: float  # Unix seconds
    cost: float
    measured: bool  # cost from events (else DEFAULT_COST)
    stop_at: float  # Unix seconds
    before_signal: float | None = None  # the lead the stop must beat, if any

    def describe(self) -> str:
        how = "measured" if self.measured else "default, nothing measured yet"
        beat = (
            f", before the B: signal ({self.before_signal:g} s lead + {SIGNAL_SLACK:g} s slack)"
            if self.before_signal is not None
            else ""
        )
        return (
            f"{self.end - self.stop_at:.0f} s before the job's end time (checkpoint cost "
            f"{self.cost:.1f} s, {how}{beat})"
        )


def plan(
    end: float,
    history: Iterable[Mapping[str, Any]],
    *,
    signal_lead: float | None = None,
    default_cost: float = DEFAULT_COST,
) -> EndStopPlan:
    """When to request the stop for a job ending at ``end`` (Unix seconds)."""
    cost = leadtime.measured_cost(history)
    measured = cost is not None
    cost = cost if cost is not None else default_cost
    limit = end if signal_lead is None else end - signal_lead - SIGNAL_SLACK
    stop = Deadline(limit).stop_at(cost)
    assert stop is not None
    return EndStopPlan(end, cost, measured, stop, signal_lead)


class EndStop:
    """Follows the end time in the background; ``due()`` once the stop time has come."""

    def __init__(
        self,
        fetch_end: Callable[[], float | None],
        history: Callable[[], Iterable[Mapping[str, Any]]],
        *,
        signal_lead: float | None = None,
        default_cost: float = DEFAULT_COST,
        refresh: float = REFRESH,
        known_end: float | None = None,
    ) -> None:
        self._fetch_end = fetch_end
        self._known_end = known_end  # read just before the step started: not read twice
        self.refresh = refresh
        self._quit = threading.Event()
        self._history = history
        self.signal_lead = signal_lead
        self.default_cost = default_cost
        self.plan: EndStopPlan | None = None
        self.error: str | None = None
        self.fired = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name="hpcckpt-endstop", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        """Read the end time now, then again every ``refresh`` seconds until the stop fired
        (also after a failed first reading: a busy controller may answer later). An end
        time the wrapper read just before the step started stands for the first reading."""
        self._load(self._known_end)
        while not self.fired and not self._quit.wait(self.refresh):
            self._load()

    def close(self) -> None:
        """Stop reading the end time (the step ended)."""
        self._quit.set()

    def _load(self, known: float | None = None) -> None:
        """One reading of the end time (``known``: one already read). A failure before any
        plan leaves the stop unarmed until a reading succeeds; a later one keeps the plan
        made from the last good reading (squeue failed once)."""
        try:
            end = self._fetch_end() if known is None else known
            if end is None:  # no limit (any more): nothing to stop for
                self.error = "Slurm reports no end time" + (" any more" if self.plan else "")
                self.plan = None
                return
            self.error = None
            self.plan = plan(
                end,
                list(self._history()),
                signal_lead=self.signal_lead,
                default_cost=self.default_cost,
            )
        except Exception as exc:  # noqa: BLE001 - any failure only disarms the stop
            if self.plan is None:
                self.error = str(exc)

    def due(self, now: float | None = None) -> bool:
        """True once, when the planned stop time has come."""
        if self.fired or self.plan is None:
            return False
        if (time.time() if now is None else now) >= self.plan.stop_at:
            self.fired = True
            return True
        return False
