"""How the ranks agree: every collective decision and every cross-rank error goes here.

Each rank does its part of a step and reports what it met; one call makes every rank
see the same outcome: all succeeded, or the same error naming the ranks that failed and
why. The common case (nothing failed) costs one reduction; reasons are gathered only
when there are some. The store, its node-local tier and the Checkpointer share one
:class:`Agreement`, so a failure reads the same wherever it happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

import numpy as np

from hpcckpt.store.comm import LAND, LOR, MAX, SUM, Comm, Request, as_comm
from hpcckpt.store.errors import CallMismatch, CheckpointError, CorruptCheckpoint

T = TypeVar("T")

#: Reasons named in one error message at most (the rest: "and N more" is not worth a gather).
SHOWN = 4


class Refused(Exception):
    """A checkpoint that is sound but cannot be restored into this run: stop, do not
    fall back to an older one (raised on every rank alike by :meth:`Agreement.findings`)."""


class Agreement:
    """The ranks of ``comm`` deciding together; every method is collective."""

    def __init__(self, comm: Comm | Any) -> None:
        self.comm = as_comm(comm)
        self.rank = self.comm.rank
        self.nranks = self.comm.size

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
        total = self.comm.allreduce_array(mine, SUM)
        if total[0]:
            errors = self.comm.allgather(None if error is None else describe(error))
            raise kind(f"{what} failed ({reasons(errors)})") from error
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
        return self.comm.allreduce_array(np.asarray(values, dtype=np.float64), MAX).tolist()

    def total(self, value: int) -> int:
        """The sum of ``value`` over the ranks."""
        return int(self.comm.allreduce(int(value), SUM))

    def anyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank."""
        return bool(self.comm.allreduce(bool(flag), LOR))

    def everyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return bool(self.comm.allreduce(bool(flag), LAND))

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
        anything = self.comm.allreduce_array(flags, MAX)
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
            self.comm.bcast_bytes(raw[lo : lo + piece], root=0)
        return out


def describe(error: BaseException) -> str:
    """An error as the agreement's message names it: its type and text."""
    return f"{type(error).__name__}: {error}"


def reasons(errors: Sequence[str | None]) -> str:
    """ "rank 0: X; ranks 1, 2: Y": each rank's reason (None: it did not fail) named once,
    with the ranks that met it; a reason that only ends with another one (a rank telling
    that rank 0 failed, and why) is an echo, left out. At most SHOWN reasons."""
    groups: dict[str, list[int]] = {}
    for rank, why in enumerate(errors):
        if why is not None:
            groups.setdefault(why, []).append(rank)
    kept = [w for w in groups if not any(w != o and w.endswith(o) for o in groups)]
    parts = []
    for why in kept[:SHOWN]:
        ranks = groups[why]
        more = f" and {len(ranks) - SHOWN} more" if len(ranks) > SHOWN else ""
        shown = ", ".join(map(str, ranks[:SHOWN]))
        parts.append(f"rank{'s' * (len(ranks) > 1)} {shown}{more}: {why}")
    return "; ".join(parts)


# -- the call agreement: which collective call, at which step, every rank is making --------
#: The Checkpointer's collective calls; a call's code is its index plus one (0: none).
CALLS = ("due", "restore", "save", "wait", "finish", "close")
#: A call key packs (code, step, rank) into one int64: code above bit 60, the step
#: (offset, so negative steps and None fit) above bit 24, the rank below.
_RANK_BITS, _STEP_BITS = 24, 36
_RANK_MASK, _STEP_MASK = (1 << _RANK_BITS) - 1, (1 << _STEP_BITS) - 1
_STEP_OFFSET = 1 << (_STEP_BITS - 1)
_NO_STEP = -(1 << 62)  # the exact step of a call without one
#: How often a slow wait tells its watch (seconds); the transport waits between.
_LOOK = 0.25
#: How every message about calls on only some ranks ends.
TAIL = "every rank must call the Checkpointer's methods in the same order, with the same step"


@dataclass(frozen=True)
class Call:
    """A collective call as people read it: ``save(step=5)``, ``finish()``."""

    name: str
    step: int | None = None

    def __str__(self) -> str:
        return f"{self.name}()" if self.step is None else f"{self.name}(step={self.step})"


class CallWatch(Protocol):
    """What a slow wait tells (the Checkpointer's heartbeats, warning and timeout)."""

    def waiting(self, call: Call, seconds: float) -> None:
        """Still waiting after ``seconds``; may raise to give up."""

    def done(self, call: Call) -> None:
        """A wait that was slow is over."""


