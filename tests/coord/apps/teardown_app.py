"""Test app: a short FSDP2 training (``fully_shard``, gloo on CPU) that ends as users end
one, to check that the process exits with status 0.

    teardown_app.py DIR [--steps N] [--every K] [--mode hpcckpt|none|state_dict]
                    [--async-save] [--order finish-first|destroy-first|no-finish]
                    [--width W]

torch.distributed joins over gloo through an MPI rendezvous (rank 0 picks a port), a
small MLP is sharded with ``fully_shard``, AdamW trains it, and every K steps the state
(model, optimizer, RNG, step) is saved with the Checkpointer (``--mode hpcckpt``,
``--async-save`` for staged saves), or only its ``state_dict()``s are taken (``state_dict``)
or nothing (``none``). At the end, ``--order``: ``finish-first`` calls ``ck.finish()`` then
``dist.destroy_process_group()``; ``destroy-first`` the other way round; ``no-finish``
destroys the process group and never calls ``finish()`` nor ``close()``. Then the script
returns from ``main`` and the interpreter finalizes as usual: no ``os._exit``. Each rank
writes ``DIR/done-<rank>`` just before returning, so a run that aborted at exit is told from
one that failed earlier.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.fsdp import fully_shard

import hpcckpt
from hpcckpt.training import RNGState


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--mode", choices=["hpcckpt", "none", "state_dict"], default="hpcckpt")
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument(
        "--order", choices=["finish-first", "destroy-first", "no-finish"], default="finish-first"
    )
    return ap.parse_args()


def start_gloo(comm: MPI.Comm) -> None:
    """torch.distributed from MPI: rank 0 picks a free port, every rank joins over gloo."""
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(comm.bcast(port))
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())


def main() -> None:
    args = parse()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    start_gloo(comm)
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(16, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.Linear(w, 1)
    )
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(10 + rank)
    state = {"model": model, "optim": opt, "rng": RNGState(), "step": 0}
    ck = None
    if args.mode == "hpcckpt":
        ck = hpcckpt.Checkpointer(
            args.directory, comm, every_steps=args.every, async_save=args.async_save
        )
        ck.restore(state)
    for step in range(args.steps):
        x = torch.randn(8, 16)
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        state["step"] = step
        if ck is not None and ck.due(step):
            ck.save(step, state)
        elif args.mode == "state_dict" and (step + 1) % args.every == 0:
            model.state_dict()
            opt.state_dict()
    if args.order == "finish-first":
        if ck is not None:
            ck.finish()
        dist.destroy_process_group()
    elif args.order == "destroy-first":
        dist.destroy_process_group()
        if ck is not None:
            ck.finish()
    else:
        dist.destroy_process_group()
    with open(os.path.join(args.directory, f"done-{rank}"), "w"):
        pass


if __name__ == "__main__":
    main()
