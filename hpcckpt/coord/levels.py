"""The Checkpointer's two levels: which saves stay on the node-local tier (with its
partner/XOR redundancy) and which are drained to the directory.

:class:`Levels` counts the node-local saves since the last drain and says whether the
next save stays node-local: every ``drain_every``-th one is drained, or with ``"auto"``
the period and the interval come from the two-level model of
:mod:`hpcckpt.policy.multilevel`. The options themselves are
:class:`~hpcckpt.coord.options.LevelOptions`.
"""

from __future__ import annotations

from hpcckpt.coord.options import LevelOptions
from hpcckpt.policy import multilevel


class Levels:
    """Whether a save stays on the node-local tier: only every ``drain_every``-th save
    (fixed, or from the two-level model) is drained to the directory."""

    def __init__(self, options: LevelOptions) -> None:
        self.options = options
        #: Whether the drain period comes from the two-level model (``drain_every="auto"``).
        self.automatic = options.period is None
        #: Node-local checkpoints since the last drained one.
        self.local_saves = 0

    def plan(
        self, mtbf: float | None, local_cost: float, drain_cost: float, cached: bool
    ) -> multilevel.LevelPlan | None:
        """With ``drain_every="auto"``: the model's node-local interval and drain period for
        the measured costs and ``mtbf``; None without a cache or an MTBF."""
        if self.options.period is not None or not cached or mtbf is None:
            return None
        local = max(local_cost, 1e-3)
        drain = max(drain_cost, local)
        return multilevel.plan_levels(local, drain, mtbf, self.options.local_fraction)

    def local_only(self, plan: multilevel.LevelPlan | None) -> bool:
        """Whether the next save stays node-local (``plan``: :meth:`plan`'s answer)."""
        every = self.options.period
        if every is None:
            every = 1 if plan is None else plan.drain_every
        return (self.local_saves + 1) % every != 0
