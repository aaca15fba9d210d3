"""Test app: data-parallel torch training through the Checkpointer, under real mpirun.

    torch_app.py DIR --out RESULT.json [--steps N] [--every K] [--stop-at S]
                 [--mode sync|async|cache] [--cache PATH] [--no-replicated]
                 [--diverge-at S] [--only KEY,KEY] [--full-incremental]

Every rank builds the same MLP (seed 0) with dropout, AdamW and a cosine schedule; each
rank draws its own batches through a ResumableSampler (shuffled, rank-split) and its
own dropout masks (torch seeded per rank); gradients are averaged over the ranks with
MPI, as DistributedDataParallel does, so the model and optimizer stay identical on every
rank and are declared replicated (unless --no-replicated). A synthetic dataset is made
by the script. ``--stop-at S`` stops after the checkpoint of step S, as a stop signal
would; a second run resumes. ``--diverge-at S`` perturbs a parameter on the last rank at
step S (a replicated value that is not). ``--only`` restores just those keys and exits.

Rank 0 writes RESULT.json: ``losses`` {step: [loss per rank]} of the steps this run made,
``params`` (sha256 of the final parameters and optimizer state per rank), ``restored``,
``saves`` (kind of each save) and ``error`` (a CheckpointError's text, exit 3).
"""

import argparse
import hashlib
import json
import sys

import numpy as np
import torch
from mpi4py import MPI

import hpcckpt
from hpcckpt.store.errors import CheckpointError
from hpcckpt.training import ResumableSampler, RNGState

SAMPLES, FEATURES, BATCH = 96, 8, 8


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--stop-at", type=int, default=-1)
    ap.add_argument("--mode", choices=["sync", "async", "cache"], default="sync")
    ap.add_argument("--cache")
    ap.add_argument("--no-replicated", action="store_true")
    ap.add_argument("--diverge-at", type=int, default=-1)
    ap.add_argument("--only", default="")
    return ap.parse_args()


def digest(obj) -> str:
    h = hashlib.sha256()
    if isinstance(obj, torch.nn.Module):
        for k, v in obj.state_dict().items():
            h.update(k.encode())
            h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
    for pid, st in sorted(obj.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}/{k}".encode())
            h.update(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(obj.state_dict()["param_groups"], sort_keys=True).encode())
    return h.hexdigest()


def main() -> int:
    args = parse()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(32, 1),
    )
    # A frozen lookup table: its blocks never change, so saves after the first are incremental.
    model.register_buffer("table", torch.arange(16384, dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    gen = np.random.default_rng(1234)  # the data: the same on every rank
    x = torch.from_numpy(gen.standard_normal((SAMPLES, FEATURES)).astype(np.float32))
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.from_numpy(
        gen.standard_normal((SAMPLES, 1)).astype(np.float32)
    )
    sampler = ResumableSampler(SAMPLES, size, rank, shuffle=True, seed=7)
    torch.manual_seed(100 + rank)  # per-rank dropout
    rng = RNGState()
    state = {"model": model, "optim": opt, "sched": sched, "rng": rng, "data": sampler, "step": 0}
    kwargs = {}
    if args.mode == "async":
        kwargs["async_save"] = True
    if args.mode == "cache":
        kwargs["cache"] = args.cache
    ck = hpcckpt.Checkpointer(
        args.directory,
        comm,
        every_steps=args.every,
        keep_last=None,
        block_size=4096,
        min_delta_saving=0,  # a small model: deltas however little they leave out
        replicated=[] if args.no_replicated else ["model", "optim", "sched"],
        **kwargs,
    )
    result = {"losses": {}, "saves": [], "error": None, "restored": None}
    try:
        if args.only:
            keys = args.only.split(",")
            result["restored"] = ck.restore({k: state[k] for k in keys}, only=keys)
            result["params"] = comm.gather([digest(model), digest(opt)])
            ck.close()
            return finish(result, comm, 0)
        restored = ck.restore(state)
        result["restored"] = restored
        step = 0 if restored is None else state["step"] + 1
        while step < args.steps:
            sampler.set_epoch(step * BATCH // sampler.per_rank)
            idx = list(sampler)[:BATCH]
            model.train()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            for p in model.parameters():  # average gradients, as DDP does
                buf = p.grad.numpy()
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                buf /= size
            opt.step()
            sched.step()
            sampler.advance(len(idx))
            if step == args.diverge_at and rank == size - 1:
                with torch.no_grad():
                    model[0].weight[0, 0] += 1.0
            result["losses"][step] = comm.gather(float(loss.detach()))
            state["step"] = step
            if ck.due(step) or step == args.stop_at:
                saved = ck.save(step, state)
                result["saves"].append([step, saved.kind if saved else None])
                if step == args.stop_at:
                    ck.close()
                    result["params"] = comm.gather([digest(model), digest(opt)])
                    return finish(result, comm, 0)
            step += 1
        ck.finish()
    except CheckpointError as exc:
        result["error"] = str(exc)
        return finish(result, comm, 3)
    result["params"] = comm.gather([digest(model), digest(opt)])
    return finish(result, comm, 0)


def finish(result: dict, comm, code: int) -> int:
    if comm.Get_rank() == 0:
        with open(parse().out, "w") as fh:
            json.dump(result, fh)
    return code


if __name__ == "__main__":
    sys.exit(main())
