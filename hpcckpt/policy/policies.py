"""Interval policies: given what a checkpoint costs, how long to compute before the next one.

A policy answers two questions for the Checkpointer: :meth:`IntervalPolicy.interval`
(seconds of work between checkpoints, for time-based policies) and
:meth:`IntervalPolicy.due_at_step` (for step-based ones). :meth:`IntervalPolicy.due`
combines both. The checkpoint cost that Young and Daly need is measured online by
:class:`CostTracker`; before the first save, :func:`initial_cost_estimate` guesses
it from the state size.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from hpcckpt.policy.formulas import daly, young

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_LATENCY",
    "MAX_INTERVAL",
    "MIN_INTERVAL",
    "POLICY_NAMES",
    "CostTracker",
    "Daly",
    "EverySteps",
    "Fixed",
    "IntervalPolicy",
    "Young",
    "initial_cost_estimate",
    "make_policy",
]

MIN_INTERVAL: float = 60.0
"""Young and Daly never checkpoint more often than once a minute.

Their formulas only drop below a minute when the checkpoint is nearly free or the
job fails every few minutes; in the first case more frequent saves buy almost
nothing, in the second no interval rescues the job. Meanwhile every checkpoint
creates files and metadata on a shared parallel file system, whose metadata
servers suffer from many small jobs saving every few seconds.
"""

MAX_INTERVAL: float = 24 * 3600.0
"""Young and Daly never wait more than a day between checkpoints.

With a cheap save on a few nodes the formulas can ask for days (C = 60 s on one
node with a 5-year MTBF gives about 38 h). The model only knows about independent
random failures, not the rest of life on a cluster: a hung job killed by its time
limit without the warning signal, a preemption, an administrator's ``scancel``.
Capping at a day bounds that loss; the price is at most C / 24 h of efficiency
(0.7 % for a 10-minute checkpoint).
"""

DEFAULT_BANDWIDTH: float = 1e9
"""Bytes per second assumed for the very first checkpoint: 1 GB/s.

What one job typically gets from a shared Lustre or GPFS file system. The guess
only sets the first interval; once a save was measured, :class:`CostTracker`
takes over. Erring optimistic is deliberate: a first checkpoint a bit too early
is cheap and gives a real measurement sooner.
"""

DEFAULT_LATENCY: float = 1.0
"""Fixed seconds added to every initial cost guess: opening, committing and syncing files."""

POLICY_NAMES = ("young", "daly", "fixed", "steps")


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


class IntervalPolicy:
    """Base class of the policies: decides when the next checkpoint is due.

    Time-based policies override :meth:`interval`; step-based ones override
    :meth:`due_at_step`. The defaults mean "never due" for the other kind.
    """

    name: str = "policy"

    def interval(self, cost: float) -> float:
        """Seconds of work between checkpoints for a checkpoint costing *cost* seconds."""
        return math.inf

    def due_at_step(self, step: int, last_saved_step: int | None) -> bool:
        """Whether a checkpoint is due at *step*, the last one being at *last_saved_step*."""
        return False

    def due(
        self,
        elapsed: float,
        cost: float,
        step: int | None = None,
        last_saved_step: int | None = None,
    ) -> bool:
        """Whether to checkpoint now: *elapsed* seconds of work since the last save, or by steps."""
        if elapsed >= self.interval(cost):
            return True
        return step is not None and self.due_at_step(step, last_saved_step)

    def describe(self) -> str:
        """A one-line description for logs and events."""
        return self.name


class _FormulaPolicy(IntervalPolicy):
    def __init__(
        self,
        mtbf: float,
        *,
        min_interval: float = MIN_INTERVAL,
        max_interval: float = MAX_INTERVAL,
    ) -> None:
        mtbf = float(mtbf)
        if not math.isfinite(mtbf) or mtbf <= 0:
            raise ValueError(f"MTBF must be a finite number of seconds > 0, got {mtbf!r}")
        if not 0 <= min_interval <= max_interval:
            raise ValueError(
                f"need 0 <= min_interval <= max_interval, got {min_interval!r} and {max_interval!r}"
            )
        self.mtbf = mtbf
        self.min_interval = float(min_interval)
        self.max_interval = float(max_interval)

    def _formula(self, cost: float) -> float:
        raise NotImplementedError

    def interval(self, cost: float) -> float:
        """The formula's interval for *cost*, clamped to ``[min_interval, max_interval]``."""
        return _clamp(self._formula(cost), self.min_interval, self.max_interval)

    def describe(self) -> str:
        return f"{self.name} (MTBF {self.mtbf:.0f} s)"


class Young(_FormulaPolicy):
    """Young's interval ``sqrt(2*C*M)``, recomputed as the measured cost C changes."""

    name = "young"

    def _formula(self, cost: float) -> float:
        return young(cost, self.mtbf)


class Daly(_FormulaPolicy):
    """Daly's higher-order interval: the default, within a hair of the optimum."""

    name = "daly"

    def _formula(self, cost: float) -> float:
        return daly(cost, self.mtbf)


class Fixed(IntervalPolicy):
    """A fixed interval chosen by the user, whatever checkpoints cost (no clamping)."""

    name = "fixed"

    def __init__(self, seconds: float) -> None:
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(
                f"fixed interval must be a finite number of seconds > 0, got {seconds!r}"
            )
        self.seconds = seconds

    def interval(self, cost: float) -> float:
        """The configured seconds."""
        return self.seconds

    def describe(self) -> str:
        return f"fixed every {self.seconds:g} s"


