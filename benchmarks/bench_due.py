"""Per-step overhead of ``Checkpointer.due(step)`` when nothing is due, over MPI or gloo.

    mpirun -n 2 .venv/bin/python -m mpi4py benchmarks/bench_due.py [--calls 100000]
    .venv/bin/torchrun --nproc-per-node=2 benchmarks/bench_due.py --backend torch
    .venv/bin/python benchmarks/bench_due.py --backend torch   # starts 2 gloo ranks itself

Each call is timed on its own (``perf_counter_ns``); the report gives, per
configuration, the median, mean and 99th percentile in microseconds (the slowest
rank's figure), next to the bare non-blocking all-reduce of the same three int32 that
``due`` pays once per call: ``Iallreduce`` + ``Wait`` over MPI, ``all_reduce(async_op=True)``
+ ``wait`` over a torch.distributed gloo group (``--backend torch``; the ranks from
torchrun's variables, else ``--nproc`` processes started here with torch.multiprocessing).
Configurations: ``every_steps`` only (no time policy), a fixed interval, and the default
Daly policy. The goal is a median of at most 50 us (over gloo, whose one all-reduce
alone costs more: at most 50 us more than the bare all-reduce). ``--json FILE`` writes the numbers
(rank 0). :func:`measure` is what ``bench_backends.py`` runs in its ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcckpt.coord.checkpointer import Checkpointer  # noqa: E402
from hpcckpt.store.comm import Comm, as_comm  # noqa: E402

GOAL_US = 50.0
BACKENDS = ("mpi", "torch")


class Backend:
    """One backend's ranks: the communicator users pass (``native``), hpcckpt's view of it
    (``comm``), and the bare all-reduce ``due`` is measured against (``bare``, ``floor``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        send = np.zeros(3, dtype=np.int32)
        recv = np.zeros(3, dtype=np.int32)
        if name == "mpi":
            from mpi4py import MPI

            native: Any = MPI.COMM_WORLD

            def bare(_i: int) -> None:
                native.Iallreduce(send, recv, op=MPI.MAX).Wait()

            self.floor = "bare Iallreduce+Wait"
        elif name == "torch":
            import torch
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo", init_method="env://")
            native = dist.group.WORLD
            tensor = torch.from_numpy(recv)

            def bare(_i: int) -> None:
                dist.all_reduce(tensor, dist.ReduceOp.MAX, async_op=True).wait()

            self.floor = "bare all_reduce(async)+wait"
        else:
            raise ValueError(f"backend {name!r}: expected one of {', '.join(BACKENDS)}")
        self.native = native
        self.comm: Comm = as_comm(native)
        self.bare: Callable[[int], None] = bare

    def close(self) -> None:
        if self.name == "torch":
            import torch.distributed as dist

            dist.destroy_process_group()


def stats(ns: np.ndarray, comm: Comm) -> dict:
    us = ns / 1e3
    mine = {
        "median_us": float(np.median(us)),
        "mean_us": float(us.mean()),
        "p99_us": float(np.percentile(us, 99)),
    }
    every = comm.allgather(mine)
    return {k: max(m[k] for m in every) for k in mine}


def time_calls(fn: Callable[[int], Any], calls: int) -> np.ndarray:
    out = np.empty(calls, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(calls):
        t0 = clock()
        fn(i)
        out[i] = clock() - t0
    return out


CONFIGS = {
    "every_steps=10**9": {"every_steps": 10**9},
    "interval=1e6 s (fixed)": {"interval": 1e6},
    "default (daly, mtbf=1y)": {"mtbf": "365d"},
}


def measure(backend: Backend, calls: int) -> dict[str, dict]:
    """The bare all-reduce and ``due`` in each configuration, ``calls`` calls each
    (collective); the slowest rank's median, mean and p99 per entry."""
    comm = backend.comm
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcckpt-due-") if comm.rank == 0 else None))
    results: dict[str, dict] = {}
    try:
        comm.barrier()
        time_calls(backend.bare, min(calls, 1000))  # warm up
        results[backend.floor] = stats(time_calls(backend.bare, calls), comm)
        for name, kwargs in CONFIGS.items():
            d = root / name.split()[0].replace("*", "").replace("=", "")
            ck = Checkpointer(d, backend.native, **kwargs)
            try:
                fired = [0]

                def call(i: int, ck: Checkpointer = ck, fired: list = fired) -> None:
                    if ck.due(i + 1):
                        fired[0] += 1

                comm.barrier()
                ns = time_calls(call, calls)
                results[name] = stats(ns, comm)
                results[name]["fired"] = int(comm.allreduce(fired[0], "sum"))
            finally:
                ck.close()
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return results


def report(results: dict[str, dict], backend: str, nranks: int, calls: int) -> list[str]:
    lines = [
        f"Checkpointer.due(step), nothing due, {backend}, {nranks} ranks, {calls} calls",
        f"{'configuration':28} {'median us':>10} {'mean us':>9} {'p99 us':>8}",
    ]
    for name, s in results.items():
        lines.append(f"{name:28} {s['median_us']:10.2f} {s['mean_us']:9.2f} {s['p99_us']:8.2f}")
    worst = max(s["median_us"] for n, s in results.items() if not n.startswith("bare"))
    floor = next(s["median_us"] for n, s in results.items() if n.startswith("bare"))
    goal, what = GOAL_US, f"{GOAL_US:.0f} us per call"
    if backend == "torch":  # gloo's one all-reduce alone costs more than the MPI goal
        goal, what = floor + GOAL_US, f"the bare all-reduce + {GOAL_US:.0f} us ({floor:.2f} us)"
    verdict = "met" if worst <= goal else "NOT met"
    lines.append(f"goal: median <= {what}: {verdict} (worst median {worst:.2f} us)")
    if any(s.get("fired") for s in results.values()):
        lines.append("warning: due() returned True during the run")
    return lines


def run(args: argparse.Namespace) -> None:
    backend = Backend(args.backend)
    try:
        results = measure(backend, args.calls)
        comm = backend.comm
        if comm.rank == 0:
            print("\n".join(report(results, args.backend, comm.size, args.calls)))
            if args.json:
                doc = {
                    "backend": args.backend,
                    "calls": args.calls,
                    "nranks": comm.size,
                    "goal_us": GOAL_US,
                    "results": results,
                }
                args.json.write_text(json.dumps(doc, indent=1))
    finally:
        backend.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, nproc: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    run(args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--backend", choices=BACKENDS, default="mpi")
    p.add_argument("--nproc", type=int, default=2, help="torch ranks started here without torchrun")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.backend == "torch" and "RANK" not in os.environ:
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(args.nproc, free_port(), args), nprocs=args.nproc)
        return
    run(args)


if __name__ == "__main__":
    main()
