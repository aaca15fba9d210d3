"""Two checkpoint levels: how often to save node-locally, and how often to drain.

With a redundant node-local tier (``cache=`` with ``redundancy=``) a checkpoint has two
levels with different costs and different protection:

- level 1, the node-local save with its partner/XOR redundancy: cost ``local_cost``
  (what the ranks are blocked for); it survives the failures the redundancy covers
  (one node of a set: most failures), a fraction ``local_fraction`` of all failures;
- level 2, the drain to the parallel file system: cost ``drain_cost``; it survives
  everything else (two nodes of one set, a requeue onto other nodes, a whole-job loss).

Every level-1 interval ``tau`` of work ends with a checkpoint; every ``k``-th one is
also drained. The first-order waste per unit of time (Young's expansion applied to each
level, as in the multi-level models of Moody et al., SC'10, and Di et al., 2014) is::

    W(tau, k) = ((k-1)·c1 + c2) / (k·tau)           checkpoints
              + λ1·(tau/2 + r1)                     failures level 1 recovers
              + λ2·(k·tau/2 + r2)                   failures only level 2 recovers

with ``λ1 = f/M``, ``λ2 = (1-f)/M``. For each ``k`` the best ``tau`` is
``sqrt(2((k-1)c1 + c2) / (k(λ1 + kλ2)))``; :func:`plan_levels` takes the ``k`` of least
waste. :func:`simulate_levels` checks a choice against others on the *same* failure
traces (Monte Carlo), e.g. against a single level (every checkpoint drained, Daly's
interval for the drain cost), which every failure sends back to the last drain.
Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hpcckpt.policy.formulas import daly

__all__ = [
    "DEFAULT_LOCAL_FRACTION",
    "Comparison",
    "LevelPlan",
    "compare_levels",
    "plan_levels",
    "simulate_levels",
    "waste",
]

#: Fraction of failures the redundant node-local tier survives when none is given: an
#: assumption (single-node failures dominate on large systems), not a measurement; set
#: it from the site's failure logs.
DEFAULT_LOCAL_FRACTION = 0.8
#: The longest drain period considered, in level-1 checkpoints.
MAX_DRAIN_EVERY = 1000


@dataclass(frozen=True)
class LevelPlan:
    """Level-1 interval (seconds of work), drain every ``drain_every`` checkpoints, and
    the model's expected waste fraction."""

    interval: float
    drain_every: int
    waste: float


def _rates(mtbf: float, local_fraction: float) -> tuple[float, float]:
    if not (math.isfinite(mtbf) and mtbf > 0):
        raise ValueError(f"MTBF must be a finite number of seconds > 0, got {mtbf!r}")
    if not 0.0 <= local_fraction <= 1.0:
        raise ValueError(
            f"the fraction of failures the node-local tier survives must be in [0, 1], "
            f"not {local_fraction!r}"
        )
    return local_fraction / mtbf, (1.0 - local_fraction) / mtbf


def waste(
    interval: float,
    drain_every: int,
    local_cost: float,
    drain_cost: float,
    mtbf: float,
    local_fraction: float = DEFAULT_LOCAL_FRACTION,
    local_restart: float = 0.0,
    restart: float = 0.0,
) -> float:
    """The first-order expected waste fraction W(tau, k) of the module's model."""
    lam1, lam2 = _rates(mtbf, local_fraction)
    k = int(drain_every)
    return (
        ((k - 1) * local_cost + drain_cost) / (k * interval)
        + lam1 * (interval / 2 + local_restart)
        + lam2 * (k * interval / 2 + restart)
    )


def plan_levels(
    local_cost: float,
    drain_cost: float,
    mtbf: float,
    local_fraction: float = DEFAULT_LOCAL_FRACTION,
    local_restart: float = 0.0,
    restart: float = 0.0,
) -> LevelPlan:
    """The (interval, drain_every) of least modelled waste for these costs and failures."""
    if local_cost <= 0 or drain_cost <= 0:
        raise ValueError("checkpoint costs must be > 0 seconds")
    lam1, lam2 = _rates(mtbf, local_fraction)
    best: LevelPlan | None = None
    for k in range(1, MAX_DRAIN_EVERY + 1):
        tau = math.sqrt(2 * ((k - 1) * local_cost + drain_cost) / (k * (lam1 + k * lam2)))
        w = waste(tau, k, local_cost, drain_cost, mtbf, local_fraction, local_restart, restart)
        if best is None or w < best.waste:
            best = LevelPlan(tau, k, w)
        elif k > 2 * best.drain_every + 10:  # W is convex enough in k: past the minimum
            break
    assert best is not None
    return best


def single_level(drain_cost: float, mtbf: float) -> LevelPlan:
    """Every checkpoint drained, at Daly's interval for the drain cost: the baseline."""
    return LevelPlan(daly(drain_cost, mtbf), 1, math.nan)


@dataclass(frozen=True)
class LevelsResult:
    """Per strategy (in the order given): mean makespan, its 95 % half-width, efficiency."""

    work: float
    runs: int
    mean_makespan: np.ndarray
    half_width: np.ndarray
    efficiency: np.ndarray
    mean_failures: float


