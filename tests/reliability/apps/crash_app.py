"""Reliability test app: checkpoint every step; the test injects a fault with HPCCKPT_FAULT.

usage: crash_app.py DIR NSTEPS PRUNE_AT [full|inc|inc-chain2|async|async-inc|cache]

State: "u", distributed (rank r owns 3 + r rows of the global array), "v" the same
array on every rank, and scalars, all functions of the step (see expected_state), so
a restore on any rank count can be checked exactly. Retention keeps everything,
except at step PRUNE_AT where it keeps only the newest (so that prune deletes several
checkpoints one after the other).

With "inc", the saves are incremental (4 KiB blocks): a larger distributed array "w"
changes in one element per rank and step, so each save writes a few blocks only.
"inc-chain2" makes a full one follow 2 incrementals: at step 3 (full) the pruning
then deletes a whole older chain. "async" and "cache" make the saves staged (written
in the background; "cache" stages in DIR-cache), "async-inc" incremental and staged.
"""

import dataclasses
import sys

import numpy as np
from mpi4py import MPI

import hpcckpt

directory, nsteps, prune_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else "full"
incremental = mode.startswith("inc") or mode.endswith("-inc")
max_chain = 2 if mode == "inc-chain2" else 8
W = 4096  # elements of "w" per rank: 8 blocks of 4 KiB
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
COLS = 4


def rows_of(r):
    lo = sum(3 + k for k in range(r))
    return lo, lo + 3 + r


def global_u(step, nrows):
    return np.arange(nrows * COLS, dtype=np.float64).reshape(nrows, COLS) * (step + 1) + 0.25


lo, hi = rows_of(rank)
nrows = rows_of(size - 1)[1]
state = {"u": np.zeros((hi - lo, COLS)), "v": np.zeros(5, dtype=np.int64), "step": -1, "name": ""}
options = {"incremental": False}
if incremental:
    state["w"] = np.arange(rank * W, (rank + 1) * W, dtype=np.float64)
    options = {
        "incremental": True,
        "block_size": 4096,
        "max_chain_fraction": 100.0,
        "min_delta_saving": 0,
        "max_chain": max_chain,
    }
if mode.startswith("async"):
    options["async_save"] = True
elif mode == "cache":
    options["cache"] = directory.rstrip("/") + "-cache"
ck = hpcckpt.Checkpointer(
    directory,
    comm=comm,
    every_steps=1,
    keep_last=None,
    distributed=["u", "w"][: 1 + incremental],
    **options,
)
start = ck.restore(state)
for step in range(0 if start is None else start + 1, nsteps):
    if incremental:  # one element per rank changes: one dirty block; "u" is small
        state["w"][0] = 1000.0 * step + rank
        state["u"][...] = global_u(0, nrows)[lo:hi]
    else:
        state["u"][...] = global_u(step, nrows)[lo:hi]
    state["v"][...] = np.arange(5) * step
    state["step"], state["name"] = step, f"crash-{step}"
    ck.retention = dataclasses.replace(ck.retention, keep_last=1 if step == prune_at else None)
    if ck.due(step):
        ck.save(step, state)
ck.finish()
