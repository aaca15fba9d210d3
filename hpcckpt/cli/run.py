"""``hpcckpt run`` and ``hpcckpt srun``: the job wrapper's command line (see docs/wrapper.md).

Both keep the signals recorded by ``hpcckpt.job.early_signals`` (main.py does not release
them for these two commands): the wrapper adopts them when it installs its own handlers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import click

from hpcckpt.job import wrapper
from hpcckpt.job.status import DIR_ENV

_CONTEXT = {
    # Stop at the first argument that is not ours: `hpcckpt run mpirun -n 4 app` works
    # without `--`; `--` is still needed when the command starts with a dash (srun args).
    "allow_interspersed_args": False,
    "help_option_names": ["-h", "--help"],
}


def _signal_option(_ctx: click.Context, _param: click.Parameter, value: str) -> Any:
    try:
        return wrapper.parse_signal(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option(
        "--requeue-timeout",
        type=click.FloatRange(min=0.1),
        default=wrapper.slurm.REQUEUE_TIMEOUT,
        show_default=True,
        metavar="SECONDS",
        help="How long to wait for `scontrol requeue`.",
    )(func)
    func = click.option(
        "--requeue/--no-requeue",
        default=None,
        help="After a checkpoint on a stop signal, requeue the job with `scontrol requeue` "
        "(default: yes inside a Slurm job, i.e. when SLURM_JOB_ID is set).",
    )(func)
    func = click.option(
        "--signal",
        "stop_signal",
        default="USR1",
        show_default=True,
        callback=_signal_option,
        metavar="SIG",
        help="The signal Slurm sends the batch shell (#SBATCH --signal=B:SIG@SECONDS); "
        "also the signal forwarded to the step. USR1, SIGUSR1 or 10.",
    )(func)
    func = click.option(
        "--ckpt-dir",
        envvar=DIR_ENV,
        show_envvar=True,
        metavar="DIR",
        help="The checkpoint directory (created 0700 if missing); exported to the step "
        "as HPCCKPT_DIR.",
    )(func)
    return func


def _launch(
    command: list[str],
    ckpt_dir: str | None,
    stop_signal: Any,
    requeue: bool | None,
    requeue_timeout: float,
) -> None:
    try:
        directory = wrapper.resolve_ckpt_dir(ckpt_dir, os.environ)
    except wrapper.WrapperError as exc:
        raise click.UsageError(str(exc)) from None
    config = wrapper.WrapperConfig(
        command=command,
        ckpt_dir=directory,
        stop_signal=stop_signal,
        requeue=requeue,
        requeue_timeout=requeue_timeout,
    )
    sys.exit(wrapper.run_wrapper(config))


@click.command("run", context_settings=_CONTEXT)
@_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    command: tuple[str, ...],
    ckpt_dir: str | None,
    stop_signal: Any,
    requeue: bool | None,
    requeue_timeout: float,
) -> None:
    """Run COMMAND (any launcher) under the checkpoint wrapper.

    \b
        hpcckpt run --ckpt-dir ckpt -- mpirun -n 4 python app.py

    Stop signals (--signal, TERM, INT) reaching the wrapper are held until the
    application reports `running`, then forwarded to COMMAND as --signal. When
    COMMAND ends: finished -> exit 0; stopped after a checkpoint -> requeue inside
    Slurm (exit 0); anything else -> the step's exit status (128+N if killed by
    signal N). In a batch script use `exec hpcckpt ...` so Slurm's B: signal
    reaches the wrapper.
    """
    _launch(list(command), ckpt_dir, stop_signal, requeue, requeue_timeout)


@click.command("srun", context_settings=_CONTEXT)
@_options
@click.argument("srun_args", nargs=-1, required=True, type=click.UNPROCESSED)
def srun(
    srun_args: tuple[str, ...],
    ckpt_dir: str | None,
    stop_signal: Any,
    requeue: bool | None,
    requeue_timeout: float,
) -> None:
    """Run `srun SRUN_ARGS...` under the checkpoint wrapper (inside a batch script).

    \b
        #SBATCH --signal=B:USR1@120 --requeue --open-mode=append
        exec hpcckpt srun --ckpt-dir "$HPCCKPT_DIR" -- --mpi=pmix python app.py

    The arguments go to srun unchanged (here Open MPI needs --mpi=pmix). srun
    forwards the wrapper's USR1 to every task. See `hpcckpt run --help` for the
    outcomes and exit statuses.
    """
    _launch(wrapper.srun_command(srun_args), ckpt_dir, stop_signal, requeue, requeue_timeout)


COMMANDS: list[click.Command] = [run, srun]
