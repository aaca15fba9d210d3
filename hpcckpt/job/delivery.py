"""Deliver the application's signal to its ranks once, by a path that does not kill them.

Which path depends on the launcher and the signal (Slurm 22.05, Open MPI 4.1.4,
measured on the local cluster; docs/wrapper.md "How the signal reaches the ranks"):

- **srun**, USR1/USR2: ``kill`` to srun, which forwards them to every task.
- **srun**, any other signal (TERM, INT, ...): srun answers TERM by SIGKILLing its tasks
  and swallows a single INT, and ``scancel --signal=SIG JOB.STEP`` delivers every task
  the signal twice. ``scancel --signal=SIG JOB`` (job level, no ``--batch``/``--full``)
  delivers it once to every task of the job's steps and not to the batch step, i.e.
  not to the wrapper nor to srun. ``JOB`` is ``<array job id>_<task id>`` for an array
  task (:func:`hpcckpt.slurm.jobid.target`). If scancel fails or hangs (a busy slurmctld),
  the tasks of the job on this node get the signal directly (``SLURM_PROCID`` in their
  environment), never srun.
- **mpirun**, USR1/USR2: ``kill`` to mpirun, which forwards them to every rank.
- **mpirun**, any other signal: mpirun answers TERM/INT with SIGCONT, TERM one second
  later and SIGKILL one second after that (``odls_base_sigkill_timeout``), so the rank
  processes are signalled directly: the processes carrying ``OMPI_COMM_WORLD_RANK``
  whose parent does not (a rank started through ``sh -c`` is signalled at the shell, as
  mpirun itself would). On one node the wrapper finds them in ``/proc``. On several,
  ranks on other nodes are invisible here, so one signaller runs on every node
  (``srun --overlap``, :mod:`hpcckpt.job.rank_signal`) and signals the ranks of its own
  node; if that step cannot run, the ranks on this node are signalled (an application
  that agrees on the stop collectively, as ``examples/c/stopapp.c`` does, still stops
  as a whole), and the log says so.
- **torchrun** (``torchrun ...``, ``python -m torch.distributed.run ...``, alone or as
  the program of ``srun``), every signal: the workers themselves, never the agent, which
  USR1 kills (its workers are not told) and which answers TERM/INT by sending its
  workers TERM and SIGKILL 30 s later (torch 2.13, measured here; srun would forward
  USR1 to the agents, its tasks). The workers are the processes carrying
  ``TORCHELASTIC_RUN_ID`` (the agent does not): on several nodes found by the per-node
  signaller, on one node in this node's ``/proc``, outside Slurm below the launcher. A
  worker with no handler for the signal yet (torchrun restarting its workers) is skipped,
  as the signal would kill it. No worker found: nothing is sent (:class:`SlurmError`)
  rather than killing the agent.
- **anything else**: ``kill`` to the step's process.
"""

from __future__ import annotations

import enum
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hpcckpt import procfs
from hpcckpt.job import rank_signal
from hpcckpt.slurm import commands, srun_options
from hpcckpt.slurm import env as slurm_env
from hpcckpt.slurm.runner import REQUEUE_TIMEOUT, SlurmError

#: Signals srun and mpirun forward to every task unharmed.
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2)
RANK_ENV = rank_signal.RANK_ENV
_MPIRUN_NAMES = {"mpirun", "mpiexec", "orterun", "prterun"}
#: ``python -m`` modules that are torchrun.
TORCHRUN_MODULES = {"torch.distributed.run", "torch.distributed.launch"}


class Launcher(enum.Enum):
    SRUN = "srun"
    MPIRUN = "mpirun"
    TORCHRUN = "torchrun"
    OTHER = "other"


def launcher_kind(command: Sequence[str]) -> Launcher:
    """What starts the ranks: the basename of the step's first word; torchrun also as
    the program srun starts (after srun's own options)."""
    name = os.path.basename(command[0]) if command else ""
    if name == "srun":
        start = srun_options.parse(command[1:])[1] + 1
        return Launcher.TORCHRUN if is_torchrun(command[start:]) else Launcher.SRUN
    if name in _MPIRUN_NAMES:
        return Launcher.MPIRUN
    return Launcher.TORCHRUN if is_torchrun(command) else Launcher.OTHER


def is_torchrun(program: Sequence[str]) -> bool:
    """Is ``program`` torchrun: ``torchrun ...`` or ``python [opts] -m torch.distributed.run``?"""
    if not program:
        return False
    name = os.path.basename(program[0])
    if name == "torchrun":
        return True
    if not name.startswith("python"):
        return False
    for i, word in enumerate(program[1:], start=1):
        if word == "-m":
            return i + 1 < len(program) and program[i + 1] in TORCHRUN_MODULES
        if word.startswith("-m"):
            return word[2:] in TORCHRUN_MODULES
        if not word.startswith("-") or word in ("-c", "--"):
            return False
    return False


