"""``hpcckpt interval`` and ``hpcckpt simulate``: choose a checkpoint interval, and check it.

Both commands are thin: the arithmetic lives in :mod:`hpcckpt.policy`. Imports of
the policy layer happen inside the commands, so that loading the ``hpcckpt``
group (which the job wrapper does first thing) stays cheap.

Over 500 lines on purpose: three related commands (interval, simulate, their plot)
share their option parsing and output formatting.
"""

from __future__ import annotations

import json
import math
from typing import Any

import click

__all__ = ["COMMANDS", "DURATION", "interval", "simulate"]


class DurationType(click.ParamType):
    """A click parameter accepting ``300``, ``5m``, ``1h30m``, ``2-12:00:00`` and the like."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, float):
            return value
        from hpcckpt.policy.durations import parse_duration

        try:
            return parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = DurationType()


def _job_mtbf(mtbf: float | None, nodes: int | None, node_mtbf: float | None) -> dict[str, Any]:
    """The MTBF to use and where it came from, from --mtbf or --nodes/--node-mtbf."""
    from hpcckpt.policy.formulas import DEFAULT_NODE_MTBF, job_mtbf

    if mtbf is not None and (nodes is not None or node_mtbf is not None):
        raise click.UsageError("give either --mtbf, or --nodes (and --node-mtbf), not both")
    if mtbf is None and nodes is None and node_mtbf is None:
        raise click.UsageError(
            "say how often the job fails: --mtbf DURATION (the job's mean time between "
            "failures), or --nodes N to derive it from a per-node MTBF (--node-mtbf, default 5y)"
        )
    if mtbf is not None:
        if mtbf <= 0:
            raise click.BadParameter("must be > 0", param_hint="--mtbf")
        return {"mtbf": mtbf, "nodes": None, "node_mtbf": None}
    nodes = 1 if nodes is None else nodes
    node_mtbf = DEFAULT_NODE_MTBF if node_mtbf is None else node_mtbf
    if node_mtbf <= 0:
        raise click.BadParameter("must be > 0", param_hint="--node-mtbf")
    return {"mtbf": job_mtbf(None, node_mtbf, nodes), "nodes": nodes, "node_mtbf": node_mtbf}


def _describe_mtbf(source: dict[str, Any]) -> str:
    from hpcckpt.policy.durations import format_duration

    text = f"job MTBF {format_duration(source['mtbf'])} ({source['mtbf']:.0f} s)"
    if source["nodes"] is not None:
        text += (
            f" = node MTBF {format_duration(source['node_mtbf'])} / {source['nodes']} "
            f"node{'s' if source['nodes'] != 1 else ''}"
        )
    return text


def _mtbf_options(func: Any) -> Any:
    """--mtbf, --nodes and --node-mtbf, shared by both commands."""
    func = click.option(
        "--node-mtbf",
        type=DURATION,
        default=None,
        metavar="DURATION",
        help="MTBF of one node, used with --nodes. [default: 5y]",
    )(func)
    func = click.option(
        "--nodes",
        type=click.IntRange(min=1),
        default=None,
        help="Derive the job's MTBF as node MTBF / N (instead of --mtbf).",
    )(func)
    func = click.option(
        "--mtbf",
        type=DURATION,
        default=None,
        metavar="DURATION",
        help="Mean time between failures that kill the job, e.g. 12h.",
    )(func)
    return func


def _json_number(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


@click.command(
    "interval",
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="""\b
Examples:
  hpcckpt interval --mtbf 12h --cost 5m
  hpcckpt interval --nodes 256 --cost 90s --restart-cost 3m
  myapp --checkpoint-every $(hpcckpt interval --mtbf 1d --cost 2m --format seconds)

