"""Data-parallel PyTorch training that survives its time limit: DDP over gloo, resumed exactly.

Run it on 2 ranks with mpirun, or in a batch job (examples/torch_ddp.sbatch):

    mpirun -n 2 python examples/torch_ddp.py --ckpt-dir ckpt-ddp --out result.json

Every rank trains the same MLP (with dropout) wrapped in DistributedDataParallel over the
gloo backend (CPU), with AdamW and a cosine learning-rate schedule, on its share of a
shuffled synthetic dataset the script makes. mpi4py starts nothing but the rendezvous:
rank 0 picks a free port and broadcasts its host and port, and every rank joins the
torch process group there.

The checkpoint holds everything a resume needs, and nothing needs converting:

- ``model``, ``optim``, ``sched``: the module, AdamW (its moments and step counts exist
  only after the first step), the schedule, declared ``replicated``: identical on every
  rank, checked by checksum and written once, by rank 0;
- ``rng``: this rank's Python, numpy and torch generators (the dropout masks);
- ``data``: this rank's sampler, epoch and position in it (a resume in the middle of
  an epoch continues with the next batch);
- ``step`` and ``history`` (this rank's loss at every step so far).

On the time-limit signal (forwarded by ``hpcckpt srun``) the ranks checkpoint at the
next step and leave; the wrapper requeues the job and the next run resumes. The losses
and final parameters are bit-identical to those of an uninterrupted run.
``--out`` (rank 0, at the end): JSON with every rank's loss per step, a sha256 of the
final parameters and where this run resumed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import hpcckpt
from hpcckpt.training import ResumableSampler, RNGState


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt-dir", default=os.environ.get("HPCCKPT_DIR", "ckpt-ddp"))
    ap.add_argument("--out", help="JSON result written by rank 0 at the end")
    ap.add_argument("--steps", type=int, default=300, help="training steps in all")
    ap.add_argument("--samples", type=int, default=4096, help="size of the dataset")
    ap.add_argument("--batch", type=int, default=16, help="batch size per rank")
    ap.add_argument("--workers", type=int, default=0, help="data loader worker processes")
    ap.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    ap.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step")
    return ap.parse_args()


def rendezvous(comm: MPI.Comm) -> None:
    """Join the gloo process group at rank 0's host and a port it picked."""
    where = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            where = (socket.gethostname(), s.getsockname()[1])
    host, port = comm.bcast(where)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{host}:{port}",
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
    )


def data(samples: int) -> TensorDataset:
    """A synthetic regression problem, the same on every rank and every run."""
    gen = np.random.default_rng(2024)
    x = gen.standard_normal((samples, 16)).astype(np.float32)
    w = gen.standard_normal((16, 1)).astype(np.float32)
    y = np.tanh(x @ w) + 0.05 * gen.standard_normal((samples, 1)).astype(np.float32)
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def build(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The model (the same initial weights on every rank), AdamW and the cosine schedule."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 1),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=steps)
    return model, optim, sched


def fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in model.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().reshape(-1).contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    args = parse()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    rendezvous(comm)

    model, optim, sched = build(args.steps)
    dataset = data(args.samples)
    sampler = ResumableSampler(len(dataset), size, rank, shuffle=True, seed=1)
    torch.manual_seed(1000 + rank)  # each rank its own dropout masks
    state = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": RNGState(),
        "data": sampler,
        "step": -1,
        "history": [],
    }
    ck = hpcckpt.Checkpointer(
        args.ckpt_dir, comm, every_steps=args.every, replicated=["model", "optim", "sched"]
    )
    restored = ck.restore(state)
    resumed_at = [sampler.epoch, sampler.offset] if restored is not None else None
    ddp = DistributedDataParallel(model)  # after the restore: the restored weights
    loader = DataLoader(
        dataset,
        batch_size=args.batch,
        sampler=sampler,
        num_workers=args.workers,
        # Its own generator for the workers' seeds: the loader must not draw from the
        # global torch generator, or a resume would shift the dropout masks.
        generator=torch.Generator().manual_seed(0),
    )

    step = state["step"] + 1
    while step < args.steps and not ck.stop_requested:
        if sampler.offset >= sampler.per_rank:
            sampler.set_epoch(sampler.epoch + 1)
        for x, y in loader:
            ddp.train()
            optim.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()  # DDP averages the gradients over the ranks
            optim.step()
            sched.step()
            sampler.advance(len(x))
            state["history"].append(loss.item())
            state["step"] = step
            if args.sleep:
                time.sleep(args.sleep)
            if ck.due(step):
                ck.save(step, state)
                if ck.stop_requested:
                    break
            step += 1
            if step == args.steps:
                break
    if ck.stop_requested:
        ck.close()
    else:
        ck.finish()
        histories = comm.gather(state["history"])
        if rank == 0 and args.out:
            with open(args.out, "w") as fh:
                json.dump(
                    {"losses": histories, "params": fingerprint(model), "resumed_at": resumed_at},
                    fh,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
