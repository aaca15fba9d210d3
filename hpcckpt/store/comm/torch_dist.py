"""The communicator over torch.distributed: a gloo group, on the CPU, as DCP coordinates.

The default process group is used as it is when its backend is gloo; otherwise (NCCL)
a gloo group over the same ranks is made beside it, once, collectively. Small Python
values of collectives go through torch's object collectives (pickled by torch: transport
between ranks, never a checkpoint file), point-to-point values as JSON (hpcckpt sends
manifests and sizes); arrays and bytes go as CPU tensors over the same memory.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpcckpt.store.comm.base import BXOR, LAND, LOR, MAX, MIN, SUM, Request, as_bytes

_OPS = {
    SUM: dist.ReduceOp.SUM,
    MAX: dist.ReduceOp.MAX,
    MIN: dist.ReduceOp.MIN,
    BXOR: dist.ReduceOp.BXOR,
}
#: Logical operations on flags, as integer reductions (True is 1).
_LOGICAL = {LAND: dist.ReduceOp.MIN, LOR: dist.ReduceOp.MAX}
#: numpy dtypes the reductions take; uint64 (XOR parity) travels as int64 (same bits).
_SIGNED = {np.dtype(np.uint64): np.int64, np.dtype(np.uint32): np.int32}


def is_process_group(obj: object) -> bool:
    """Whether ``obj`` is a torch.distributed process group."""
    return isinstance(obj, dist.ProcessGroup)


def initialized_rank() -> int | None:
    """This process's rank in the default group if one is initialized, else None."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def gloo_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """``group`` (the default group when None) if its backend is gloo, else a gloo group
    over the same ranks (collective over them)."""
    pg = group if group is not None else dist.group.WORLD
    if dist.get_backend(pg) == "gloo":
        return pg
    return dist.new_group(dist.get_process_group_ranks(pg), backend="gloo")


def _op(op: str) -> Any:
    return _LOGICAL.get(op) or _OPS[op]


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``array``'s memory (uint64 seen as int64)."""
    signed = _SIGNED.get(array.dtype)
    return torch.from_numpy(array.view(signed) if signed is not None else array)


def _byte_tensor(buf: Any) -> torch.Tensor:
    view = as_bytes(buf)
    if not view.flags.writeable:  # torch wants writable memory even to send from
        view = view.copy()
    return torch.from_numpy(view)


class _Work:
    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def test(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self) -> None:
        self.work.wait()

    def wait_for(self, seconds: float) -> bool:
        # A timed-out wait raises and leaves the work running; a failed one raises too,
        # and then the work is completed: wait again for its own error.
        try:
            return bool(self.work.wait(timedelta(seconds=seconds)))
        except RuntimeError:
            if not self.work.is_completed():
                return False
            self.work.wait()
            return True


