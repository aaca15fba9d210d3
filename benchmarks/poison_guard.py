"""Cost of the poisoned-state guard ("finite") next to the save it protects.

    mpirun -n 2 python benchmarks/poison_guard.py --mib 256 --dir /tmp/pg

Each rank holds MIB/nranks MiB of float64. Prints, per repetition, the slowest rank's
seconds for: the finite check (hpcckpt.coord.validate.check_finite), the block hashing a
save does anyway (hpcckpt.store.io.blocks.block_hashes), a prototype of the check fused
into the hashing loop (what fusing would save), and a full durable save (CheckpointStore,
not incremental). The best of --repeat is reported.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import xxhash
from mpi4py import MPI

from hpcckpt.coord import validate
from hpcckpt.store.io import blocks
from hpcckpt.store.store import CheckpointStore


def fused(a: np.ndarray, block: int = 1 << 20) -> bool:
    """Prototype: hash each 1 MiB block and check it while it is in cache."""
    flat = a.reshape(-1)
    n = block // a.itemsize
    ok = True
    digest = xxhash.xxh3_64_intdigest
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, flat.size, n):
            b = flat[lo : lo + n]
            digest(memoryview(b).cast("B"))
            ok &= bool(np.isfinite(np.add.reduce(b)))
    return ok


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256, help="total state, all ranks")
    p.add_argument("--dir", default="/tmp/hpcckpt-poison-bench")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = args.mib * 2**20 // 8 // size
    state = {"u": np.random.default_rng(rank).standard_normal(n), "t": 0.0}
    directory = Path(args.dir)
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    comm.Barrier()
    store = CheckpointStore(directory, comm, incremental=False)
    best: dict[str, float] = {}

    def timed(name, fn):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        best[name] = min(best.get(name, float("inf")), dt)

    for i in range(args.repeat):
        timed("check", lambda: validate.check_finite(state))
        timed("hash", lambda: blocks.block_hashes(state["u"], 1 << 20))
        timed("hash+check fused", lambda: fused(state["u"]))
        timed("save", lambda i=i: store.save(i, state))
    if rank == 0:
        total = args.mib * 2**20
        print(f"{size} rank(s), {args.mib} MiB float64 in total, best of {args.repeat}:")
        for name, dt in best.items():
            print(f"  {name:18} {dt:8.3f} s  {total / dt / 1e9:6.2f} GB/s")
        print(f"  check / save       {best['check'] / best['save']:8.1%}")
        extra = best["hash+check fused"] - best["hash"]
        print(f"  fused extra        {extra:8.3f} s  ({extra / best['save']:.1%} of a save)")
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