def simulate_levels(
    work: float,
    plans: Sequence[tuple[float, int]],
    local_cost: float,
    drain_cost: float,
    mtbf: float,
    local_fraction: float = DEFAULT_LOCAL_FRACTION,
    local_restart: float = 0.0,
    restart: float = 0.0,
    *,
    runs: int = 1000,
    seed: int | None = 1,
    single: Sequence[bool] | None = None,
) -> LevelsResult:
    """Run every strategy ``(interval, drain_every)`` on the same ``runs`` failure traces.

    A trace is a Poisson process of failures (mean gap ``mtbf``) in wall-clock time,
    each one recoverable from level 1 with probability ``local_fraction``. A failure
    during a segment, a checkpoint or a restart loses the work since the last
    checkpoint of the level that recovers it (level 2 for the others, and for every
    failure of a strategy marked ``single``: it keeps no level 1). The last segment is
    not followed by a checkpoint.
    """
    if work <= 0:
        raise ValueError("work must be > 0 seconds")
    rng = np.random.default_rng(seed)
    singles = list(single) if single is not None else [k == 1 for _, k in plans]
    spans = np.zeros((len(plans), runs))
    failures = 0
    horizon = 64
    for run in range(runs):
        gaps = rng.exponential(mtbf, horizon)
        kinds = rng.random(horizon) < local_fraction
        trace = (np.cumsum(gaps), kinds)
        for i, (tau, k) in enumerate(plans):
            span, n, trace = _one_run(
                work, tau, k, local_cost, drain_cost, local_restart, restart, trace, rng,
                mtbf, local_fraction, singles[i],
            )  # fmt: skip
            spans[i, run] = span
            failures += n if i == 0 else 0
    mean = spans.mean(axis=1)
    half = 1.959963984540054 * spans.std(axis=1, ddof=1) / math.sqrt(runs) if runs > 1 else 0 * mean
    return LevelsResult(work, runs, mean, half, work / mean, failures / runs)


@dataclass(frozen=True)
class Strategy:
    """One strategy of a :class:`Comparison` and how it fared on the simulated traces."""

    name: str
    interval: float
    drain_every: int
    mean_makespan: float
    half_width_95: float
    efficiency: float


@dataclass(frozen=True)
class Comparison:
    """The two-level plan against Daly's single level, simulated on the same traces."""

    two: LevelPlan
    one: LevelPlan
    strategies: tuple[Strategy, Strategy]  # two levels, then the single level
    mean_failures: float

    @property
    def gain(self) -> float:
        """Seconds the two-level plan finishes sooner on average (negative: later)."""
        return self.strategies[1].mean_makespan - self.strategies[0].mean_makespan


def compare_levels(
    work: float,
    mtbf: float,
    cost: float,
    local_cost: float,
    local_fraction: float = DEFAULT_LOCAL_FRACTION,
    local_restart: float = 0.0,
    restart: float = 0.0,
    *,
    runs: int = 1000,
    seed: int | None = 1,
) -> Comparison:
    """Plan two levels for these costs (:func:`plan_levels`), take Daly's single level
    for the drain cost, and run both on the same ``runs`` failure traces; ValueError on
    costs or failure rates the model cannot take."""
    two = plan_levels(local_cost, cost, mtbf, local_fraction, local_restart, restart)
    one = single_level(cost, mtbf)
    result = simulate_levels(
        work,
        [(two.interval, two.drain_every), (one.interval, 1)],
        local_cost,
        cost,
        mtbf,
        local_fraction,
        local_restart,
        restart,
        runs=runs,
        seed=seed,
        single=[False, True],
    )
    rows = [("two levels", two), ("single level (Daly)", one)]
    strategies = tuple(
        Strategy(
            name,
            plan.interval,
            1 if i else plan.drain_every,
            float(result.mean_makespan[i]),
            float(result.half_width[i]),
            float(result.efficiency[i]),
        )
        for i, (name, plan) in enumerate(rows)
    )
    return Comparison(two, one, (strategies[0], strategies[1]), result.mean_failures)


def _one_run(
    work: float,
    tau: float,
    k: int,
    c1: float,
    c2: float,
    r1: float,
    r2: float,
    trace: tuple[np.ndarray, np.ndarray],
    rng: np.random.Generator,
    mtbf: float,
    fraction: float,
    single: bool,
) -> tuple[float, int, tuple[np.ndarray, np.ndarray]]:
    """One virtual job through one failure trace: (makespan, failures, the trace, grown)."""
    times, kinds = trace
    t = 0.0
    done = level1 = level2 = 0.0  # work done; work saved at each level
    nxt = 0

    def failure_at(i: int) -> tuple[float, bool]:
        nonlocal times, kinds
        while i >= len(times):  # the trace is extended the same way for every strategy
            more = rng.exponential(mtbf, len(times))
            times = np.concatenate([times, times[-1] + np.cumsum(more)])
            kinds = np.concatenate([kinds, rng.random(len(more)) < fraction])
        return float(times[i]), bool(kinds[i])

    failed = 0
    since = since1 = 0  # level-1 checkpoints since the last drain (now; at ``level1``)
    while done < work:
        seg = min(tau, work - done)
        last = done + seg >= work
        drain = single or since + 1 >= k
        cost = 0.0 if last else (c2 if drain else c1)
        f, local = failure_at(nxt)
        if f >= t + seg + cost:
            t += seg + cost
            done += seg
            if not last:
                since = 0 if drain else since + 1
                level1, since1 = done, since
                if drain:
                    level2 = done
            continue
        # a failure during the segment or its checkpoint; then restarts until one survives
        while True:
            failed += 1
            t = f
            nxt += 1
            use_local = local and not single and level1 > level2
            if use_local:
                done, since = level1, since1
            else:
                done = level1 = level2
                since = since1 = 0
            f, local = failure_at(nxt)
            r = r1 if use_local else r2
            if f >= t + r:
                t += r
                break
    return t, failed, (times, kinds)