DURATION is seconds (300) or a number with a unit (5m, 1h30m, 2.5h, 5y) or
Slurm's [D-]HH:MM:SS.""",
)
@_mtbf_options
@click.option(
    "--cost",
    type=DURATION,
    required=True,
    metavar="DURATION",
    help="Wall time one checkpoint takes, e.g. 5m (time one save of your job).",
)
@click.option(
    "--restart-cost",
    type=DURATION,
    default=0.0,
    metavar="DURATION",
    help="Wall time to read a checkpoint back and resume after a failure. [default: 0]",
)
@click.option(
    "--method",
    type=click.Choice(["young", "daly", "both"]),
    default=None,
    help="Which formula to show. [default: both; daly with --format]",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["seconds", "minutes", "hms"]),
    default=None,
    help="Print only the interval (whole seconds, whole minutes or HH:MM:SS), for scripts.",
)
def interval(
    mtbf: float | None,
    nodes: int | None,
    node_mtbf: float | None,
    cost: float,
    restart_cost: float,
    method: str | None,
    as_json: bool,
    fmt: str | None,
) -> None:
    """Compute the checkpoint interval that wastes the least time.

    Checkpointing too often wastes time writing; too rarely, time redoing lost work.
    Young (1974): interval = sqrt(2 x cost x MTBF). Daly (2006) adds higher-order
    terms and is within a hair of the exact optimum; both assume failures arrive at
    random with a known mean time between failures (MTBF).

    Prints both intervals and the efficiency each gives (the fraction of wall time
    spent computing, from the exact exponential-failure model).
    """
    from hpcckpt.policy import policies
    from hpcckpt.policy.durations import format_duration, format_hms
    from hpcckpt.policy.formulas import daly, efficiency, optimal_interval, young

    if as_json and fmt:
        raise click.UsageError("--json and --format are alternatives; choose one")
    if cost <= 0:
        raise click.BadParameter("a checkpoint takes some time: must be > 0", param_hint="--cost")
    source = _job_mtbf(mtbf, nodes, node_mtbf)
    m = source["mtbf"]
    method = method or ("daly" if fmt else "both")
    methods = ["young", "daly"] if method == "both" else [method]
    formulas = {"young": young, "daly": daly}
    values = {name: formulas[name](cost, m) for name in methods}
    if method == "both":
        values["optimum"] = optimal_interval(cost, m)

    if fmt:
        value = values["daly" if method == "both" else method]
        if fmt == "seconds":
            click.echo(str(max(1, round(value))))
        elif fmt == "minutes":
            click.echo(str(max(1, round(value / 60))))
        else:
            click.echo(format_hms(max(1.0, value)))
        return

    def summary(t: float) -> dict[str, float]:
        eff = efficiency(t, cost, m, restart_cost)
        return {"interval": t, "efficiency": eff, "waste": 1.0 - eff}

    if as_json:
        doc: dict[str, Any] = {
            "mtbf": m,
            "nodes": source["nodes"],
            "node_mtbf": source["node_mtbf"],
            "cost": cost,
            "restart_cost": restart_cost,
        }
        for name, t in values.items():
            doc[name] = summary(t)
        click.echo(json.dumps(doc, indent=2))
        return

    click.echo(
        f"{_describe_mtbf(source)}; checkpoint cost {format_duration(cost)}, "
        f"restart cost {format_duration(restart_cost)}"
    )
    click.echo("")
    click.echo(f"  {'method':<9}{'interval':>10}  {'':<10}{'efficiency':>10}")
    notes = {"optimum": "exact optimum of the model"}
    for name, t in values.items():
        eff = efficiency(t, cost, m, restart_cost)
        note = notes.get(name, "")
        label = name.capitalize()
        click.echo(
            f"  {label:<9}{t:>8.0f} s  {'(' + format_duration(t) + ')':<10}{eff:>10.2%}"
            f"  {note}".rstrip()
        )
    chosen = values["daly" if "daly" in values else methods[0]]
    click.echo("")
    click.echo(
        f"Checkpoint about every {format_duration(chosen)}; a failure then costs on average "
        f"{format_duration(chosen / 2 + restart_cost)} (half an interval plus the restart)."
    )
    if not policies.MIN_INTERVAL <= chosen <= policies.MAX_INTERVAL:
        clamped = min(max(chosen, policies.MIN_INTERVAL), policies.MAX_INTERVAL)
        click.echo(
            f"Note: hpcckpt's young/daly policies keep intervals within "
            f"{format_duration(policies.MIN_INTERVAL)}..{format_duration(policies.MAX_INTERVAL)}, "
            f"so a Checkpointer would use {format_duration(clamped)}."
        )
    click.echo("For a script: add --format seconds (or minutes, hms) to print just the number.")


