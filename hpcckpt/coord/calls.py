"""What a rank does while it waits in a Checkpointer call for the other ranks, and the
calls' agreement that once broken stays broken (:class:`Calls`).

Every public call of the Checkpointer first agrees on which call and step each rank is
making (:class:`hpcckpt.store.agreement.CallAgreement`): ranks in different calls get
CallMismatch at once. A rank that never makes a call at all (stuck in the application)
cannot be seen that way, so a wait that lasts is watched here (docs/hang-and-poison.md):

- after :data:`BEAT_AFTER` seconds the rank writes its heartbeat with the call as its
  phase (``due``, ``save``, ``finish``...), so that the other ranks and the wrapper's hang
  watch see where it is; when a wait in ``due`` or ``wait`` ends it writes ``compute``
  back (``save`` and ``restore`` write their own phases next). A wait that ends sooner
  writes nothing: a heartbeat is a file write (0.1-1 ms), too dear for every call;
- after :data:`WARN_AFTER` seconds it logs one warning naming the ranks that are not in
  the call, and where their heartbeats say they are, and goes on waiting;
- after ``call_timeout`` seconds (``Checkpointer(call_timeout=...)``,
  ``$HPCCKPT_CALL_TIMEOUT``; no limit by default) it raises CallTimeout with those names.

Only ranks below :data:`READERS` read every rank's heartbeat (one small file each); the
others say less and give up :data:`LATER` seconds after them, so that a message naming
the missing ranks comes first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hpcckpt.rundir.env import CALL_TIMEOUT_ENV
from hpcckpt.rundir.heartbeat import (
    CALL_PHASES,
    Heartbeat,
    HeartbeatWriter,
    places,
    read_heartbeats,
    where,
)
from hpcckpt.store.agreement import SHOWN, TAIL, Call, CallAgreement
from hpcckpt.store.errors import CallMismatch, CallTimeout

log = logging.getLogger("hpcckpt")

#: Seconds of waiting before the rank's heartbeat names the call it waits in.
BEAT_AFTER = 0.5
#: Seconds of waiting before the warning (without a call_timeout, or a longer one).
WARN_AFTER = 60.0
#: Ranks that read every heartbeat to name the missing ranks.
READERS = 4
#: Seconds the other ranks wait past the timeout, so that a reader's message comes first.
LATER = 2.0


class Calls:
    """One Checkpointer's calls, each agreed first thing (``agreement``, whose flags
    ``due()`` uses); once the ranks fell apart (CallMismatch), every later call raises at
    once, naming what happened (``broken``)."""

    def __init__(self, agreement: CallAgreement) -> None:
        self.agreement = agreement
        #: Why the ranks fell apart (None: they did not).
        self.broken: str | None = None

    def drain(self) -> list[int] | None:
        """Complete and check the agreement in flight (a due()'s): its flags, or None when
        none was; CallMismatch on every rank when the ranks were in different calls."""
        if self.broken is not None:
            raise CallMismatch(self.broken)
        try:
            return self.agreement.complete()
        except CallMismatch as exc:
            self.broken = f"the ranks fell apart earlier: {exc}"
            raise

    def enter(self, call: str, step: int | None = None) -> None:
        """Every rank agrees that it is in ``call`` at ``step``, first thing (CallMismatch
        naming the ranks and their calls otherwise; CallTimeout after ``call_timeout``)."""
        self.drain()
        try:
            self.agreement.enter(call, step)  # a wait past 0.5 s puts the call in the heartbeat
        except CallMismatch as exc:
            self.broken = f"the ranks fell apart earlier: {exc}"
            raise


class Patience:
    """The watch of one Checkpointer's waits (a :class:`~hpcckpt.store.agreement.CallWatch`)."""

    def __init__(
        self,
        heartbeat: HeartbeatWriter,
        nranks: int,
        timeout: float | None,
        last_step: Callable[[], int | None],
    ) -> None:
        self.heartbeat = heartbeat
        self.rank = heartbeat.rank
        self.nranks = nranks
        self.timeout = timeout
        self.last_step = last_step
        self.reader = self.rank < READERS
        self._beaten = self._warned = False

    def waiting(self, call: Call, seconds: float) -> None:
        if not self._beaten and seconds >= BEAT_AFTER:
            self._beaten = True
            step = call.step if call.step is not None else self.last_step()
            self.heartbeat.beat(step, call.name, force=True)
        limit = self.timeout
        if limit is not None and seconds >= limit + (0.0 if self.reader else LATER):
            self._beaten = self._warned = False
            raise CallTimeout(
                f"{self.message(call, seconds)} (gave up after call_timeout={limit:g} s)"
            )
        if not self._warned and seconds >= WARN_AFTER and self.reader:
            self._warned = True
            log.warning(
                "%s; still waiting (call_timeout=%s, %s gives up after a time)",
                self.message(call, seconds),
                "None" if limit is None else f"{limit:g} s",
                CALL_TIMEOUT_ENV,
            )

    def done(self, call: Call) -> None:
        if self._beaten and call.name in ("due", "wait"):  # back to the application
            step = call.step if call.step is not None else self.last_step()
            self.heartbeat.beat(step, "compute", force=True)
        self._beaten = self._warned = False

    def message(self, call: Call, seconds: float) -> str:
        """Who this rank waited for, from the heartbeats (readers only)."""
        head = f"rank {self.rank} waited {seconds:.0f} s in {call}"
        if not self.reader:
            return f"{head} for the other ranks (ranks 0-{READERS - 1} name them); {TAIL}"
        beats = read_heartbeats(self.heartbeat.directory)
        return missing_text(head, call, beats, self.rank, self.nranks, time.time())


def missing_text(
    head: str, call: Call, beats: dict[int, Heartbeat], me: int, nranks: int, now: float
) -> str:
    """``head`` "for rank 1: rank 1 is not in a Checkpointer call (computing, step 4, last
    heartbeat 3 s ago)" and so on: the ranks whose heartbeat is not in ``call``."""
    others = [r for r in range(nranks) if r != me]
    away = [r for r in others if beats.get(r) is None or beats[r].phase != call.name]
    if not away:
        return f"{head} for the other ranks; their heartbeats: {places(beats, others)}; {TAIL}"
    named = ", ".join(map(str, away[:SHOWN])) + (
        f" and {len(away) - SHOWN} more" if len(away) > SHOWN else ""
    )
    details = [_detail(r, beats.get(r), now) for r in away[:SHOWN]]
    more = f"; and {len(away) - SHOWN} more" if len(away) > SHOWN else ""
    who = f"rank{'s' * (len(away) > 1)} {named}"
    return f"{head} for {who}: {'; '.join(details)}{more}; {TAIL}"


def _detail(rank: int, beat: Heartbeat | None, now: float) -> str:
    if beat is None:
        return f"rank {rank} has written no heartbeat"
    age = f"last heartbeat {max(0.0, now - beat.time):.0f} s ago"
    if beat.phase in CALL_PHASES:
        return f"rank {rank} is {where(beat)} ({age})"
    doing = "computing" if beat.phase == "compute" else beat.phase
    step = "" if beat.step is None else f", step {beat.step}"
    return f"rank {rank} is not in a Checkpointer call ({doing}{step}, {age})"
