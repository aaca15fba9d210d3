"""How much host memory a staged (``async_save``) save may take, and what it does with it.

A rank's *budget* is the host memory its staging may hold: given in bytes, or by
default :data:`DEFAULT_FRACTION` of the memory available on the node when the first
save plans (``MemAvailable``, or the job's cgroup room when that is tighter), shared by
the node's ranks, then kept (``HostBuffers.plan``). Each save then takes one of three
ways (:func:`plan`):

- ``copy``: the state fits: it is copied whole into host buffers kept between saves
  and written in the background (blocked time: one copy of the state);
- ``pieces``: it does not fit, but the budget is worth using: the state is hashed,
  then copied piece by piece into a ring of buffers while earlier pieces are written
  (memory: the ring; blocked time: the copy, plus writing what exceeds the ring);
- ``sync``: memory is too short for even a small ring: the save is written
  synchronously (the caller records why) rather than risk the OOM killer.

Pure: the caller measures the memory (:mod:`hpcckpt.store.io.memory`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcckpt.store.io.direct_io import BOUNCE_BYTES

#: The default budget: this fraction of the node's available memory, shared by its ranks.
DEFAULT_FRACTION = 0.5
#: Below this much usable memory a staged save is not worth it (a ring of two pieces):
#: it is written synchronously.
MIN_RING_BYTES = 2 * BOUNCE_BYTES
#: Kept free beyond the staging itself: the background writer's two bounce buffers.
RESERVE_BYTES = 2 * BOUNCE_BYTES

COPY, PIECES, SYNC = "copy", "pieces", "sync"


def parse_budget(value: int | float | str | None) -> int | None:
    """A budget in bytes from an int or a size such as ``"4G"``, ``"512M"``; None = default."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().upper().removesuffix("B").removesuffix("I")
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
        scale = units.get(text[-1:], 1)
        number = text[:-1] if text[-1:] in units else text
        try:
            value = float(number) * scale
        except ValueError:
            raise ValueError(
                f"staging_budget must be a number of bytes or a size like '4G', not {value!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"staging_budget must be a non-negative number of bytes, not {value!r}")
    return int(value)


@dataclass(frozen=True)
class StagingPlan:
    """One rank's way for one staged save: ``mode`` and the host bytes it will hold."""

    mode: str  # COPY, PIECES or SYNC
    staging_bytes: int
    budget: int  # the budget it was planned against
    available: int | None  # the memory this rank could still take, as measured
    reason: str = ""


def plan(
    state_bytes: int,
    budget: int | None,
    available: int | None,
    local_ranks: int,
    held: int = 0,
) -> StagingPlan:
    """The way to stage ``state_bytes`` (this rank's array bytes).

    ``budget``: the rank's budget (None: the default fraction of ``available``);
    ``available``: the node's (or cgroup's) memory still free, None when unknown;
    ``local_ranks``: ranks on the node sharing it; ``held``: bytes this rank's staging
    already holds and would reuse (counted as available to it).
    """
    share = None if available is None else available // max(1, local_ranks) + held
    if budget is None:
        budget = int(DEFAULT_FRACTION * share) if share is not None else state_bytes
    usable = budget if share is None else min(budget, share - RESERVE_BYTES)
    usable = max(0, usable)
    if state_bytes <= usable:
        return StagingPlan(COPY, state_bytes, budget, share)
    if usable >= MIN_RING_BYTES:
        return StagingPlan(PIECES, usable, budget, share)
    mib = 1 << 20
    why = (
        f"{state_bytes / mib:.0f} MiB to stage, {usable / mib:.0f} MiB usable "
        f"(budget {budget / mib:.0f} MiB"
        + ("" if share is None else f", {share / mib:.0f} MiB available to this rank")
        + f"), under the {MIN_RING_BYTES // mib} MiB a staged save needs"
    )
    return StagingPlan(SYNC, 0, budget, share, why)
