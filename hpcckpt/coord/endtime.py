"""The job's end time, which places the Checkpointer's last checkpoint (its deadline).

It comes from the argument or ``$HPCCKPT_END_TIME`` (resolved in
:mod:`hpcckpt.coord.options`), else from Slurm: rank 0 asks at the start and again every
:data:`REFRESH` seconds after a save, since a job's time limit can be extended.
"""

from __future__ import annotations

import logging
import time

from hpcckpt import slurm
from hpcckpt.coord.options import CheckpointerOptions
from hpcckpt.policy import Deadline, requeue_lead
from hpcckpt.store.agreement import Agreement

log = logging.getLogger("hpcckpt")

#: How often rank 0 asks Slurm again for the job's end time (seconds).
REFRESH = 300.0


def mirror_wait_bound(wait: float, end_time: float | None, now: float) -> float:
    """Seconds a stop or ``finish()`` may wait for the mirror: ``wait``, cut so that the
    ranks are done :func:`~hpcckpt.policy.requeue_lead` seconds before the job's end time
    (never below 0; ``wait`` when there is no end time), the time the wrapper needs after
    them to take the step down and requeue the job. Slurm's ``KillWait`` is not counted:
    the job must be requeued before its end, not in Slurm's grace after its TERM, and rank
    0 does not ask the controller for it at a stop."""
    if end_time is None:
        return wait
    return max(0.0, min(wait, end_time - now - requeue_lead()))


class JobEnd:
    """The job's end time and the :class:`~hpcckpt.policy.Deadline` it sets; collective
    when made and in :meth:`refresh` (every rank of ``agreement`` calls them)."""

    def __init__(self, options: CheckpointerOptions, agreement: Agreement) -> None:
        #: "argument", "environment", "slurm" or None (no deadline).
        self.source = options.end_time_source
        self._job = options.job.job_id
        self._agreement = agreement
        schedule = options.schedule
        end = self._ask() if self.source == "slurm" else schedule.end_time
        self.deadline = Deadline(
            end,  # type: ignore[arg-type]
            safety=schedule.deadline_safety,
            margin=schedule.deadline_margin,
        )
        self._checked = time.monotonic()

    def refresh(self) -> Deadline:
        """The deadline, after asking Slurm again if it is the source and it is time."""
        if self.source == "slurm" and time.monotonic() - self._checked >= REFRESH:
            self._checked = time.monotonic()
            end = self._ask()
            if end is not None:
                old = self.deadline
                self.deadline = Deadline(end, safety=old.safety, margin=old.margin)
        return self.deadline

    def _ask(self) -> float | None:
        """Slurm's end time of the job, as rank 0 reads it, on every rank."""
        return self._agreement.from_root(self._read)

    def _read(self) -> float | None:
        try:
            end = slurm.end_time(self._job) if self._job else None
        except slurm.SlurmError as exc:
            log.warning(
                "cannot read the job's end time from Slurm (%s): no deadline checkpoint", exc
            )
            return None
        return None if end is None else end.timestamp()
