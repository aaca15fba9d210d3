"""DDP training (gloo, CPU) through hpcckpt's Checkpointer with no MPI: started by torchrun
or by plain ``srun`` (rank and size from ``SLURM_PROCID``/``SLURM_NTASKS``).

    torchrun --nproc-per-node=2 torch_train.py --steps 200 --out result.json
    srun --mpi=none -n 2 python torch_train.py ...   # MASTER_ADDR, MASTER_PORT exported

The state: the model, AdamW (its moments), the cosine schedule, this rank's random
generators (dropout), its sampler (the data position), the step and this rank's loss at
every step. ``--first-run-sleep S``: seconds per step in a job's first run only (not a
requeued one), so that a time-limit warning always finds it training; it changes no
number. ``--crash-at STEP RANK``: in the job's first run and torchrun's first start, rank
RANK exits 3 at STEP (after that step's checkpoint, if one is due). ``--out`` (rank 0, at
the finish): every rank's losses, sha256 of the parameters and of the optimizer's
moments, where the run resumed and how the ranks were started.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hpcckpt
from hpcckpt.training import ResumableSampler, RNGState


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt-dir", default=os.environ.get("HPCCKPT_DIR", "ckpt"))
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--first-run-sleep", type=float, default=0.0)
    ap.add_argument("--crash-at", type=int, nargs=2, metavar=("STEP", "RANK"))
    return ap.parse_args()


def init() -> str:
    """Join the gloo group: torchrun's variables, else Slurm's (plain srun)."""
    how = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "srun"
    if how == "srun":
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
    # A restart whose peers never come fails in 2 minutes, not torch's default 30: the
    # job's short time limit is then left for the wrapper's requeue.
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=120))
    return how


def fingerprint(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    how = init()
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = np.random.default_rng(2024)
    x_all = torch.from_numpy(gen.standard_normal((1024, 16)).astype(np.float32))
    y_all = torch.tanh(x_all @ torch.from_numpy(gen.standard_normal((16, 1)).astype(np.float32)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    sampler = ResumableSampler(len(x_all), size, rank, shuffle=True, seed=1)
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
    ck = hpcckpt.Checkpointer(args.ckpt_dir, every_steps=args.every,
                              replicated=["model", "optim", "sched"])  # fmt: skip
    restored = ck.restore(state)
    resumed_at = state["step"] if restored is not None else None
    ddp = DistributedDataParallel(model)
    first = not int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    sleep = args.first_run_sleep if first else 0.0
    crash = (
        args.crash_at
        if first and not int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        else None
    )
    step = state["step"] + 1
    while step < args.steps:
        if sampler.offset >= sampler.per_rank:
            sampler.set_epoch(sampler.epoch + 1)
        idx = torch.tensor(list(sampler)[:16])
        optim.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x_all[idx]), y_all[idx])
        loss.backward()
        optim.step()
        sched.step()
        sampler.advance(len(idx))
        state["history"].append(loss.item())
        state["step"] = step
        time.sleep(sleep)
        if ck.due(step):
            ck.save(step, state)
            if ck.stop_requested:
                break
        if crash and crash == [step, rank]:
            print(f"rank {rank}: crashing at step {step}", flush=True)
            os._exit(3)
        step += 1
    if ck.stop_requested:
        ck.close()
    else:
        ck.finish()
        histories: list = [None] * size
        dist.all_gather_object(histories, state["history"])
        moments = [v for s in optim.state.values() for k, v in sorted(s.items()) if k != "step"]
        if rank == 0 and args.out:
            with open(args.out, "w") as fh:
                json.dump({
                    "losses": histories,
                    "params": fingerprint(list(model.state_dict().values())),
                    "moments": fingerprint(moments),
                    "resumed_at": resumed_at,
                    "launched_by": how,
                }, fh)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
