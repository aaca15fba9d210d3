"""Monte-Carlo check of checkpoint intervals: run many virtual jobs and time them.

A virtual job needs ``work`` seconds of computation. It computes ``interval``
seconds, writes a checkpoint (``cost``), and so on; the last piece of work is not
followed by a checkpoint. Failures arrive as a Poisson process of mean gap
``mtbf`` and may strike at any moment: while computing, while checkpointing, or
while restarting. A failure loses everything since the last completed
checkpoint, costs ``restart_cost`` (which a further failure can interrupt), and
the job resumes from that checkpoint. Because exponential failures have no memory,
each attempt draws a fresh failure time.

The simulation is vectorised over all (interval, run) pairs: each loop iteration
advances every unfinished virtual job by one attempt, so the loop runs about as
many times as the shortest interval has segments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hpcckpt.policy.formulas import daly, expected_makespan

__all__ = ["MAX_SEGMENTS", "SimulationResult", "best_interval", "default_intervals", "simulate"]

MAX_SEGMENTS = 200_000
"""Refuse intervals that cut the work into more segments than this (the loop would crawl)."""

MIN_SUCCESS = 1e-3
"""Intervals whose attempt (restart + interval + checkpoint) survives with a probability
below this are not simulated: such jobs essentially never finish, and are reported
with an infinite makespan and zero efficiency."""

Z95 = 1.959963984540054


@dataclass(frozen=True)
class SimulationResult:
    """Per-interval statistics of a simulation; all arrays share the order of *intervals*.

    ``efficiency`` is ``work / mean_makespan``; the confidence bounds are the 95 %
    normal interval of the mean makespan, mapped through the same ratio.
    """

    work: float
    cost: float
    mtbf: float
    restart_cost: float
    runs: int
    seed: int | None
    intervals: np.ndarray
    mean_makespan: np.ndarray
    makespan_low: np.ndarray
    makespan_high: np.ndarray
    efficiency: np.ndarray
    efficiency_low: np.ndarray
    efficiency_high: np.ndarray
    mean_failures: np.ndarray
    expected_makespan: np.ndarray
    """The exact expectation from :func:`hpcckpt.policy.formulas.expected_makespan`."""

    @property
    def best_index(self) -> int:
        """Index of the interval with the highest simulated efficiency."""
        return int(np.argmax(self.efficiency))

    def rows(self) -> list[dict[str, float]]:
        """One plain dict per interval, for tables and JSON."""
        keys = (
            "interval",
            "mean_makespan",
            "makespan_low",
            "makespan_high",
            "efficiency",
            "efficiency_low",
            "efficiency_high",
            "mean_failures",
            "expected_makespan",
        )
        arrays = (
            self.intervals,
            self.mean_makespan,
            self.makespan_low,
            self.makespan_high,
            self.efficiency,
            self.efficiency_low,
            self.efficiency_high,
            self.mean_failures,
            self.expected_makespan,
        )
        return [
            {key: float(array[i]) for key, array in zip(keys, arrays, strict=True)}
            for i in range(len(self.intervals))
        ]


def default_intervals(
    cost: float,
    mtbf: float,
    count: int = 30,
    low: float | None = None,
    high: float | None = None,
    work: float | None = None,
) -> np.ndarray:
    """*count* log-spaced intervals from Daly's interval / 5 to x 5 (or *low*..*high*).

    The efficiency curve is flat near its optimum and steep far away, so a
    logarithmic grid a factor 25 wide shows both. *high* is capped at *work*.
    """
    if count < 1:
        raise ValueError(f"need at least one interval, got {count!r}")
    center = daly(cost, mtbf)
    if center <= 0:
        center = 1.0
    lo = float(low) if low is not None else center / 5
    hi = float(high) if high is not None else center * 5
    if work is not None:
        hi = min(hi, float(work))
        if low is None:
            lo = min(lo, hi / 25)
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 or hi < lo:
        raise ValueError(f"need 0 < min interval <= max interval, got {lo!r} and {hi!r}")
    if count == 1 or lo == hi:
        return np.full(count, lo)
    return np.geomspace(lo, hi, count)


def simulate(
    work: float,
    intervals: Sequence[float] | np.ndarray,
    cost: float,
    mtbf: float,
    restart_cost: float = 0.0,
    runs: int = 10_000,
    seed: int | None = None,
) -> SimulationResult:
    """Simulate *runs* virtual jobs for each interval and return makespan and efficiency statistics.

    Deterministic for a given *seed* (NumPy's default Generator); see the module
    docstring for the model.
    """
    work = float(work)
    cost = float(cost)
    mtbf = float(mtbf)
    restart_cost = float(restart_cost)
    if not math.isfinite(work) or work <= 0:
        raise ValueError(f"work must be a finite number of seconds > 0, got {work!r}")
    if not math.isfinite(mtbf) or mtbf <= 0:
        raise ValueError(f"MTBF must be a finite number of seconds > 0, got {mtbf!r}")
    for name, value in (("checkpoint cost", cost), ("restart cost", restart_cost)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    if isinstance(runs, bool) or int(runs) != runs or runs < 2:
        raise ValueError(f"runs must be a whole number >= 2, got {runs!r}")
    runs = int(runs)
    grid = np.asarray(intervals, dtype=float).reshape(-1)
    if grid.size == 0:
        raise ValueError("no intervals to simulate")
    if not np.all(np.isfinite(grid)) or np.any(grid <= 0):
        raise ValueError("intervals must be finite numbers of seconds > 0")
    segments = np.ceil(work / grid * (1 - 1e-12))
    if segments.max() > MAX_SEGMENTS:
        raise ValueError(
            f"the shortest interval ({grid.min():g} s) cuts {work:g} s of work into "
            f"{segments.max():.0f} segments; at most {MAX_SEGMENTS} are simulated"
        )
    attempt = np.minimum(grid, work) + np.where(segments > 1, cost, 0.0) + restart_cost
    feasible = np.exp(-attempt / mtbf) >= MIN_SUCCESS

    rng = np.random.default_rng(seed)
    n_int = grid.size
    makespans = np.full((n_int, runs), np.inf)
    failures = np.zeros((n_int, runs))

    # State of the unfinished (interval, run) pairs, compacted as they finish.
    rows = np.repeat(np.flatnonzero(feasible), runs)
    cols = np.tile(np.arange(runs), int(feasible.sum()))
    period = grid[rows]
    remaining = np.full(rows.size, work)
    clock = np.zeros(rows.size)
    fails = np.zeros(rows.size)
    restarting = np.zeros(rows.size, dtype=bool)
    tolerance = 1e-9 * work

    while rows.size:
        last = remaining <= period + tolerance
        chunk = np.where(last, remaining, period)
        length = chunk + np.where(last, 0.0, cost) + np.where(restarting, restart_cost, 0.0)
        strike = rng.exponential(mtbf, rows.size)
        ok = strike >= length
        clock += np.where(ok, length, strike)
        remaining = np.where(ok, remaining - chunk, remaining)
        restarting = ~ok
        fails += restarting
        done = ok & last
        if done.any():
            makespans[rows[done], cols[done]] = clock[done]
            failures[rows[done], cols[done]] = fails[done]
            keep = ~done
            rows, cols, period = rows[keep], cols[keep], period[keep]
            remaining, clock, fails, restarting = (
                remaining[keep],
                clock[keep],
                fails[keep],
                restarting[keep],
            )

    mean = np.full(n_int, np.inf)
    half = np.full(n_int, np.inf)
    mean[feasible] = makespans[feasible].mean(axis=1)
    half[feasible] = Z95 * makespans[feasible].std(axis=1, ddof=1) / math.sqrt(runs)
    low = mean - np.where(feasible, half, 0.0)  # inf where not simulated
    high = mean + half
    exact = np.array([expected_makespan(work, t, cost, mtbf, restart_cost) for t in grid])
    eff = work / mean  # 0 where the mean is infinite
    eff_low = work / high
    eff_high = np.where(low > 0, work / np.maximum(low, 1e-300), 1.0)
    return SimulationResult(
        work=work,
        cost=cost,
        mtbf=mtbf,
        restart_cost=restart_cost,
        runs=runs,
        seed=seed,
        intervals=grid,
        mean_makespan=mean,
        makespan_low=low,
        makespan_high=high,
        efficiency=eff,
        efficiency_low=eff_low,
        efficiency_high=np.minimum(eff_high, 1.0),
        mean_failures=np.where(feasible, failures.mean(axis=1), np.inf),
        expected_makespan=exact,
    )


def best_interval(result: SimulationResult) -> float:
    """The simulated interval with the highest mean efficiency."""
    return float(result.intervals[result.best_index])
