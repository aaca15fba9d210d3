"""The *when* layer: how often to checkpoint, and when to stop before the time limit.

Pure functions and small classes, no I/O: the Young and Daly formulas and the
exact waste model (:mod:`~hpcckpt.policy.formulas`), interval policies and the
online cost tracker (:mod:`~hpcckpt.policy.policies`), the job's deadline
(:mod:`~hpcckpt.policy.deadline`), duration parsing
(:mod:`~hpcckpt.policy.durations`) and a Monte-Carlo simulator
(:mod:`~hpcckpt.policy.simulate`, which alone needs NumPy and is imported on first use;
its main function is ``hpcckpt.policy.simulate.simulate``, since the package
attribute ``simulate`` is that submodule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpcckpt.policy.deadline import (
    DEFAULT_MARGIN,
    DEFAULT_SAFETY,
    Deadline,
    fit_interval,
    parse_end_time,
    requeue_lead,
)
from hpcckpt.policy.durations import format_duration, format_hms, parse_duration
from hpcckpt.policy.formulas import (
    DEFAULT_NODE_MTBF,
    daly,
    efficiency,
    expected_makespan,
    expected_segment_time,
    expected_waste,
    job_mtbf,
    optimal_interval,
    young,
)
from hpcckpt.policy.policies import (
    DEFAULT_BANDWIDTH,
    DEFAULT_LATENCY,
    MAX_INTERVAL,
    MIN_INTERVAL,
    POLICY_NAMES,
    CostTracker,
    Daly,
    EverySteps,
    Fixed,
    IntervalPolicy,
    Young,
    initial_cost_estimate,
    make_policy,
)

if TYPE_CHECKING:
    from hpcckpt.policy.simulate import SimulationResult, best_interval, default_intervals

_SIMULATE = {"SimulationResult", "best_interval", "default_intervals"}

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_LATENCY",
    "DEFAULT_MARGIN",
    "DEFAULT_NODE_MTBF",
    "DEFAULT_SAFETY",
    "MAX_INTERVAL",
    "MIN_INTERVAL",
    "POLICY_NAMES",
    "CostTracker",
    "Daly",
    "Deadline",
    "EverySteps",
    "Fixed",
    "IntervalPolicy",
    "SimulationResult",
    "Young",
    "best_interval",
    "daly",
    "default_intervals",
    "efficiency",
    "expected_makespan",
    "expected_segment_time",
    "expected_waste",
    "fit_interval",
    "format_duration",
    "format_hms",
    "initial_cost_estimate",
    "job_mtbf",
    "make_policy",
    "optimal_interval",
    "parse_duration",
    "parse_end_time",
    "requeue_lead",
    "young",
]


def __getattr__(name: str) -> Any:
    if name in _SIMULATE:
        import importlib

        return getattr(importlib.import_module("hpcckpt.policy.simulate"), name)
    raise AttributeError(f"module 'hpcckpt.policy' has no attribute {name!r}")