class CallAgreement:
    """Every collective call first agrees on *which call and step* each rank is in.

    One ``Iallreduce`` (MAX) of a few int64 carries each rank's call key (the call, its
    step and the rank, packed so that MAX and the MAX of the negated key give the
    largest and the smallest), the exact step both ways, and whether the rank is in a
    call that does not wait for the result (``due``: its reduction is completed by the
    rank's next call). ``flags`` leading slots carry the caller's own flags (MAX) on the
    same reduction. The ranks agree when the largest and smallest (call, step) are
    equal; otherwise :class:`CallMismatch` is raised on every rank that completes the
    reduction, naming the ranks and their calls: all of them (one ``allgather``) when
    every rank waits for this reduction, else the two extremes.

    A non-blocking collective matches only non-blocking ones, so every call posts the
    same ``Iallreduce``: a rank in ``save`` and one in ``due`` or ``finish`` meet in it.
    Waits poll with ``Test`` and tell ``watch`` every quarter second once they are slow.
    """

    def __init__(self, comm: Comm | Any, flags: int = 0, watch: CallWatch | None = None) -> None:
        self.comm = as_comm(comm)
        self.rank = self.comm.rank
        self.nranks = self.comm.size
        self.flags = flags
        self.watch = watch
        self.send = np.zeros(flags + 5, dtype=np.int64)
        self.recv = np.zeros(flags + 5, dtype=np.int64)
        self.request: Request | None = None
        #: ``send`` for item writes (cheaper than numpy's): the caller's flags go here.
        self.slots = memoryview(self.send)
        self._codes = {
            name: ((i + 1) << 60) | (self.rank & _RANK_MASK) for i, name in enumerate(CALLS)
        }
        self._posted: tuple[str, int | None] = ("", None)  # the call whose agreement is in flight

    def post(self, name: str, step: int | None = None, lagged: bool = False) -> None:
        """Start this rank's part of the agreement on the call ``name`` at ``step`` (the
        flags slots as the caller set them). ``lagged``: the result is completed by the
        rank's next call (``due``)."""
        assert self.request is None, "the previous agreement is still in flight"
        if step is None:
            key, exact = self._codes[name], _NO_STEP
        else:
            packed = min(max(step + _STEP_OFFSET + 1, 1), _STEP_MASK)
            key, exact = self._codes[name] | (packed << _RANK_BITS), step
        slots, f = self.slots, self.flags
        slots[f] = key
        slots[f + 1] = -key
        slots[f + 2] = exact
        slots[f + 3] = -exact
        slots[f + 4] = 1 if lagged else 0
        self._posted = (name, step)
        self.request = self.comm.iallreduce_array(self.send, self.recv, MAX)

    def complete(self) -> list[int] | None:
        """Wait for the agreement in flight and check it: the flags slots reduced over
        the ranks (a copy), or None when none was in flight. CallMismatch when the ranks
        disagree."""
        request = self.request
        if request is None:
            return None
        if not request.test():
            self._wait(request)
        self.request = None
        values = self.recv.tolist()
        f = self.flags
        top, low, hi, lo, lagged = values[f:]
        if top >> _RANK_BITS != -low >> _RANK_BITS or hi != -lo:
            self._disagree(top, -low, bool(lagged))
        return values[:f]

    def enter(self, name: str, step: int | None = None) -> None:
        """A call that waits for the agreement: complete the one in flight (a ``due``'s),
        then agree on the call ``name`` at ``step``."""
        self.complete()
        self.post(name, step)
        self.complete()

    def _wait(self, request: Request) -> None:
        call = Call(*self._posted)
        start = time.monotonic()
        told = False
        while not request.wait_for(_LOOK):
            if self.watch is not None:
                told = True
                self.watch.waiting(call, time.monotonic() - start)  # may raise (call_timeout)
        if told and self.watch is not None:
            self.watch.done(call)

    def _decode(self, key: int) -> tuple[int, Call]:
        step = (key >> _RANK_BITS) & _STEP_MASK
        name = CALLS[(key >> 60) - 1]
        return key & _RANK_MASK, Call(name, None if step == 0 else step - _STEP_OFFSET - 1)

    def _disagree(self, top: int, low: int, lagged: bool) -> NoReturn:
        if not lagged:  # every rank waits for this agreement: each can say where it is
            calls = self.comm.allgather(self._posted)
            where = places({r: Call(*c) for r, c in enumerate(calls)})
        else:  # a rank in due() has gone on: the largest and the smallest call are known
            ends = sorted([self._decode(top), self._decode(low)], key=lambda e: e[0])
            where = ", ".join(f"rank {r} is in {c}" for r, c in ends)
            if self.nranks > 2:
                where += f" (the other {self.nranks - 2} ranks not shown)"
        raise CallMismatch(f"ranks disagree on the collective call: {where}; {TAIL}")


def places(calls: dict[int, Call]) -> str:
    """ "rank 0 is in save(step=5), ranks 1, 2 are in finish()": ranks grouped by call."""
    groups: dict[Call, list[int]] = {}
    for rank in sorted(calls):
        groups.setdefault(calls[rank], []).append(rank)
    parts = []
    for call, ranks in list(groups.items())[:SHOWN]:
        shown = ", ".join(map(str, ranks[:SHOWN]))
        more = f" and {len(ranks) - SHOWN} more" if len(ranks) > SHOWN else ""
        verb = "is" if len(ranks) == 1 else "are"
        parts.append(f"rank{'s' * (len(ranks) > 1)} {shown}{more} {verb} in {call}")
    if len(groups) > SHOWN:
        parts.append(f"and {len(groups) - SHOWN} more calls")
    return ", ".join(parts)