class EverySteps(IntervalPolicy):
    """Checkpoint every *n* application steps (the application calls with its step number).

    Counting from the last saved step, not ``step % n``, keeps the rhythm right after
    a restart from a step that is not a multiple of *n*; before any save, steps
    count from 0.
    """

    name = "steps"

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ValueError(f"every_steps must be a whole number >= 1, got {n!r}")
        self.n = int(n)

    def due_at_step(self, step: int, last_saved_step: int | None) -> bool:
        """True once *n* steps have passed since *last_saved_step* (or since step 0)."""
        return step - (last_saved_step if last_saved_step is not None else 0) >= self.n

    def describe(self) -> str:
        return f"every {self.n} steps"


def make_policy(
    name: str,
    *,
    mtbf: float | None = None,
    interval: float | None = None,
    every_steps: int | None = None,
    min_interval: float = MIN_INTERVAL,
    max_interval: float = MAX_INTERVAL,
) -> IntervalPolicy:
    """Build a policy from its name ("young", "daly", "fixed", "steps") and the value it needs.

    Young and Daly need *mtbf* (seconds, see :func:`hpcckpt.policy.formulas.job_mtbf`),
    "fixed" needs *interval* (seconds) and "steps" needs *every_steps*.
    """
    key = str(name).strip().lower()
    if key in ("young", "daly"):
        if mtbf is None:
            raise ValueError(f"policy {key!r} needs the job's MTBF (mtbf=seconds)")
        cls = Young if key == "young" else Daly
        return cls(mtbf, min_interval=min_interval, max_interval=max_interval)
    if key == "fixed":
        if interval is None:
            raise ValueError("policy 'fixed' needs interval=seconds")
        return Fixed(interval)
    if key == "steps":
        if every_steps is None:
            raise ValueError("policy 'steps' needs every_steps=N")
        return EverySteps(every_steps)
    raise ValueError(f"unknown interval policy {name!r}: choose one of {', '.join(POLICY_NAMES)}")


def initial_cost_estimate(
    state_bytes: int | float,
    bandwidth: float = DEFAULT_BANDWIDTH,
    latency: float = DEFAULT_LATENCY,
) -> float:
    """A guess of the first checkpoint's cost, ``latency + state_bytes / bandwidth`` seconds.

    *state_bytes* is the whole job's checkpoint size (all ranks) and *bandwidth* the
    aggregate write rate in bytes per second; used only until a save was measured.
    """
    state_bytes = float(state_bytes)
    bandwidth = float(bandwidth)
    if not math.isfinite(state_bytes) or state_bytes < 0:
        raise ValueError(f"state size must be a number of bytes >= 0, got {state_bytes!r}")
    if not math.isfinite(bandwidth) or bandwidth <= 0:
        raise ValueError(f"bandwidth must be bytes per second > 0, got {bandwidth!r}")
    if not math.isfinite(latency) or latency < 0:
        raise ValueError(f"latency must be seconds >= 0, got {latency!r}")
    return float(latency) + state_bytes / bandwidth


class CostTracker:
    """A robust running estimate of the checkpoint cost from measured save times.

    Each measurement is clipped to ``[median/clip, median*clip]`` of the last
    *window* measurements (itself included) and blended into an exponentially
    weighted mean with weight *alpha*; the previous estimate is clipped to the same
    band first. One slow save among normal ones stays inside the band (at most
    ``clip``x the median) and moves the estimate by at most ``alpha*(clip-1)``, 50 %
    with the defaults, i.e. the interval by about 22 %. When the cost really changes,
    the median flips after ``window//2 + 1`` saves and the estimate is within about
    10 % of the new level two saves later.
    """

    def __init__(self, alpha: float = 0.5, window: int = 5, clip: float = 2.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if isinstance(window, bool) or int(window) != window or window < 1:
            raise ValueError(f"window must be a whole number >= 1, got {window!r}")
        if not clip > 1:
            raise ValueError(f"clip must be > 1, got {clip!r}")
        self.alpha = float(alpha)
        self.clip = float(clip)
        self._recent: deque[float] = deque(maxlen=int(window))
        self._estimate: float | None = None
        self.count = 0
        self.last: float | None = None

    @property
    def estimate(self) -> float | None:
        """The smoothed cost in seconds, or None before any measurement."""
        return self._estimate

    def add(self, seconds: float) -> float:
        """Record one measured checkpoint duration; returns the new estimate."""
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(
                f"a checkpoint cost must be a finite number of seconds >= 0, got {seconds!r}"
            )
        self._recent.append(seconds)
        self.count += 1
        self.last = seconds
        if self._estimate is None:
            self._estimate = seconds
            return seconds
        median = statistics.median(self._recent)
        value, previous = seconds, self._estimate
        if median > 0:
            low, high = median / self.clip, median * self.clip
            value = _clamp(value, low, high)
            previous = _clamp(previous, low, high)
        self._estimate = self.alpha * value + (1.0 - self.alpha) * previous
        return self._estimate

    def get(self, default: float) -> float:
        """The estimate, or *default* (e.g. :func:`initial_cost_estimate`) before any save."""
        return default if self._estimate is None else self._estimate
