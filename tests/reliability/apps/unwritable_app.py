"""Reliability test app: the checkpoint directory becomes unwritable in mid-run.

usage: unwritable_app.py DIR

Every rank saves step 1; then rank 0 makes DIR immutable (``chattr +i``: not even root
may create a file in it) and every rank saves step 2, which fails. The error is not
caught: the job ends as a user's would, with Python's report of it on every rank (and
whatever runs at exit). The test undoes the flag.
"""

import subprocess
import sys

import numpy as np
from mpi4py import MPI

import hpcckpt

directory = sys.argv[1]
comm = MPI.COMM_WORLD
ck = hpcckpt.Checkpointer(directory, comm=comm, every_steps=1)
state = {"u": np.full(100, float(comm.rank))}
ck.restore(state)
ck.save(1, state)
comm.Barrier()
if comm.rank == 0:
    subprocess.run(["chattr", "+i", directory], check=True)
comm.Barrier()
ck.save(2, state)  # raises on every rank
