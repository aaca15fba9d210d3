"""``hpcckpt run`` and ``hpcckpt srun``: the job wrapper's command line (see docs/wrapper.md).

Both keep the signals recorded by ``hpcckpt.job.early_signals`` (main.py does not release
them for these two commands): the wrapper adopts them when it installs its own handlers.
``hpcckpt submit`` (hpcckpt/cli/submit.py) is registered here too.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from typing import Any

import click

from hpcckpt.job import budget, config, wrapper
from hpcckpt.policy import parse_duration
from hpcckpt.rundir import verbosity
from hpcckpt.rundir.env import DIR_ENV, MIRROR_ENV, MIRROR_WAIT_ENV
from hpcckpt.slurm import srun_options
from hpcckpt.slurm.env import SlurmEnv
from hpcckpt.slurm.runner import REQUEUE_TIMEOUT

_CONTEXT = {
    # Stop at the first argument that is not ours: `hpcckpt run mpirun -n 4 app` works
    # without `--`; `--` is still needed when the command starts with a dash (srun args).
    "allow_interspersed_args": False,
    "help_option_names": ["-h", "--help"],
}


class _WrapperCommand(click.Command):
    """``hpcckpt run``/``srun``: an option of the launcher given before ``--`` (click would
    say only "No such option") is explained, with the command line to type instead."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)  # click consumes the list
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            if exc.possibilities and not _launchers_option(self.name, exc.option_name):
                raise  # a misspelt option of ours: click's "Did you mean" says it best
            raise click.UsageError(_dashes_hint(self.name, exc.option_name, given), ctx) from None


def _launchers_option(command: str | None, option: str) -> bool:
    """Is ``option`` (as given: ``-n``, ``--ntasks``) one of srun's, for ``hpcckpt srun``?"""
    if command != "srun":
        return False
    name = option.lstrip("-")
    if len(name) == 1:
        return name in srun_options.SHORT
    return srun_options.long_name(name) is not None


def _dashes_hint(command: str | None, option: str, args: list[str]) -> str:
    """The error for ``option`` given before ``--``, and the same command line with ``--``."""
    at = next((i for i, word in enumerate(args) if word == option or word.startswith(option)), 0)
    ours, rest = args[:at], args[at:]
    if command == "srun":
        where = "srun's options go after `--` (hpcckpt's before it)"
    else:
        where = "the command goes after `--`, its launcher first (hpcckpt's options before it)"
        if rest and rest[0].startswith("-"):
            rest = ["mpirun", *rest]
    typed = shlex.join(["hpcckpt", str(command), *ours, "--", *rest])
    return f"{option} is not an option of hpcckpt {command}: {where}:\n    {typed}"


