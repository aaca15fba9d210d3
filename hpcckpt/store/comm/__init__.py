"""The communicator between ranks: one interface (:class:`Comm`), two transports.

:mod:`.mpi` wraps an mpi4py communicator (the only module that imports mpi4py),
:mod:`.torch_dist` a torch.distributed gloo group; each is loaded only when used, so a
torch job without an MPI library never touches mpi4py, and an MPI job never loads torch.
:func:`as_comm` turns what a user hands in (an mpi4py communicator, a torch process
group, a :class:`Comm`, or nothing: the launcher decides) into a :class:`Comm`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from hpcckpt.store.comm.base import (
    BXOR,
    LAND,
    LOR,
    MAX,
    MIN,
    OPERATIONS,
    OPS,
    SUM,
    Comm,
    Request,
)

__all__ = [
    "BXOR",
    "LAND",
    "LOR",
    "MAX",
    "MIN",
    "OPERATIONS",
    "OPS",
    "SUM",
    "Comm",
    "Request",
    "as_comm",
    "default_comm",
    "mpi_launched",
    "running_rank",
]

#: Variables an MPI launcher sets in every rank (Open MPI's mpirun, PMI-1/2, PMIx:
#: MPICH's and Intel MPI's hydra, srun --mpi=pmi2/pmix).
MPI_LAUNCHER_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
#: Set by torchrun in its workers: they were started by torchrun, whatever PMI variables
#: srun (``--mpi=pmix``) left in the agent's environment for them to inherit.
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"


def mpi_launched(environ: dict[str, str] | None = None) -> bool:
    """Whether an MPI launcher started this process (its variables are set, and torchrun
    did not start it)."""
    env = os.environ if environ is None else environ
    return TORCHRUN_ENV not in env and any(name in env for name in MPI_LAUNCHER_ENV)


def _torch_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")  # no process group before torch is loaded
    return dist is not None and dist.is_available() and dist.is_initialized()


def default_comm() -> Comm:
    """The communicator of a ``Checkpointer`` given none: MPI's ``COMM_WORLD`` when an MPI
    launcher started the job, else the default torch.distributed group when one is
    initialized, else MPI's ``COMM_WORLD`` (a lone process: one rank)."""
    if mpi_launched() or not _torch_initialized():
        try:
            from hpcckpt.store.comm import mpi
        except (ImportError, RuntimeError) as exc:  # no mpi4py, or no MPI library for it
            if _torch_initialized():
                return _torch(None)
            raise RuntimeError(
                "hpcckpt needs a communicator between ranks: mpi4py with an MPI library "
                f"({type(exc).__name__}: {' '.join(str(exc).split())}), or an initialized "
                "torch.distributed process group (torch.distributed.init_process_group) "
                "before the Checkpointer"
            ) from exc
        return mpi.world()
    return _torch(None)


def _torch(group: Any) -> Comm:
    from hpcckpt.store.comm.torch_dist import TorchComm

    return TorchComm(group)


def as_comm(comm: Any = None) -> Comm:
    """``comm`` as a :class:`Comm`: None (see :func:`default_comm`), an mpi4py
    communicator (wrapped, not duplicated), a torch.distributed ``ProcessGroup`` (its
    gloo group: itself, or one made beside an NCCL group) or a :class:`Comm` as it is."""
    if comm is None:
        return default_comm()
    modules = [c.__module__ for c in type(comm).__mro__]  # a subclass of a communicator too
    if any(m.startswith("mpi4py") for m in modules):
        from hpcckpt.store.comm.mpi import MpiComm

        return MpiComm(comm)
    if any(m.startswith("torch") for m in modules):
        return _torch(comm)
    if isinstance(comm, Comm):
        return comm
    raise TypeError(
        f"comm={comm!r}: expected an mpi4py communicator, a torch.distributed "
        "ProcessGroup or an hpcckpt.store.comm.Comm"
    )


def running_rank() -> int | None:
    """This process's rank in MPI's ``COMM_WORLD`` or the default torch group, whichever
    is already initialized (None if neither): nothing is initialized or loaded here."""
    if "mpi4py.MPI" in sys.modules:
        from hpcckpt.store.comm.mpi import initialized_rank

        rank = initialized_rank()
        if rank is not None:
            return rank
    if _torch_initialized():
        return int(sys.modules["torch.distributed"].get_rank())
    return None
