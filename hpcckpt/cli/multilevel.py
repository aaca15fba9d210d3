"""``hpcckpt simulate --local-cost``: the two-level choice against a single level.

Thin: the model, the simulator and the comparison live in :mod:`hpcckpt.policy.multilevel`.
"""

from __future__ import annotations

import dataclasses
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
        result = multilevel.compare_levels(
            work, mtbf, cost, local_cost, local_fraction, local_restart_cost, restart_cost,
            runs=runs, seed=seed,
        )  # fmt: skip
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
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
            "strategies": [dataclasses.asdict(s) for s in result.strategies],
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
    for s in result.strategies:
        span = f"{s.mean_makespan / scale:.2f}±{s.half_width_95 / scale:.2f} {unit}"
        drain = "every" if s.drain_every == 1 else f"every {s.drain_every}"
        click.echo(
            f"  {s.name:<20} {format_duration(s.interval):>10} {drain:>9} {span:>16} "
            f"{s.efficiency:>10.2%}"
        )
    gain, two = result.gain, result.two
    click.echo("")
    click.echo(
        f"Two levels: save node-locally every {format_duration(two.interval)} of work and "
        f"drain every {two.drain_every} saves (Checkpointer(interval=..., drain_every="
        f"{two.drain_every}) or drain_every='auto'); it finishes {format_duration(abs(gain))} "
        f"{'sooner' if gain >= 0 else 'later'} than a single level on the same failures."
    )
