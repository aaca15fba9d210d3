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
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcckpt.job.reporting import WARN, Reporter
from hpcckpt.policy import DEFAULT_MARGIN, DEFAULT_SAFETY
from hpcckpt.rundir import events
from hpcckpt.rundir.events import checkpoint_costs, read_events
from hpcckpt.slurm import commands
from hpcckpt.slurm.parse import is_cancelled
from hpcckpt.slurm.runner import SlurmError

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


def start_check(
    reporter: Reporter,
    *,
    job: str,
    arrived: float,
    signal_name: str,
    ckpt_dir: str | os.PathLike[str],
    environ: Mapping[str, str],
) -> threading.Thread:
    """Check the lead of a stop signal that ``arrived`` (Unix time) in the background
    (squeue may be slow); warn through ``reporter`` if it is too short."""

    def check() -> None:
        try:
            cost = measured_cost(read_events(ckpt_dir))
            if cost is None:
                return
            end = commands.end_time(job, environ=environ)
            if end is None:
                return
            result = check_lead(cost, end.timestamp() - arrived)
            if result.too_short and is_cancelled(commands.show_job(job, environ=environ)):
                return  # scancel moved the end time to now: no time limit to warn about
            if result.too_short:
                reporter.log(warning_text(result, signal_name), WARN)
                reporter.event(
                    events.LEAD_TIME_WARNING,
                    lead=round(result.lead, 1),
                    cost=round(result.cost, 3),
                    needed=round(result.needed, 1),
                    suggested_signal=f"B:{signal_name}@{result.suggested}",
                )
        except (SlurmError, OSError, ValueError) as exc:
            reporter.log(f"note: cannot check the signal's lead time: {exc}")

    thread = threading.Thread(target=check, name="hpcckpt-lead", daemon=True)
    thread.start()
    return thread
