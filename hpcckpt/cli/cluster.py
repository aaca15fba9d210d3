"""``hpcckpt cluster``: a real local Slurm cluster for trying hpcckpt and testing failures."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click

from hpcckpt.cluster import (
    DEFAULT_CPUS,
    DEFAULT_KILL_WAIT,
    DIR_ENV,
    PORT_ENV,
    ClusterError,
    LocalCluster,
)


def _state_dir_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--state-dir",
        type=click.Path(file_okay=False),
        envvar=DIR_ENV,
        default=None,
        help=f"Where slurm.conf, logs and pid files live "
        f"[env {DIR_ENV}; default $XDG_STATE_HOME/hpcckpt/cluster].",
    )(func)


def _note(message: str) -> None:
    click.echo(message, err=True)


@click.group()
def cluster() -> None:
    """A local Slurm cluster on this machine (for trying hpcckpt and fault tests).

    \b
    One slurmctld and N slurmd "nodes" (n1..nN), all on localhost, with their own
    ports and a private state directory. Not a production Slurm.
    \b
        eval "$(hpcckpt cluster up --nodes 2)"   # prints: export SLURM_CONF=...
        sbatch job.sh; squeue
        hpcckpt cluster fail-node n2            # power loss of n2
        hpcckpt cluster restore-node n2
        hpcckpt cluster down
    """


@cluster.command()
@click.option(
    "--nodes",
    "-N",
    type=click.IntRange(min=1),
    default=None,
    help="Number of nodes n1..nN [default: as configured before, else 1].",
)
@click.option(
    "--cpus-per-node",
    type=click.IntRange(min=1),
    default=None,
    help=f"CPUs each node claims, trusted even if the machine has fewer cores "
    f"[default: as before, else {DEFAULT_CPUS}].",
)
@click.option(
    "--port",
    type=click.IntRange(1024, 65000),
    envvar=PORT_ENV,
    default=None,
    help=f"slurmctld port; node i listens on PORT+i "
    f"[env {PORT_ENV}; default: as before, else 16817].",
)
@click.option(
    "--kill-wait",
    type=click.IntRange(min=0),
    default=None,
    help=f"KillWait: seconds between SIGTERM and SIGKILL at a time limit or cancel "
    f"[default: as before, else {DEFAULT_KILL_WAIT}].",
)
@click.option(
    "--preempt",
    type=click.Choice(["off", "requeue", "requeue-signal"]),
    default=None,
    help="A preemptible setup: a second partition `high` whose jobs preempt those of the "
    "default one, which Slurm requeues after --grace-time (requeue-signal: also "
    "SlurmctldParameters=preempt_send_user_signal) [default: as before, else off].",
)
@click.option(
    "--grace-time",
    type=click.IntRange(min=0),
    default=None,
    help="GraceTime of the preemptible partition: seconds between the preemption's SIGTERM "
    "and the requeue [default: as before, else 30].",
)
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds to wait.")
@_state_dir_option
def up(
    nodes: int | None,
    cpus_per_node: int | None,
    port: int | None,
    kill_wait: int | None,
    preempt: str | None,
    grace_time: int | None,
    timeout: float,
    state_dir: str | None,
) -> None:
    """Start the cluster (idempotent) and print the SLURM_CONF line to export.

    A running cluster with the same configuration is kept; with another one (e.g. a
    different --nodes) it is stopped and started again.
    """
    c = LocalCluster(state_dir)
    before = c.config() if c.is_running() else None
    start = time.monotonic()
    try:
        started = c.up(
            nodes=nodes,
            cpus_per_node=cpus_per_node,
            port=port,
            kill_wait=kill_wait,
            timeout=timeout,
            preempt=preempt,
            grace_time=grace_time,
        )
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from exc
    cfg = c.config()
    names = ", ".join(c.nodes())
    if before is not None and before != cfg:
        _note(f"reconfigured the running cluster ({before.nodes} -> {cfg.nodes} node(s))")
    if started:
        _note(
            f"cluster up in {time.monotonic() - start:.1f} s: nodes {names} "
            f"(slurmctld port {cfg.port}); state and logs in {c.state_dir}"
        )
    else:
        _note(f"cluster already running: nodes {names}; state and logs in {c.state_dir}")
    click.echo(c.export_line())


@cluster.command()
@_state_dir_option
def down(state_dir: str | None) -> None:
    """Stop every daemon of the cluster and the processes of its jobs (idempotent)."""
    c = LocalCluster(state_dir)
    try:
        pids = c.down()
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from exc
    if pids:
        _note(f"cluster in {c.state_dir} stopped ({len(pids)} process(es))")
    else:
        _note(f"nothing was running in {c.state_dir}")


@cluster.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_state_dir_option
def status(as_json: bool, state_dir: str | None) -> None:
    """Daemons (with pids), node states from sinfo, and the SLURM_CONF line."""
    c = LocalCluster(state_dir)
    info = c.status()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    if not info["configured"]:
        click.echo(f"no cluster in {info['state_dir']} (start one with: hpcckpt cluster up)")
        return
    click.echo(f"state dir: {info['state_dir']}   logs: {info['logs']}")
    click.echo(f"munge:     {'ok' if info['munge'] else 'NOT answering'}")
    for d in info["daemons"]:
        state = f"up (pid {d['pid']})" if d["running"] else "down"
        click.echo(f"{d['name']:<14} {state}")
    if info["daemons"][0]["running"]:
        click.echo("nodes:     " + "  ".join(f"{n['name']}={n['state']}" for n in info["nodes"]))
    click.echo(info["export"])


@cluster.command("fail-node")
@click.argument("name")
@click.option("--no-wait", is_flag=True, help="Do not wait until Slurm sees the node down.")
@click.option("--timeout", type=float, default=90.0, show_default=True)
@click.option(
    "--wipe",
    "wipe",
    multiple=True,
    metavar="DIR",
    help="Also delete DIR, the node's local storage (%n = the node's name), as if the "
    "node were replaced by an empty one; e.g. --wipe /dev/shm/myjob/%n (repeatable).",
)
@_state_dir_option
def fail_node(
    name: str, no_wait: bool, timeout: float, wipe: tuple[str, ...], state_dir: str | None
) -> None:
    """Power loss of node NAME: SIGKILL its slurmd, slurmstepds and job processes.

    Slurm notices after SlurmdTimeout (10 s) plus its ping interval: about 20-30 s.
    With --wipe, the node's node-local directory goes too (a replaced node's disk is empty).
    """
    c = LocalCluster(state_dir)
    try:
        waited = c.fail_node(name, wait=not no_wait, timeout=timeout, wipe=wipe)
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from exc
    if no_wait:
        _note(f"{name} killed; Slurm will mark it down within about 30 s")
    else:
        _note(f"{name} killed; Slurm marked it down after {waited:.0f} s")


@cluster.command("restore-node")
@click.argument("name")
@click.option("--timeout", type=float, default=60.0, show_default=True)
@_state_dir_option
def restore_node(name: str, timeout: float, state_dir: str | None) -> None:
    """Start node NAME's slurmd again and wait until the node is back in service."""
    c = LocalCluster(state_dir)
    try:
        waited = c.restore_node(name, timeout=timeout)
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from exc
    _note(f"{name} is back ({waited:.1f} s)")


COMMANDS: list[click.Command] = [cluster]