@dataclass
class Delivered:
    """What a delivery did: the path taken, the pids or job signalled, and any note."""

    path: str  # "launcher", "scancel", "ranks", "nodes", "tasks"
    targets: list[str] = field(default_factory=list)
    note: str = ""
    per_node: list[dict] = field(default_factory=list)  # "nodes": each signaller's report

    def describe(self) -> str:
        if self.path == "scancel":
            return f"to every task by scancel --signal (job {self.targets[0]})"
        if self.path == "ranks":
            return f"to the rank processes directly (pid {', '.join(self.targets)})"
        if self.path == "nodes":
            each = "; ".join(
                f"{r.get('node')}: rank {', '.join(map(str, r.get('ranks', [])))}"
                for r in self.per_node
            )
            return f"to the rank processes by a signaller on every node ({each})"
        if self.path == "none":
            return "nowhere (it could not be delivered)"
        if self.path == "tasks":
            return f"to the tasks on this node directly (pid {', '.join(self.targets)})"
        return f"to step (pid {self.targets[0]})"


def rank_processes(
    launcher_pid: int, slurm_job_id: str | None = None, kind: str = rank_signal.MPI
) -> list[int]:
    """The rank processes of the step on this node (see the module doc).

    Below ``launcher_pid``, and, inside a Slurm job, every process on this node whose
    environment has the rank marker (``OMPI_COMM_WORLD_RANK``; ``TORCHELASTIC_RUN_ID``
    for torchrun's workers) and this ``SLURM_JOB_ID``: under Slurm mpirun starts
    ``orted`` through srun on every node whose name is not its own host's, so those ranks
    are children of a slurmstepd, not of mpirun (seen on the local cluster).
    """
    if slurm_job_id:
        return sorted(rank_signal.ranks_here(slurm_job_id, None, kind))
    return sorted(rank_signal.ranks_below(launcher_pid, kind))


def without_handler(
    kind: Launcher,
    launcher_pid: int,
    sig: signal.Signals,
    environ: Mapping[str, str] | None = None,
) -> list[int] | None:
    """The rank processes of an mpirun step on this node that neither catch nor ignore
    ``sig`` yet (still in MPI_Init or reading their restart files): the signal would kill
    them. None while no rank has started (mpirun itself would get the signal); empty for
    other launchers, whose ranks are not signalled one by one."""
    if kind is not Launcher.MPIRUN:
        return []
    job_id = slurm_env.job_id(os.environ if environ is None else environ)
    ranks = rank_processes(launcher_pid, job_id)
    if not ranks:
        return None
    return [p for p in ranks if not rank_signal.takes(p, sig)]


def signal_on_every_node(
    job_id: str,
    nodes: int,
    sig: signal.Signals,
    *,
    timeout: float = REQUEUE_TIMEOUT,
    environ: Mapping[str, str] | None = None,
    kind: str = rank_signal.MPI,
) -> Delivered:
    """Run :mod:`hpcckpt.job.rank_signal` once on each of the job's ``nodes``: every node's
    ranks (``kind``: mpi or torchrun) get ``sig`` from their own node's signaller. Raises
    :class:`SlurmError` when the step fails or a node did not report."""
    command = [sys.executable, "-m", "hpcckpt.job.rank_signal", sig.name, job_id]
    if kind != rank_signal.MPI:
        command.append(kind)
    out = commands.run_on_nodes(job_id, nodes, command, timeout=timeout, environ=environ)
    reports = rank_signal.parse_reports(out)
    if len(reports) != nodes:
        raise SlurmError(f"{len(reports)} of {nodes} nodes reported (output: {out.strip()!r})")
    targets = [f"{r['node']}:{pid}" for r in reports for pid in r["pids"]]
    if not targets:
        raise SlurmError("no rank process found on any node")
    note = _skipped_note(sum(len(r.get("skipped", [])) for r in reports), sig)
    per_node = sorted(reports, key=lambda r: str(r["node"]))
    return Delivered("nodes", targets, note, per_node=per_node)


def signal_job(
    job: str,
    sig: signal.Signals,
    *,
    timeout: float = REQUEUE_TIMEOUT,
    environ: Mapping[str, str] | None = None,
) -> None:
    """``scancel --signal=SIG JOB``: once to every task of the job's steps, not the batch step."""
    commands.cancel([job], signal=sig.name.removeprefix("SIG"), timeout=timeout, environ=environ)


