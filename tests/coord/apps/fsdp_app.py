"""Test app: FSDP2 training (``fully_shard``, gloo on CPU) through the Checkpointer, under
real mpirun.

    fsdp_app.py DIR --out RESULT.json [--steps N] [--every K] [--stop-at S] [--hang-at S]
                [--api objects|dcp] [--only KEY,KEY] [--reference] [--log FILE]
                [--sleep SECONDS]

A tiny MLP (seed 0) with dropout is sharded with ``fully_shard`` over all ranks (its
weights uneven: 31 rows); AdamW, a cosine schedule, per-rank dropout (torch seeded per
rank, in ``RNGState``) and per-rank batches from a ``ResumableSampler`` are the state.
``--log`` appends each step's losses as it goes (a run that is killed keeps them);
``--sleep`` waits after each step (a run long enough for a signal to land mid-way). A
stop signal (under the ``hpcckpt`` wrapper) saves at the next step and ends the run.
``--api objects`` saves the model and optimizer objects; ``--api dcp`` their state dicts
from ``torch.distributed.checkpoint.state_dict.get_state_dict`` (taken at each save, as
with DCP: the optimizer's learning rate is a plain float in them) and sets them back
with ``set_state_dict``. ``--stop-at S`` saves step S and exits; ``--hang-at S`` saves
step S, writes DIR/saved-S and waits to be killed (in a run that restored nothing).
``--only`` restores just those keys (a resume on another rank count: the per-rank keys
start afresh). ``--reference`` restores the model and optimizer as global tensors (no
DTensor there) and shards them itself with ``distribute_tensor``: the same values
reached without hpcckpt's resharding.

Rank 0 writes RESULT.json: ``losses`` {step: [loss per rank]}, ``local`` (sha256 of each
rank's shards of parameters and optimizer state), ``full`` (sha256 of the gathered
parameters and moments, the same on every rank), ``restored``, ``error``.
"""

import argparse
import gc
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import hpcckpt
from hpcckpt.store.errors import CheckpointError
from hpcckpt.training import ResumableSampler, RNGState

SAMPLES, FEATURES, HIDDEN, BATCH = 64, 8, 31, 4


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--stop-at", type=int, default=-1)
    ap.add_argument("--hang-at", type=int, default=-1)
    ap.add_argument("--api", choices=["objects", "dcp"], default="objects")
    ap.add_argument("--only", default="")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--log", help="rank 0 appends each step's losses here, as JSON lines")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after each step")
    return ap.parse_args()


def start_gloo(comm: MPI.Comm) -> None:
    """torch.distributed from MPI: rank 0 picks a free port, every rank joins over gloo."""
    import socket

    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(comm.bcast(port))
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())


def sha(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def moments(opt):
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            out += [st[k] for k in ("exp_avg", "exp_avg_sq", "step") if k in st]
    return out


def shard_into(model, opt, saved_model: dict, saved_optim: dict) -> None:
    """The reference: global tensors (``saved_*``, restored without DTensors) sharded
    here as the model's own parameters are, with torch's distribute_tensor."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            local(p).copy_(local(distribute_tensor(saved_model[name], p.device_mesh, p.placements)))
    order = [p for group in opt.param_groups for p in group["params"]]
    state = {}
    for i, p in enumerate(order):
        st = saved_optim["state"][i]
        state[i] = {
            k: (v if k == "step" else distribute_tensor(v, p.device_mesh, p.placements))
            for k, v in st.items()
        }
    opt.load_state_dict({"state": state, "param_groups": saved_optim["param_groups"]})


def main() -> int:
    args = parse()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    start_gloo(comm)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(HIDDEN, 1),
    )
    fully_shard(model[0])
    fully_shard(model[3])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    gen = np.random.default_rng(1234)  # the data: the same on every rank
    x = torch.from_numpy(gen.standard_normal((SAMPLES, FEATURES)).astype(np.float32))
    y = x.sum(dim=1, keepdim=True).tanh()
    sampler = ResumableSampler(SAMPLES, size, rank, shuffle=True, seed=7)
    torch.manual_seed(100 + rank)  # per-rank dropout
    state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "data": sampler}
    state["step"] = 0
    if args.api == "dcp":
        state["model"], state["optim"] = get_state_dict(model, opt)
    ck = hpcckpt.Checkpointer(args.directory, comm, every_steps=args.every, keep_last=None)
    result = {"losses": {}, "error": None, "restored": None}
    try:
        if args.reference:
            keys = args.only.split(",")
            held = {k: state[k] for k in keys if k not in ("model", "optim")}
            held.update(model={}, optim={})
            restored = ck.restore(held, only=keys)
            shard_into(model, opt, held["model"], held["optim"])
            state.update({k: v for k, v in held.items() if k not in ("model", "optim")})
        elif args.only:
            keys = args.only.split(",")
            restored = ck.restore({k: state[k] for k in keys}, only=keys)
            state["step"] = comm.bcast(restored)  # an int in the state is not restored in place
        else:
            restored = ck.restore(state)
        if args.api == "dcp" and restored is not None and not args.reference:
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        result["restored"] = restored
        step = 0 if restored is None else restored + 1
        while step < args.steps:
            sampler.set_epoch(step * BATCH // sampler.per_rank)
            idx = list(sampler)[:BATCH]
            model.train()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            sched.step()
            sampler.advance(len(idx))
            result["losses"][step] = comm.gather(float(loss.detach()))
            if args.log and rank == 0:
                with open(args.log, "a") as fh:
                    fh.write(json.dumps({"step": step, "losses": result["losses"][step]}) + "\n")
            state["step"] = step
            if args.sleep:
                time.sleep(args.sleep)
            if ck.due(step) or step in (args.stop_at, args.hang_at):
                if args.api == "dcp":  # as with DCP: the state dicts of this moment
                    state["model"], state["optim"] = get_state_dict(model, opt)
                ck.save(step, state)
                if step == args.stop_at or ck.stop_requested:
                    break
                if step == args.hang_at and restored is None:
                    comm.Barrier()
                    if rank == 0:
                        (open(os.path.join(args.directory, f"saved-{step}"), "w")).close()
                    time.sleep(600)  # killed here by the test
            step += 1
        if step >= args.steps:
            ck.finish()  # done: the wrapper must not requeue
        else:
            ck.close()
    except CheckpointError as exc:
        result["error"] = str(exc)
        return finish(result, comm, 3)
    params = [p for _, p in sorted(model.named_parameters())]
    result["local"] = comm.gather(
        sha([local(p) for p in params] + [local(m) for m in moments(opt)])
    )
    result["full"] = comm.gather(sha([full(p) for p in params] + [full(m) for m in moments(opt)]))
    return finish(result, comm, 0)


def finish(result: dict, comm, code: int) -> int:
    if comm.Get_rank() == 0:
        with open(parse().out, "w") as fh:
            json.dump(result, fh)
    return code


if __name__ == "__main__":
    code = main()
    # gloo's threads may still drop Python objects while the interpreter shuts down (an
    # abort seen here): leave without running the interpreter's finalization.
    dist.destroy_process_group()
    gc.collect()
    MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
