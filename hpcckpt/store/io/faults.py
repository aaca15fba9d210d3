"""Fault injection for the reliability suite: die at a named phase of a save.

``HPCCKPT_FAULT="phase[:rank[:step]][,phase...]"`` (read once, at import) makes
:func:`fault_point` kill the calling process with SIGKILL when it reaches ``phase``
on ``rank`` (a number, or ``*``/empty for every rank) during the save of ``step``
(a number, or ``*``/empty for any step). SIGKILL is what a node failure, the OOM
killer or Slurm after ``KillWait`` do: no ``finally``, no ``atexit``, no flush.

Phases (see docs/reliability.md for what each one tests):

=======================  ===========================================================
``save.begin``           every rank: the state is encoded, no file touched yet
``save.prepared``        every rank: directory ready, leftovers removed, the empty
                         ``.partial`` created; no data written
``write.data``           every rank: in the middle of the data (the file created with
                         its metadata, the rank's first array slice written, the
                         rest not)
``write.closed``         every rank: the rank's bytes are written and fsynced; the
                         ranks have not agreed yet, nothing renamed
``commit.fsynced``       rank 0: every rank fsynced the ``.partial``; not yet renamed
``commit.renamed``       rank 0: renamed to ``ckpt-<step>.h5`` (directory fsynced);
                         the other ranks do not know yet
``checkpointer.saved``   every rank: the store's save returned; no prune, no event,
                         no status update yet
``prune.deleting``       rank 0: retention deleted its first checkpoint, not the rest
=======================  ===========================================================

Phases of a staged save (``async_save=True`` or ``cache=PATH``; :data:`STAGED_PHASES`):

=======================  ===========================================================
``stage.written``        every rank: the state is copied to the staging area (and the
                         node-local copy sealed); the checkpoint file not created yet
``drain.writing``        the background thread: its first piece of array bytes is in
                         the ``.partial`` file, the rest not
``redundancy.encoded``   every rank (``cache`` with ``redundancy``): its data and its
                         parity or partner file are written, no manifest yet
``drain.eio``            not a kill: the background thread's next write fails with
                         ``OSError(EIO)``, as a failing disk or a lost server would
=======================  ===========================================================

When the variable is unset, :func:`fault_point` is one test of a module global.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections.abc import Mapping

from hpcckpt.store.comm import TORCHRUN_ENV, running_rank

ENV = "HPCCKPT_FAULT"

#: Every phase a fault can be injected at, in the order a save meets them.
PHASES = (
    "save.begin",
    "save.prepared",
    "write.data",
    "write.closed",
    "commit.fsynced",
    "commit.renamed",
    "checkpointer.saved",
    "prune.deleting",
)
#: Phases of a restore (not of a save).
RESTORE_PHASES = ("restore.reading",)
#: Phases only a staged save (async or through a node-local cache) meets.
STAGED_PHASES = ("stage.written", "drain.writing", "drain.eio")
#: Phases of a node-local save with redundancy (tests/store/tier/test_node_local_mpi.py).
REDUNDANCY_PHASES = ("redundancy.encoded",)
_ALL = (*PHASES, *RESTORE_PHASES, *STAGED_PHASES, *REDUNDANCY_PHASES)

_RANK_ENVS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def parse(text: str) -> list[tuple[str, int | None, int | None]]:
    """``"phase[:rank[:step]],..."`` -> [(phase, rank or None, step or None)]; ValueError if bad."""
    faults = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split(":")
        if len(parts) > 3 or parts[0] not in _ALL:
            raise ValueError(
                f"{ENV}={text!r}: {item!r} is not phase[:rank[:step]] with a phase among "
                f"{', '.join(_ALL)}"
            )
        nums: list[int | None] = []
        for part in parts[1:] + [""] * (3 - len(parts)):
            if part in ("", "*"):
                nums.append(None)
            elif part.isdigit():
                nums.append(int(part))
            else:
                raise ValueError(f"{ENV}={text!r}: {part!r} is not a number or '*'")
        faults.append((parts[0], nums[0], nums[1]))
    return faults


_FAULTS = parse(os.environ.get(ENV, ""))
_step: int | None = None  # the step of the save under way (from the last point that gave one)


def _my_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank, from the launcher's variables. A torchrun worker's is ``RANK``:
    the ``SLURM_PROCID`` (and PMIx rank) it inherits are its agent's, one per node."""
    env = os.environ if environ is None else environ
    names = ("RANK", *_RANK_ENVS) if TORCHRUN_ENV in env else _RANK_ENVS
    for name in names:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    rank = running_rank()  # MPI's or torch.distributed's, if already initialized
    return 0 if rank is None else rank


def fault_point(phase: str, step: int | None = None) -> None:
    """Die here (SIGKILL) if ``$HPCCKPT_FAULT`` asks for ``phase`` on this rank and step
    (for a ``*.eio`` phase: raise ``OSError(EIO)`` instead).

    ``step`` is given by the first point of a save; later points reuse it.
    """
    if not _FAULTS:
        return
    global _step
    if step is not None:
        _step = step
    for want, rank, at in _FAULTS:
        if want != phase or (at is not None and at != _step):
            continue
        if rank is not None and rank != _my_rank():
            continue
        if phase.endswith(".eio"):
            raise OSError(errno.EIO, f"injected I/O error at {phase} (step {_step})")
        sys.stderr.write(f"hpcckpt: injected fault {phase} (step {_step}): SIGKILL\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
