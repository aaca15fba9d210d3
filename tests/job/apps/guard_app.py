"""A small checkpointed MPI app for the hang and poisoned-state tests.

Each rank holds a slice of a 1-D field; every step smooths it with its ring neighbours
(Sendrecv) and agrees on the global sum (Allreduce), so one silent rank blocks the
others inside MPI, like a real hang. Test hooks:

--hang-at STEP --hang-rank R   rank R sleeps forever at STEP (only while --marker FILE
                               does not exist; it creates FILE first, so the next
                               attempt runs through)
--nan-at STEP --nan-rank R     rank R writes a NaN into its field at STEP (before the
                               checkpoint of that step)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import hpcckpt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", default=os.environ.get("HPCCKPT_DIR"))
    p.add_argument("--n", type=int, default=4096, help="elements per rank")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--hang-at", type=int, default=None)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--marker", default=None)
    p.add_argument("--nan-at", type=int, default=None)
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--nan-array", default="u")
    p.add_argument("--validate", default="finite", choices=["finite", "none", "positive"])
    p.add_argument("--out", default=None)
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.linspace(0, 1, args.n * size)[rank * args.n : (rank + 1) * args.n]
    state = {"u": np.sin(7 * x) + rank, "v": np.zeros(args.n, dtype=np.complex128), "t": 0.0}
    validate = {"finite": "finite", "none": None, "positive": _positive}[args.validate]
    ck = hpcckpt.Checkpointer(args.ckpt_dir, comm=comm, every_steps=args.every, validate=validate)
    last = ck.restore(state)
    start = 0 if last is None else last + 1
    left, right = (rank - 1) % size, (rank + 1) % size
    for step in range(start, args.steps):
        u = state["u"]
        halo_l = comm.sendrecv(u[-1], dest=right, source=left)
        halo_r = comm.sendrecv(u[0], dest=left, source=right)
        padded = np.concatenate([[halo_l], u, [halo_r]])
        u[:] = 0.25 * padded[:-2] + 0.5 * padded[1:-1] + 0.25 * padded[2:]
        state["v"] += 1j * u
        state["t"] += comm.allreduce(float(u.sum()))
        if args.sleep:
            time.sleep(args.sleep)
        if step == args.hang_at and rank == args.hang_rank % size:
            marker = Path(args.marker) if args.marker else None
            if marker is None or not marker.exists():
                if marker is not None:
                    marker.write_text(str(os.getpid()))
                print(f"guard_app: rank {rank} hangs at step {step}", file=sys.stderr, flush=True)
                while True:
                    time.sleep(3600)
        if step == args.nan_at and rank == args.nan_rank % size:
            state[args.nan_array][len(state[args.nan_array]) // 2] = np.nan
        if ck.due(step):
            ck.save(step, state)
            if ck.stop_requested:
                return
    ck.finish()
    field = comm.gather(state["u"], root=0)
    if rank == 0:
        print(f"guard_app: finished {args.steps} steps, t={state['t']:.6f}", flush=True)
        if args.out:
            np.save(args.out, np.concatenate(field))


def _positive(state: dict) -> bool | str:
    return True if state["t"] >= 0 else f"t is negative ({state['t']})"


if __name__ == "__main__":
    main()
