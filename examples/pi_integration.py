"""Pi by the midpoint rule, the intervals split over MPI ranks, checkpointed with hpcckpt.

    pi = integral from 0 to 1 of 4 / (1 + x^2) dx

The interval [0, 1] is cut into N = STEPS * CHUNK equal intervals of width h. Step i
handles the CHUNK intervals [i * CHUNK, (i + 1) * CHUNK); each rank evaluates the
integrand at the midpoints of its own band of them and adds their sum to its running
partial sum. At the end one allreduce adds the partial sums and multiplies by h.

The state is what a rank would lose if it died:

- ``partial``: this rank's running sum, a Python float. It goes into the checkpoint
  as the float's shortest round-trip text, so it comes back bit for bit (a numpy
  scalar such as ``np.float64`` would also round-trip exactly);
- the step: ``restore`` returns the last completed step, and the loop goes on with
  the next one, so no chunk is added twice or skipped;
- ``config``: the problem size. Resuming a checkpoint of another N would add partial
  sums of different grids, so the run refuses it.

Every rank adds the same numbers in the same order whether or not the run was
interrupted, so a resumed run prints exactly the digits of an uninterrupted one
(with the same number of ranks; another rank count groups the additions differently
and may change the last bits).

    mpirun -n 2 python examples/pi_integration.py --ckpt-dir ckpt --every 100
    sbatch examples/pi_integration.sbatch      # under Slurm, through the hpcckpt wrapper
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import hpcckpt


def band(n: int, nranks: int, rank: int) -> tuple[int, int]:
    """Items [lo, hi) owned by ``rank`` when ``n`` items are split as evenly as possible."""
    base, extra = divmod(n, nranks)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def chunk_sum(step: int, chunk: int, h: float, comm: MPI.Comm) -> float:
    """This rank's sum of 4 / (1 + x^2) over its midpoints of chunk ``step``."""
    lo, hi = band(chunk, comm.Get_size(), comm.Get_rank())
    first = step * chunk
    x = (np.arange(first + lo, first + hi, dtype=np.float64) + 0.5) * h
    return float(np.sum(4.0 / (1.0 + x * x)))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=1000, help="number of chunks")
    p.add_argument("--chunk", type=int, default=100_000, help="intervals per chunk (all ranks)")
    p.add_argument(
        "--ckpt-dir", default=os.environ.get("HPCCKPT_DIR"), help="default: $HPCCKPT_DIR"
    )
    p.add_argument("--interval", type=float, default=None, help="seconds between checkpoints")
    p.add_argument("--every", type=int, default=None, help="checkpoint every N steps")
    p.add_argument(
        "--sleep", type=float, default=0.0, help="seconds of extra work per step (demos)"
    )
    p.add_argument("--crash-at", type=int, default=None, help="rank 1 dies at this step (tests)")
    p.add_argument("--out", default=None, help="write the result here (JSON)")
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    intervals = args.steps * args.chunk
    h = 1.0 / intervals
    config = {"steps": args.steps, "chunk": args.chunk}
    state = {"partial": 0.0, "config": dict(config)}

    ck = hpcckpt.Checkpointer(
        args.ckpt_dir, comm=comm, interval=args.interval, every_steps=args.every
    )
    last = ck.restore(state)  # replaces the scalars in ``state``: read them from there
    if state["config"] != config:
        if rank == 0:
            print(
                f"pi_integration: {args.ckpt_dir} holds a run with {state['config']}, "
                f"not {config}; use another --ckpt-dir",
                file=sys.stderr,
            )
        ck.close()
        sys.exit(2)  # every rank restored the same config, so every rank leaves here
    start = 0 if last is None else last + 1
    for step in range(start, args.steps):
        state["partial"] += chunk_sum(step, args.chunk, h, comm)
        if args.sleep:
            time.sleep(args.sleep)
        crash_rank = min(1, comm.Get_size() - 1)
        if args.crash_at is not None and step == args.crash_at and rank == crash_rank:
            os._exit(17)
        if ck.due(step):
            ck.save(step, state)
            if ck.stop_requested:
                break
    else:
        ck.finish()
        pi = comm.allreduce(state["partial"], op=MPI.SUM) * h
        if rank == 0:
            error = pi - math.pi
            # The midpoint rule's error is -(f'(1) - f'(0)) h^2 / 24 = h^2 / 12 here;
            # below about 1e-13 rounding in the sums dominates.
            print(
                f"pi_integration: {intervals} intervals on {comm.Get_size()} ranks: "
                f"pi ~ {pi!r} ({pi.hex()}), error {error:.3e} (midpoint rule predicts "
                f"{h * h / 12:.3e})"
            )
            if args.out:
                result = {
                    "pi": pi,
                    "hex": pi.hex(),
                    "error": error,
                    "intervals": intervals,
                    "ranks": comm.Get_size(),
                }
                with open(args.out, "w") as fh:
                    fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