@click.command(
    "simulate",
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="""\b
Examples:
  hpcckpt simulate --work 48h --mtbf 12h --cost 5m --restart-cost 2m
  hpcckpt simulate --work 7d --nodes 512 --cost 10m --plot efficiency.png
  hpcckpt simulate --work 48h --mtbf 12h --cost 5m --min 10m --max 6h --json
  hpcckpt simulate --work 48h --mtbf 6h --cost 5m --local-cost 20s   # two levels""",
)
@click.option(
    "--work",
    type=DURATION,
    required=True,
    metavar="DURATION",
    help="Computing time the job needs without failures or checkpoints, e.g. 48h.",
)
@_mtbf_options
@click.option(
    "--cost", type=DURATION, required=True, metavar="DURATION", help="Wall time of one checkpoint."
)
@click.option(
    "--restart-cost",
    type=DURATION,
    default=0.0,
    metavar="DURATION",
    help="Wall time to resume after a failure. [default: 0]",
)
@click.option(
    "--runs",
    type=click.IntRange(min=2),
    default=10_000,
    show_default=True,
    help="Virtual jobs per interval.",
)
@click.option(
    "--intervals",
    "count",
    type=click.IntRange(min=1),
    default=30,
    show_default=True,
    help="How many intervals to try (log-spaced; Young's and Daly's are added).",
)
@click.option(
    "--min",
    "low",
    type=DURATION,
    default=None,
    metavar="DURATION",
    help="Shortest interval tried. [default: Daly's / 5]",
)
@click.option(
    "--max",
    "high",
    type=DURATION,
    default=None,
    metavar="DURATION",
    help="Longest interval tried. [default: Daly's x 5, at most --work]",
)
@click.option(
    "--local-cost",
    type=DURATION,
    default=None,
    metavar="DURATION",
    help="Two levels: the node-local save (with redundancy) takes this; --cost is then the "
    "drain to the file system. Prints the two-level plan against a single level on the "
    "same failures.",
)
@click.option(
    "--local-fraction",
    type=click.FloatRange(0.0, 1.0),
    default=None,
    help="Two levels: fraction of failures the node-local tier survives. [default: 0.8]",
)
@click.option(
    "--local-restart-cost",
    type=DURATION,
    default=None,
    metavar="DURATION",
    help="Two levels: time to resume from the node-local tier. [default: --restart-cost]",
)
@click.option("--seed", type=int, default=1, show_default=True, help="Random seed.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Also draw efficiency vs interval into this image (needs matplotlib).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def simulate(
    work: float,
    mtbf: float | None,
    nodes: int | None,
    node_mtbf: float | None,
    cost: float,
    restart_cost: float,
    runs: int,
    count: int,
    low: float | None,
    high: float | None,
    local_cost: float | None,
    local_fraction: float | None,
    local_restart_cost: float | None,
    seed: int,
    plot: str | None,
    as_json: bool,
) -> None:
    """Check checkpoint intervals by simulating many runs of a job with random failures.

    Each virtual job computes for --work, checkpointing every interval; failures
    arrive at random (mean gap: the MTBF), also during checkpoints and restarts, and
    send it back to its last checkpoint. Prints, per interval, the mean time to
    finish, the efficiency (work / that time) with its 95% confidence interval, and
    how the best interval compares with Young's and Daly's formulas.
    """
    import numpy as np

    from hpcckpt.policy.durations import format_duration
    from hpcckpt.policy.formulas import daly, young
    from hpcckpt.policy.simulate import default_intervals
    from hpcckpt.policy.simulate import simulate as run_simulation

    if work <= 0:
        raise click.BadParameter("must be > 0", param_hint="--work")
    if cost <= 0:
        raise click.BadParameter("a checkpoint takes some time: must be > 0", param_hint="--cost")
    source = _job_mtbf(mtbf, nodes, node_mtbf)
    m = source["mtbf"]
    if local_cost is not None:
        from hpcckpt.cli.multilevel import compare_levels
        from hpcckpt.policy.multilevel import DEFAULT_LOCAL_FRACTION

        compare_levels(
            work=work,
            mtbf=m,
            mtbf_text=_describe_mtbf(source),
            cost=cost,
            restart_cost=restart_cost,
            local_cost=local_cost,
            local_fraction=DEFAULT_LOCAL_FRACTION if local_fraction is None else local_fraction,
            local_restart_cost=restart_cost if local_restart_cost is None else local_restart_cost,
            runs=runs,
            seed=seed,
            as_json=as_json,
        )
        return
    try:
        grid = default_intervals(cost, m, count, low, high, work=work)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    t_young, t_daly = young(cost, m), daly(cost, m)
    extra = [t for t in (t_young, t_daly) if grid[0] <= t <= grid[-1]]
    grid = np.unique(np.concatenate([grid, extra]))
    try:
        result = run_simulation(work, grid, cost, m, restart_cost, runs=runs, seed=seed)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None

    best = result.best_index

    def at(t: float) -> int | None:
        hits = np.flatnonzero(result.intervals == t)
        return int(hits[0]) if hits.size else None

    marks = {i: [] for i in range(len(grid))}
    for name, t in (("Young", t_young), ("Daly", t_daly)):
        i = at(t)
        if i is not None:
            marks[i].append(name)
    marks[best].append("best")

    if plot:
        _plot(result, t_young, t_daly, plot)

    if as_json:
        doc: dict[str, Any] = {
            "work": work,
            "mtbf": m,
            "nodes": source["nodes"],
            "node_mtbf": source["node_mtbf"],
            "cost": cost,
            "restart_cost": restart_cost,
            "runs": runs,
            "seed": seed,
            "rows": [{k: _json_number(v) for k, v in row.items()} for row in result.rows()],
            "best": {
                "interval": float(result.intervals[best]),
                "efficiency": _json_number(result.efficiency[best]),
            },
        }
        for name, t in (("young", t_young), ("daly", t_daly)):
            i = at(t)
            doc[name] = {
                "interval": t,
                "efficiency": None if i is None else _json_number(result.efficiency[i]),
            }
        if plot:
            doc["plot"] = plot
        click.echo(json.dumps(doc, indent=2))
        return

    click.echo(
        f"{runs} simulated runs per interval of a job needing {format_duration(work)} of work; "
        f"{_describe_mtbf(source)}, checkpoint {format_duration(cost)}, "
        f"restart {format_duration(restart_cost)}, seed {seed}."
    )
    click.echo("")
    scale, unit = (3600.0, "h") if work >= 3600 else (60.0, "min")
    click.echo(
        f"  {'interval':>19}  {'mean makespan':>13}  {'failures':>8}  {'efficiency':>10}  "
        f"{'95% CI':>15}"
    )
    for i, t in enumerate(result.intervals):
        label = f"{t:>7.0f} s {'(' + format_duration(t) + ')':<10}"
        mark = ("  <- " + ", ".join(marks[i])) if marks[i] else ""
        if not math.isfinite(result.mean_makespan[i]):
            click.echo(f"  {label}  never finishes (interval far beyond the MTBF){mark}")
            continue
        ci = f"{result.efficiency_low[i]:.2%}..{result.efficiency_high[i]:.2%}"
        makespan = f"{result.mean_makespan[i] / scale:.2f} {unit}"
        click.echo(
            f"  {label}  {makespan:>13}  {result.mean_failures[i]:>8.2f}  "
            f"{result.efficiency[i]:>10.2%}  {ci:>15}{mark}"
        )
    click.echo("")
    t_best = result.intervals[best]
    click.echo(
        f"Best simulated interval: {format_duration(t_best)} ({t_best:.0f} s), efficiency "
        f"{result.efficiency[best]:.2%} (95% CI {result.efficiency_low[best]:.2%}.."
        f"{result.efficiency_high[best]:.2%})."
    )
    for name, t in (("Daly", t_daly), ("Young", t_young)):
        i = at(t)
        where = f"{name:<5} {format_duration(t)} ({t:.0f} s, {t / t_best:.2f}x the best)"
        if i is None:
            click.echo(f"{where}: outside the simulated range.")
            continue
        gap = (result.efficiency[best] - result.efficiency[i]) * 100
        overlap = result.efficiency_high[i] >= result.efficiency_low[best]
        verdict = "within the noise" if overlap else "a real difference"
        if i == best:
            click.echo(f"{where}: {result.efficiency[i]:.2%}, the best of those simulated.")
        else:
            click.echo(
                f"{where}: {result.efficiency[i]:.2%}, {gap:.2f} points below the best ({verdict})."
            )
    if plot:
        click.echo(f"Plot written to {plot}")


