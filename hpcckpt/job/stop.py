"""A stop request's life in one attempt: requested -> (held) -> forwarded, at most once.

Slurm's warning signal (or TERM, INT...) makes a *request*; it is *held* while the
application cannot take it yet (it has not reported ``running``, or ``--app-ready`` has
not passed), and *forwarded* once to the step. Repeated signals do not start another
request. The wrapper decides when to hold and forward; this object only remembers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class StopRequest:
    requested_at: float | None = None  # time.monotonic() of the first stop signal
    requested_wall: float | None = None  # the same moment, as Unix time
    name: str = ""  # the signal that asked, as Slurm spells it (USR1)
    forwarded_at: float | None = None
    held: bool = False
    interrupts: int = 0  # SIGINTs so far (the third takes the step down)

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    @property
    def forwarded(self) -> bool:
        return self.forwarded_at is not None

    @property
    def under_way(self) -> bool:
        """A request exists that is not waiting: a new signal is a duplicate."""
        return self.forwarded or (self.requested and not self.held)

    def request(self, name: str, at: float | None = None) -> None:
        """The first stop signal, received at ``at`` (monotonic; None: now)."""
        self.requested_at = time.monotonic() if at is None else at
        self.requested_wall = wall_time(self.requested_at)
        self.name = name

    def hold(self) -> None:
        self.held = True

    def drop(self) -> None:
        """The application ended (or reported stopped/finished) before it could take it."""
        self.held = False

    def forward(self) -> None:
        self.held = False
        self.forwarded_at = time.monotonic()

    def held_for(self, since_start: float) -> float:
        """Seconds since the request (``since_start`` if it came before the clock started)."""
        return time.monotonic() - (self.requested_at or since_start)


def wall_time(at: float | None) -> float:
    """The Unix time of the monotonic instant ``at`` (None: now)."""
    now = time.monotonic()
    return time.time() - (now - (now if at is None else at))
