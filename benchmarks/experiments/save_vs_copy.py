"""One async save against the copy it needs, alone: where the blocked time goes.

    mpirun -n 2 --oversubscribe .venv/bin/python benchmarks/experiments/save_vs_copy.py \
        [--mib 512] [--reps 8] [--keep-last N] [--dir DIR] [--no-drop-caches]

``bench_async.py`` measures every kind of save of the same state in one run, with the
other Checkpointers' memory (a node-local copy in ``/dev/shm``) beside it. This script
runs one ``Checkpointer(async_save=True)`` and nothing else: per repetition one
``np.copyto`` of the state into the save's own host buffer, then a save, then the same
copy again, each after a page-cache drop and between barriers, timed on the slowest
rank. Inside each save it times (on every rank, printed for rank 1) the copy
(``HostBuffers.stage``), the whole ``DeferredSaves.begin`` (encoding, plan, copy), the
save's ``save()`` around it, the plan (with the previous save's memory reading, 0.01
ms; without, a read of ``/proc/meminfo`` and the cgroup), and garbage collections.

``--keep-last 1`` lets the Checkpointer prune the previous checkpoint after each commit
(rank 0's thread; unlinking a large file on this VM takes a core for a part of a
second: a save a moment later competes with it); the default keeps every checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent))

import _util  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcckpt.coord import checkpointer as checkpointer_module  # noqa: E402
from hpcckpt.store.save import deferred, staging  # noqa: E402

PARTS: dict[str, float] = {}


def timer(owner, name: str, key: str) -> None:
    """Wrap ``owner.name`` so that its time adds to PARTS[key] (what it does is unchanged)."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            PARTS[key] = PARTS.get(key, 0.0) + time.perf_counter() - t0

    setattr(owner, name, timed)


def collections(phase: str, info: dict) -> None:
    if phase == "start":
        PARTS["_gc_start"] = time.perf_counter()
    else:
        PARTS["gc"] = PARTS.get("gc", 0.0) + time.perf_counter() - PARTS.pop("_gc_start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=512, help="float64 state per rank, MiB")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--keep-last", type=int, default=None, help="prune after each commit")
    p.add_argument("--dir", default="/var/tmp/hpcckpt-bench/save_vs_copy")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument(
        "--cache",
        default=None,
        help="a node-local cache directory (e.g. /dev/shm/x): the save goes there "
        "(Checkpointer(cache=...)) instead of async_save",
    )
    p.add_argument(
        "--compute",
        type=float,
        default=None,
        help="instead of wait() after each save, sleep this many seconds (the write ends "
        "meanwhile) and let the next save() commit it, as a training loop does",
    )
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    directory = Path(args.dir)
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    comm.Barrier()
    timer(staging.HostBuffers, "stage", "copy")
    timer(staging.HostBuffers, "plan", "plan")
    timer(deferred.DeferredSaves, "begin", "begin")
    timer(checkpointer_module.Checkpointer, "save", "save")
    timer(checkpointer_module.Checkpointer, "_complete_pending", "commit_previous")
    gc.callbacks.append(collections)

    u = np.random.default_rng(rank).random(args.mib << 17)
    state = {"u": u}
    kind = {"async_save": True} if args.cache is None else {"cache": Path(args.cache)}
    ck = checkpointer_module.Checkpointer(
        directory, comm=comm, incremental=False, validate=None,
        keep_last=args.keep_last, every_steps=10**9, **kind,
    )  # fmt: skip
    ck.restore(state)  # as a job starts: reserves the staging
    ck.save(0, state)
    ck.wait()

    def prep() -> None:
        comm.Barrier()
        if rank == 0:
            os.sync()
            if not args.no_drop_caches:
                _util.drop_caches()
        comm.Barrier()

    def timed(fn) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    rows = []
    for i in range(1, args.reps + 1):
        (own,) = [b for b in ck.buffers.copies().values() if b.shape == u.shape]
        prep()
        before = timed(lambda own=own: np.copyto(own, u))
        PARTS.clear()
        prep()
        save = timed(lambda i=i: ck.save(i, state))
        copy = comm.allreduce(PARTS["copy"], op=MPI.MAX)
        parts = comm.gather({k: round(v * 1e3, 2) for k, v in PARTS.items()}, root=0)
        if args.compute is None:
            ck.wait()
        else:
            time.sleep(args.compute)
        prep()
        after = timed(lambda own=own: np.copyto(own, u))
        rows.append((before, save, copy, after))
        if rank == 0:
            print(
                f"{i}: copy before {before:.4f} s, save {save:.4f} s (its copy {copy:.4f}), "
                f"copy after {after:.4f} s; save / copy before {save / before:.2f}; "
                f"parts, ms, rank 0: {parts[0]}, rank {len(parts) - 1}: {parts[-1]}",
                flush=True,
            )
    ck.finish()
    if rank == 0:
        med = statistics.median
        print(
            f"{args.mib} MiB per rank, {comm.Get_size()} ranks, median of {args.reps}: "
            f"save / copy before {med(r[1] / r[0] for r in rows):.2f}, "
            f"/ copy after {med(r[1] / r[3] for r in rows):.2f}; "
            f"its copy / copy before {med(r[2] / r[0] for r in rows):.2f}"
        )
        shutil.rmtree(directory, ignore_errors=True)
        if args.cache is not None:
            shutil.rmtree(args.cache, ignore_errors=True)


if __name__ == "__main__":
    main()
