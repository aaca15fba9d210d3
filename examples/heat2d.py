"""2-D heat equation, rows split over MPI ranks, checkpointed with hpcckpt.

Explicit finite differences on an NX x NY grid with fixed (zero) boundaries and a
hot square in the middle. Each rank owns a band of rows plus one ghost row on each
side, exchanged with its neighbours every step. The run is deterministic, so a run
that was stopped and resumed any number of times ends bit-identical to one that
ran straight through.

    mpirun -n 2 python examples/heat2d.py --ckpt-dir ckpt --steps 2000 --out u.npy
    sbatch examples/heat2d.sbatch          # under Slurm, through the hpcckpt wrapper
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np
from mpi4py import MPI

import hpcckpt


def band(n: int, nranks: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) owned by ``rank`` when ``n`` rows are split as evenly as possible."""
    base, extra = divmod(n, nranks)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def initial_field(nx: int, ny: int, lo: int, hi: int) -> np.ndarray:
    """This rank's rows of the initial field, with one ghost row above and below."""
    up = np.zeros((hi - lo + 2, ny))
    rows = np.arange(lo, hi)
    hot = (rows >= nx // 3) & (rows < 2 * nx // 3)
    up[1:-1][hot, ny // 3 : 2 * ny // 3] = 100.0
    return up


def exchange_halos(comm: MPI.Comm, up: np.ndarray) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    above = rank - 1 if rank > 0 else MPI.PROC_NULL
    below = rank + 1 if rank < size - 1 else MPI.PROC_NULL
    comm.Sendrecv(up[1], dest=above, recvbuf=up[-1], source=below)
    comm.Sendrecv(up[-2], dest=below, recvbuf=up[0], source=above)


def advance(comm: MPI.Comm, up: np.ndarray, alpha: float) -> None:
    """One explicit step of u_t = alpha * laplace(u) on the interior rows (in place)."""
    exchange_halos(comm, up)
    lap = np.zeros_like(up[1:-1])
    lap[:, 1:-1] = (
        up[:-2, 1:-1] + up[2:, 1:-1] + up[1:-1, :-2] + up[1:-1, 2:] - 4.0 * up[1:-1, 1:-1]
    )
    up[1:-1] += alpha * lap


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nx", type=int, default=256)
    p.add_argument("--ny", type=int, default=256)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument(
        "--alpha", type=float, default=0.2, help="diffusion number, < 0.25 for stability"
    )
    p.add_argument(
        "--ckpt-dir", default=os.environ.get("HPCCKPT_DIR"), help="default: $HPCCKPT_DIR"
    )
    p.add_argument("--interval", type=float, default=None, help="seconds between checkpoints")
    p.add_argument("--every", type=int, default=None, help="checkpoint every N steps")
    p.add_argument(
        "--sleep", type=float, default=0.0, help="seconds of extra work per step (demos)"
    )
    p.add_argument("--crash-at", type=int, default=None, help="rank 1 dies at this step (tests)")
    p.add_argument("--out", default=None, help="write the final global field here (.npy)")
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    lo, hi = band(args.nx, comm.Get_size(), rank)
    up = initial_field(args.nx, args.ny, lo, hi)
    state = {"u": up[1:-1], "t": 0.0}

    ck = hpcckpt.Checkpointer(
        args.ckpt_dir, comm=comm, interval=args.interval, every_steps=args.every
    )
    last = ck.restore(state)
    start = 0 if last is None else last + 1
    for step in range(start, args.steps):
        advance(comm, up, args.alpha)
        state["t"] += args.alpha
        if args.sleep:
            time.sleep(args.sleep)
        if (
            args.crash_at is not None
            and step == args.crash_at
            and rank == min(1, comm.Get_size() - 1)
        ):
            os._exit(17)
        if ck.due(step):
            ck.save(step, state)
            if ck.stop_requested:
                break
    else:
        ck.finish()
        field = comm.gather(state["u"], root=0)
        if rank == 0:
            u = np.concatenate(field)
            digest = hashlib.sha256(u.tobytes()).hexdigest()[:16]
            print(
                f"heat2d: finished {args.steps} steps, t={state['t']:.3f}, "
                f"sum={u.sum():.6f}, sha256={digest}"
            )
            if args.out:
                np.save(args.out, u)


if __name__ == "__main__":
    main()
