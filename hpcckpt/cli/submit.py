"""``hpcckpt submit``: fill a batch-script template and submit it (docs/templates.md)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

import click

from hpcckpt import slurm
from hpcckpt.rundir.env import DIR_ENV
from hpcckpt.slurm import chain, templates

#: Options that become ``#SBATCH --NAME=VALUE`` lines (click name -> sbatch name).
_SBATCH_OPTIONS = {
    "job_name": "job-name",
    "time": "time",
    "nodes": "nodes",
    "ntasks": "ntasks",
    "ntasks_per_node": "ntasks-per-node",
    "cpus_per_task": "cpus-per-task",
    "partition": "partition",
    "account": "account",
    "output": "output",
}


@click.command(
    "submit",
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.argument("template")
@click.option("--time", metavar="TIME", help="Wall time of one run, e.g. 02:00:00.")
@click.option("--nodes", metavar="N")
@click.option("--ntasks", metavar="N", help="MPI ranks.")
@click.option("--ntasks-per-node", metavar="N")
@click.option("--cpus-per-task", metavar="N")
@click.option("--partition", metavar="NAME")
@click.option("--account", metavar="NAME")
@click.option("--job-name", metavar="NAME")
@click.option("--output", metavar="FILE", help="The job log (%x = name, %j = job id).")
@click.option(
    "--ckpt-dir", metavar="DIR", help="The checkpoint directory (made absolute) = HPCCKPT_DIR."
)
@click.option(
    "--venv",
    metavar="DIR",
    help="The venv with hpcckpt for the job to activate (the template's VENV= line; made "
    "absolute): needed when the job does not get your shell's environment "
    "(sbatch --export=NONE).",
)
@click.option(
    "--signal",
    "signal_spec",
    metavar="SIG@SECONDS",
    help="The warning signal and its lead time, e.g. USR1@120 (USR2 for GPU jobs).",
)
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="NAME=VALUE",
    help="Replace the template's line NAME=... with NAME=VALUE (VALUE inserted verbatim).",
)
@click.option(
    "--sbatch-arg",
    "sbatch_args",
    multiple=True,
    metavar="ARG",
    help="An extra sbatch command-line argument (repeatable); recorded in "
    "HPCCKPT_SBATCH_ARGS so that --chain carries it to the next job.",
)
@click.option(
    "--script",
    "script_path",
    metavar="PATH",
    help="Where to write the rendered script [default: ./hpcckpt-TEMPLATE.sbatch].",
)
@click.option(
    "--dry-run", is_flag=True, help="Print the script (and the sbatch command); submit nothing."
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=slurm.SUBMIT_TIMEOUT,
    show_default=True,
    metavar="SECONDS",
    help="How long sbatch may take.",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def submit(
    template: str,
    command: tuple[str, ...],
    signal_spec: str | None,
    ckpt_dir: str | None,
    venv: str | None,
    settings: tuple[str, ...],
    sbatch_args: tuple[str, ...],
    script_path: str | None,
    dry_run: bool,
    timeout: float,
    **resources: Any,
) -> None:
    """Render TEMPLATE (requeue, chain, mpirun, python-api, restart-files, torchrun,
    srun-torch, or a path) with the options given and submit it with sbatch.

    \b
        hpcckpt submit requeue --time 02:00:00 --ntasks 4 --ckpt-dir ckpt \\
            -- python app.py --steps 10000
        hpcckpt submit chain --signal USR2@180 --dry-run -- python train.py

    COMMAND replaces the template's APP=(...) line: srun or mpirun start it as the
    template says. Everything else keeps the template's defaults and comments.
    """
    try:
        path = templates.find(template)
        sbatch = {_SBATCH_OPTIONS[k]: str(v) for k, v in resources.items() if v is not None}
        values: dict[str, str] = {}
        if signal_spec:
            sbatch["signal"], name = templates.signal_spec(signal_spec)
            values["STOP_SIGNAL"] = name
        if ckpt_dir:
            values[DIR_ENV] = shlex.quote(os.path.abspath(os.path.expanduser(ckpt_dir)))
        if venv:
            values["VENV"] = shlex.quote(os.path.abspath(os.path.expanduser(venv)))
        if command:
            values["APP"] = templates.bash_array(command)
        for item in settings:
            name, sep, value = item.partition("=")
            if not sep or not name:
                raise templates.TemplateError(f"--set {item!r}: write NAME=VALUE")
            values[name] = value
        text = templates.render(path.read_text(), sbatch=sbatch, settings=values)
    except (templates.TemplateError, OSError) as exc:
        raise click.UsageError(str(exc)) from None

    name = path.name.removesuffix(templates.SUFFIX)
    out = Path(script_path or f"hpcckpt-{name}{templates.SUFFIX}").absolute()
    argv = ["sbatch", "--parsable", *sbatch_args, str(out)]
    if dry_run:
        click.echo(text, nl=False)
        click.echo(f"# would write {out} and run: {shlex.join(argv)}", err=True)
        return
    try:
        out.write_text(text)
        out.chmod(0o755)
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc}") from None
    env = dict(os.environ)
    env[chain.SBATCH_ARGS_ENV] = shlex.join(sbatch_args)
    try:
        job = slurm.submit([*sbatch_args, str(out)], timeout=timeout, env=env)
    except slurm.SlurmError as exc:
        click.echo(f"hpcckpt: submit failed: {exc}", err=True)
        sys.exit(1)
    click.echo(f"hpcckpt: submitted job {job} ({out})", err=True)
    click.echo(job)


COMMANDS: list[click.Command] = [submit]
