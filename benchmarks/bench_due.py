"""Per-step overhead of ``Checkpointer.due(step)`` when nothing is due; run under mpirun.

    mpirun -n 2 .venv/bin/python -m mpi4py benchmarks/bench_due.py [--calls 100000]

Each call is timed on its own (``perf_counter_ns``); the report gives, per
configuration, the median, mean and 99th percentile in microseconds (the slowest
rank's figure), next to a bare ``Iallreduce`` + ``Wait`` of the same three int32
(the MPI floor that ``due`` pays once per call). Configurations: ``every_steps``
only (no time policy), a fixed interval, and the default Daly policy. The goal is
a median of at most 50 us. ``--json FILE`` writes the numbers (rank 0).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcckpt.coord.checkpointer import Checkpointer  # noqa: E402

GOAL_US = 50.0


def stats(ns: np.ndarray, comm: MPI.Comm) -> dict:
    us = ns / 1e3
    mine = {
        "median_us": float(np.median(us)),
        "mean_us": float(us.mean()),
        "p99_us": float(np.percentile(us, 99)),
    }
    every = comm.allgather(mine)
    return {k: max(m[k] for m in every) for k in mine}


def time_calls(fn, calls: int) -> np.ndarray:
    out = np.empty(calls, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(calls):
        t0 = clock()
        fn(i)
        out[i] = clock() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcckpt-due-") if rank == 0 else None))
    results = {}

    send = np.zeros(3, dtype=np.int32)
    recv = np.zeros(3, dtype=np.int32)

    def bare(_i: int) -> None:
        comm.Iallreduce(send, recv, op=MPI.MAX).Wait()

    configs = {
        "every_steps=10**9": {"every_steps": 10**9},
        "interval=1e6 s (fixed)": {"interval": 1e6},
        "default (daly, mtbf=1y)": {"mtbf": "365d"},
    }
    try:
        comm.Barrier()
        time_calls(bare, min(args.calls, 1000))  # warm up
        results["bare Iallreduce+Wait"] = stats(time_calls(bare, args.calls), comm)
        for name, kwargs in configs.items():
            d = root / name.split()[0].replace("*", "").replace("=", "")
            ck = Checkpointer(d, comm, **kwargs)
            try:
                fired = [0]

                def call(i: int, ck: Checkpointer = ck, fired: list = fired) -> None:
                    if ck.due(i + 1):
                        fired[0] += 1

                comm.Barrier()
                ns = time_calls(call, args.calls)
                results[name] = stats(ns, comm)
                results[name]["fired"] = comm.allreduce(fired[0])
            finally:
                ck.close()
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    if rank == 0:
        print(f"Checkpointer.due(step), nothing due, {comm.Get_size()} ranks, {args.calls} calls")
        print(f"{'configuration':28} {'median us':>10} {'mean us':>9} {'p99 us':>8}")
        for name, s in results.items():
            print(f"{name:28} {s['median_us']:10.2f} {s['mean_us']:9.2f} {s['p99_us']:8.2f}")
        worst = max(s["median_us"] for n, s in results.items() if not n.startswith("bare"))
        verdict = "met" if worst <= GOAL_US else "NOT met"
        print(f"goal: median <= {GOAL_US:.0f} us per call: {verdict} (worst median {worst:.2f} us)")
        if any(s.get("fired") for s in results.values()):
            print("warning: due() returned True during the run")
        if args.json:
            doc = {
                "calls": args.calls,
                "nranks": comm.Get_size(),
                "goal_us": GOAL_US,
                "results": results,
            }
            args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
