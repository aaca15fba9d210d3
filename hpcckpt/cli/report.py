"""``hpcckpt report DIR``: what happened to the job, from DIR/events.jsonl.

The analysis lives in :mod:`hpcckpt.report` (pure functions over the events) and
the timeline in :mod:`hpcckpt.report.plot` (matplotlib, imported only for
``--plot``). Imports happen inside the command so that ``hpcckpt`` starts fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

__all__ = ["COMMANDS", "report"]


@click.command(
    "report",
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="""\b
Examples:
  hpcckpt report ckpt                      # the summary
  hpcckpt report ckpt --plot timeline.png  # and the timeline, one row per attempt
  hpcckpt report ckpt --json | jq .efficiency
""",
)
@click.argument("directory", type=click.Path(exists=True, path_type=Path), metavar="DIR")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE",
    help="Draw the timeline into FILE (.png, .svg or .pdf; needs matplotlib).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def report(directory: Path, plot: Path | None, as_json: bool) -> None:
    """Summarise a job's life from DIR/events.jsonl.

    \b
    DIR is the checkpoint directory (or the events.jsonl file itself). Shows:
      attempts     each run of the job (wrapper start, or application start):
                   job id, restart count, duration, time waited before it,
                   the steps restored, reached (the last step given to due(),
                   or the stop checkpoint's; ? after a crash) and saved (the
                   last committed checkpoint), outcome
      checkpoints  how many, why (interval, steps, signal, deadline), the cost
                   of a save (the store's write and commit), the bytes written
                   per save (array data and state trees, all ranks)
      time         useful work, checkpoints (the time in save(): the store's
                   part and the rest around it), start-up/restore, work lost to
                   failures (after the last checkpoint of a crashed attempt),
                   waiting between attempts; the useful-work efficiency
      interval     the interval used against Young's and Daly's for the measured
                   cost and the observed MTBF (run time / failures)
    """
    from hpcckpt.report import analyze, format_report, load_events
    from hpcckpt.rundir.events import EVENTS_FILE

    try:
        events = load_events(directory)
    except FileNotFoundError:
        raise click.ClickException(
            f"no {EVENTS_FILE} in {directory}: is it a checkpoint directory of a run "
            "that used hpcckpt.Checkpointer or the hpcckpt wrapper?"
        ) from None
    except OSError as exc:
        raise click.ClickException(f"cannot read the events of {directory}: {exc}") from None
    from hpcckpt.store import committed_checkpoints

    folder = directory if directory.is_dir() else directory.parent
    result = analyze(events, present={e.step for e in committed_checkpoints(folder)})
    result["directory"] = str(directory)
    if plot is not None:
        try:
            from hpcckpt.report.plot import plot_report
        except ImportError:
            raise click.ClickException(
                "--plot needs matplotlib, which is not installed: pip install matplotlib"
            ) from None
        try:
            plot_report(result, plot, title=str(directory))
        except ImportError:
            raise click.ClickException(
                "--plot needs matplotlib, which is not installed: pip install matplotlib"
            ) from None
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"cannot write the plot to {plot}: {exc}") from None
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(format_report(result))
    if plot is not None:
        click.echo(f"\nPlot written to {plot}")


COMMANDS: list[click.Command] = [report]
