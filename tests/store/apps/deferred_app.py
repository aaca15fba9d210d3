"""Staged saves in memory after the first, whose collective steps run in the background
(store/save/deferred.py), under real mpirun. Prints one JSON report per rank.

``slow``: rank 0's work on the directory before it creates each file (the metadata
server's part: mkdir, listing, statfs) takes 1.5 s; every rank's save returns at once.
``bad``: at the third save rank 1's state holds a value that cannot be checkpointed: every
rank's save returns, and the commit raises on every rank naming rank 1.
``short``: rank 1's staging budget holds no copy: its saves write its live state and
wait, the others' are copied; every checkpoint is good and exact.
``behind``: after each save no call is made until the checkpoint's file is in place (the
ranks' threads commit it); then ``wait()`` takes the commit.
``plain``: no case of its own (run it with MPI initialized below MPI_THREAD_MULTIPLE).

An optional third argument is a node-local cache (``%n``: each rank's fake node ``n<R>``),
a fourth its ``redundancy``; then each rank reports its cache's files after each commit.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import hpcckpt
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.save.commit import Saver

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
case, directory = sys.argv[1], Path(sys.argv[2])
cache = sys.argv[3] if len(sys.argv) > 3 else None
tier = {} if cache is None else {"cache": cache, "node_name": f"n{rank}"}
if len(sys.argv) > 4:
    tier["redundancy"] = sys.argv[4]
ROWS = 1 << 17  # 1 MiB of float64 per rank


def values(step: int) -> np.ndarray:
    return np.arange(ROWS, dtype=np.float64) * (rank + 1) + step


if case == "slow" and rank == 0:
    prepare = Saver._prepare_directory

    def slow_prepare(self, state_bytes):
        time.sleep(1.5)  # a metadata server under load
        prepare(self, state_bytes)

    Saver._prepare_directory = slow_prepare

budget = 100_000 if case == "short" and rank == 1 else "1G"  # under a 1 MiB state
staging = {"async_save": True, "staging_budget": budget} if cache is None else tier
ck = hpcckpt.Checkpointer(directory, comm=comm, every_steps=1, validate=None, **staging)
state = {"u": values(0), "step": 0}
out: dict = {"rank": rank, "blocked": [], "said": [], "threads": [], "error": None}
out["multiple"] = MPI.Query_thread() == MPI.THREAD_MULTIPLE
for step in range(4):
    state["u"][:] = values(step)
    state["step"] = step
    if case == "bad" and step == 2 and rank == 1:
        state["bad"] = threading.Lock()  # cannot be checkpointed
    t0 = time.perf_counter()
    saved = ck.save(step, state)
    out["blocked"].append(time.perf_counter() - t0)
    out["said"].append(None if saved is None else saved.kind)
    out["threads"].append(sorted({t.name for t in threading.enumerate()} - {"MainThread"}))
    state["u"][:] = -1.0  # training goes on at once: the checkpoint keeps the values at save()
    state.pop("bad", None)
    if case == "behind" and step:  # nothing called: is it committed by the threads alone?
        final = directory / layout.checkpoint_name(step)
        deadline = time.monotonic() + 60
        while not final.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        partial = final.with_name(final.name + layout.PARTIAL)
        out.setdefault("in_place", []).append(final.exists() and not partial.exists())
    try:
        done = ck.wait()
        out.setdefault("committed", []).append(None if done is None else done.step)
        if ck.cache is not None:
            out.setdefault("cache_files", []).append(sorted(p.name for p in ck.cache.iterdir()))
    except CheckpointError as exc:
        out["error"] = {"step": step, "message": str(exc)}
ck.finish()
comm.Barrier()
out["files"] = sorted(p.name for p in directory.iterdir() if p.name.startswith("ckpt-"))
print(json.dumps(out), flush=True)
