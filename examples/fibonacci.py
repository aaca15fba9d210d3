"""Huge Fibonacci-like numbers, exact, one sequence per MPI rank, checkpointed with hpcckpt.

Rank r runs the recurrence G(n + 1) = G(n) + G(n - 1) from the seeds G(0) = r,
G(1) = 1: rank 0 computes the Fibonacci numbers F(n), rank 1 F(n + 1), rank 2 the
Lucas numbers, and in general G_r(n) = r * F(n - 1) + F(n). Each step advances the
sequence by --per-step positions; after STEPS steps rank 0 holds F(N) with
N = STEPS * PER_STEP (F(10000) has 2090 decimal digits by default).

The state of each rank is three Python ints, with no fixed width:

- ``n``: the position, and ``a``, ``b``: G(n) and G(n + 1), thousands of bits long.

The checkpoint stores Python ints exactly (as JSON integers, never through a float
or a 64-bit integer), and every rank gets back its own numbers, so a resumed run ends
with exactly the integers of an uninterrupted one. The end checks that: rank 0
recomputes F(N - 1) and F(N) by fast doubling, an independent algorithm, and checks
every rank's G_r(N) against r * F(N - 1) + F(N).

The ranks do no communication while they compute; they still take part in every
checkpoint, because a checkpoint is one file holding every rank's state.

    mpirun -n 3 python examples/fibonacci.py --ckpt-dir ckpt --every 20
    sbatch examples/fibonacci.sbatch           # under Slurm, through the hpcckpt wrapper
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time

from mpi4py import MPI

import hpcckpt


def advance(a: int, b: int, count: int) -> tuple[int, int]:
    """(G(n + count), G(n + count + 1)) from (G(n), G(n + 1))."""
    for _ in range(count):
        a, b = b, a + b
    return a, b


def fib_pair(n: int) -> tuple[int, int]:
    """(F(n), F(n + 1)) by fast doubling, O(log n) big-int products.

    F(2k) = F(k) (2 F(k+1) - F(k)) and F(2k+1) = F(k)^2 + F(k+1)^2.
    """
    a, b = 0, 1
    for bit in bin(n)[2:]:
        a, b = a * (2 * b - a), a * a + b * b
        if bit == "1":
            a, b = b, a + b
    return a, b


def decimal_digits(x: int) -> int:
    """Number of decimal digits of ``x`` >= 0 (str(x) refuses more than 4300 digits)."""
    if x == 0:
        return 1
    d = max(1, int((x.bit_length() - 1) * math.log10(2)))  # 10**(d-1) <= x
    while 10**d <= x:
        d += 1
    return d


def digest(x: int) -> str:
    return hashlib.sha256(x.to_bytes((x.bit_length() + 7) // 8 or 1, "big")).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--per-step", type=int, default=100, help="positions advanced per step")
    p.add_argument(
        "--ckpt-dir", default=os.environ.get("HPCCKPT_DIR"), help="default: $HPCCKPT_DIR"
    )
    p.add_argument("--interval", type=float, default=None, help="seconds between checkpoints")
    p.add_argument("--every", type=int, default=None, help="checkpoint every N steps")
    p.add_argument(
        "--sleep", type=float, default=0.0, help="seconds of extra work per step (demos)"
    )
    p.add_argument("--crash-at", type=int, default=None, help="rank 1 dies at this step (tests)")
    p.add_argument("--out", default=None, help="write F(N) and every rank's digest here (JSON)")
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank, nranks = comm.Get_rank(), comm.Get_size()
    state = {"n": 0, "a": rank, "b": 1}

    ck = hpcckpt.Checkpointer(
        args.ckpt_dir, comm=comm, interval=args.interval, every_steps=args.every
    )
    last = ck.restore(state)  # replaces the ints in ``state``: always read them from there
    start = 0 if last is None else last + 1
    if state["n"] != start * args.per_step:
        print(
            f"fibonacci[{rank}]: the checkpoint of step {last} is at position {state['n']}, "
            f"not {start * args.per_step}: was it written with another --per-step?",
            file=sys.stderr,
        )
        ck.close()
        sys.exit(2)  # every rank holds the same n, so every rank leaves here
    for step in range(start, args.steps):
        state["a"], state["b"] = advance(state["a"], state["b"], args.per_step)
        state["n"] += args.per_step
        if args.sleep:
            time.sleep(args.sleep)
        crash_rank = min(1, nranks - 1)
        if args.crash_at is not None and step == args.crash_at and rank == crash_rank:
            os._exit(17)
        if ck.due(step):
            ck.save(step, state)
            if ck.stop_requested:
                break
    else:
        ck.finish()
        n = state["n"]
        values = comm.gather(state["a"], root=0)
        if rank == 0:
            f_prev, f_n = fib_pair(n - 1) if n > 0 else (1, 0)  # F(-1) = 1
            if values[0] != f_n:
                sys.exit(f"fibonacci: F({n}) differs from fast doubling")
            for r, g in enumerate(values):
                if g != r * f_prev + f_n:
                    sys.exit(f"fibonacci: rank {r}'s G({n}) is not {r} * F({n - 1}) + F({n})")
            print(
                f"fibonacci: F({n}) has {decimal_digits(f_n)} digits, sha256 {digest(f_n)[:16]}; "
                f"the {nranks} ranks' sequences agree with fast doubling"
            )
            if args.out:
                result = {
                    "n": n,
                    "digits": decimal_digits(f_n),
                    "sha256": digest(f_n),
                    "hex": hex(f_n),  # hex, unlike str(), has no 4300-digit limit
                    "rank_sha256": [digest(g) for g in values],
                }
                with open(args.out, "w") as fh:
                    fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
