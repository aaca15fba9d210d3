"""The ``hpcckpt`` command: a thin click layer over policy, store, coordination and job life."""

from __future__ import annotations

import click

from hpcckpt._version import __version__
from hpcckpt.cli import cluster, interval, mirror, report, run, store
from hpcckpt.job import early_signals

WRAPPER_COMMANDS = {"run", "srun"}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpcckpt")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Checkpoint/restart for long MPI jobs on Slurm.

    \b
    Inside a batch script, wrap the job step:
        exec hpcckpt srun -- --mpi=pmix python app.py
    The wrapper forwards Slurm's time-limit signal (#SBATCH --signal=B:USR1@120)
    to the application, which checkpoints through hpcckpt.Checkpointer; the
    wrapper then requeues the job, and the next run resumes from the newest
    good checkpoint.

    \b
    Inspect checkpoints:   hpcckpt ls DIR, hpcckpt verify DIR
    The mirror:            hpcckpt mirror ls|verify|pull MIRROR
    Choose an interval:    hpcckpt interval --mtbf 12h --cost 5m
    Try it locally:        hpcckpt cluster up
    """
    # Only the wrapper keeps the signals recorded since start-up; others get defaults back.
    if ctx.invoked_subcommand not in WRAPPER_COMMANDS:
        early_signals.release()


for _module in (run, cluster, interval, store, mirror, report):
    for _command in _module.COMMANDS:
        cli.add_command(_command)
