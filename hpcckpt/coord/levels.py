"""The Checkpointer's two levels: node-local saves (with partner/XOR redundancy) and how
often one of them is drained to the directory.

The options come from the arguments, else from ``$HPCCKPT_REDUNDANCY`` and
``$HPCCKPT_DRAIN_EVERY``; :class:`Levels` counts the node-local saves since the last
drain and says whether the next save stays node-local (``drain_every`` N, or the
two-level model of :mod:`hpcckpt.policy.multilevel` with ``"auto"``). The collective
pieces the Checkpointer calls at restore and at the end (finding the copy to scavenge,
freeing the node's copies) live here too, so that the Checkpointer keeps one line each.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpi4py import MPI

from hpcckpt.policy import multilevel
from hpcckpt.rundir.env import CACHE_ENV, DRAIN_EVERY_ENV, REDUNDANCY_ENV
from hpcckpt.store import fast_tier
from hpcckpt.store.results import RestoreResult

log = logging.getLogger("hpcckpt")

#: Ranks per redundancy set when neither the argument nor the variable gives a size.
DEFAULT_SET = 8


@dataclass(frozen=True)
class LevelOptions:
    """The checked multi-level options of one Checkpointer."""

    redundancy: str | None  # "partner", "xor" or None
    redundancy_set: int
    drain_every: int | None  # None: chosen by the two-level model ("auto")
    local_fraction: float  # failures the redundant node-local tier survives


def resolve(
    redundancy: str | None,
    redundancy_set: int | None,
    drain_every: int | str | None,
    local_fraction: float | None,
    cache: object,
) -> LevelOptions:
    """The arguments, else the environment; ValueError naming the argument or variable
    when one is malformed (the scheme itself is checked by the store)."""
    set_size = redundancy_set
    if redundancy is None and os.environ.get(REDUNDANCY_ENV):
        text = os.environ[REDUNDANCY_ENV].strip()
        scheme, _, size = text.partition(":")
        redundancy = scheme or None
        if size and set_size is None:
            try:
                set_size = int(size)
            except ValueError:
                raise ValueError(
                    f"{REDUNDANCY_ENV}={text!r}: write the scheme and optionally the set "
                    "size, e.g. xor, xor:4 or partner"
                ) from None
    if drain_every is None and os.environ.get(DRAIN_EVERY_ENV):
        text = os.environ[DRAIN_EVERY_ENV].strip()
        try:
            drain_every = "auto" if text == "auto" else int(text)
        except ValueError:
            raise ValueError(
                f"{DRAIN_EVERY_ENV}={text!r} must be a positive integer or auto"
            ) from None
    drain_every = 1 if drain_every is None else drain_every
    if redundancy is not None and cache is None and not os.environ.get(CACHE_ENV):
        raise ValueError(
            f"redundancy={redundancy!r} protects the node-local tier: pass cache=PATH too "
            f"(or set {CACHE_ENV})"
        )
    auto = drain_every == "auto"
    if not auto and (
        isinstance(drain_every, str) or int(drain_every) != drain_every or drain_every < 1
    ):
        raise ValueError(f"drain_every must be a positive integer or 'auto', not {drain_every!r}")
    fraction = multilevel.DEFAULT_LOCAL_FRACTION if local_fraction is None else local_fraction
    if not 0.0 <= float(fraction) <= 1.0:
        raise ValueError(f"local_fraction must be in [0, 1], not {local_fraction!r}")
    return LevelOptions(
        redundancy,
        set_size or DEFAULT_SET,
        None if auto else int(drain_every),
        float(fraction),
    )


class Levels:
    """Whether a save stays on the node-local tier: only every ``drain_every``-th save
    (fixed, or from the two-level model) is drained to the directory."""

    def __init__(self, options: LevelOptions) -> None:
        self.options = options
        #: Node-local checkpoints since the last drained one.
        self.local_saves = 0

    def plan(
        self, mtbf: float | None, local_cost: float, drain_cost: float, cached: bool
    ) -> multilevel.LevelPlan | None:
        """With ``drain_every="auto"``: the model's node-local interval and drain period for
        the measured costs and ``mtbf``; None without a cache or an MTBF."""
        if self.options.drain_every is not None or not cached or mtbf is None:
            return None
        local = max(local_cost, 1e-3)
        drain = max(drain_cost, local)
        return multilevel.plan_levels(local, drain, mtbf, self.options.local_fraction)

    def local_only(self, plan: multilevel.LevelPlan | None) -> bool:
        """Whether the next save stays node-local (``plan``: :meth:`plan`'s answer)."""
        every = self.options.drain_every
        if every is None:
            every = 1 if plan is None else plan.drain_every
        return (self.local_saves + 1) % every != 0


def restore_extra(result: RestoreResult, redundancy: str | None) -> tuple[str, dict[str, Any]]:
    """The log line's note on rebuilt ranks and the restore event's extra fields."""
    how = ""
    if result.rebuilt:
        ranks = ", ".join(map(str, result.rebuilt))
        how = f" (rank {ranks} rebuilt from {result.rebuilt_from})"
    extra: dict[str, Any] = {}
    if result.source == "cache" and redundancy is not None:
        extra = {
            "rebuilt": list(result.rebuilt),
            "rebuilt_from": result.rebuilt_from,
            "moved": list(result.moved),
        }
    return how, extra


def scavenge_copy(
    comm: MPI.Comm, cache: Path, directory: Path, step: int
) -> fast_tier.LocalCopy | None:
    """This rank's node-local copy of ``step`` when every rank holds its own; collective."""
    rank, nranks = comm.Get_rank(), comm.Get_size()
    copies = fast_tier.scan(cache, directory, rank, nranks)
    mine = next((c for c in copies if c.step == step), None)
    if not comm.allreduce(mine is not None, op=MPI.LAND):
        log.warning("cannot drain node-local step %d: not every rank holds it", step)
        return None
    return mine


def free_cache(comm: MPI.Comm, cache: Path, redundancy: str | None) -> None:
    """The job is done: delete every rank's node-local files and the node's directory
    once empty; collective."""
    moved = redundancy is not None  # ranks may have left files here
    comm.Barrier()
    fast_tier.remove(cache, comm.Get_rank(), nranks=comm.Get_size(), every_rank=moved)
    comm.Barrier()
    try:
        cache.rmdir()  # one rank per node succeeds, once all copies are gone
    except OSError:
        pass
