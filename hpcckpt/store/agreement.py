"""How the ranks agree: every collective decision and every cross-rank error goes here.

Each rank does its part of a step and reports what it met; one call makes every rank
see the same outcome: all succeeded, or the same error naming the ranks that failed and
why. The common case (nothing failed) costs one reduction; reasons are gathered only
when there are some. The store, its node-local tier and the Checkpointer share one
:class:`Agreement`, so a failure reads the same wherever it happens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint

T = TypeVar("T")

#: Reasons named in one error message at most (the rest: "and N more" is not worth a gather).
SHOWN = 4


class Refused(Exception):
    """A checkpoint that is sound but cannot be restored into this run: stop, do not
    fall back to an older one (raised on every rank alike by :meth:`Agreement.findings`)."""


class Agreement:
    """The ranks of ``comm`` deciding together; every method is collective."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.nranks = comm.Get_size()

    def agree(
        self,
        error: BaseException | None,
        what: str,
        kind: type[Exception] = CheckpointError,
        extra: Sequence[int] = (),
    ) -> list[int]:
        """Raise ``kind`` on every rank if any rank met an error; the message names the
        ranks and reasons. Returns the sum over the ranks of each of ``extra``, which
        ride on the same reduction."""
        mine = np.array([error is not None, *extra], dtype=np.int64)
        total = np.empty_like(mine)
        self.comm.Allreduce(mine, total, op=MPI.SUM)
        if total[0]:
            errors = self.comm.allgather(None if error is None else describe(error))
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
            detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:SHOWN])
            raise kind(f"{what} failed ({detail})") from error
        return [int(x) for x in total[1:]]

    def agree_root(self, error: BaseException | None, what: str) -> None:
        """:meth:`agree` for what only rank 0 does: one broadcast of its outcome."""
        why = self.comm.bcast(None if error is None else describe(error))
        if why is not None:
            raise CheckpointError(f"{what} failed (rank 0: {why})") from error

    def from_root(self, compute: Callable[[], T]) -> T:
        """What rank 0 computes (``compute`` runs there only), on every rank."""
        return self.comm.bcast(compute() if self.rank == 0 else None)

    def slowest(self, *values: float) -> list[float]:
        """The largest of each value over the ranks, in one reduction."""
        out = np.empty(len(values))
        self.comm.Allreduce(np.asarray(values, dtype=np.float64), out, op=MPI.MAX)
        return out.tolist()

    def total(self, value: int) -> int:
        """The sum of ``value`` over the ranks."""
        return int(self.comm.allreduce(int(value), op=MPI.SUM))

    def anyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank."""
        return bool(self.comm.allreduce(bool(flag), op=MPI.LOR))

    def everyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return bool(self.comm.allreduce(bool(flag), op=MPI.LAND))

    def findings(
        self, problem: str | None, fatal: str | None, payload: Any = None, culprit: Any = None
    ) -> list[Any]:
        """Every rank's ``payload``, once the ranks agree that the read they just made
        went well: :class:`Refused` on every rank when some rank found the checkpoint
        unusable here (``fatal``), else :class:`CorruptCheckpoint` when some rank found
        damage (``problem``; its ``culprit`` lists the files at fault).

        One reduction when nothing went wrong and no rank has a payload (the common
        case); the gather only otherwise.
        """
        flags = np.array([problem is not None or fatal is not None, bool(payload)], np.int32)
        anything = np.empty_like(flags)
        self.comm.Allreduce(flags, anything, op=MPI.MAX)
        if not anything.any():
            return [payload] * self.nranks
        outcome = self.comm.allgather((problem, fatal, payload, culprit and str(culprit)))
        fatals = [f for _, f, _, _ in outcome if f]
        if fatals:
            raise Refused(fatals[0])
        problems = [p for p, _, _, _ in outcome if p]
        if problems:
            culprits = list(dict.fromkeys(c for p, _, _, c in outcome if p and c))
            raise CorruptCheckpoint("; ".join(dict.fromkeys(problems[:SHOWN])), culprit=culprits)
        return [p for _, _, p, _ in outcome]

    def bcast_array(self, array: np.ndarray | None) -> np.ndarray:
        """Rank 0's ``array`` on every rank (in pieces below MPI's 2 GiB count limit)."""
        spec = self.from_root(lambda: (array.dtype.str, array.shape))  # type: ignore[union-attr]
        out = array if self.rank == 0 else np.empty(spec[1], dtype=np.dtype(spec[0]))
        assert out is not None
        raw = out.reshape(-1).view(np.uint8)
        piece = 1 << 30
        for lo in range(0, raw.size, piece):
            self.comm.Bcast(raw[lo : lo + piece], root=0)
        return out


def describe(error: BaseException) -> str:
    """An error as the agreement's message names it: its type and text."""
    return f"{type(error).__name__}: {error}"
