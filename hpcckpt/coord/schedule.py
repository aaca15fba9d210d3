"""When the Checkpointer's next checkpoint is due: an interval policy (Young, Daly, fixed)
fed by the measured costs, a step count, and with ``drain_every="auto"`` the two-level
model's node-local interval. Pure bookkeeping: the ranks agree on its answer in ``due``.
"""

from __future__ import annotations

from hpcckpt.coord.levels import Levels
from hpcckpt.coord.options import ScheduleOptions
from hpcckpt.policy import CostTracker, initial_cost_estimate, multilevel


class Schedule:
    """The schedule of one Checkpointer and the costs it learns from its saves."""

    def __init__(self, options: ScheduleOptions, nodes: int | None, levels: Levels, cached: bool):
        #: The time policy, or None when only ``every_steps`` (and stop requests) apply.
        self.policy = options.interval_policy(nodes)
        self.every_steps = options.every_steps
        #: What the ranks were blocked per save (a staged save: staging only).
        self.costs = CostTracker()
        #: The full cost of a checkpoint (staging to commit): what a deadline save costs.
        self.durable_costs = CostTracker()
        self.levels = levels
        self.cached = cached  # a node-local tier: the two-level model may apply
        self._initial: float | None = options.initial_cost  # type: ignore[assignment]

    def describe(self) -> str:
        """The schedule in words, for logs and events."""
        parts = [] if self.policy is None else [self.policy.describe()]
        if self.every_steps is not None:
            parts.append(f"every {self.every_steps} steps")
        return " or ".join(parts)

    def size_first_cost(self, state_bytes: int) -> None:
        """Before anything is measured: guess the first cost from the state's size."""
        if self._initial is None:
            self._initial = initial_cost_estimate(state_bytes)

    @property
    def needs_size(self) -> bool:
        """Whether :meth:`size_first_cost` would still use a size (no guess yet)."""
        return self._initial is None

    @property
    def cost_estimate(self) -> float:
        if self._initial is None:
            self._initial = initial_cost_estimate(0)
        return self.costs.get(self._initial)

    @property
    def durable_cost_estimate(self) -> float:
        return self.durable_costs.get(self.cost_estimate)

    @property
    def interval(self) -> float | None:
        if self.policy is None:
            return None
        plan = self.level_plan() if self.levels.automatic else None
        if plan is not None:  # two levels: the node-local interval of the model
            low = getattr(self.policy, "min_interval", 0.0)
            high = getattr(self.policy, "max_interval", plan.interval)
            return min(max(plan.interval, low), high)
        return self.policy.interval(self.cost_estimate)

    def level_plan(self) -> multilevel.LevelPlan | None:
        mtbf = getattr(self.policy, "mtbf", None)
        return self.levels.plan(mtbf, self.cost_estimate, self.durable_cost_estimate, self.cached)

    def steps_due(self, step: int) -> bool:
        """Whether ``every_steps`` makes ``step`` a checkpoint step. Aligned to the step
        numbers (N-1, 2N-1, ... for a loop from 0), so a run resumed after an
        off-schedule stop checkpoint returns to the same schedule."""
        return self.every_steps is not None and (step + 1) % self.every_steps == 0
