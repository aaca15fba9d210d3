"""The communicator: every operation the store and the Checkpointer need between ranks.

One small interface, two transports (mpi4py, torch.distributed over gloo). Values are
Python objects (small: flags, reasons, plans) or numpy arrays and byte buffers (the
reductions the agreements ride on, the bytes of partner copies and XOR parity).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

SUM = "sum"
MAX = "max"
MIN = "min"
LAND = "land"
LOR = "lor"
BXOR = "bxor"
#: The reduction operations a communicator offers, by name.
OPS = frozenset({SUM, MAX, MIN, LAND, LOR, BXOR})

#: The operations of :class:`Comm`, by name (what a new transport must implement).
OPERATIONS = frozenset(
    {
        "background",
        "rank",
        "size",
        "barrier",
        "bcast",
        "gather",
        "allgather",
        "scatter",
        "allreduce",
        "allreduce_array",
        "iallreduce_array",
        "exscan_sum",
        "bcast_bytes",
        "reduce_array",
        "reduce_scatter_block",
        "send",
        "recv",
        "send_bytes",
        "recv_bytes",
        "sendrecv_bytes",
        "split",
        "split_node",
        "free",
    }
)


class Request(Protocol):
    """A non-blocking reduction in flight."""

    def test(self) -> bool:
        """Whether it has completed (its result is then in the output array)."""

    def wait(self) -> None:
        """Block until it has completed."""

    def wait_for(self, seconds: float) -> bool:
        """Wait up to ``seconds``; whether it has completed. Each transport waits its own
        way: MPI progresses only while a rank tests, gloo in threads of its own that a
        polling rank would starve of the core."""


@runtime_checkable
class Comm(Protocol):
    """The ranks of one group; every method but ``rank``, ``size`` and the point-to-point
    ones is collective over the group. ``op`` is one of :data:`OPS`."""

    @property
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    def size(self) -> int:
        """How many ranks the group has."""

    def barrier(self) -> None:
        """Return once every rank has entered."""

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """``root``'s small Python value, on every rank."""

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's value in rank order on ``root``; None elsewhere."""

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's value in rank order, on every rank."""

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        """Item ``rank`` of ``root``'s list, on each rank."""

    def allreduce(self, value: Any, op: str) -> Any:
        """A Python int, float or bool reduced over the ranks."""

    def allreduce_array(self, array: np.ndarray, op: str) -> np.ndarray:
        """A numpy array (int32/int64/float64) reduced element-wise; a new array."""

    def iallreduce_array(self, send: np.ndarray, recv: np.ndarray, op: str) -> Request:
        """:meth:`allreduce_array` without waiting: ``recv`` holds the result once the
        request completes; ``send`` must not change before then."""

    def exscan_sum(self, array: np.ndarray) -> np.ndarray:
        """The sum of the arrays of the ranks before this one (zeros on rank 0)."""

    def bcast_bytes(self, buf: np.ndarray, root: int = 0) -> None:
        """``root``'s bytes into ``buf`` (a contiguous uint8 array) on every rank."""

    def reduce_array(
        self, send: np.ndarray, recv: np.ndarray | None, op: str, root: int = 0
    ) -> None:
        """``send`` reduced element-wise into ``recv`` on ``root`` (None elsewhere)."""

    def reduce_scatter_block(self, send: np.ndarray, recv: np.ndarray, op: str) -> None:
        """``send`` (``size`` equal blocks) reduced element-wise; block ``rank`` into ``recv``."""

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        """A small JSON value (a document, a number) to rank ``dest``."""

    def recv(self, source: int, tag: int = 0) -> Any:
        """The value rank ``source`` sent with ``tag``."""

    def send_bytes(self, buf: Any, dest: int, tag: int = 0) -> None:
        """The bytes of ``buf`` (any contiguous buffer) to rank ``dest``."""

    def recv_bytes(self, buf: Any, source: int, tag: int = 0) -> None:
        """Exactly ``len(buf)`` bytes from rank ``source`` into the writable ``buf``."""

    def sendrecv_bytes(self, send: Any, dest: int, recv: Any, source: int, tag: int = 0) -> None:
        """Send ``send`` to ``dest`` while receiving ``len(recv)`` bytes from ``source``."""

    def split(self, color: int | None, key: int = 0) -> Comm | None:
        """The ranks of the same ``color`` as a new group, ordered by ``key`` then rank;
        None for a rank whose color is None (it takes part in the call, joins nothing)."""

    def split_node(self) -> Comm:
        """The ranks on this node (MPI's ``COMM_TYPE_SHARED``), as a new group."""

    def free(self) -> None:
        """Release a group made by :meth:`split` or :meth:`split_node` (collective)."""

    def background(self) -> Comm | None:
        """The same ranks as a group of their own, for the collectives a background thread
        runs while this one is in use (collective); None where the library cannot run
        collectives from two threads at once (MPI initialized below
        ``MPI_THREAD_MULTIPLE``)."""


def as_bytes(buf: Any) -> np.ndarray:
    """A contiguous buffer (array, bytes, bytearray, memoryview) as a flat uint8 array
    over the same memory (writable where the buffer is)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)
