"""Checkpoint-interval formulas and the waste model behind them.

Symbols used throughout (all in seconds):

- ``T`` (*interval*): useful work between two checkpoints;
- ``C`` (*cost*): wall time one checkpoint takes;
- ``R`` (*restart_cost*): wall time from a failure to being back at work
  (requeue wait excluded), spent again if a failure strikes during it;
- ``M`` (*mtbf*): mean time between failures hitting the job; failures are
  assumed to arrive as a Poisson process of rate 1/M (exponential gaps).

The model: work is cut into segments of ``T`` followed by a checkpoint ``C``. A
failure anywhere in a segment (or in the checkpoint, or during a restart) loses
everything since the last completed checkpoint; the job pays ``R`` and tries the
segment again. For exponential failures the expected wall time of one segment is
exactly (Daly 2006; Bougeret et al., SC 2011, with no downtime)::

    E(T) = M * exp(R/M) * (exp((T + C)/M) - 1)

and the efficiency is ``T / E(T)``, the fraction of wall time that advances the
computation. Young (1974) and Daly (2006) are first- and higher-order
approximations of the ``T`` that maximises it.
"""

from __future__ import annotations

import math

from hpcckpt.policy.durations import YEAR

__all__ = [
    "DEFAULT_NODE_MTBF",
    "daly",
    "efficiency",
    "expected_makespan",
    "expected_segment_time",
    "expected_waste",
    "job_mtbf",
    "optimal_interval",
    "young",
]

DEFAULT_NODE_MTBF: float = 5 * YEAR
"""Mean time between failures of one compute node as seen by a job: 5 years.

Failure logs of production clusters (Schroeder & Gibson, "A large-scale study of
failures in high-performance computing systems", DSN 2006, on 22 LANL systems)
show a system's failure rate growing roughly in proportion to its number of
processor chips, so a job's MTBF is a per-node figure divided by its node count.
Published per-node figures lie between a few years and a few decades; we take the
pessimistic end, because a job also dies of things no hardware log records
(kernel panics, file-system or network hiccups, a node drained under it), and
because guessing M too small by 2x costs little: the interval shrinks by sqrt(2)
and the efficiency moves by a fraction of a percent. Give ``--mtbf`` (or
``--node-mtbf``) when the site publishes its own number.
"""


def _check_cost(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return value


def _check_positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return value


def young(cost: float, mtbf: float) -> float:
    """Young's (1974) interval ``sqrt(2*C*M)``: the first-order optimum, good while C << M."""
    cost = _check_cost("checkpoint cost", cost)
    mtbf = _check_positive("MTBF", mtbf)
    return math.sqrt(2.0 * cost * mtbf)


def daly(cost: float, mtbf: float) -> float:
    """Daly's (2006) higher-order interval, nearer the true optimum than Young's when C is large.

    For ``C < 2M``: ``T = sqrt(2CM) * [1 + (1/3)*sqrt(C/(2M)) + (1/9)*(C/(2M))] - C``;
    otherwise ``T = M`` (checkpointing more often than failures occur is futile).
    """
    cost = _check_cost("checkpoint cost", cost)
    mtbf = _check_positive("MTBF", mtbf)
    if cost >= 2.0 * mtbf:
        return mtbf
    x = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost


def optimal_interval(cost: float, mtbf: float) -> float:
    """The interval maximising :func:`efficiency` exactly (it does not depend on R).

    Setting the derivative of ``T / (exp((T+C)/M) - 1)`` to zero gives
    ``T/M = 1 - exp(-(T+C)/M)``, solved here by Newton's method from Daly's value.
    """
    cost = _check_cost("checkpoint cost", cost)
    mtbf = _check_positive("MTBF", mtbf)
    if cost == 0:
        return 0.0
    c = cost / mtbf
    # f(x) = x - 1 + exp(-x - c) is convex with f(0) = exp(-c) - 1 < 0 and f(1) > 0;
    # Newton from the right of the root converges monotonically.
    x = 1.0
    for _ in range(200):
        em1 = math.expm1(-x - c)  # exp(-x-c) - 1, exact for small x + c
        step = (x + em1) / -em1
        x -= step
        if abs(step) <= 1e-15 * max(x, 1e-300):
            break
    return x * mtbf


def expected_segment_time(
    interval: float, cost: float, mtbf: float, restart_cost: float = 0.0
) -> float:
    """Expected wall time to get one interval of work safely checkpointed, failures included.

    ``E = M * exp(R/M) * (exp((T+C)/M) - 1)`` (see the module docstring); ``inf``
    when it overflows.
    """
    interval = _check_positive("interval", interval)
    cost = _check_cost("checkpoint cost", cost)
    mtbf = _check_positive("MTBF", mtbf)
    restart_cost = _check_cost("restart cost", restart_cost)
    try:
        return mtbf * math.exp(restart_cost / mtbf) * math.expm1((interval + cost) / mtbf)
    except OverflowError:
        return math.inf


def efficiency(interval: float, cost: float, mtbf: float, restart_cost: float = 0.0) -> float:
    """Fraction of wall time doing useful work when checkpointing every *interval* seconds.

    ``T / E(T)`` in the exact exponential-failure model (module docstring); 1.0
    means no overhead at all, and it falls both for too-short intervals (time spent
    writing) and too-long ones (work lost to failures).
    """
    expected = expected_segment_time(interval, cost, mtbf, restart_cost)
    return float(interval) / expected if math.isfinite(expected) else 0.0


def expected_waste(interval: float, cost: float, mtbf: float, restart_cost: float = 0.0) -> float:
    """Expected fraction of wall time lost to checkpoints, redone work and restarts.

    That is ``1 - efficiency``; to first order ``C/T + T/(2M) + R/M``, the
    trade-off Young's formula balances, but computed exactly here.
    """
    return 1.0 - efficiency(interval, cost, mtbf, restart_cost)


def expected_makespan(
    work: float, interval: float, cost: float, mtbf: float, restart_cost: float = 0.0
) -> float:
    """Expected wall time to finish *work* seconds of computation, checkpointing every *interval*.

    The work is ``floor`` full segments, each followed by a checkpoint, plus a last
    (possibly shorter) segment with no checkpoint after it: the job is done. This is
    the exact expectation of what :func:`hpcckpt.policy.simulate.simulate` samples.
    """
    work = _check_positive("work", work)
    interval = _check_positive("interval", interval)
    cost = _check_cost("checkpoint cost", cost)
    mtbf = _check_positive("MTBF", mtbf)
    restart_cost = _check_cost("restart cost", restart_cost)
    full = math.ceil(work / interval * (1 - 1e-12)) - 1  # segments followed by a checkpoint
    last = work - full * interval
    total = 0.0
    if full:
        total += full * expected_segment_time(interval, cost, mtbf, restart_cost)
    return total + expected_segment_time(last, 0.0, mtbf, restart_cost)


def job_mtbf(
    mtbf: float | None = None, node_mtbf: float = DEFAULT_NODE_MTBF, nodes: int = 1
) -> float:
    """The MTBF to plan with: *mtbf* when given, else ``node_mtbf / nodes``.

    Independent node failures add up their rates, so a job on N nodes fails N
    times as often as one node (see :data:`DEFAULT_NODE_MTBF` for the default).
    """
    if mtbf is not None:
        return _check_positive("MTBF", mtbf)
    node_mtbf = _check_positive("node MTBF", node_mtbf)
    if isinstance(nodes, bool) or int(nodes) != nodes or nodes < 1:
        raise ValueError(f"nodes must be a whole number >= 1, got {nodes!r}")
    return node_mtbf / int(nodes)
