"""The communicator over mpi4py: each operation is the one MPI call the store made before
the interface existed, so an MPI job's behaviour and cost stay what they were.

The only module of hpcckpt that imports mpi4py (``import mpi4py.MPI`` needs an MPI
library; torch users without one never load this module).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcckpt.store.comm.base import BXOR, LAND, LOR, MAX, MIN, SUM, Request, as_bytes

#: Seconds a wait spins on ``Test``, then yields the core between tests, before it
#: sleeps between tests; the sleep.
_SPIN, _YIELD, _NAP = 0.001, 0.01, 0.0005

_OPS = {SUM: MPI.SUM, MAX: MPI.MAX, MIN: MPI.MIN, LAND: MPI.LAND, LOR: MPI.LOR, BXOR: MPI.BXOR}


def world() -> MpiComm:
    """``MPI.COMM_WORLD`` (MPI initialized on first use)."""
    return MpiComm(MPI.COMM_WORLD)


def is_mpi_comm(obj: object) -> bool:
    """Whether ``obj`` is an mpi4py communicator."""
    return isinstance(obj, MPI.Comm)


def initialized_rank() -> int | None:
    """This process's rank in ``COMM_WORLD`` if MPI is initialized, else None."""
    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else None


class _Request(MPI.Request):
    """An MPI request as :class:`Request` (a handle on the same request, made in C:
    ``due()`` posts and tests one on every step)."""

    test = MPI.Request.Test
    wait = MPI.Request.Wait

    def wait_for(self, seconds: float) -> bool:
        """Test, spinning a millisecond, then yielding the core between tests (the other
        rank may share it) up to 10 ms, then sleeping half a millisecond between them
        (a yield costs a microsecond: most waits of ``due`` are shorter)."""
        start = time.monotonic()
        while not self.Test():
            waited = time.monotonic() - start
            if waited >= seconds:
                return False
            if waited > _YIELD:
                time.sleep(_NAP)
            elif waited > _SPIN:
                os.sched_yield()
        return True


class MpiComm:
    """An mpi4py intracommunicator behind :class:`~hpcckpt.store.comm.base.Comm`."""

    __slots__ = ("mpi", "rank", "size")

    def __init__(self, comm: MPI.Intracomm) -> None:
        #: The mpi4py communicator itself (for applications and tests that hold it).
        self.mpi = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()

    def __repr__(self) -> str:
        return f"MpiComm({self.mpi!r}, rank={self.rank}, size={self.size})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MpiComm) and other.mpi == self.mpi

    def __hash__(self) -> int:
        return hash(MpiComm)

    def barrier(self) -> None:
        self.mpi.Barrier()

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.mpi.bcast(obj, root=root)

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        return self.mpi.gather(obj, root=root)

    def allgather(self, obj: Any) -> list[Any]:
        return self.mpi.allgather(obj)

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        return self.mpi.scatter(objs, root=root)

    def allreduce(self, value: Any, op: str) -> Any:
        return self.mpi.allreduce(value, op=_OPS[op])

    def allreduce_array(self, array: np.ndarray, op: str) -> np.ndarray:
        out = np.empty_like(array)
        self.mpi.Allreduce(array, out, op=_OPS[op])
        return out

    def iallreduce_array(self, send: np.ndarray, recv: np.ndarray, op: str) -> Request:
        return _Request(self.mpi.Iallreduce(send, recv, op=_OPS[op]))

    def exscan_sum(self, array: np.ndarray) -> np.ndarray:
        out = np.zeros_like(array)
        self.mpi.Exscan(array, out, op=MPI.SUM)
        if self.rank == 0:
            out[...] = 0  # Exscan leaves rank 0's buffer undefined
        return out

    def bcast_bytes(self, buf: np.ndarray, root: int = 0) -> None:
        self.mpi.Bcast(buf, root=root)

    def reduce_array(
        self, send: np.ndarray, recv: np.ndarray | None, op: str, root: int = 0
    ) -> None:
        self.mpi.Reduce(send, recv, op=_OPS[op], root=root)

    def reduce_scatter_block(self, send: np.ndarray, recv: np.ndarray, op: str) -> None:
        self.mpi.Reduce_scatter_block(send, recv, op=_OPS[op])

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        self.mpi.send(obj, dest=dest, tag=tag)

    def recv(self, source: int, tag: int = 0) -> Any:
        return self.mpi.recv(source=source, tag=tag)

    def send_bytes(self, buf: Any, dest: int, tag: int = 0) -> None:
        self.mpi.Send([as_bytes(buf), MPI.BYTE], dest=dest, tag=tag)

    def recv_bytes(self, buf: Any, source: int, tag: int = 0) -> None:
        self.mpi.Recv([as_bytes(buf), MPI.BYTE], source=source, tag=tag)

    def sendrecv_bytes(self, send: Any, dest: int, recv: Any, source: int, tag: int = 0) -> None:
        self.mpi.Sendrecv(
            [as_bytes(send), MPI.BYTE], dest, tag, [as_bytes(recv), MPI.BYTE], source, tag
        )

    def split(self, color: int | None, key: int = 0) -> MpiComm | None:
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else MpiComm(sub)

    def free(self) -> None:
        self.mpi.Free()

    def split_node(self) -> MpiComm:
        return MpiComm(self.mpi.Split_type(MPI.COMM_TYPE_SHARED))

    def background(self) -> MpiComm | None:
        threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        if not self.mpi.allreduce(threads, op=MPI.LAND):
            return None
        return MpiComm(self.mpi.Dup())