def deliver(
    kind: Launcher,
    launcher_pid: int,
    sig: signal.Signals,
    *,
    job: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Delivered:
    """Send ``sig`` to the step's ranks by the path of the module doc.

    Raises ProcessLookupError when the launcher is gone, and :class:`SlurmError`
    when scancel fails (the caller may then fall back to :func:`deliver_to_launcher`), or
    when no torchrun worker was found.
    """
    if kind is Launcher.TORCHRUN:
        return deliver_to_workers(launcher_pid, sig, environ)
    if sig in FORWARDED or kind is Launcher.OTHER:
        return deliver_to_launcher(launcher_pid, sig)
    if kind is Launcher.SRUN:
        if job is None:
            got = deliver_to_launcher(launcher_pid, sig)
            got.note = (
                "not inside a Slurm job: srun got the signal itself (it kills its tasks on TERM)"
            )
            return got
        os.kill(launcher_pid, 0)  # the step is still there
        try:
            signal_job(job, sig, environ=environ)
        except SlurmError as exc:
            env = os.environ if environ is None else environ
            tasks = _signal_all(task_processes(slurm_env.job_id(env) or job), sig)
            if not tasks:
                raise
            return Delivered("tasks", tasks, f"{exc}; signalled the tasks on this node directly")
        return Delivered("scancel", [job])
    os.kill(launcher_pid, 0)  # the step is still there
    env = os.environ if environ is None else environ
    note = ""
    job_id = slurm_env.job_id(env)
    nodes = slurm_env.node_count(env)
    if job_id and nodes > 1:
        try:
            return signal_on_every_node(job_id, nodes, sig, environ=env)
        except SlurmError as exc:
            note = f"the per-node signaller failed ({exc}); signalled the ranks on this node only"
    ranks = rank_processes(launcher_pid, job_id)
    if note and ranks:
        return Delivered("ranks", _signal_all(ranks, sig), note)
    if not ranks:
        got = deliver_to_launcher(launcher_pid, sig)
        got.note = "no rank process found on this node; mpirun got the signal itself"
        return got
    sent = _signal_all(ranks, sig)
    if not sent:
        raise ProcessLookupError(launcher_pid)
    return Delivered("ranks", sent)


def deliver_to_workers(
    launcher_pid: int, sig: signal.Signals, environ: Mapping[str, str] | None = None
) -> Delivered:
    """torchrun: ``sig`` to every worker on every node, never to an agent (module doc)."""
    os.kill(launcher_pid, 0)  # the step is still there
    env = os.environ if environ is None else environ
    job_id = slurm_env.job_id(env)
    nodes = slurm_env.node_count(env)
    note = ""
    if job_id and nodes > 1:
        try:
            return signal_on_every_node(job_id, nodes, sig, environ=env, kind=rank_signal.TORCHRUN)
        except SlurmError as exc:
            note = f"the per-node signaller failed ({exc}); signalled the workers on this node only"
    workers = rank_processes(launcher_pid, job_id, rank_signal.TORCHRUN)
    targets, skipped = rank_signal.ready(workers, sig, rank_signal.TORCHRUN)
    sent = _signal_all(targets, sig)
    if not sent:
        os.kill(launcher_pid, 0)  # gone meanwhile: ProcessLookupError
        found = f"{len(skipped)} without a handler for it yet" if skipped else "none"
        raise SlurmError(
            f"{note + '; ' if note else ''}no torchrun worker (TORCHELASTIC_RUN_ID) to take "
            f"{sig.name} on this node ({found}); not signalling "
            "torchrun's agent (USR1 kills it, TERM ends its workers)"
        )
    return Delivered(
        "ranks", sent, "; ".join(filter(None, [note, _skipped_note(len(skipped), sig)]))
    )


def _skipped_note(skipped: int, sig: signal.Signals) -> str:
    if not skipped:
        return ""
    return (
        f"{skipped} torchrun worker(s) had no handler for {sig.name} yet (starting or "
        "restarting) and were not signalled: it would kill them"
    )


def _signal_all(pids: list[int], sig: signal.Signals) -> list[str]:
    return [str(pid) for pid in rank_signal.signal_all(pids, sig)]


def task_processes(slurm_job_id: str) -> list[int]:
    """The tasks of the job's steps on this node: ``SLURM_PROCID`` and this job's id in the
    environment, not the batch step, topmost only (a task's own children are its business)."""
    found = set()
    for pid, env in procfs.environs_with(slurm_env.TASK_RANK_ENV).items():
        if slurm_env.job_id(env) == slurm_job_id and slurm_env.is_step_task(env):
            found.add(pid)
    return procfs.topmost(found)


def deliver_to_launcher(launcher_pid: int, sig: signal.Signals) -> Delivered:
    os.kill(launcher_pid, sig)
    return Delivered("launcher", [str(launcher_pid)])
