"""The Checkpointer: every rank checkpoints at the same step, and resumes from the newest good one.

It joins the *when* (interval, step count, stop signals) with the *where* (the
store) over MPI. All public methods are collective: every rank of ``comm`` calls
them in the same order with the same step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcckpt.coord.signals import StopSignals
from hpcckpt.job import events as job_events
from hpcckpt.job import status as job_status
from hpcckpt.store.store import CheckpointStore, SaveResult

log = logging.getLogger("hpcckpt")

# Slots of the flag vector the ranks reduce (MAX) to agree on a decision.
_SIGNAL, _TIME = 0, 1


def _configure_logging(rank: int) -> None:
    """One stderr handler with a rank prefix; ranks other than 0 log warnings only."""
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"hpcckpt[{rank}] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


class Checkpointer:
    """Coordinated checkpoints of per-rank state into one parallel HDF5 file per checkpoint.

    ``directory`` defaults to ``$HPCCKPT_DIR`` (set by the ``hpcckpt`` wrapper).
    Checkpoints are due every ``interval`` seconds or every ``every_steps`` steps, and
    at once when a stop signal (``signal``, SIGUSR1 by default, and SIGTERM) reaches
    any rank; after such a stop checkpoint ``stop_requested`` is true on every rank.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        comm: MPI.Comm | None = None,
        *,
        interval: float | None = None,
        every_steps: int | None = None,
        signal: str | int = "USR1",
        stop_signals: Iterable[str | int] = ("TERM",),
    ) -> None:
        directory = directory if directory is not None else os.environ.get(job_status.DIR_ENV)
        if not directory:
            raise ValueError(
                "Checkpointer needs a directory: pass Checkpointer(directory, ...) "
                f"or set {job_status.DIR_ENV} (the hpcckpt wrapper sets it from --ckpt-dir)"
            )
        if interval is not None and interval <= 0:
            raise ValueError(f"interval must be a positive number of seconds, not {interval!r}")
        if every_steps is not None and (int(every_steps) != every_steps or every_steps < 1):
            raise ValueError(f"every_steps must be a positive integer, not {every_steps!r}")
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.nranks = self.comm.Get_size()
        _configure_logging(self.rank)
        self.directory = Path(directory).absolute()
        self.interval = None if interval is None else float(interval)
        self.every_steps = every_steps
        self.store = CheckpointStore(self.directory, self.comm)
        self._signals = StopSignals([signal, *stop_signals])
        self._attempt = os.environ.get(job_status.ATTEMPT_ENV)

        self._send = np.zeros(2, dtype=np.int32)
        self._recv = np.zeros(2, dtype=np.int32)
        self._request: MPI.Request | None = None
        self._last_save_time = time.monotonic()
        self._last_save_step: int | None = None
        self._first_step: int | None = None
        self._stop_pending = False
        self._stop_requested = False
        self._finished = False
        self.last_save: SaveResult | None = None

        error = None
        if self.rank == 0:
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                error = f"cannot create checkpoint directory {self.directory}: {exc}"
        error = self.comm.bcast(error)
        if error:
            raise OSError(error)
        # Every rank has its handlers now: the wrapper may forward signals.
        self.comm.Barrier()
        self._report(job_status.RUNNING)
        self._event("start", pid=os.getpid())

    # -- helpers -----------------------------------------------------------------
    def _report(self, state: str, step: int | None = None, reason: str = "") -> None:
        if self.rank == 0:
            job_status.write_status(
                self.directory, job_status.RunStatus(state, self._attempt, step, reason)
            )

    def _event(self, kind: str, **fields: Any) -> None:
        if self.rank == 0:
            job_events.append_event(self.directory, kind, source="checkpointer", nranks=self.nranks, **fields)

    def _drain(self) -> None:
        """Complete and discard the reduction in flight (after a save it is stale)."""
        if self._request is not None:
            self._request.Wait()
            self._request = None

    # -- public API --------------------------------------------------------------
    @property
    def stop_requested(self) -> bool:
        """True on every rank once the checkpoint taken on a stop signal is committed."""
        return self._stop_requested

    def restore(self, state: dict[str, Any]) -> int | None:
        """Fill ``state`` in place from the newest good checkpoint; its step, or None if none.

        Arrays are filled in place (the application's references stay valid);
        scalars are replaced in the dict. Collective.
        """
        result = self.store.restore(state)
        self._drain()
        self._last_save_time = time.monotonic()
        if result is None:
            log.info("no checkpoint in %s: starting from the beginning", self.directory)
            self._event("restore", step=None)
            return None
        for step, reason in result.skipped:
            self._event("skip_bad", step=step, reason=reason)
        log.info("restored step %d from %s", result.step, result.path.name)
        self._event("restore", step=result.step, path=result.path.name)
        self._last_save_step = result.step
        return result.step

    def due(self, step: int) -> bool:
        """Whether to checkpoint at ``step``; collective, cheap, and the same on every rank.

        Ranks exchange their flags (signal seen, interval elapsed) with a non-blocking
        reduction whose result is used at the next call, so no rank waits for the
        others in the common case and all ranks decide on the same step.
        """
        if self._first_step is None:
            self._first_step = step
        decided = np.zeros(2, dtype=np.int32)
        if self._request is not None:
            self._request.Wait()
            decided[:] = self._recv
        self._send[_SIGNAL] = 1 if self._signals.received is not None else 0
        elapsed = time.monotonic() - self._last_save_time
        self._send[_TIME] = 1 if self.interval is not None and elapsed >= self.interval else 0
        self._request = self.comm.Iallreduce(self._send, self._recv, op=MPI.MAX)

        if decided[_SIGNAL]:
            self._stop_pending = True
            return True
        if decided[_TIME]:
            return True
        if self.every_steps is not None:
            since = self._last_save_step if self._last_save_step is not None else self._first_step - 1
            return step - since >= self.every_steps
        return False

    def save(self, step: int, state: dict[str, Any]) -> SaveResult:
        """Write a coordinated checkpoint of ``state`` at ``step``; collective.

        Returns once the checkpoint is committed: written by every rank, durable and
        renamed into place. After a save triggered by a stop signal, ``stop_requested``
        becomes true.
        """
        self._drain()
        stop = self._stop_pending
        reason = "signal" if stop else "interval" if self.interval else "steps"
        self._event("checkpoint_begin", step=step, reason=reason)
        result = self.store.save(step, state, extra_meta={"reason": reason})
        self.last_save = result
        self._last_save_time = time.monotonic()
        self._last_save_step = step
        mib = result.bytes_written / 2**20
        rate = result.bytes_written / result.seconds / 1e6 if result.seconds > 0 else float("inf")
        log.info(
            "checkpoint step %d: %.1f MiB in %.2f s (%.0f MB/s), reason %s",
            step, mib, result.seconds, rate, reason,
        )
        self._event(
            "checkpoint", step=step, seconds=round(result.seconds, 6),
            bytes=result.bytes_written, reason=reason, path=result.path.name,
        )
        if stop:
            self._stop_requested = True
            sig = self._signals.received
            self._report(job_status.STOPPED, step, f"signal {sig.name if sig else '?'}")
            self._event("stop", step=step, signal=sig.name if sig else None)
            log.info("stop requested: checkpoint of step %d committed, leaving", step)
        return result

    def finish(self) -> None:
        """Mark the run complete so the wrapper does not requeue it; collective."""
        self._drain()
        self.comm.Barrier()
        self._finished = True
        self._report(job_status.FINISHED, self._last_save_step, "finish() called")
        self._event("finish", last_step=self._last_save_step)
        self._signals.close()

    def close(self) -> None:
        """Release signal handlers and the pending reduction (also done by ``finish``)."""
        self._drain()
        self._signals.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