def _plot(result: Any, t_young: float, t_daly: float, path: str) -> None:
    """Draw simulated efficiency against the interval, with the model curve and both formulas."""
    try:
        import matplotlib
    except ImportError:
        raise click.ClickException(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from hpcckpt.policy.durations import format_duration
    from hpcckpt.policy.formulas import expected_makespan

    intervals = result.intervals
    if intervals.max() >= 2 * 3600:
        scale, unit = 3600.0, "hours"
    elif intervals.max() >= 120:
        scale, unit = 60.0, "minutes"
    else:
        scale, unit = 1.0, "seconds"
    ok = np.isfinite(result.mean_makespan)
    fine = np.geomspace(intervals.min(), intervals.max(), 400)
    model = np.array(
        [
            result.work
            / expected_makespan(result.work, t, result.cost, result.mtbf, result.restart_cost)
            for t in fine
        ]
    )

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    ax.plot(
        fine / scale,
        model * 100,
        color="0.55",
        lw=1.2,
        ls="--",
        label="exact model (expected value)",
    )
    ax.fill_between(
        intervals[ok] / scale,
        result.efficiency_low[ok] * 100,
        result.efficiency_high[ok] * 100,
        color="tab:blue",
        alpha=0.25,
        lw=0,
        label="95% CI",
    )
    ax.plot(
        intervals[ok] / scale,
        result.efficiency[ok] * 100,
        "o-",
        color="tab:blue",
        ms=3.5,
        lw=1.2,
        label=f"simulated ({result.runs} runs each)",
    )
    for t, name, color in ((t_young, "Young", "tab:orange"), (t_daly, "Daly", "tab:green")):
        ax.axvline(
            t / scale, color=color, lw=1.5, label=f"{name}: {format_duration(t)} ({t:.0f} s)"
        )
    best = result.best_index
    ax.plot(
        intervals[best] / scale,
        result.efficiency[best] * 100,
        "*",
        color="tab:red",
        ms=14,
        label=f"best simulated: {format_duration(intervals[best])}",
        zorder=5,
    )
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(f"checkpoint interval ({unit}, log scale)")
    ax.set_ylabel("efficiency (% of wall time computing)")
    ax.set_title(
        f"Work {format_duration(result.work)}, MTBF {format_duration(result.mtbf)}, "
        f"checkpoint {format_duration(result.cost)}, restart {format_duration(result.restart_cost)}"
    )
    finite = result.efficiency[ok]
    if finite.size:
        top = max(float(finite.max()), float(model.max())) * 100
        bottom = float(finite.min()) * 100
        ax.set_ylim(
            max(0.0, bottom - 0.05 * (top - bottom)), min(100.0, top + 0.15 * (top - bottom))
        )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower center", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise click.ClickException(f"cannot write the plot to {path}: {exc}") from None
    finally:
        plt.close(fig)


COMMANDS: list[click.Command] = [interval, simulate]
