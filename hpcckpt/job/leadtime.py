"""Is the warning signal early enough for a checkpoint? (a warning in the job log)

When the stop signal arrives, the job has ``lead`` seconds left (its end time from
``squeue -h -j ID -o %e`` minus the arrival time). The checkpoints measured so far
(``seconds`` of ``checkpoint`` events from the Checkpointer, ``restart_set`` events from
the wrapper) say what the next one may cost. If ``cost x safety + margin`` exceeds the
lead, the next time-limit checkpoint may be cut off by SIGKILL: say so, and which
``#SBATCH --signal=B:SIG@N`` would fit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcckpt.policy import DEFAULT_MARGIN, DEFAULT_SAFETY
from hpcckpt.rundir.events import checkpoint_costs

#: How many recent checkpoints to look at (the worst of them counts).
RECENT = 5


def measured_cost(events: Iterable[Mapping[str, Any]]) -> float | None:
    """The largest of the last few measured checkpoint durations, or None."""
    costs = checkpoint_costs(events)
    return max(costs[-RECENT:]) if costs else None


@dataclass(frozen=True)
class LeadCheck:
    cost: float
    needed: float
    lead: float
    suggested: int  # seconds for --signal=B:SIG@N

    @property
    def too_short(self) -> bool:
        return self.needed > self.lead


def check_lead(
    cost: float,
    lead: float,
    *,
    safety: float = DEFAULT_SAFETY,
    margin: float = DEFAULT_MARGIN,
) -> LeadCheck:
    """Compare the lead time with ``cost*safety + margin``; suggest a round @N."""
    needed = cost * safety + margin
    suggested = int(math.ceil(needed / 10.0) * 10)
    return LeadCheck(cost, needed, lead, max(suggested, 30))


def warning_text(check: LeadCheck, signal_name: str) -> str:
    return (
        f"warning: the stop signal came {check.lead:.0f} s before the job's end time, but "
        f"checkpoints took up to {check.cost:.1f} s here ({check.cost:.1f} s x "
        f"{DEFAULT_SAFETY:g} + {DEFAULT_MARGIN:g} s for the requeue = {check.needed:.0f} s): "
        f"the checkpoint may be cut off at the limit. Use #SBATCH "
        f"--signal=B:{signal_name}@{check.suggested} (or more)"
    )