def _signal_option(_ctx: click.Context, _param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return config.parse_signal(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _duration_option(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _every_option(_ctx: click.Context, _param: click.Parameter, value: str | None) -> Any:
    if value is None or value.strip().lower() == "auto":
        return value
    _duration_option(_ctx, _param, value)
    return value


def _options(func: Callable[..., Any]) -> Callable[..., Any]:
    # Applied bottom-up: the help lists them in the reverse order of this list.
    options = [
        # how much the job log says (hpcckpt/rundir/verbosity.py)
        click.option(
            "--verbose",
            "verbosity",
            flag_value=verbosity.VERBOSE,
            help="Say more: the step's hpcckpt environment, and every rank's log lines "
            "(exported to the step as HPCCKPT_LOG_LEVEL=verbose).",
        ),
        click.option(
            "--quiet",
            "verbosity",
            flag_value=verbosity.QUIET,
            help="Say only warnings and the decisions that need you (crash, give-up, a "
            "failed requeue); also for the application's ranks (HPCCKPT_LOG_LEVEL=quiet).",
        ),
        # node failures (hpcckpt/job/relaunch.py, docs/wrapper.md "Node failures")
        click.option(
            "--spare-nodes",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            metavar="K",
            help="`hpcckpt srun` in a job of N nodes submitted with --no-kill: run the step "
            "on N-K nodes and, when one of them fails, relaunch it on the healthy nodes "
            "from the last good checkpoint without leaving the allocation; requeue when "
            "no spare is left.",
        ),
        # hang detection (hpcckpt/job/hang.py, docs/hang-and-poison.md)
        click.option(
            "--progress-file",
            "progress_files",
            multiple=True,
            metavar="GLOB",
            help="With --hang-timeout, for applications without the Python API: a change "
            "of any matching file (size or modification time; e.g. the application's log) "
            "counts as the step's heartbeat (repeatable).",
        ),
        click.option(
            "--hang-save-timeout",
            callback=_duration_option,
            metavar="DURATION",
            help="The allowance of a rank inside a checkpoint save or restore, and of a "
            "rank starting up before its first heartbeat (default: 4x --hang-timeout, or "
            "3x the slowest measured checkpoint plus --hang-timeout).",
        ),
        click.option(
            "--hang-timeout",
            callback=_duration_option,
            metavar="DURATION",
            help="Treat a step as crashed when a rank's heartbeat (written from due() at "
            "most every 5 s) is older than DURATION: kill it and continue from the last "
            "good checkpoint within --max-restarts. Must exceed the longest step.",
        ),
        click.option(
            "--mtbf",
            metavar="DURATION",
            help="With --ckpt-every auto: the job's mean time between failures (default: "
            "a per-node default divided by the node count).",
        ),
        click.option(
            "--ckpt-every",
            metavar="auto|DURATION",
            callback=_every_option,
            help="Send --app-signal periodically: every DURATION, or `auto` = the Young "
            "interval from the measured cost of the application's checkpoints. Exported "
            "as HPCCKPT_INTERVAL (whole seconds).",
        ),
        click.option(
            "--restart-timeout",
            type=click.FloatRange(min=1),
            default=600.0,
            show_default=True,
            metavar="SECONDS",
            help="Give up watching restart files this long after the signal.",
        ),
        click.option(
            "--keep-sets",
            type=click.IntRange(min=1),
            default=2,
            show_default=True,
            metavar="N",
            help="Restart sets kept in DIR/restart-sets/.",
        ),
        click.option(
            "--settle",
            type=click.FloatRange(min=0),
            default=2.0,
            show_default=True,
            metavar="SECONDS",
            help="Restart files are complete when all were written after the signal and "
            "none changed for this long.",
        ),
        click.option(
            "--restart-marker",
            metavar="FILE",
            help="Restart files are complete once the application wrote FILE after the "
            "signal (instead of --settle).",
        ),
        click.option(
            "--restart-files",
            multiple=True,
            metavar="GLOB",
            help="The application's restart files (repeatable): watched after each signal, "
            "checksummed and kept aside in DIR/restart-sets/; a damaged set is replaced by "
            "the previous good one at the next start. Without --app-signal the application "
            "takes no signal and writes them on its own schedule: every complete set is kept, "
            "and a stop ends the step once no write is under way.",
        ),
        click.option(
            "--app-ready",
            callback=_duration_option,
            default="5",
            show_default=True,
            metavar="DURATION",
            help="With --app-signal: hold signals until the step has run this long (the "
            "application must have installed its handler by then).",
        ),
        click.option(
            "--app-signal",
            callback=_signal_option,
            metavar="SIG",
            help="The application does not use the Python API: it writes its own restart "
            "files when it receives SIG. Stop requests are forwarded as SIG and the "
            "wrapper decides the outcome itself (docs/wrapper.md).",
        ),
        click.option(
            "--min-progress",
            callback=_duration_option,
            default=str(int(budget.DEFAULT_MIN_PROGRESS)),
            show_default=True,
            metavar="DURATION",
            help="A crashed attempt without a checkpoint of its own is restarted only if it "
            "ran at least this long.",
        ),
        click.option(
            "--max-restarts",
            type=click.IntRange(min=0),
            default=budget.DEFAULT_MAX_RESTARTS,
            show_default=True,
            metavar="N",
            help="Restarts after crashes allowed per computation (time-limit and "
            "preemption stops do not count).",
        ),
        click.option(
            "--chain",
            is_flag=True,
            help="Continue by submitting the same batch script again with "
            "sbatch --dependency=afterany:<this job> instead of scontrol requeue.",
        ),
        click.option(
            "--requeue-timeout",
            type=click.FloatRange(min=0.1),
            default=REQUEUE_TIMEOUT,
            show_default=True,
            metavar="SECONDS",
            help="How long to wait for `scontrol requeue` (or sbatch with --chain).",
        ),
        click.option(
            "--requeue/--no-requeue",
            default=None,
            help="After a checkpoint on a stop signal (or a crash within the budget), "
            "requeue the job with `scontrol requeue` (default: yes inside a Slurm job).",
        ),
        click.option(
            "--signal",
            "stop_signal",
            default="USR1",
            show_default=True,
            callback=_signal_option,
            metavar="SIG",
            help="The signal Slurm sends the batch shell (#SBATCH --signal=B:SIG@SECONDS); "
            "also the signal forwarded to the step. USR1, SIGUSR1 or 10. Use USR2 for "
            "GPU jobs (NCCL uses USR1).",
        ),
        click.option(
            "--mirror",
            envvar=MIRROR_ENV,
            show_envvar=True,
            metavar="URL",
            help="A second tier for the checkpoints: a directory on another file system or "
            "s3://bucket/prefix; exported to the step as HPCCKPT_MIRROR (the Checkpointer "
            "copies checkpoints there in the background and restores from it).",
        ),
        click.option(
            "--mirror-wait",
            envvar=MIRROR_WAIT_ENV,
            type=click.FloatRange(min=0),
            metavar="SECONDS",
            help="How long the application's finish() and last stop wait for the newest "
            "checkpoint to reach the mirror (default 300); exported as HPCCKPT_MIRROR_WAIT.",
        ),
        click.option(
            "--ckpt-dir",
            envvar=DIR_ENV,
            show_envvar=True,
            metavar="DIR",
            help="The checkpoint directory (created 0700 if missing); exported to the step "
            "as HPCCKPT_DIR.",
        ),
    ]
    for option in options:
        func = option(func)
    return func


def _launch(command: list[str], opts: dict[str, Any]) -> None:
    try:
        directory = config.resolve_ckpt_dir(opts["ckpt_dir"], os.environ)
    except config.WrapperError as exc:
        raise click.UsageError(str(exc)) from None
    if opts["chain"] and opts["requeue"]:
        raise click.UsageError("--chain and --requeue exclude each other")
    app_options = ("restart_marker", "ckpt_every")
    if opts["app_signal"] is None and any(opts[k] for k in app_options):
        raise click.UsageError(
            "--restart-marker and --ckpt-every need a signal the application checkpoints on: "
            "add --app-signal SIG (--restart-files alone: the application writes its restart "
            "files on its own schedule)"
        )
    cfg = config.WrapperConfig(
        command=command,
        ckpt_dir=directory,
        stop_signal=opts["stop_signal"],
        requeue=opts["requeue"],
        requeue_timeout=opts["requeue_timeout"],
        chain=opts["chain"],
        max_restarts=opts["max_restarts"],
        min_progress=opts["min_progress"],
        app_signal=opts["app_signal"],
        app_ready=opts["app_ready"],
        restart_files=list(opts["restart_files"]),
        restart_marker=opts["restart_marker"],
        settle=opts["settle"],
        keep_sets=opts["keep_sets"],
        restart_timeout=opts["restart_timeout"],
        ckpt_every=opts["ckpt_every"],
        mtbf=opts["mtbf"],
        spare_nodes=opts["spare_nodes"],
        hang_timeout=opts["hang_timeout"],
        hang_save_timeout=opts["hang_save_timeout"],
        progress_files=list(opts["progress_files"]),
        verbosity=opts["verbosity"] if opts["verbosity"] is not None else verbosity.NORMAL,
        environ=_mirror_environ(opts["mirror"], opts["mirror_wait"]),
    )
    sys.exit(wrapper.run_wrapper(cfg))


def _mirror_environ(mirror: str | None, wait: float | None) -> dict[str, str] | None:
    """The wrapper's environment with the mirror for the step (None: unchanged)."""
    if mirror is None and wait is None:
        return None
    env = dict(os.environ)
    if mirror is not None:
        if not mirror.strip():
            raise click.UsageError("--mirror is empty: give a directory or s3://bucket/prefix")
        env[MIRROR_ENV] = mirror
    if wait is not None:
        env[MIRROR_WAIT_ENV] = repr(float(wait))
    return env


@click.command("run", cls=_WrapperCommand, context_settings=_CONTEXT)
@_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(command: tuple[str, ...], **opts: Any) -> None:
    """Run COMMAND (any launcher) under the checkpoint wrapper.

    \b
        hpcckpt run --ckpt-dir ckpt -- mpirun -n 4 python app.py

    Stop signals (--signal, TERM, INT) reaching the wrapper are held until the
    application is ready, then forwarded to COMMAND as --signal (or --app-signal).
    When COMMAND ends: finished -> exit 0; stopped after a checkpoint -> continue
    the job (scontrol requeue, or --chain) and exit 0; crashed -> continue from the
    last checkpoint while --max-restarts allows and the attempt made progress,
    otherwise give up with the step's exit status (128+N if killed by signal N).
    In a batch script use `exec hpcckpt ...` so Slurm's B: signal reaches the wrapper.
    """
    _launch(list(command), opts)


@click.command("srun", cls=_WrapperCommand, context_settings=_CONTEXT)
@_options
@click.argument("srun_args", nargs=-1, required=True, type=click.UNPROCESSED)
def srun(srun_args: tuple[str, ...], **opts: Any) -> None:
    """Run `srun SRUN_ARGS...` under the checkpoint wrapper (inside a batch script).

    \b
        #SBATCH --signal=B:USR1@120 --requeue --open-mode=append
        exec hpcckpt srun --ckpt-dir "$HPCCKPT_DIR" -- --mpi=pmix python app.py

    The arguments go to srun (here Open MPI needs --mpi=pmix), after
    --kill-on-bad-exit=1 unless you give -K yourself: a task that exits non-zero or
    is killed ends the whole step at once instead of leaving its peers waiting in
    MPI until the time limit (with --app-signal or --restart-files srun's own
    default stays). srun forwards the wrapper's USR1 to every task. See `hpcckpt run
    --help` for the outcomes and exit statuses.
    """
    if not SlurmEnv.from_environ(os.environ).in_job:
        raise _Refused(_outside_slurm(srun_args, opts["ckpt_dir"]))
    app_mode = opts["app_signal"] is not None or bool(opts["restart_files"])
    _launch(config.srun_command(srun_args, kill_on_bad_exit=not app_mode), opts)


class _Refused(click.ClickException):
    """A command that cannot work here: said before anything starts (exit status 2)."""

    exit_code = config.EXIT_USAGE


def _outside_slurm(srun_args: tuple[str, ...], ckpt_dir: str | None) -> str:
    """``hpcckpt srun`` without an allocation: what to do, and the same run under mpirun."""
    found, at = srun_options.parse(srun_args)
    ntasks = [o.value for o in found if o.name == "ntasks" and o.value]
    mpirun = ["mpirun", *(["-n", ntasks[-1]] if ntasks else []), *srun_args[at:]]
    typed = shlex.join(["hpcckpt", "run", "--ckpt-dir", ckpt_dir or "DIR", "--", *mpirun])
    return (
        "not inside a Slurm allocation (no SLURM_JOB_ID): hpcckpt srun starts srun in a job. "
        "Submit the batch script with sbatch (or run it inside salloc); without Slurm, use "
        f"mpirun:\n    {typed}"
    )


def _commands() -> list[click.Command]:
    from hpcckpt.cli import submit

    return [run, srun, *submit.COMMANDS]


COMMANDS: list[click.Command] = _commands()
