"""Direct or buffered writes: measure both on this file system at this size, keep the faster.

Whether ``O_DIRECT`` (past the page cache) or buffered writes plus ``fsync`` finish a
save sooner depends on the device, the file system, the size written per rank and the
moment: on this machine the same ``dd oflag=direct`` ran at 0.43-0.69 of the buffered
write in one run and 0.94-1.03 in another. So the synchronous save measures instead of
assuming. Saves are grouped by the bytes each rank writes (powers of two); in each
group the first :data:`PROBES` saves alternate direct, buffered, direct, buffered; then
the path with the higher measured rate (its best of the last :data:`KEEP` samples) is
used, and every :data:`RECHECK` saves the other path is tried once more, so a change in
the file system's behaviour is seen. Only writes of at least :data:`MIN_BYTES` per rank
are measured: below that the fixed costs hide the path (and the writer sends extents
under ``direct_io.MIN_DIRECT_BYTES`` through the page cache anyway).

Every rank keeps the same state: it is fed the same numbers (the bytes per rank of the
save and the slowest rank's write time, from a reduction the save does anyway), so the
ranks agree on every choice without a collective of their own. Pure: no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: Saves of a size group that alternate the two paths before a choice is made.
PROBES = 4
#: Samples kept per path and size group; the best of them counts.
KEEP = 2
#: After this many saves of a size group, the path not chosen is measured once more.
RECHECK = 20
#: Smaller writes per rank are not measured: fixed costs would decide.
MIN_BYTES = 8 << 20


def size_group(nbytes: int) -> int:
    """The power of two at or below ``nbytes`` (the size group of a save)."""
    return 1 << max(0, int(nbytes).bit_length() - 1)


@dataclass
class _Group:
    rates: dict[bool, deque[float]] = field(
        default_factory=lambda: {True: deque(maxlen=KEEP), False: deque(maxlen=KEEP)}
    )
    saves: int = 0
    choice: bool | None = None


class WritePathChooser:
    """Which path the next save writes through, and what the saves measured.

    ``allowed``: the file system takes ``O_DIRECT`` (the tuning plan's default);
    ``forced``: ``TuningOptions(direct_io=...)``, which wins (no measuring).
    """

    def __init__(self, allowed: bool, forced: bool | None = None) -> None:
        self.allowed = allowed
        self.forced = forced
        self.groups: dict[int, _Group] = {}

    def direct(self, nbytes: int) -> bool:
        """Whether a save writing ``nbytes`` per rank goes past the page cache."""
        if self.forced is not None:
            return self.forced
        if not self.allowed:
            return False
        if nbytes < MIN_BYTES:
            return True  # as before: only extents of >= 4 MiB go direct
        g = self.groups.get(size_group(nbytes), _Group())
        if g.saves < PROBES:
            return g.saves % 2 == 0  # direct, buffered, direct, buffered
        assert g.choice is not None
        if g.saves % RECHECK == 0:
            return not g.choice  # the re-check
        return g.choice

    def record(self, nbytes: int, direct: bool, seconds: float) -> dict[str, Any] | None:
        """Count a save that wrote ``nbytes`` per rank through ``direct`` in ``seconds``
        (the slowest rank). Returns the decision when one was made (a choice after the
        probes, or after a re-check), for the events; else None."""
        if self.forced is not None or not self.allowed or nbytes < MIN_BYTES or seconds <= 0:
            return None
        group = size_group(nbytes)
        g = self.groups.setdefault(group, _Group())
        g.rates[direct].append(nbytes / seconds)
        g.saves += 1
        decide = g.saves == PROBES or (g.saves > PROBES and direct != g.choice)
        if not decide or not g.rates[True] or not g.rates[False]:
            return None
        before = g.choice
        best = {path: max(rates) for path, rates in g.rates.items()}
        g.choice = best[True] >= best[False]
        return {
            "size_group_bytes": group,
            "path": "direct" if g.choice else "buffered",
            "direct_mb_s": round(best[True] / 1e6, 1),
            "buffered_mb_s": round(best[False] / 1e6, 1),
            "changed": before is not None and before != g.choice,
            "saves": g.saves,
        }
