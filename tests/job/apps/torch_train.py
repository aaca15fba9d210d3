"""DDP or FSDP2 training (gloo, CPU) through hpcckpt's Checkpointer with no MPI: started by
torchrun or by plain ``srun`` (rank and size from ``SLURM_PROCID``/``SLURM_NTASKS``).

    torchrun --nproc-per-node=2 torch_train.py --steps 200 --out result.json
    srun --mpi=none -n 2 python torch_train.py ...   # MASTER_ADDR, MASTER_PORT exported

The state: the model, AdamW (its moments), the cosine schedule, this rank's random
generators (torch's for dropout, numpy's and Python's for a jitter of the inputs), its
sampler (the data position), the step and this rank's loss at every step. ``--fsdp``:
the model is sharded with FSDP2's ``fully_shard`` (its parameters and AdamW's moments
DTensors, each rank a band of rows; the last layer's single row on rank 0 only) instead
of replicated by DDP. ``--first-run-sleep S``: seconds per step in a job's first run only
(not a requeued one), so that a time-limit warning always finds it training; it changes
no number. ``--crash-at STEP RANK``: in the job's first run and torchrun's first start,
rank RANK exits 3 at STEP (after that step's checkpoint, if one is due). ``--only KEYS``:
restore just those keys (comma-separated; a resume on another world size), the rest
starts afresh. ``--out`` (rank 0, at the finish): every rank's losses, sha256 of the
parameters and of the optimizer's moments (gathered whole; ``each_moment`` per tensor),
of each rank's shards, of each rank's random generators, each rank's data position, the
same parameter and moment hashes at each checkpoint this run saved (``saved``) and right
after its restore (``restored``), where the run resumed and how the ranks were started.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
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
    ap.add_argument("--fsdp", action="store_true", help="shard with fully_shard, not DDP")
    ap.add_argument("--only", default="", help="restore only these keys (comma-separated)")
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
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (collective); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def moments(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """AdamW's state tensors in parameter order (none before its first step)."""
    out = []
    for group in optim.param_groups:
        for p in group["params"]:
            st = optim.state.get(p, {})
            out += [st[k] for k in ("exp_avg", "exp_avg_sq", "step") if k in st]
    return out


def hashes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of the parameters and of the moments, gathered whole (the same on every rank
    and world size)."""
    params = [whole(p) for _, p in sorted(model.named_parameters())]
    each = [whole(m) for m in moments(optim)]
    return {
        "params": fingerprint(params),
        "moments": fingerprint(each),
        "each_moment": [fingerprint([m])[:16] for m in each],  # which one, when they differ
    }


def rng_hashes() -> dict[str, str]:
    """sha256 of each of this rank's generators: torch's, numpy's and Python's."""
    numpy_state = np.random.get_state(legacy=False)
    return {
        "torch": fingerprint([torch.get_rng_state()]),
        "numpy": hashlib.sha256(
            json.dumps(numpy_state, default=lambda a: a.tolist(), sort_keys=True).encode()
        ).hexdigest(),
        "python": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
    }


def build(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model[3])
        fully_shard(model)
    return model


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    how = init()
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = np.random.default_rng(2024)
    x_all = torch.from_numpy(gen.standard_normal((1024, 16)).astype(np.float32))
    y_all = torch.tanh(x_all @ torch.from_numpy(gen.standard_normal((16, 1)).astype(np.float32)))
    model = build(args)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    sampler = ResumableSampler(len(x_all), size, rank, shuffle=True, seed=1)
    torch.manual_seed(1000 + rank)  # each rank its own dropout masks
    random.seed(2000 + rank)  # and input jitter: all three generators in every loss
    np.random.seed(3000 + rank)
    state = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": RNGState(),
        "data": sampler,
        "step": -1,
        "history": [],
    }
    # FSDP2: no replicated=, each rank's shards differ.
    replicated = [] if args.fsdp else ["model", "optim", "sched"]
    ck = hpcckpt.Checkpointer(args.ckpt_dir, every_steps=args.every, replicated=replicated)
    if args.only:
        keys = args.only.split(",")
        restored = ck.restore({k: state[k] for k in keys}, only=keys)
        if restored is not None:
            state["step"] = restored  # an int in the state is not restored in place
    else:
        restored = ck.restore(state)
    resumed_at = state["step"] if restored is not None else None
    after_restore = hashes(model, optim) if restored is not None else None
    net = model if args.fsdp else DistributedDataParallel(model)
    first = not int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    sleep = args.first_run_sleep if first else 0.0
    crash = (
        args.crash_at
        if first and not int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        else None
    )
    saved: dict[str, dict[str, str]] = {}
    step = state["step"] + 1
    while step < args.steps:
        if sampler.offset >= sampler.per_rank:
            sampler.set_epoch(sampler.epoch + 1)
        idx = torch.tensor(list(sampler)[:16])
        optim.zero_grad()
        jitter = 1e-3 * (random.gauss(0.0, 1.0) + float(np.random.standard_normal()))
        loss = torch.nn.functional.mse_loss(net(x_all[idx] + jitter), y_all[idx])
        loss.backward()
        optim.step()
        sched.step()
        sampler.advance(len(idx))
        state["history"].append(loss.item())
        state["step"] = step
        time.sleep(sleep)
        if ck.due(step):
            ck.save(step, state)
            saved[str(step)] = hashes(model, optim)
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
        per_rank: list = [None] * size
        params = [p for _, p in sorted(model.named_parameters())]
        mine = {
            "losses": state["history"],
            "local": fingerprint([local(t) for t in params + moments(optim)]),
            "rng": rng_hashes(),
            "data": sampler.state_dict(),
        }
        dist.all_gather_object(per_rank, mine)
        final = hashes(model, optim)
        if rank == 0 and args.out:
            with open(args.out, "w") as fh:
                json.dump({
                    "losses": [r["losses"] for r in per_rank],
                    **final,
                    "local": [r["local"] for r in per_rank],
                    "rng": [r["rng"] for r in per_rank],
                    "data": [r["data"] for r in per_rank],
                    "saved": saved,
                    "restored": after_restore,
                    "resumed_at": resumed_at,
                    "launched_by": how,
                    "world_size": size,
                }, fh)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
