"""Save and restore a PyTorch model + AdamW state: hpcckpt against torch.save and DCP.

    mpirun -n 2 python benchmarks/bench_torch.py [--size 512M] [--repeat 3] [--root DIR]

Every rank holds the same MLP (data parallel) and its AdamW state after one step
(weights, ``exp_avg``, ``exp_avg_sq``: about ``--size`` bytes per rank). Each method
saves durably, then restores into the live model and optimizer after the page cache
was dropped (cold read), ``--repeat`` times, the methods interleaved in a rotated
order; the optimizer steps before every save
so every save writes new values. Reported: the median over repetitions of the slowest
rank's seconds, and each method's ratio to ``torch_save``, all from one run.

- ``hpcckpt_replicated``: ``Checkpointer(replicated=["model", "optim"])``: rank 0
  writes the one copy (checked equal on every rank by checksum);
- ``hpcckpt_per_rank``: the same without the declaration: every rank writes its copy;
- ``torch_save``: ``torch.save`` of both state dicts to a file per rank, then fsync;
  restore is ``torch.load`` + ``load_state_dict``;
- ``torch_dcp``: ``torch.distributed.checkpoint.save``/``load`` (gloo, CPU) of
  ``get_state_dict(model, optim)`` (it deduplicates replicated tensors too), then
  ``set_state_dict``.

Writes ``benchmarks/results/torch-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mpi4py import MPI
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util  # noqa: E402

import hpcckpt  # noqa: E402

METHODS = ["hpcckpt_replicated", "hpcckpt_per_rank", "torch_save", "torch_dcp"]


def build(nbytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP of 4 square layers whose weights + AdamW moments take about ``nbytes``."""
    width = int(math.sqrt(nbytes / 12 / 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(optim)
    return model, optim


def step(optim: torch.optim.Optimizer) -> None:
    for group in optim.param_groups:
        for p in group["params"]:
            p.grad = torch.full_like(p, 1e-3)
    optim.step()


def nbytes_of(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in optim.state.values():
        total += sum(v.numel() * v.element_size() for v in st.values())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="512M", help="model + optimizer bytes per rank")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--root", default=os.environ.get("HPCCKPT_BENCH_DIR", "/var/tmp/hpcckpt-bench"))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument("--json", help="where to write the results (default benchmarks/results/)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    root = Path(args.root) / "torch"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    where = (socket.gethostname(), _free_port()) if rank == 0 else None
    host, port = comm.bcast(where)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=size)
    model, optim = build(_util.parse_size(args.size))
    per_rank = nbytes_of(model, optim)
    cold = _util.ColdCache(comm, skip=args.no_drop_caches)

    def timed(fn) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    methods = args.methods.split(",")
    results: dict[str, dict[str, list[float]]] = {m: {"save": [], "restore": []} for m in methods}
    checkpointers = {
        m: hpcckpt.Checkpointer(
            root / m,
            comm,
            every_steps=1,
            keep_last=1,
            incremental=False,
            validate=None,
            replicated=["model", "optim"] if m == "hpcckpt_replicated" else [],
        )
        for m in methods
        if m.startswith("hpcckpt")
    }
    for rep in range(args.repeat):
        # Interleaved, in a rotated order per repetition: the disk's drift spreads evenly.
        for method in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
            step(optim)
            ck = checkpointers.get(method)
            save, load = operations(
                method, root / method / f"rep{rep}", rep, model, optim, ck, rank
            )
            results[method]["save"].append(timed(save))
            cold()
            results[method]["restore"].append(timed(load))
            comm.Barrier()
    for ck in checkpointers.values():
        ck.close()
    if rank == 0:
        for method, r in results.items():
            each = " ".join(
                f"{a:.2f}/{b:.2f}" for a, b in zip(r["save"], r["restore"], strict=True)
            )
            print(
                f"{method:20s} save {statistics.median(r['save']):6.2f} s  "
                f"restore {statistics.median(r['restore']):6.2f} s  (save/restore: {each})",
                flush=True,
            )
    if rank == 0:
        base = results.get("torch_save")
        summary = {}
        for method, r in results.items():
            s, l = statistics.median(r["save"]), statistics.median(r["restore"])
            summary[method] = {"save_s": s, "restore_s": l}
            if base:
                summary[method]["save_vs_torch_save"] = s / statistics.median(base["save"])
                summary[method]["restore_vs_torch_save"] = l / statistics.median(base["restore"])
        print(json.dumps(summary, indent=1))
        stamp = time.strftime("torch-%Y%m%dT%H%M%SZ.json", time.gmtime())
        out = Path(args.json) if args.json else Path(__file__).resolve().parent / "results" / stamp
        out.write_text(
            json.dumps(
                {
                    "ranks": size,
                    "bytes_per_rank": per_rank,
                    "repeat": args.repeat,
                    "root": str(root),
                    "torch": torch.__version__,
                    "drop_problem": cold.problem,
                    "runs": results,
                    "summary": summary,
                },
                indent=1,
            )
        )
        print(f"written {out}")
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


def operations(method, d: Path, rep: int, model, optim, ck, rank: int):
    """(save, load) of one repetition of ``method``: callables without arguments."""
    state = {"model": model, "optim": optim}
    if ck is not None:
        return (lambda: ck.save(rep, state)), (lambda: ck.restore(state))
    if method == "torch_save":
        path = d / f"rank{rank}.pt"
        d.mkdir(parents=True, exist_ok=True)

        def save() -> None:
            torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
            _util.fsync_path(path)

        def load() -> None:
            sd = torch.load(path, weights_only=True)
            model.load_state_dict(sd["model"])
            optim.load_state_dict(sd["optim"])

        return save, load

    def dcp_save() -> None:
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d))

    def dcp_load() -> None:
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(d))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    return dcp_save, dcp_load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
