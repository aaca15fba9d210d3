"""Which arrays of a state are split across ranks and which are the same on every rank."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from hpcckpt.store.tree import replicated as sharing

#: ``split(global_rows, nranks, rank) -> (lo, hi)``: the rows of a distributed array a
#: rank holds.
Split = Callable[[int, int, int], tuple[int, int]]


@dataclass(frozen=True)
class ArrayOptions:
    """How arrays lie across ranks.

    ``distributed``: array paths (keys joined by '/', e.g. ``"fields/u"``) split along
    axis 0 across ranks, as a collection or a mapping to a split function
    ``split(global_rows, nranks, rank) -> (lo, hi)`` (or None); stored as the global
    array, restorable on any rank count. ``replicated``: key paths whose values are the
    same on every rank: checked equal by checksum at each save, written once by rank 0.
    """

    distributed: Iterable[str] | Mapping[str, Split | None] = ()
    replicated: Iterable[str] = ()

    def __post_init__(self) -> None:
        given = self.distributed
        names = [given] if isinstance(given, str) else list(given)
        splits = dict(given) if isinstance(given, Mapping) else {}
        object.__setattr__(self, "distributed", {n: splits.get(n) for n in names})
        object.__setattr__(self, "replicated", sharing.normalize(self.replicated))
        clash = sorted(n for n in self.replicated if n in self.distributed)
        if clash:
            raise ValueError(f"{clash} declared both distributed and replicated; choose one")

    @property
    def splits(self) -> dict[str, Split | None]:
        """Each distributed array path and its split function (None: even rows)."""
        return self.distributed  # type: ignore[return-value]
