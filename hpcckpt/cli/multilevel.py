"""``hpcckpt simulate --local-cost``: the two-level choice against a single level.

Thin: the model and the simulator live in :mod:`hpcckpt.policy.multilevel`.
"""

from __future__ import annotations

import json
from typing import Any

import click


def compare_levels(
    *,
    work: float,
    mtbf: float,
    mtbf_text: str,
    cost: float,
    restart_cost: float,
    local_cost: float,
    local_fraction: float,
    local_restart_cost: float,
    runs: int,
    seed: int,
    as_json: bool,
) -> None:
    """Print the two-level plan, Daly's single level, and both simulated on the same traces."""
    from hpcckpt.policy import multilevel
    from hpcckpt.policy.durations import format_duration

    if local_cost <= 0:
        raise click.BadParameter("must be > 0", param_hint="--local-cost")
    try:
        two = multilevel.plan_levels(
            local_cost, cost, mtbf, local_fraction, local_restart_cost, restart_cost
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    one = multilevel.single_level(cost, mtbf)
    result = multilevel.simulate_levels(
        work,
        [(two.interval, two.drain_every), (one.interval, 1)],
        local_cost,
        cost,
        mtbf,
        local_fraction,
        local_restart_cost,
        restart_cost,
        runs=runs,
        seed=seed,
        single=[False, True],
    )
    rows = [
        ("two levels", two.interval, two.drain_every, 0),
        ("single level (Daly)", one.interval, 1, 1),
    ]
    if as_json:
        doc: dict[str, Any] = {
            "work": work,
            "mtbf": mtbf,
            "cost": cost,
            "local_cost": local_cost,
            "local_fraction": local_fraction,
            "restart_cost": restart_cost,
            "local_restart_cost": local_restart_cost,
            "runs": runs,
            "seed": seed,
            "mean_failures": result.mean_failures,
            "strategies": [
                {
                    "name": name,
                    "interval": t,
                    "drain_every": k,
                    "mean_makespan": float(result.mean_makespan[i]),
                    "half_width_95": float(result.half_width[i]),
                    "efficiency": float(result.efficiency[i]),
                }
                for name, t, k, i in rows
            ],
        }
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(
        f"{runs} simulated runs of a job needing {format_duration(work)} of work, each "
        f"strategy on the same failure traces; {mtbf_text}, {local_fraction:.0%} of failures "
        f"recoverable from the node-local tier; node-local save {format_duration(local_cost)}, "
        f"drain {format_duration(cost)}; restart {format_duration(local_restart_cost)} from "
        f"the node-local tier, {format_duration(restart_cost)} from the directory; seed {seed}."
    )
    click.echo("")
    click.echo(
        f"  {'strategy':<20} {'interval':>10} {'drain':>9} {'makespan':>16} {'efficiency':>10}"
    )
    scale, unit = (3600.0, "h") if work >= 3600 else (60.0, "min")
    for name, t, k, i in rows:
        span = f"{result.mean_makespan[i] / scale:.2f}±{result.half_width[i] / scale:.2f} {unit}"
        drain = "every" if k == 1 else f"every {k}"
        click.echo(
            f"  {name:<20} {format_duration(t):>10} {drain:>9} {span:>16} "
            f"{result.efficiency[i]:>10.2%}"
        )
    gain = result.mean_makespan[1] - result.mean_makespan[0]
    click.echo("")
    click.echo(
        f"Two levels: save node-locally every {format_duration(two.interval)} of work and "
        f"drain every {two.drain_every} saves (Checkpointer(interval=..., drain_every="
        f"{two.drain_every}) or drain_every='auto'); it finishes {format_duration(abs(gain))} "
        f"{'sooner' if gain >= 0 else 'later'} than a single level on the same failures."
    )
