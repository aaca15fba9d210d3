"""The Checkpointer's side of the checkpoint directory it shares with the wrapper
(docs/architecture.md, "Contracts between the application and the wrapper"): rank 0
locks the directory for the job, writes the status file the wrapper decides by, and
appends the events that ``hpcckpt report`` reads, the store's reports among them.

Only rank 0 writes: on the other ranks every method but the collective
:meth:`RunRecord.lock` does nothing. What the lines and fields say is
:mod:`hpcckpt.coord.logbook`'s; when to write them is the Checkpointer's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcckpt.rundir import directory as run_directory
from hpcckpt.rundir import events as job_events
from hpcckpt.rundir import status as job_status
from hpcckpt.store import DirectoryLock, DirectoryLocked, make_directory
from hpcckpt.store.agreement import Agreement
from hpcckpt.store.store import MIRROR_FAILED, MIRROR_PRUNED, MIRRORED, STAGING_REFUSED

#: The store's report kinds (the mirror's thread, a staged save refused) and their events.
STORE_EVENTS = {
    MIRRORED: job_events.MIRRORED,
    MIRROR_FAILED: job_events.MIRROR_FAILED,
    MIRROR_PRUNED: job_events.MIRROR_PRUNED,
    STAGING_REFUSED: job_events.STAGING_REFUSED,
}


class RunRecord:
    """Rank 0's lock, status file and event log of one Checkpointer's directory."""

    def __init__(self, directory: Path, rank: int, nranks: int, attempt: str | None) -> None:
        self.directory = directory
        self.rank = rank
        self.nranks = nranks
        #: The wrapper's token of this attempt, in every status written.
        self.attempt = attempt
        self._lock: DirectoryLock | None = None  # rank 0: one job per directory
        self._events = job_events.EventLog(directory)  # rank 0 writes it

    def lock(self, agreement: Agreement, dir_mode: int, file_mode: int, job_id: str | None) -> None:
        """Rank 0 creates and locks the directory; DirectoryLocked (or OSError) on every
        rank when it cannot. Collective."""

        def take() -> tuple[str, str] | None:
            try:
                make_directory(self.directory, dir_mode)
                self._lock = DirectoryLock(self.directory, mode=file_mode, job_id=job_id).acquire()
            except DirectoryLocked as exc:
                return ("locked", str(exc))
            except OSError as exc:
                why = run_directory.explain(self.directory, exc, option="checkpoint directory")
                return ("os", why)
            return None

        error = agreement.from_root(take)
        if error:
            raise DirectoryLocked(error[1]) if error[0] == "locked" else OSError(error[1])

    def release(self, timeout: float = 10.0) -> None:
        """Give the directory up (the next job may take it) and join the lock's refresh
        thread within ``timeout`` seconds once no user in this process holds it; again is
        harmless."""
        self._events.close()
        lock, self._lock = self._lock, None
        if lock is None:
            return
        lock.release()
        lock.join(timeout)

    def status(self, state: str, step: int | None = None, reason: str = "") -> None:
        """Rank 0 writes the status file: ``running``, ``stopped`` or ``finished``."""
        if self.rank == 0:
            job_status.write_status(
                self.directory, job_status.RunStatus(state, self.attempt, step, reason)
            )

    def event(self, kind: str, **fields: Any) -> None:
        """Rank 0 appends one event of the Checkpointer."""
        if self.rank == 0:
            self._events.append(kind, source="checkpointer", nranks=self.nranks, **fields)

    def store_report(self, kind: str, fields: dict[str, Any]) -> None:
        """One of the store's reports (the mirror's thread on rank 0, a refused staging),
        as its event."""
        self.event(STORE_EVENTS[kind], **fields)
