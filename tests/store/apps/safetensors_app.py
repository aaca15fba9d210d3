"""Test app: a model's weights saved by N ranks, for the safetensors export.

    safetensors_app.py rows DIR REF        each rank saves its rows of every weight
                                           (declared distributed, uneven split)
    safetensors_app.py replicated DIR REF  model + AdamW declared replicated
    safetensors_app.py perrank DIR REF     weights that differ between ranks, undeclared
    safetensors_app.py fsdp DIR REF        the model sharded with FSDP2 (fully_shard, gloo):
                                           DTensor shards, uneven rows

Every rank builds the same model (seed 0, float32 and bfloat16 layers) and takes one
AdamW step on the same batch; rank 0 writes the live model's full state_dict (FSDP2:
the gathered tensors) to REF (safetensors.torch.save_file) for the test to compare the
export against, bit for bit.
"""

import sys

import torch
from mpi4py import MPI
from safetensors.torch import save_file

from hpcckpt.store.store import CheckpointStore

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
mode, directory, ref = sys.argv[1], sys.argv[2], sys.argv[3]


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 10),
        torch.nn.LayerNorm(10),
        torch.nn.Linear(10, 7).to(torch.bfloat16),
    )
    model.register_buffer("count", torch.tensor(3, dtype=torch.int64))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(5, 12)
    h = model[1](model[0](x))
    model[2](h.to(torch.bfloat16)).float().square().mean().backward()
    optim.step()
    return model, optim


def rows(n: int) -> tuple[int, int]:
    """An uneven split: rank 0 takes the most rows."""
    weights = list(range(size, 0, -1))
    cuts = [0]
    for w in weights:
        cuts.append(cuts[-1] + w)
    return n * cuts[rank] // cuts[-1], n * cuts[rank + 1] // cuts[-1]


def start_gloo() -> None:
    import os
    import socket

    import torch.distributed as dist

    port = None
    if rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(comm.bcast(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)


if mode == "fsdp":
    from torch.distributed.fsdp import fully_shard

    start_gloo()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 7),  # 7 rows: uneven shards on 2 ranks
        torch.nn.LayerNorm(7),
        torch.nn.Linear(7, 5).to(torch.bfloat16),
    )
    model.register_buffer("count", torch.tensor(3, dtype=torch.int64))
    for layer in model:
        fully_shard(layer)  # one group per dtype
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(5, 12)
    model[2](model[1](model[0](x)).to(torch.bfloat16)).float().square().mean().backward()
    optim.step()
else:
    model, optim = build()
if mode == "perrank":
    with torch.no_grad():
        model[0].weight.add_(rank)
full = {
    k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().contiguous()
    for k, v in model.state_dict().items()
}
if rank == 0:
    save_file(full, ref)

if mode == "rows":
    state, distributed = {}, []
    for name, value in model.state_dict().items():
        if value.dim():
            lo, hi = rows(value.shape[0])
            state[name] = value[lo:hi].clone()
            distributed.append(f"model/{name}")
        else:
            state[name] = value
    store = CheckpointStore(directory, comm, distributed=distributed)
    store.save(1, {"model": state, "step": 1})
elif mode == "replicated":
    store = CheckpointStore(directory, comm, replicated=["model", "optim"])
    store.save(1, {"model": model, "optim": optim, "step": 1})
elif mode == "fsdp":
    store = CheckpointStore(directory, comm)
    store.save(1, {"model": model, "optim": optim, "step": 1})
elif mode == "perrank":
    store = CheckpointStore(directory, comm)
    store.save(1, {"model": model, "step": 1})
else:
    raise SystemExit(f"unknown mode {mode}")
comm.Barrier()
