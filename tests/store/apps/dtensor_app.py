"""Test app: DTensors of several placements saved and restored through the Checkpointer,
under real mpirun (gloo on CPU).

    dtensor_app.py DIR save|load --mesh 2 | --mesh 1,2 --out RESULT.json
                   [--perturb] [--plain] [--block-size B]

Every rank builds the same global tensors (known values) and shards them on a 1-D or
2-D device mesh with the placements of ``PLACEMENTS`` (Shard on dims 0 and 1, uneven and
empty shards, Replicate, bfloat16). ``save`` saves them at step 5 (``--perturb``: rank
1's copy of a replicated one differs). ``load`` makes DTensors of zeros on its own mesh
and placements and restores into them in place; ``--plain`` restores into an empty dict
instead (global tensors). RESULT.json: ``ok`` {name: the restored values are the global
tensor's, checked with torch's own gather and sharding}, ``restored``, ``error``.
"""

import argparse
import gc
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import hpcckpt
from hpcckpt.store.errors import CheckpointError

SHAPES = {
    "w0": ((10, 6), torch.float32),
    "w1": ((5, 7), torch.bfloat16),
    "b": ((7,), torch.float64),
    "r": ((3, 4), torch.float32),
    "z": ((2, 3), torch.int64),
    "big": ((64, 256), torch.float32),
}
#: Placements by mesh dimensionality.
PLACEMENTS = {
    1: {
        "w0": [Shard(0)],
        "w1": [Shard(1)],
        "b": [Shard(0)],
        "r": [Replicate()],
        "z": [Shard(0)],
        "big": [Shard(0)],
    },
    2: {
        "w0": [Shard(0), Shard(1)],
        "w1": [Replicate(), Shard(0)],
        "b": [Shard(0), Replicate()],
        "r": [Replicate(), Replicate()],
        "z": [Shard(1), Shard(0)],
        "big": [Shard(0), Shard(0)],
    },
}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("what", choices=["save", "load"])
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--perturb", action="store_true")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--block-size", type=int, default=4096)
    return ap.parse_args()


def expected(name: str) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    n = 1
    for x in shape:
        n *= x
    values = torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 + len(name)
    return values.to(dtype)


def main() -> int:
    args = parse()
    comm = MPI.COMM_WORLD
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(comm.bcast(port)))
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    mesh_shape = tuple(int(x) for x in args.mesh.split(","))
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = PLACEMENTS[len(mesh_shape)]
    ck = hpcckpt.Checkpointer(args.directory, comm, keep_last=None, block_size=args.block_size)
    result = {"ok": {}, "error": None, "restored": None}
    code = 0
    try:
        if args.what == "save":
            state = {
                "t": {k: distribute_tensor(expected(k), mesh, placements[k]) for k in SHAPES},
                "n": 5,
            }
            if args.perturb and comm.Get_rank() == 1:
                state["t"]["r"].to_local()[0, 0] += 1
            ck.save(5, state)
        else:
            held = {}
            if not args.plain:
                held = {
                    k: distribute_tensor(torch.zeros_like(expected(k)), mesh, placements[k])
                    for k in SHAPES
                }
            state = {"t": held, "n": 0}
            result["restored"] = ck.restore(state)
            for k in SHAPES:
                got, want = state["t"][k], expected(k)
                if args.plain:
                    ok = type(got) is torch.Tensor and torch.equal(got, want)
                else:
                    mine = distribute_tensor(want, mesh, placements[k]).to_local()
                    ok = torch.equal(got.to_local(), mine) and torch.equal(got.full_tensor(), want)
                result["ok"][k] = comm.allreduce(bool(ok), op=MPI.LAND)
            result["n"] = state["n"]
        ck.close()
    except CheckpointError as exc:
        result["error"] = str(exc)
        code = 3
    if comm.Get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(result, fh)
    return code


if __name__ == "__main__":
    code = main()
    dist.destroy_process_group()  # then leave without the interpreter's finalization,
    gc.collect()  # which gloo's threads may race (an abort seen here)
    MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
