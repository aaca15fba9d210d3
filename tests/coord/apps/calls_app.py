"""Test app: ranks that do not make the same collective call of the Checkpointer.

    calls_app.py DIR MODE

MODE:
  save_finish  rank 0 calls save(5), rank 1 goes on to finish()
  save_due     rank 0 calls save(5), rank 1 goes on with due(6), due(7), ...
  stuck        rank 1 stays in the application (sleeps 60 s) while rank 0 calls finish()

Nothing is caught: an error ends the run as it would an application's (``python -m
mpi4py`` aborts every rank), and its message is on stderr.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import hpcckpt

directory, mode = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
state = {"x": np.full(100, float(rank))}
ck = hpcckpt.Checkpointer(directory, comm=comm, every_steps=10**9)
ck.restore(state)
for step in range(5):
    ck.due(step)
if mode == "save_finish":
    if rank == 0:
        ck.save(5, state)
    else:
        ck.finish()
elif mode == "save_due":
    if rank == 0:
        ck.save(5, state)
    else:
        for step in range(5, 1000):
            ck.due(step)
            time.sleep(0.01)
elif mode == "stuck":
    if rank == 0:
        ck.finish()
    else:
        time.sleep(60)
print(f"rank {rank}: no error", flush=True)
