"""Test app: DTensors restored on the mesh that saved them, read as rank 0 planned it.

    dtensor_plan_app.py save DIR [--replicate]     steps 1 and 2 of Shard(0) and Shard(1)
                                                   DTensors (uneven shards, float32 and
                                                   bfloat16) on a 1-D mesh of every rank
                                                   (--replicate: and a Replicate one)
    dtensor_plan_app.py restore DIR HOW [--replicate]
        same      DTensors of zeros with the saved placements: each rank's shard is its piece
        swapped   Shard(1) where Shard(0) was saved and the reverse: other boxes (the pieces)

Rank 0 prints one JSON line per rank: the step restored (or the error), whether every
DTensor holds bitwise the saved values in the application's own local tensors, and how
many times the rank opened a checkpoint with the full reader (HDF5).
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import hpcckpt.store.restore.load as load_module
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.store import CheckpointStore

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
mode, directory = sys.argv[1], sys.argv[2]
how = sys.argv[3] if mode == "restore" else "same"
SHAPES = {"a": ((1001, 33), torch.float32), "b": ((17, 2051), torch.bfloat16)}
if "--replicate" in sys.argv:
    SHAPES["r"] = ((5, 3), torch.float32)


def placement(name: str) -> list:
    if name == "r":
        return [Replicate()]
    dim = 0 if name == "a" else 1
    return [Shard(1 - dim if how == "swapped" else dim)]


def expected(name: str, step: int) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    n = shape[0] * shape[1]
    return ((torch.arange(n, dtype=torch.float64).reshape(shape) % 251) * 0.5 + step).to(dtype)


opened = 0
Reader = load_module.CheckpointReader


def counting_reader(*args, **kwargs):
    global opened
    opened += 1
    return Reader(*args, **kwargs)


def report(**fields) -> None:
    reports = comm.gather({"rank": rank, **fields}, root=0)
    if rank == 0:
        print("\n".join(json.dumps(r) for r in reports), flush=True)


def main() -> None:
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(comm.bcast(port)))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))
    store = CheckpointStore(directory, comm, block_size=4096, incremental=False)
    if mode == "save":
        for step in (1, 2):
            t = {k: distribute_tensor(expected(k, step), mesh, placement(k)) for k in SHAPES}
            store.save(step, {"t": t, "n": step})
        report(saved=[1, 2])
        return
    load_module.CheckpointReader = counting_reader
    held = {k: distribute_tensor(torch.zeros(*SHAPES[k][0], dtype=SHAPES[k][1]), mesh,
                                 placement(k)) for k in SHAPES}  # fmt: skip
    locals_ = {k: v.to_local() for k, v in held.items()}
    state = {"t": dict(held), "n": 0}
    try:
        result = store.restore(state)
    except CheckpointError as exc:
        report(error=str(exc), opened=opened)
        return
    step = result.step
    exact = state["n"] == step
    for k in SHAPES:
        got = state["t"][k]
        mine = distribute_tensor(expected(k, step), mesh, placement(k)).to_local()
        exact = exact and got is held[k] and got.to_local().data_ptr() == locals_[k].data_ptr()
        exact = exact and torch.equal(got.to_local(), mine)
    report(step=step, exact=bool(exact), opened=opened)


if __name__ == "__main__":
    main()
    dist.destroy_process_group()  # then leave without the interpreter's finalization,
    MPI.Finalize()  # which gloo's threads may race (an abort seen here)
    sys.stdout.flush()
    os._exit(0)