class TorchComm:
    """A gloo process group behind :class:`~hpcckpt.store.comm.base.Comm`."""

    __slots__ = ("group", "rank", "size", "_global", "_sends", "_owned")

    def __init__(self, group: dist.ProcessGroup | None = None, *, owned: bool = False) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed has no process group: call "
                "torch.distributed.init_process_group() before making the Checkpointer"
            )
        #: The gloo group the operations run on.
        self.group = gloo_group(group)
        self.rank: int = dist.get_rank(self.group)
        self.size: int = dist.get_world_size(self.group)
        self._global = dist.get_process_group_ranks(self.group)
        #: Whether :meth:`free` destroys the group: one made here, never the caller's.
        self._owned = owned or self.group is not (group or dist.group.WORLD)
        self._sends: list[tuple[Any, torch.Tensor]] = []  # object sends in flight

    def __repr__(self) -> str:
        return f"TorchComm(rank={self.rank}, size={self.size})"

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        box = [obj if self.rank == root else None]
        dist.broadcast_object_list(box, group=self.group, group_src=root)
        return box[0]

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        out = [None] * self.size if self.rank == root else None
        dist.gather_object(obj, out, group=self.group, group_dst=root)
        return out

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(
            out, objs if self.rank == root else None, group=self.group, group_src=root
        )
        return out[0]

    def allreduce(self, value: Any, op: str) -> Any:
        if isinstance(value, (bool, np.bool_)) or op in _LOGICAL:
            t = torch.tensor([int(bool(value))], dtype=torch.int64)
            dist.all_reduce(t, _op(op), group=self.group)
            return bool(t.item())
        if isinstance(value, (int, np.integer)):
            t = torch.tensor([int(value)], dtype=torch.int64)
            dist.all_reduce(t, _op(op), group=self.group)
            return int(t.item())
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, _op(op), group=self.group)
        return float(t.item())

    def allreduce_array(self, array: np.ndarray, op: str) -> np.ndarray:
        out = np.array(array, copy=True, order="C")
        dist.all_reduce(_tensor(out), _op(op), group=self.group)
        return out

    def iallreduce_array(self, send: np.ndarray, recv: np.ndarray, op: str) -> Request:
        recv[...] = send
        work = dist.all_reduce(_tensor(recv), _op(op), group=self.group, async_op=True)
        return _Work(work)

    def exscan_sum(self, array: np.ndarray) -> np.ndarray:
        mine = _tensor(np.ascontiguousarray(array).reshape(-1))
        rows = torch.zeros(self.size * mine.numel(), dtype=mine.dtype)
        dist.all_gather_single(rows, mine, group=self.group)
        before = rows.reshape(self.size, -1)[: self.rank].sum(dim=0)
        return before.numpy().astype(array.dtype).reshape(array.shape)

    def bcast_bytes(self, buf: np.ndarray, root: int = 0) -> None:
        if buf.size:
            dist.broadcast(_byte_tensor(buf), group=self.group, group_src=root)

    def reduce_array(
        self, send: np.ndarray, recv: np.ndarray | None, op: str, root: int = 0
    ) -> None:
        t = _tensor(np.array(send, copy=True))
        dist.reduce(t, group=self.group, group_dst=root, op=_op(op))
        if self.rank == root:
            assert recv is not None
            recv[...] = t.numpy().view(recv.dtype).reshape(recv.shape)

    def reduce_scatter_block(self, send: np.ndarray, recv: np.ndarray, op: str) -> None:
        # gloo has no reduce-scatter: an allreduce, this rank's block kept
        total = self.allreduce_array(np.ascontiguousarray(send), op).reshape(self.size, -1)
        recv[...] = total[self.rank].reshape(recv.shape)

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        # Not waited for, as MPI sends small messages eagerly: two ranks may send to each
        # other before they receive. Completed sends are dropped at the next send.
        raw = json.dumps(obj).encode()  # hpcckpt sends JSON documents and ints
        size = torch.tensor([len(raw)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self._sends[:] = [(w, t) for w, t in self._sends if not w.is_completed()]
        for t in (size, data):
            work = dist.isend(t, group=self.group, group_dst=dest, tag=tag)
            self._sends.append((work, t))

    def recv(self, source: int, tag: int = 0) -> Any:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, group=self.group, group_src=source, tag=tag)
        raw = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(raw, group=self.group, group_src=source, tag=tag)
        return json.loads(raw.numpy().tobytes())

    def send_bytes(self, buf: Any, dest: int, tag: int = 0) -> None:
        t = _byte_tensor(buf)
        if t.numel():
            dist.send(t, group=self.group, group_dst=dest, tag=tag)

    def recv_bytes(self, buf: Any, source: int, tag: int = 0) -> None:
        t = torch.from_numpy(as_bytes(buf))
        if t.numel():
            dist.recv(t, group=self.group, group_src=source, tag=tag)

    def sendrecv_bytes(self, send: Any, dest: int, recv: Any, source: int, tag: int = 0) -> None:
        ops = []
        out, inp = _byte_tensor(send), torch.from_numpy(as_bytes(recv))
        if out.numel():
            ops.append(dist.P2POp(dist.isend, out, group=self.group, group_peer=dest, tag=tag))
        if inp.numel():
            ops.append(dist.P2POp(dist.irecv, inp, group=self.group, group_peer=source, tag=tag))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    def split(self, color: int | None, key: int = 0) -> TorchComm | None:
        everyone = self.allgather((color, key))
        groups = {
            c: [
                self._global[r]
                for _, r in sorted((k, r) for r, (cc, k) in enumerate(everyone) if cc == c)
            ]
            for c in sorted({c for c, _ in everyone if c is not None})
        }
        mine: TorchComm | None = None
        if self.size == dist.get_world_size():
            # torch's rule for new groups: every rank of the job makes each, in one order
            for c, ranks in groups.items():
                group = dist.new_group(ranks, backend="gloo", sort_ranks=False)
                if c == color:
                    mine = TorchComm(group, owned=True)
        elif color is not None:  # a group inside a sub-group: its members alone make it
            group = dist.new_group(
                groups[color], backend="gloo", use_local_synchronization=True, sort_ranks=False
            )
            mine = TorchComm(group, owned=True)
        return mine

    def split_node(self) -> TorchComm:
        hosts = self.allgather(socket.gethostname())
        names = sorted(set(hosts))
        sub = self.split(names.index(hosts[self.rank]), self.rank)
        assert sub is not None
        return sub

    def background(self) -> TorchComm:
        sub = self.split(0, self.rank)  # gloo groups are independent of each other's threads
        assert sub is not None
        return sub

    def free(self) -> None:
        if self._owned:
            dist.destroy_process_group(self.group)
