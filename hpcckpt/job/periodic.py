"""When to send an application without the Python API its checkpoint signal.

``--ckpt-every DURATION`` sends it every DURATION of runtime; ``--ckpt-every auto``
every Young interval ``sqrt(2 C M)``: C is the measured cost of the application's own
checkpoints (signal to complete restart files, smoothed by
:class:`hpcckpt.policy.CostTracker`, seeded from earlier attempts' ``restart_set``
events), M the job's MTBF (``--mtbf``, else the per-node default divided by the node
count). The interval counts from the end of the previous checkpoint (or the start).

``HPCCKPT_INTERVAL`` (:meth:`PeriodicSchedule.exported`), for applications with an
interval option of their own, is that interval fitted to the time left before the job's
end-time stop (:func:`hpcckpt.policy.fit_interval`): Young's interval with a default
MTBF is often longer than the whole job, which would let the run end without a write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hpcckpt.policy import CostTracker, fit_interval, job_mtbf, make_policy, parse_duration
from hpcckpt.rundir.events import RESTART_SET, checkpoint_costs

AUTO = "auto"
#: Assumed cost of the first checkpoint of an application we know nothing about.
INITIAL_COST = 10.0


class PeriodicSchedule:
    """``interval()`` now, ``due(now)``, and ``checkpointed(now, cost)`` after each one."""

    def __init__(
        self,
        every: str,
        *,
        start: float,
        nodes: int = 1,
        mtbf: float | str | None = None,
        history: Iterable[Mapping[str, Any]] = (),
    ) -> None:
        self.costs = CostTracker()
        for seconds in checkpoint_costs(history, kinds=(RESTART_SET,)):
            self.costs.add(max(0.0, seconds))
        text = str(every).strip().lower()
        if text == AUTO:
            m = parse_duration(mtbf) if mtbf is not None else None
            self.policy = make_policy("young", mtbf=job_mtbf(m, nodes=nodes))
        else:
            self.policy = make_policy("fixed", interval=parse_duration(every))
        self.last = start

    def interval(self) -> float:
        return self.policy.interval(self.costs.get(INITIAL_COST))

    def exported(self, stop_in: float | None) -> int:
        """``HPCCKPT_INTERVAL``: whole seconds, fitted to the ``stop_in`` seconds left before
        the end-time stop (None: no limit known)."""
        cost = self.costs.get(INITIAL_COST)
        return max(1, round(fit_interval(self.interval(), stop_in, cost)))

    def next_at(self) -> float:
        return self.last + self.interval()

    def due(self, now: float) -> bool:
        return now >= self.next_at()

    def checkpointed(self, now: float, cost: float | None) -> None:
        if cost is not None:
            self.costs.add(max(0.0, cost))
        self.last = now

    def describe(self) -> str:
        return self.policy.describe()
