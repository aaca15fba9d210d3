"""Signal the rank processes of one Slurm job on this node: the per-node signaller.

Under ``hpcckpt run -- mpirun`` the application's TERM/INT must reach the rank
processes themselves (mpirun gives them one second before SIGKILL); under torchrun every
stop signal must (its agent dies of USR1 and kills its workers 30 s after a TERM). Ranks
on other nodes
are not visible in this node's ``/proc``, so the wrapper runs this module once on every
node of the allocation (``srun --overlap --ntasks-per-node=1``,
:func:`hpcckpt.slurm.commands.run_on_nodes`; :mod:`hpcckpt.job.delivery`). Each copy
signals only the ranks of this job on *its own* node: the launcher's rank marker
(:data:`MARKERS`: ``OMPI_COMM_WORLD_RANK`` for mpirun, ``TORCHELASTIC_RUN_ID`` for
torchrun's workers, which its agent lacks), this ``SLURM_JOB_ID`` and this node's
``SLURMD_NODENAME`` in their environment (several slurmd on one machine share its
``/proc``, not a node name), topmost only. A torchrun worker that neither catches nor
ignores the signal (one torchrun is still starting or restarting) is skipped: the signal
would kill it. It prints one line (:data:`PREFIX` + JSON: node, signal, pids, ranks,
skipped pids) for the wrapper's log.

``python -m hpcckpt.job.rank_signal SIG JOB [mpi|torchrun]``
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcckpt import procfs
from hpcckpt.signames import parse_signal, short_name
from hpcckpt.slurm import env as slurm_env

RANK_ENV = "OMPI_COMM_WORLD_RANK"
#: What marks a rank process, per launcher: (the variable only ranks have, the variable
#: holding the rank). torchrun sets ``TORCHELASTIC_RUN_ID`` in its workers, not in its
#: agent (seen with torch 2.13).
MARKERS = {"mpi": (RANK_ENV, RANK_ENV), "torchrun": ("TORCHELASTIC_RUN_ID", "RANK")}
MPI = "mpi"
TORCHRUN = "torchrun"
#: Starts each report line; anything else srun prints is not ours.
PREFIX = "hpcckpt-rank-signal "


def ranks_here(job: str, node: str | None, kind: str = MPI) -> dict[int, str]:
    """``{pid: rank}`` of this job's topmost rank processes on ``node`` (None: any node),
    marked as ``kind``'s launcher marks them (:data:`MARKERS`)."""
    marker, rank = MARKERS[kind]
    found: dict[int, str] = {}
    for pid, env in procfs.environs_with(marker).items():
        if slurm_env.job_id(env) != job:
            continue
        if node is not None and slurm_env.node_name(env) != node:
            continue
        found[pid] = env.get(rank, "?")
    return {pid: found[pid] for pid in procfs.topmost(set(found))}


def ranks_below(pid: int, kind: str = MPI) -> dict[int, str]:
    """``{pid: rank}`` of the topmost rank processes among ``pid``'s descendants (outside
    Slurm, where no job id tells the ranks apart)."""
    marker, rank = MARKERS[kind]
    found = {}
    for child in procfs.descendants(pid):
        env = procfs.environ(child)
        if marker in env:
            found[child] = env.get(rank, "?")
    return {p: found[p] for p in procfs.topmost(set(found))}


def takes(pid: int, sig: signal.Signals) -> bool:
    """Does ``pid`` catch or ignore ``sig`` (``SigCgt``/``SigIgn`` of /proc/PID/status)?
    If not, the signal's default action (for the stop signals: terminate) would kill it."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = 0
    for line in text.splitlines():
        if line.startswith(("SigCgt:", "SigIgn:")):
            mask |= int(line.split()[1], 16)
    return bool(mask >> (int(sig) - 1) & 1)


def ready(pids: Iterable[int], sig: signal.Signals, kind: str) -> tuple[list[int], list[int]]:
    """``pids`` split into those that may get ``sig`` and those skipped: under torchrun
    the workers without a handler (see the module doc); MPI ranks all, as before."""
    pids = list(pids)
    if kind == MPI:
        return pids, []
    ok = [p for p in pids if takes(p, sig)]
    return ok, [p for p in pids if p not in ok]


def signal_all(pids: Iterable[int], sig: signal.Signals) -> list[int]:
    """Send ``sig`` to each of ``pids``; those that were still there to receive it."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        sent.append(pid)
    return sent


def signal_here(
    sig: signal.Signals, job: str, environ: Mapping[str, str], kind: str = MPI
) -> dict[str, Any]:
    """Send ``sig`` to this job's ranks on this node; the report of what was signalled."""
    node = slurm_env.node_name(environ)
    found = ranks_here(job, node, kind)
    targets, skipped = ready(found, sig, kind)
    pids = signal_all(targets, sig)
    ranks = [int(found[p]) if found[p].isdigit() else found[p] for p in pids]
    report = {"node": node, "signal": short_name(sig), "pids": pids, "ranks": ranks}
    if skipped:
        report["skipped"] = skipped
    return report


def parse_reports(output: str) -> list[dict[str, Any]]:
    """The report lines in the signallers' combined output (others are skipped)."""
    reports = []
    for line in output.splitlines():
        if line.startswith(PREFIX):
            try:
                reports.append(json.loads(line[len(PREFIX) :]))
            except ValueError:
                continue
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (2, 3) or (len(args) == 3 and args[2] not in MARKERS):
        print("usage: python -m hpcckpt.job.rank_signal SIG JOB_ID [mpi|torchrun]", file=sys.stderr)
        return 2
    name, job, kind = (*args, MPI) if len(args) == 2 else args
    try:
        sig = parse_signal(name)
    except ValueError as exc:
        print(f"rank_signal: {exc}", file=sys.stderr)
        return 2
    print(PREFIX + json.dumps(signal_here(sig, job, os.environ, kind)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
